// SPDX-License-Identifier: Apache-2.0
// The cuda char model: cuBLAS sgemm plus small kernels, all queued on the model's CUDA stream;
// only loss() waits for the GPU. The arithmetic follows kernels/char_model_cpu.cpp step for step.
//
// Reproducibility: every reduction (bias gradients, softmax, the embedding's scatter-add) is done
// by one thread or one block in a fixed order, never with float atomics; cuBLAS is deterministic
// on one stream for a given architecture and toolkit, and its math mode is left at the default
// (no TF32), so the results also stay close to the cpu implementation's.
//
// cuBLAS works column-major; a row-major M x N matrix is its transpose in column-major, so
// row-major Y = X W is computed as column-major Y^T = W^T X^T (see the gemm helpers).
//
// cuBLAS is not linked: its entry points come from kernels/cublas_loader.hpp's table, loaded when
// the first model is made (make_cuda_char_model), so that nothing else needs libcublas.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/char_model_impl.hpp"
#include "kernels/launch.cuh"
#include "kernels/cublas_table.hpp"
#include "terrace/error.hpp"
#include "tiers/cuda_context.hpp"

namespace terrace::model::detail {
namespace {

constexpr int threads_per_block = 256;

// ------------------------------------------------------------------------------ kernels

__device__ __forceinline__ float widen_bf16(std::uint16_t h) {
  return __uint_as_float(static_cast<unsigned>(h) << 16);
}

unsigned blocks_for(std::size_t n) {
  const std::size_t b = (n + threads_per_block - 1) / threads_per_block;
  return static_cast<unsigned>(b < 65535 * 16 ? (b == 0 ? 1 : b) : 65535 * 16);
}

#define TERRACE_GRID_STRIDE(i, n)                                                             \
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)

__global__ void widen_kernel(const std::uint16_t* __restrict__ in, float* __restrict__ out, std::size_t n) {
  TERRACE_GRID_STRIDE(i, n) { out[i] = widen_bf16(in[i]); }
}

// x0[b, c*E + k] = table[tokens[b*row + c], k]
__global__ void gather_kernel(const std::uint8_t* __restrict__ tokens, const std::uint16_t* __restrict__ table,
                              float* __restrict__ x0, int batch, int context, int embed) {
  const std::size_t n = static_cast<std::size_t>(batch) * context * embed;
  TERRACE_GRID_STRIDE(i, n) {
    const std::size_t k = i % embed;
    const std::size_t bc = i / embed;  // b * context + c
    const std::size_t b = bc / context, c = bc % context;
    x0[i] = widen_bf16(table[static_cast<std::size_t>(tokens[b * (context + 1) + c]) * embed + k]);
  }
}

// h = relu(h + bias), bias widened from the layer's bf16 tail.
__global__ void bias_relu_kernel(float* __restrict__ h, const std::uint16_t* __restrict__ bias,
                                 std::size_t rows, std::size_t cols) {
  TERRACE_GRID_STRIDE(i, rows * cols) { h[i] = fmaxf(h[i] + widen_bf16(bias[i % cols]), 0.0f); }
}

// r = relu(r + bias); next = h + r
__global__ void block_forward_kernel(float* __restrict__ r, const std::uint16_t* __restrict__ bias,
                                     const float* __restrict__ h, float* __restrict__ next,
                                     std::size_t rows, std::size_t cols) {
  TERRACE_GRID_STRIDE(i, rows * cols) {
    const float v = fmaxf(r[i] + widen_bf16(bias[i % cols]), 0.0f);
    r[i] = v;
    next[i] = h[i] + v;
  }
}

// One block per row: logits + bias -> softmax in place, and the row's cross-entropy. The
// reductions are shared-memory trees of fixed shape: the same order every run.
__global__ void softmax_xent_kernel(float* __restrict__ z, const std::uint16_t* __restrict__ bias,
                                    const std::uint8_t* __restrict__ tokens, float* __restrict__ row_loss,
                                    int vocab, int row) {
  __shared__ float part[threads_per_block];
  float* zr = z + static_cast<std::size_t>(blockIdx.x) * vocab;
  float top = -INFINITY;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    zr[j] += widen_bf16(bias[j]);
    top = fmaxf(top, zr[j]);
  }
  part[threadIdx.x] = top;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) part[threadIdx.x] = fmaxf(part[threadIdx.x], part[threadIdx.x + s]);
    __syncthreads();
  }
  top = part[0];
  __syncthreads();
  const int target = tokens[static_cast<std::size_t>(blockIdx.x) * row + row - 1];
  const float target_shifted = zr[target] - top;
  __syncthreads();  // everyone has read zr[target] before it is overwritten below
  float sum = 0;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float e = expf(zr[j] - top);
    zr[j] = e;
    sum += e;
  }
  part[threadIdx.x] = sum;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  sum = part[0];
  const float inv = 1.0f / sum;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) zr[j] *= inv;
  if (threadIdx.x == 0) row_loss[blockIdx.x] = logf(sum) - target_shifted;
}

