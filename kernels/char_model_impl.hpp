// SPDX-License-Identifier: Apache-2.0
// Internal to kernels/: what the cpu and cuda char models share (char_model.hpp is the contract).
// The shapes of the layers, the call-order checks, and the two factories that make_char_model
// chooses between. Kept free of CUDA and OpenBLAS headers so both implementations include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/char_model.hpp"

namespace terrace::model::detail {

enum class layer_kind { embedding, input, block, output };

/// A layer's weight matrix is in x out (row-major); `bias` says whether out bias values follow.
struct layer_shape {
  layer_kind kind;
  std::size_t in;
  std::size_t out;
  bool bias;
  std::size_t elements() const noexcept { return in * out + (bias ? out : 0); }
};

/// REQUIRES: a validated config and 0 <= layer < layer_count(config).
layer_shape shape_of(const char_model_config& config, int layer) noexcept;
inline int layer_count(const char_model_config& config) noexcept { return config.layers + 3; }

/// Enforces the order of char_model's calls, the same for both implementations: a batch is
/// begin_batch, forward 0 .. last, then (optionally) loss and backward last .. 0. Every check
/// throws logic_error before anything changes; the `done_*` calls advance the state after the
/// work succeeded, so a call that failed (out of memory) can be retried.
class call_order {
 public:
  explicit call_order(int layers) : layers_(layers) {}
  void begin_batch() noexcept {
    next_forward_ = 0;
    next_backward_ = -1;
    in_batch_ = true;
  }
  /// The batch's activations are going: no call of it may run, even if no new batch begins
  /// (a begin_batch that fails after freeing them).
  void abandon() noexcept { in_batch_ = false; }
  void check_forward(int layer, const void* params) const;
  void done_forward() noexcept;
  void check_loss() const;
  void check_backward(int layer, const void* params, const void* grad) const;
  /// True after backward of layer 0: the batch is over and its activations may go.
  bool done_backward() noexcept;

 private:
  int layers_;
  int next_forward_ = 0;
  int next_backward_ = -1;
  bool in_batch_ = false;
};

/// Copies `tokens` (batch rows of context+1 bytes) after checking each is < vocab.
/// @throws logic_error naming the first bad token.
std::vector<std::uint8_t> check_tokens(const char_model_config& config, const std::uint8_t* tokens);

/// The OpenBLAS thread count that cpu_threads = 0 stands for on this machine.
int default_cpu_threads() noexcept;

std::unique_ptr<char_model> make_cpu_char_model(const char_model_config& config,
                                                device_backend& device,
                                                caching_allocator& activations, stream_ref stream);
#if defined(TERRACE_MODEL_WITH_CUDA)
std::unique_ptr<char_model> make_cuda_char_model(const char_model_config& config,
                                                 device_backend& device,
                                                 caching_allocator& activations, stream_ref stream);
#endif

// Per-call scratch of both implementations, returned to the allocator at the end of the call.
// Neither copyable nor movable: returned only as a prvalue (guaranteed elision), so it is freed
// exactly once.
class scratch {
 public:
  scratch(caching_allocator& memory, stream_ref stream, float* p) : memory_(memory), stream_(stream), p(p) {}
  scratch(const scratch&) = delete;
  scratch& operator=(const scratch&) = delete;
  ~scratch() {
    try {
      memory_.deallocate(p, stream_);
    } catch (...) {
      // Only a pointer the allocator does not know throws, and this one came from it.
    }
  }

 private:
  caching_allocator& memory_;
  stream_ref stream_;

 public:
  float* const p;
};

// The activations of one batch, shared by both implementations: device memory from the caching
// allocator on the model's stream (so they count against the device like any tensor), all given
// back at once by release() (next begin_batch, after backward of layer 0, destruction).
class activation_set {
 public:
  activation_set(caching_allocator& memory, stream_ref stream) : memory_(memory), stream_(stream) {}
  ~activation_set() { release(); }
  activation_set(const activation_set&) = delete;
  activation_set& operator=(const activation_set&) = delete;

  void* bytes(std::size_t n, const char* tag) {
    void* p = memory_.allocate(n, stream_, tag);
    live_.push_back(p);
    return p;
  }
  float* floats(std::size_t n, const char* tag) { return static_cast<float*>(bytes(n * sizeof(float), tag)); }
  void release() noexcept {
    for (void* p : live_) {
      try {
        memory_.deallocate(p, stream_);
      } catch (...) {
        // Only a pointer the allocator does not know throws, and these all came from it.
      }
    }
    live_.clear();
  }

 private:
  caching_allocator& memory_;
  stream_ref stream_;
  std::vector<void*> live_;
};

}  // namespace terrace::model::detail
