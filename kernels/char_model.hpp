// SPDX-License-Identifier: Apache-2.0
// The demo model of `terrace train`: a char-level MLP language model whose math runs on the
// device's memory, queued on a stream. Two implementations behind one interface:
//   - cpu  (kernels/char_model_cpu.cpp): OpenBLAS sgemm on memory the host can address (the
//          simulated device); each call first waits for the stream, and counts that wait;
//   - cuda (kernels/char_model_cuda.cu): cuBLAS and small kernels on the CUDA stream.
// Both compute in fp32 from bf16 weights (widened once per use), in the same order, so a run is
// deterministic for a given implementation and configuration, wherever the weights came from.
//
// CONTRACT for the offload engine (optimizer/offload_engine.cpp): the engine owns the weights
// and gradients (tier_manager tensors); the model owns only activations, which it allocates from
// the caching allocator it is given (they count against the device) and frees after backward.
//
// Layers, in forward order: 0 = embedding (vocab x embed), 1 = input projection
// (context*embed x width, + bias), 2 .. layers+1 = residual blocks h = h + relu(W h + b)
// (width x width, + bias), layers+2 = output projection (width x vocab, + bias). A layer's
// parameters are one flat bf16 tensor (weights then bias); its gradient one flat fp32 tensor of
// the same element count. Weights are row-major (in x out): a layer computes y = x W + b for a
// row-major batch x. The input projection is followed by relu; the output gives the logits of a
// softmax cross-entropy over the target byte, averaged over the batch.
//
// Reproducibility: the cpu implementation is bitwise deterministic for a given machine (OpenBLAS
// picks its kernels by CPU), configuration and cpu_threads; the cuda one for a given GPU
// architecture and toolkit (cuBLAS's guarantee); no reduction uses float atomics. The two agree
// to float tolerance, not bitwise (different GEMM summation orders).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "terrace/caching_allocator.hpp"
#include "terrace/device.hpp"

namespace terrace::model {

struct char_model_config {
  int vocab = 256;    ///< byte-level
  int context = 8;    ///< characters of context per prediction
  int embed = 32;     ///< embedding width
  int width = 1024;   ///< hidden width
  int layers = 16;    ///< residual blocks
  int batch = 64;     ///< predictions per step
  /// cpu only: OpenBLAS threads, set before each call (the count is process-wide in OpenBLAS, and
  /// the blocking of a GEMM may depend on it, so it is part of what makes a run reproducible).
  /// 0 = the machine's hardware threads, at most 16.
  int cpu_threads = 0;
  /// Activation checkpointing of the residual blocks: forward keeps only each block's input h (the
  /// previous block's output), not relu(h W + b); backward recomputes it from h and the params it
  /// is given. Half the blocks' activation memory for one more GEMM per block in backward; the
  /// results are the same bits (the same GEMM on the same inputs, the same elementwise ops).
  bool recompute_blocks = false;
};

/// @brief Throws logic_error unless every size is positive, vocab <= 256 (tokens are bytes),
/// layers <= 2^20, cpu_threads >= 0 and every layer and activation fits BLAS's int sizes. Every function below that takes a config calls it.
void validate(const char_model_config& config);

/// @brief The OpenBLAS threads the cpu implementation uses for `config`: cpu_threads, or for 0
/// the machine's hardware threads, at most 16.
int effective_cpu_threads(const char_model_config& config) noexcept;

/// @brief Parameters in all layers (the sum of layers(config)'s elements).
std::size_t parameter_count(const char_model_config& config);

/// @brief One layer's parameters: a name (stable: used as the tensor id on NVMe) and elements.
struct layer_spec {
  std::string name;
  std::size_t elements = 0;
};

/// @brief The layers of `config` in forward order. @throws logic_error for a non-positive field.
std::vector<layer_spec> layers(const char_model_config& config);

/// @brief Deterministic fp32 initial values of layer `layer` (scaled normal from `seed`; biases 0):
/// the same on every machine and for every implementation. `out` holds layers(config)[layer]
/// .elements floats. Scales: embedding 1; input projection sqrt(2/fan_in) (He, relu follows);
/// residual blocks sqrt(2/fan_in)/sqrt(layers), so that the residual stream's second moment grows
/// by a bounded factor over all blocks (about 45 for the default 16: relu's positive mean adds up
/// along the stream); output 0.02/sqrt(fan_in), so that the logits start small and an untrained
/// model's loss is within a few hundredths of ln(vocab) (the default model's first loss on the
/// GPL-3 corpus: 5.516 against 5.545; tests/char_model_test.cpp allows 0.05).
/// @throws logic_error for a bad config, a layer out of range or a null `out`.
void init_layer(const char_model_config& config, int layer, std::uint64_t seed, float* out);

/// @brief fp32 -> bf16, round to nearest even (NaN stays NaN), exactly as optimizer/half.hpp.
void to_bf16(const float* in, std::size_t n, std::uint16_t* out) noexcept;
/// @brief bf16 -> fp32 (exact).
void from_bf16(const std::uint16_t* in, std::size_t n, float* out) noexcept;

/// @brief Time the host spent blocked on the stream before computing (cpu: waiting for transfers
/// the stream was ordered after; cuda: 0, the GPU waits instead). Both figures add up over the
/// model's life. compute_seconds: cpu, the host computing; cuda, the host inside the model's
/// calls (launching work, and loss() waiting for the GPU).
struct compute_stats {
  double wait_seconds = 0;
  double compute_seconds = 0;
};

/// @brief Forward and backward of one batch, layer by layer (see the file comment).
class char_model {
 public:
  virtual ~char_model() = default;

  /// @brief Starts a batch: `tokens` (host memory) holds batch rows of context+1 bytes, the
  /// context then the target. Forgets any activations of the previous batch. The tokens are
  /// copied before it returns.
  /// @throws logic_error for null tokens or a token >= vocab (nothing changed then).
  virtual void begin_batch(const std::uint8_t* tokens) = 0;
  /// @brief Forward through `layer` (in order 0, 1, ...) with its bf16 parameters, a device
  /// pointer valid on the model's stream.
  virtual void forward(int layer, const std::uint16_t* params) = 0;
  /// @brief The batch's mean cross-entropy; blocks the host until it is known. After the last
  /// forward.
  virtual float loss() = 0;
  /// @brief Backward through `layer` (in order last .. 0): writes (does not accumulate) the
  /// layer's fp32 gradient into `grad` (device memory, as many elements as the layer has).
  /// Activations are freed after backward of layer 0.
  /// Calls out of order (forward before begin_batch, a layer skipped, backward before the last
  /// forward, ...) and null pointers throw logic_error and change nothing.
  virtual void backward(int layer, const std::uint16_t* params, float* grad) = 0;
  virtual compute_stats stats() const = 0;
  virtual const char_model_config& config() const noexcept = 0;
};

/// @brief The implementation for `device`: cuda when device.properties() says CUDA, else cpu
/// (which requires memory the host can address: sim, never null).
/// @throws logic_error for a null device, a bad config, an allocator over another device, or a
/// cuda device in a build without CUDA; out_of_memory from `activations`; device_error when
/// cuBLAS cannot start.
std::unique_ptr<char_model> make_char_model(const char_model_config& config, device_backend& device,
                                            caching_allocator& activations, stream_ref stream);

}  // namespace terrace::model