// d logits = (p - onehot) / batch, in place.
__global__ void xent_backward_kernel(float* __restrict__ p, const std::uint8_t* __restrict__ tokens,
                                     int batch, int vocab, int row) {
  const float inv_batch = 1.0f / static_cast<float>(batch);
  TERRACE_GRID_STRIDE(i, static_cast<std::size_t>(batch) * vocab) {
    const std::size_t b = i / vocab;
    const int j = static_cast<int>(i % vocab);
    const float onehot = j == tokens[b * row + row - 1] ? 1.0f : 0.0f;
    p[i] = (p[i] - onehot) * inv_batch;
  }
}

// out = mask > 0 ? d : 0 (out may alias d)
__global__ void relu_backward_kernel(const float* d, const float* __restrict__ mask, float* out,
                                     std::size_t n) {
  TERRACE_GRID_STRIDE(i, n) { out[i] = mask[i] > 0.0f ? d[i] : 0.0f; }
}

// db[j] = sum over rows of d[b, j], rows in order (one thread per column: coalesced, and the
// cpu's order).
__global__ void column_sum_kernel(const float* __restrict__ d, float* __restrict__ db, std::size_t rows,
                                  std::size_t cols) {
  TERRACE_GRID_STRIDE(j, cols) {
    float s = 0;
    for (std::size_t b = 0; b < rows; ++b) s += d[b * cols + j];
    db[j] = s;
  }
}

// grad[v, k] = sum over (b, c) in order with tokens[b, c] == v of dx0[b, c*E + k]: a gather per
// output element instead of a scatter with atomics, so the sum's order is fixed (and the cpu's).
__global__ void embedding_backward_kernel(const std::uint8_t* __restrict__ tokens,
                                          const float* __restrict__ dx0, float* __restrict__ grad,
                                          int vocab, int batch, int context, int embed) {
  TERRACE_GRID_STRIDE(i, static_cast<std::size_t>(vocab) * embed) {
    const int v = static_cast<int>(i / embed);
    const std::size_t k = i % embed;
    float s = 0;
    for (int b = 0; b < batch; ++b) {
      for (int c = 0; c < context; ++c) {
        if (tokens[static_cast<std::size_t>(b) * (context + 1) + c] == v) {
          s += dx0[(static_cast<std::size_t>(b) * context + c) * embed + k];
        }
      }
    }
    grad[i] = s;
  }
}

// ------------------------------------------------------------------------------ errors

[[noreturn]] void throw_cuda(cudaError_t e, const std::string& what) {
  cudaGetLastError();  // clear it, so that a later check does not report this failure again
  throw device_error("terrace: char_model (cuda): " + what + " failed: " + cudaGetErrorName(e) + " (" +
                     cudaGetErrorString(e) + ")");
}
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw_cuda(e, what);
}
void cublas_check(const cublas_api& blas, cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw device_error(std::string("terrace: char_model (cuda): ") + what + " failed: " +
                       blas.status_name(s) + " (" + blas.status_string(s) + ")");
  }
}

