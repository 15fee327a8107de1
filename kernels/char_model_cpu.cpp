// SPDX-License-Identifier: Apache-2.0
// The cpu char model: OpenBLAS sgemm plus plain loops, on the simulated device's memory (host
// memory). Each call first waits for the stream (the transfers of the layer's parameters were
// queued on it or ordered before it), then computes on the calling thread, so the call's results
// are in place when it returns and nothing is left queued.
//
// Only the GEMMs are threaded (by OpenBLAS, with the configured thread count); every elementwise
// loop and every reduction is sequential in a fixed order, so that a run is bitwise repeatable.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/char_model_impl.hpp"
#include "optimizer/half.hpp"
#include "terrace/error.hpp"

namespace terrace::model::detail {
namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

int to_int(std::size_t v) { return static_cast<int>(v); }  // validate() bounds every size

class cpu_char_model final : public char_model {
 public:
  cpu_char_model(const char_model_config& config, device_backend& device,
                 caching_allocator& activations, stream_ref stream)
      : config_(config),
        device_(device),
        memory_(activations),
        stream_(stream),
        order_(layer_count(config)),
        threads_(effective_cpu_threads(config)) {}

  ~cpu_char_model() override { release_activations(); }

  void begin_batch(const std::uint8_t* tokens) override {
    auto copy = check_tokens(config_, tokens);
    release_activations();
    tokens_ = std::move(copy);
    order_.begin_batch();
  }

  void forward(int layer, const std::uint16_t* params) override {
    order_.check_forward(layer, params);
    wait_for_stream();
    const auto t0 = clock_type::now();
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
    return loss_;
  }