// Makes the model's device current for a call and puts the caller's device and context back
// after (tiers/cuda_context.hpp, as tiers' device_scope): the backends are used from any thread,
// and an embedder must not find its current device changed.
class device_guard {
 public:
  explicit device_guard(int device) {
    int current = -1;
    cuda_check(cudaGetDevice(&current), "cudaGetDevice");
    if (current == device) return;
    const auto caller = ::terrace::detail::save_cuda_caller(current);
    cuda_check(cudaSetDevice(device), "cudaSetDevice");
    caller_ = caller;
  }
  ~device_guard() { ::terrace::detail::restore_cuda_caller(caller_); }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  ::terrace::detail::cuda_caller caller_;
};

using clock_type = std::chrono::steady_clock;

// ------------------------------------------------------------------------------ the model

class cuda_char_model final : public char_model {
 public:
  cuda_char_model(const cublas_api& blas, const char_model_config& config, device_backend& device,
                  caching_allocator& activations, stream_ref stream)
      : blas_(blas),
        config_(config),
        memory_(activations),
        stream_(stream),
        native_(static_cast<cudaStream_t>(stream.native)),
        device_index_(device.properties().device_index),
        order_(layer_count(config)),
        row_loss_host_(static_cast<std::size_t>(config.batch)) {
    device_guard guard(device_index_);
    cublas_check(blas_, blas_.create(&handle_), "cublasCreate");
    const cublasStatus_t s = blas_.set_stream(handle_, native_);
    if (s != CUBLAS_STATUS_SUCCESS) {
      blas_.destroy(handle_);
      cublas_check(blas_, s, "cublasSetStream");
    }
  }

  ~cuda_char_model() override {
    try {
      device_guard guard(device_index_);
      release_activations();
      blas_.destroy(handle_);
    } catch (...) {
      // A destructor only reports by leaving things behind: the runtime may be unloading.
    }
  }

  void begin_batch(const std::uint8_t* tokens) override {
    auto copy = check_tokens(config_, tokens);
    const auto t0 = clock_type::now();
    device_guard guard(device_index_);
    order_.abandon();  // before the old batch's buffers go: the steps below may throw
    release_activations();
    tokens_ = static_cast<std::uint8_t*>(activation_bytes(copy.size(), "char_model.tokens"));
    // From pageable memory: the call returns once the bytes are staged, so `copy` may go.
    cuda_check(cudaMemcpyAsync(tokens_, copy.data(), copy.size(), cudaMemcpyHostToDevice, native_),
               "cudaMemcpyAsync(tokens)");
    order_.begin_batch();
    stats_.compute_seconds += seconds_since(t0);
  }

  void forward(int layer, const std::uint16_t* params) override {
    order_.check_forward(layer, params);
    const auto t0 = clock_type::now();
    device_guard guard(device_index_);
    const auto shape = shape_of(config_, layer);
    switch (shape.kind) {
      case layer_kind::embedding: forward_embedding(params); break;
      case layer_kind::input: forward_input(shape, params); break;
      case layer_kind::block: forward_block(layer - 1, shape, params); break;
      case layer_kind::output: forward_output(shape, params); break;
    }
    stats_.compute_seconds += seconds_since(t0);
    order_.done_forward();
  }

  float loss() override {
    order_.check_loss();
    const auto t0 = clock_type::now();
    device_guard guard(device_index_);
    cuda_check(cudaMemcpyAsync(row_loss_host_.data(), row_loss_, row_loss_host_.size() * sizeof(float),
                               cudaMemcpyDeviceToHost, native_),
               "cudaMemcpyAsync(loss)");
    cuda_check(cudaStreamSynchronize(native_), "cudaStreamSynchronize");
    double total = 0;  // in row order, as the cpu implementation sums
    for (const float l : row_loss_host_) total += static_cast<double>(l);
    stats_.compute_seconds += seconds_since(t0);
    return static_cast<float>(total / static_cast<double>(config_.batch));
  }

  void backward(int layer, const std::uint16_t* params, float* grad) override {
    order_.check_backward(layer, params, grad);
    const auto t0 = clock_type::now();
    device_guard guard(device_index_);
    const auto shape = shape_of(config_, layer);
    switch (shape.kind) {
      case layer_kind::embedding: backward_embedding(grad); break;
      case layer_kind::input: backward_input(shape, params, grad); break;
      case layer_kind::block: backward_block(layer - 1, shape, params, grad); break;
      case layer_kind::output: backward_output(shape, params, grad); break;
    }
    stats_.compute_seconds += seconds_since(t0);
    if (order_.done_backward()) release_activations();
  }

  compute_stats stats() const override { return stats_; }
  const char_model_config& config() const noexcept override { return config_; }

 private:
  static double seconds_since(clock_type::time_point t0) {
    return std::chrono::duration<double>(clock_type::now() - t0).count();
  }

  // ------------------------------------------------------------------------ memory
  // As in the cpu model: activations from the caching allocator on the model's stream, freed at
  // the next begin_batch or after backward of layer 0; per-call scratch freed as the call returns.
  // Freeing right after queueing the kernels that use a block is safe: the block is reused only by
  // work queued later on the same stream (the allocator's stream-order rule).
  void* activation_bytes(std::size_t bytes, const char* tag) { return activations_.bytes(bytes, tag); }
  float* activation(std::size_t floats, const char* tag) { return activations_.floats(floats, tag); }
  void release_activations() noexcept {
    activations_.release();
    tokens_ = nullptr;
    x0_ = dx0_ = probs_ = dh_ = row_loss_ = nullptr;
    h_.clear();
    r_.clear();
  }

  scratch allocate_scratch(std::size_t floats, const char* tag) {
    return scratch(memory_, stream_,
                   static_cast<float*>(memory_.allocate(floats * sizeof(float), stream_, tag)));
  }
  scratch widen(const std::uint16_t* params, std::size_t n) {
    auto* w = static_cast<float*>(memory_.allocate(n * sizeof(float), stream_, "char_model.weights_f32"));
    if (const cudaError_t e =
            kernels::launch(widen_kernel, blocks_for(n), threads_per_block, native_, params, w, n);
        e != cudaSuccess) {
      memory_.deallocate(w, stream_);
      throw_cuda(e, "launching widen_kernel");
    }
    return scratch(memory_, stream_, w);  // a prvalue: the non-movable scratch is not copied
  }

  std::size_t batch() const { return static_cast<std::size_t>(config_.batch); }
  int row() const { return config_.context + 1; }

  // Row-major y (batch x out) = x (batch x in) W (in x out) + beta y:
  // column-major y^T (out x batch) = W^T (out x in) x^T (in x batch).
  void gemm_forward(const float* x, const float* w, float* y, std::size_t in, std::size_t out) {
    const float one = 1.0f, zero = 0.0f;
    cublas_check(blas_,
                 blas_.sgemm(handle_, CUBLAS_OP_N, CUBLAS_OP_N, int(out), int(batch()), int(in), &one, w,
                             int(out), x, int(in), &zero, y, int(out)),
                 "cublasSgemm(forward)");
  }
  // Row-major dW (in x out) = x^T dy: column-major dW^T (out x in) = dy^T (out x batch) x (batch x in).
  void gemm_weight_grad(const float* x, const float* dy, float* dw, std::size_t in, std::size_t out) {
    const float one = 1.0f, zero = 0.0f;
    cublas_check(blas_,
                 blas_.sgemm(handle_, CUBLAS_OP_N, CUBLAS_OP_T, int(out), int(in), int(batch()), &one, dy,
                             int(out), x, int(in), &zero, dw, int(out)),
                 "cublasSgemm(weight grad)");
  }
  // Row-major dx (batch x in) = dy W^T + beta dx: column-major dx^T (in x batch) = W (in x out)
  // dy^T (out x batch).
  void gemm_input_grad(const float* dy, const float* w, float* dx, std::size_t in, std::size_t out,
                       float beta) {
    const float one = 1.0f;
    cublas_check(blas_,
                 blas_.sgemm(handle_, CUBLAS_OP_T, CUBLAS_OP_N, int(in), int(batch()), int(out), &one, w,
                             int(out), dy, int(out), &beta, dx, int(in)),
                 "cublasSgemm(input grad)");
  }
  void bias_grad(const float* d, float* db, std::size_t cols) {
    cuda_check(kernels::launch(column_sum_kernel, blocks_for(cols), threads_per_block, native_, d, db,
                               batch(), cols),
               "launching column_sum_kernel");
  }