  void backward(int layer, const std::uint16_t* params, float* grad) override {
    order_.check_backward(layer, params, grad);
    wait_for_stream();
    const auto t0 = clock_type::now();
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
  // ------------------------------------------------------------------------ memory
  // Activations live in device memory from the caching allocator on the model's stream, so they
  // count against the device like any tensor; they are freed at the next begin_batch or after
  // backward of layer 0. Per-call scratch (widened weights, dr) is freed when the call returns:
  // the host has finished with it by then, and later work on the stream may reuse it.
  float* allocate(std::size_t floats, const char* tag) {
    return static_cast<float*>(memory_.allocate(floats * sizeof(float), stream_, tag));
  }
  float* activation(std::size_t floats, const char* tag) { return activations_.floats(floats, tag); }
  void release_activations() noexcept {
    activations_.release();
    x0_ = dx0_ = probs_ = dh_ = nullptr;
    h_.clear();
    r_.clear();
  }

  scratch widen(const std::uint16_t* params, std::size_t n) {
    float* w = allocate(n, "char_model.weights_f32");
    for (std::size_t i = 0; i < n; ++i) w[i] = terrace::detail::bf16_to_float(params[i]);
    return scratch(memory_, stream_, w);
  }

  void wait_for_stream() {
    const auto t0 = clock_type::now();
    device_.synchronize(stream_);
    stats_.wait_seconds += seconds_since(t0);
    // Set per call, not once: the count is process-wide, and another user of OpenBLAS in the
    // process may have changed it since.
    if (openblas_get_num_threads() != threads_) openblas_set_num_threads(threads_);
  }

  std::size_t batch() const { return static_cast<std::size_t>(config_.batch); }
  std::size_t row() const { return static_cast<std::size_t>(config_.context) + 1; }

  // y (batch x out) = x (batch x in) W (in x out) + beta y
  void gemm_forward(const float* x, const float* w, float* y, std::size_t in, std::size_t out) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, to_int(batch()), to_int(out), to_int(in),
                1.0f, x, to_int(in), w, to_int(out), 0.0f, y, to_int(out));
  }
  // dW (in x out) = x^T dy
  void gemm_weight_grad(const float* x, const float* dy, float* dw, std::size_t in, std::size_t out) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, to_int(in), to_int(out), to_int(batch()),
                1.0f, x, to_int(in), dy, to_int(out), 0.0f, dw, to_int(out));
  }
  // dx (batch x in) = dy W^T + beta dx
  void gemm_input_grad(const float* dy, const float* w, float* dx, std::size_t in, std::size_t out,
                       float beta) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, to_int(batch()), to_int(in), to_int(out),
                1.0f, dy, to_int(out), w, to_int(out), beta, dx, to_int(in));
  }
  // db[j] = sum over rows of d[b][j], rows in order.
  void bias_grad(const float* d, float* db, std::size_t cols) {
    std::fill(db, db + cols, 0.0f);
    for (std::size_t b = 0; b < batch(); ++b) {
      for (std::size_t j = 0; j < cols; ++j) db[j] += d[b * cols + j];
    }
  }

  // ----------------------------------------------------------------------- forward
  void forward_embedding(const std::uint16_t* table) {
    const std::size_t e = static_cast<std::size_t>(config_.embed);
    const std::size_t ctx = static_cast<std::size_t>(config_.context);
    x0_ = activation(batch() * ctx * e, "char_model.x0");
    for (std::size_t b = 0; b < batch(); ++b) {
      for (std::size_t c = 0; c < ctx; ++c) {
        const std::uint16_t* src = table + tokens_[b * row() + c] * e;
        float* dst = x0_ + (b * ctx + c) * e;
        for (std::size_t k = 0; k < e; ++k) dst[k] = terrace::detail::bf16_to_float(src[k]);
      }
    }
  }

  void forward_input(const layer_shape& s, const std::uint16_t* params) {
    const auto w = widen(params, s.elements());
    float* h = activation(batch() * s.out, "char_model.h");
    gemm_forward(x0_, w.p, h, s.in, s.out);
    const float* bias = w.p + s.in * s.out;
    for (std::size_t b = 0; b < batch(); ++b) {
      for (std::size_t j = 0; j < s.out; ++j) h[b * s.out + j] = std::max(h[b * s.out + j] + bias[j], 0.0f);
    }
    h_.assign(1, h);
  }

  // Block `block` (1-based): r = relu(h W + b), h' = h + r. Both r (its sign is relu's mask) and
  // h (the next GEMM's input, and this block's weight gradient's) are kept for backward; with
  // recompute_blocks r is scratch, and backward makes it again (block_relu).
  void forward_block(int block, const layer_shape& s, const std::uint16_t* params) {
    const auto w = widen(params, s.elements());
    const float* h = h_[static_cast<std::size_t>(block) - 1];
    float* r = config_.recompute_blocks ? allocate(batch() * s.out, "char_model.r_scratch")
                                        : activation(batch() * s.out, "char_model.r");
    const scratch r_scratch(memory_, stream_, config_.recompute_blocks ? r : nullptr);
    float* next = activation(batch() * s.out, "char_model.h");
    block_relu(h, w.p, r, s);
    for (std::size_t i = 0; i < batch() * s.out; ++i) next[i] = h[i] + r[i];
    if (r_.empty()) r_.push_back(nullptr);  // r_[0] unused: blocks count from 1
    r_.push_back(config_.recompute_blocks ? nullptr : r);
    h_.push_back(next);
  }

  // r = relu(h W + b), W and b widened (w).
  void block_relu(const float* h, const float* w, float* r, const layer_shape& s) {
    gemm_forward(h, w, r, s.in, s.out);
    const float* bias = w + s.in * s.out;
    for (std::size_t b = 0; b < batch(); ++b) {
      for (std::size_t j = 0; j < s.out; ++j) {
        const std::size_t i = b * s.out + j;
        r[i] = std::max(r[i] + bias[j], 0.0f);
      }
    }
  }

  void forward_output(const layer_shape& s, const std::uint16_t* params) {
    const auto w = widen(params, s.elements());
    probs_ = activation(batch() * s.out, "char_model.probs");
    gemm_forward(h_.back(), w.p, probs_, s.in, s.out);
    const float* bias = w.p + s.in * s.out;
    double total = 0;
    for (std::size_t b = 0; b < batch(); ++b) {
      float* z = probs_ + b * s.out;
      float top = -INFINITY;
      for (std::size_t j = 0; j < s.out; ++j) top = std::max(top, z[j] += bias[j]);
      const std::uint8_t target = tokens_[b * row() + row() - 1];
      const float target_shifted = z[target] - top;
      float sum = 0;
      for (std::size_t j = 0; j < s.out; ++j) sum += (z[j] = std::exp(z[j] - top));
      // -log softmax(target) = log(sum) - (z_t - top): finite even when exp(z_t - top) underflows.
      total += static_cast<double>(std::log(sum) - target_shifted);
      const float inv = 1.0f / sum;
      for (std::size_t j = 0; j < s.out; ++j) z[j] *= inv;
    }
    loss_ = static_cast<float>(total / static_cast<double>(batch()));
  }

  // ---------------------------------------------------------------------- backward
  void backward_output(const layer_shape& s, const std::uint16_t* params, float* grad) {
    // Every allocation before the in-place logits gradient below: a call that failed for memory
    // is retried, and a retry after it would subtract the one-hot and divide a second time.
    const auto w = widen(params, s.elements());
    dh_ = activation(batch() * s.in, "char_model.dh");
    // d logits = (softmax - onehot) / batch, in place over the probabilities (no longer needed).
    const float inv_batch = 1.0f / static_cast<float>(batch());
    for (std::size_t b = 0; b < batch(); ++b) {
      float* p = probs_ + b * s.out;
      p[tokens_[b * row() + row() - 1]] -= 1.0f;
      for (std::size_t j = 0; j < s.out; ++j) p[j] *= inv_batch;
    }
    gemm_weight_grad(h_.back(), probs_, grad, s.in, s.out);
    bias_grad(probs_, grad + s.in * s.out, s.out);
    gemm_input_grad(probs_, w.p, dh_, s.in, s.out, 0.0f);
  }

  void backward_block(int block, const layer_shape& s, const std::uint16_t* params, float* grad) {
    const auto w = widen(params, s.elements());
    const float* r = r_[static_cast<std::size_t>(block)];
    const scratch again(memory_, stream_,
                        r == nullptr ? allocate(batch() * s.out, "char_model.r_scratch") : nullptr);
    if (r == nullptr) {  // recompute_blocks: make r again from the block's input
      block_relu(h_[static_cast<std::size_t>(block) - 1], w.p, again.p, s);
      r = again.p;
    }
    scratch dr(memory_, stream_, allocate(batch() * s.out, "char_model.dr"));
    for (std::size_t i = 0; i < batch() * s.out; ++i) dr.p[i] = r[i] > 0.0f ? dh_[i] : 0.0f;
    gemm_weight_grad(h_[static_cast<std::size_t>(block) - 1], dr.p, grad, s.in, s.out);
    bias_grad(dr.p, grad + s.in * s.out, s.out);
    // The residual: d h_{l-1} = d h_l + dr W^T, accumulated in place.
    gemm_input_grad(dr.p, w.p, dh_, s.in, s.out, 1.0f);
  }

  void backward_input(const layer_shape& s, const std::uint16_t* params, float* grad) {
    const auto w = widen(params, s.elements());
    const float* h = h_.front();
    for (std::size_t i = 0; i < batch() * s.out; ++i) dh_[i] = h[i] > 0.0f ? dh_[i] : 0.0f;
    gemm_weight_grad(x0_, dh_, grad, s.in, s.out);
    bias_grad(dh_, grad + s.in * s.out, s.out);
    dx0_ = activation(batch() * s.in, "char_model.dx0");
    gemm_input_grad(dh_, w.p, dx0_, s.in, s.out, 0.0f);
  }

  // Scatter-add in (row, position) order: the cuda kernel sums each element in the same order.
  void backward_embedding(float* grad) {
    const std::size_t e = static_cast<std::size_t>(config_.embed);
    const std::size_t ctx = static_cast<std::size_t>(config_.context);
    std::fill(grad, grad + static_cast<std::size_t>(config_.vocab) * e, 0.0f);
    for (std::size_t b = 0; b < batch(); ++b) {
      for (std::size_t c = 0; c < ctx; ++c) {
        float* dst = grad + tokens_[b * row() + c] * e;
        const float* src = dx0_ + (b * ctx + c) * e;
        for (std::size_t k = 0; k < e; ++k) dst[k] += src[k];
      }
    }
  }

  char_model_config config_;
  device_backend& device_;
  caching_allocator& memory_;
  stream_ref stream_;
  call_order order_;
  int threads_;
  compute_stats stats_;
  std::vector<std::uint8_t> tokens_;
  float loss_ = 0;

  activation_set activations_{memory_, stream_};  // every activation of the batch, to free
  float* x0_ = nullptr;       // batch x context*embed: the gathered embeddings
  std::vector<float*> h_;     // h_[0] after the input projection, h_[l] after block l
  std::vector<float*> r_;     // r_[l]: block l's relu output
  float* probs_ = nullptr;    // batch x vocab: softmax, then d logits
  float* dh_ = nullptr;       // batch x width: d loss / d h, walking down the blocks
  float* dx0_ = nullptr;      // batch x context*embed
};

}  // namespace

std::unique_ptr<char_model> make_cpu_char_model(const char_model_config& config,
                                                device_backend& device,
                                                caching_allocator& activations, stream_ref stream) {
  return std::make_unique<cpu_char_model>(config, device, activations, stream);
}

}  // namespace terrace::model::detail