  // ----------------------------------------------------------------------- forward
  void forward_embedding(const std::uint16_t* table) {
    const std::size_t n = batch() * static_cast<std::size_t>(config_.context) * config_.embed;
    x0_ = activation(n, "char_model.x0");
    cuda_check(kernels::launch(gather_kernel, blocks_for(n), threads_per_block, native_, tokens_, table, x0_,
                               config_.batch, config_.context, config_.embed),
               "launching gather_kernel");
  }

  void forward_input(const layer_shape& s, const std::uint16_t* params) {
    const scratch w = widen(params, s.in * s.out);
    float* h = activation(batch() * s.out, "char_model.h");
    gemm_forward(x0_, w.p, h, s.in, s.out);
    cuda_check(kernels::launch(bias_relu_kernel, blocks_for(batch() * s.out), threads_per_block, native_, h,
                               params + s.in * s.out, batch(), s.out),
               "launching bias_relu_kernel");
    h_.assign(1, h);
  }

  // With recompute_blocks r is scratch, and backward makes it again (as the cpu model does).
  void forward_block(int block, const layer_shape& s, const std::uint16_t* params) {
    const scratch w = widen(params, s.in * s.out);
    const float* h = h_[static_cast<std::size_t>(block) - 1];
    const scratch r_scratch = allocate_scratch(config_.recompute_blocks ? batch() * s.out : 0,
                                               "char_model.r_scratch");
    float* r = config_.recompute_blocks ? r_scratch.p : activation(batch() * s.out, "char_model.r");
    float* next = activation(batch() * s.out, "char_model.h");
    gemm_forward(h, w.p, r, s.in, s.out);
    cuda_check(kernels::launch(block_forward_kernel, blocks_for(batch() * s.out), threads_per_block, native_,
                               r, params + s.in * s.out, h, next, batch(), s.out),
               "launching block_forward_kernel");
    if (r_.empty()) r_.push_back(nullptr);  // r_[0] unused: blocks count from 1
    r_.push_back(config_.recompute_blocks ? nullptr : r);
    h_.push_back(next);
  }

  void forward_output(const layer_shape& s, const std::uint16_t* params) {
    const scratch w = widen(params, s.in * s.out);
    probs_ = activation(batch() * s.out, "char_model.probs");
    row_loss_ = activation(batch(), "char_model.row_loss");
    gemm_forward(h_.back(), w.p, probs_, s.in, s.out);
    cuda_check(kernels::launch(softmax_xent_kernel, unsigned(batch()), threads_per_block, native_, probs_,
                               params + s.in * s.out, tokens_, row_loss_, config_.vocab, row()),
               "launching softmax_xent_kernel");
  }

  // ---------------------------------------------------------------------- backward
  void backward_output(const layer_shape& s, const std::uint16_t* params, float* grad) {
    // Every allocation before the logits gradient overwrites the probabilities in place: a call
    // that failed for memory is retried, and a retry after that kernel would subtract the
    // one-hot and divide by the batch a second time.
    const scratch w = widen(params, s.in * s.out);
    dh_ = activation(batch() * s.in, "char_model.dh");
    cuda_check(kernels::launch(xent_backward_kernel, blocks_for(batch() * s.out), threads_per_block, native_,
                               probs_, tokens_, config_.batch, config_.vocab, row()),
               "launching xent_backward_kernel");
    gemm_weight_grad(h_.back(), probs_, grad, s.in, s.out);
    bias_grad(probs_, grad + s.in * s.out, s.out);
    gemm_input_grad(probs_, w.p, dh_, s.in, s.out, 0.0f);
  }

  void backward_block(int block, const layer_shape& s, const std::uint16_t* params, float* grad) {
    const scratch w = widen(params, s.in * s.out);
    const float* r = r_[static_cast<std::size_t>(block)];
    const scratch again = allocate_scratch(r == nullptr ? batch() * s.out : 0, "char_model.r_scratch");
    if (r == nullptr) {  // recompute_blocks: make r again from the block's input
      gemm_forward(h_[static_cast<std::size_t>(block) - 1], w.p, again.p, s.in, s.out);
      cuda_check(kernels::launch(bias_relu_kernel, blocks_for(batch() * s.out), threads_per_block, native_,
                                 again.p, params + s.in * s.out, batch(), s.out),
                 "launching bias_relu_kernel");
      r = again.p;
    }
    const scratch dr = allocate_scratch(batch() * s.out, "char_model.dr");
    cuda_check(kernels::launch(relu_backward_kernel, blocks_for(batch() * s.out), threads_per_block, native_,
                               dh_, r, dr.p, batch() * s.out),
               "launching relu_backward_kernel");
    gemm_weight_grad(h_[static_cast<std::size_t>(block) - 1], dr.p, grad, s.in, s.out);
    bias_grad(dr.p, grad + s.in * s.out, s.out);
    gemm_input_grad(dr.p, w.p, dh_, s.in, s.out, 1.0f);
  }

  void backward_input(const layer_shape& s, const std::uint16_t* params, float* grad) {
    const scratch w = widen(params, s.in * s.out);
    cuda_check(kernels::launch(relu_backward_kernel, blocks_for(batch() * s.out), threads_per_block, native_,
                               dh_, h_.front(), dh_, batch() * s.out),
               "launching relu_backward_kernel");
    gemm_weight_grad(x0_, dh_, grad, s.in, s.out);
    bias_grad(dh_, grad + s.in * s.out, s.out);
    dx0_ = activation(batch() * s.in, "char_model.dx0");
    gemm_input_grad(dh_, w.p, dx0_, s.in, s.out, 0.0f);
  }

  void backward_embedding(float* grad) {
    const std::size_t n = static_cast<std::size_t>(config_.vocab) * config_.embed;
    cuda_check(kernels::launch(embedding_backward_kernel, blocks_for(n), threads_per_block, native_, tokens_,
                               dx0_, grad, config_.vocab, config_.batch, config_.context, config_.embed),
               "launching embedding_backward_kernel");
  }

  const cublas_api& blas_;
  char_model_config config_;
  caching_allocator& memory_;
  stream_ref stream_;
  cudaStream_t native_;
  int device_index_;
  call_order order_;
  cublasHandle_t handle_ = nullptr;
  compute_stats stats_;
  std::vector<float> row_loss_host_;

  activation_set activations_{memory_, stream_};  // every activation of the batch, to free
  std::uint8_t* tokens_ = nullptr;  // batch x (context+1), on the device
  float* x0_ = nullptr;
  std::vector<float*> h_;
  std::vector<float*> r_;
  float* probs_ = nullptr;
  float* row_loss_ = nullptr;
  float* dh_ = nullptr;
  float* dx0_ = nullptr;
};

}  // namespace

std::unique_ptr<char_model> make_cuda_char_model(const char_model_config& config,
                                                 device_backend& device,
                                                 caching_allocator& activations, stream_ref stream) {
  // cuBLAS first, before the CUDA runtime is touched: a machine without it gets the loader's
  // error (which library, why, what to do), not a failure further in.
  const cublas_api& blas = cublas();
  return std::make_unique<cuda_char_model>(blas, config, device, activations, stream);
}

}  // namespace terrace::model::detail
