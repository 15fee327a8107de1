// SPDX-License-Identifier: Apache-2.0
// What char_model.hpp promises independently of where the math runs: the layer list, the
// deterministic initial values, bf16 conversion, the call-order checks, and the choice of
// implementation.
#include "kernels/char_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numbers>
#include <string>
#include <thread>

#include "kernels/char_model_impl.hpp"
#include "optimizer/half.hpp"
#include "terrace/error.hpp"

namespace terrace::model {

// ------------------------------------------------------------------------------ the layers

void validate(const char_model_config& c) {
  const auto positive = [](int v, const char* name) {
    if (v <= 0) {
      throw logic_error(std::string("terrace: char_model_config.") + name + " must be positive, got " +
                        std::to_string(v));
    }
  };
  positive(c.vocab, "vocab");
  positive(c.context, "context");
  positive(c.embed, "embed");
  positive(c.width, "width");
  positive(c.layers, "layers");
  positive(c.batch, "batch");
  if (c.vocab > 256) {
    throw logic_error("terrace: char_model_config.vocab must be at most 256 (tokens are bytes), got " +
                      std::to_string(c.vocab));
  }
  // Every layer is a tensor of its own (its name a tensor id in the store), listed up front:
  // a million blocks is far past any model this trains, and keeps layers + 3 (the layer count)
  // an int.
  constexpr int kMaxLayers = 1 << 20;
  if (c.layers > kMaxLayers) {
    throw logic_error("terrace: char_model_config.layers must be at most " +
                      std::to_string(kMaxLayers) + ", got " + std::to_string(c.layers));
  }
  if (c.cpu_threads < 0) {
    throw logic_error("terrace: char_model_config.cpu_threads must be >= 0 (0 = the machine's), got " +
                      std::to_string(c.cpu_threads));
  }
  // Every layer's element count, and every activation, must fit the int arguments of BLAS.
  // context * embed and vocab * embed are products of two ints, so they fit long long; `in` is
  // bounded first so that the products with width and batch below cannot wrap.
  const auto wide = [](long long v) { return v > (1LL << 31) - 1; };
  const long long in = static_cast<long long>(c.context) * c.embed;
  if (wide(in) || wide(static_cast<long long>(c.vocab) * c.embed) || wide(in * c.width) ||
      wide(static_cast<long long>(c.width) * c.width + c.width) ||
      wide(static_cast<long long>(c.batch) * std::max<long long>(in, c.width))) {
    throw logic_error("terrace: char_model_config too large: a layer or an activation would exceed "
                      "2^31 elements");
  }
}

namespace detail {

layer_shape shape_of(const char_model_config& c, int layer) noexcept {
  const auto n = [](int v) { return static_cast<std::size_t>(v); };
  if (layer == 0) return {layer_kind::embedding, n(c.vocab), n(c.embed), false};
  if (layer == 1) return {layer_kind::input, n(c.context) * n(c.embed), n(c.width), true};
  if (layer <= c.layers + 1) return {layer_kind::block, n(c.width), n(c.width), true};
  return {layer_kind::output, n(c.width), n(c.vocab), true};
}

}  // namespace detail

std::vector<layer_spec> layers(const char_model_config& config) {
  validate(config);
  std::vector<layer_spec> out;
  const int count = detail::layer_count(config);
  out.reserve(static_cast<std::size_t>(count));
  // Names are tensor ids on NVMe: stable, and zero-padded so that they sort in forward order.
  char name[32];
  for (int layer = 0; layer < count; ++layer) {
    const auto shape = detail::shape_of(config, layer);
    switch (shape.kind) {
      case detail::layer_kind::embedding: std::snprintf(name, sizeof name, "embedding"); break;
      case detail::layer_kind::input: std::snprintf(name, sizeof name, "input"); break;
      case detail::layer_kind::block: std::snprintf(name, sizeof name, "block%03d", layer - 2); break;
      case detail::layer_kind::output: std::snprintf(name, sizeof name, "output"); break;
    }
    out.push_back({name, shape.elements()});
  }
  return out;
}

std::size_t parameter_count(const char_model_config& config) {
  std::size_t total = 0;
  for (const auto& l : layers(config)) total += l.elements;
  return total;
}

// ------------------------------------------------------------------------- initial values

namespace {

// splitmix64 (Steele, Lea, Flood 2014): a 64-bit state, integer arithmetic only, so the stream of
// bits is the same on every machine. One stream per (seed, layer).
struct splitmix64 {
  std::uint64_t state;
  std::uint64_t next() noexcept {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // (0, 1]: never 0, so that log() below is finite. 53 bits: exact in double.
  double uniform() noexcept { return (static_cast<double>(next() >> 11) + 1.0) * 0x1p-53; }
};

}  // namespace

void init_layer(const char_model_config& config, int layer, std::uint64_t seed, float* out) {
  validate(config);
  TERRACE_EXPECTS(layer >= 0 && layer < detail::layer_count(config), "init_layer: layer out of range");
  TERRACE_EXPECTS(out != nullptr, "init_layer: null output");
  const auto shape = detail::shape_of(config, layer);
  double scale = 1.0;
  switch (shape.kind) {
    case detail::layer_kind::embedding: scale = 1.0; break;
    case detail::layer_kind::input: scale = std::sqrt(2.0 / static_cast<double>(shape.in)); break;
    case detail::layer_kind::block:
      scale = std::sqrt(2.0 / static_cast<double>(shape.in)) / std::sqrt(static_cast<double>(config.layers));
      break;
    case detail::layer_kind::output: scale = 0.02 / std::sqrt(static_cast<double>(shape.in)); break;
  }
  // Box-Muller in double, both outputs used. sqrt is exactly rounded everywhere; log and cos come
  // from libm, whose last-bit differences vanish in the rounding to float except when a value
  // lies within a double ulp of a float rounding boundary (tests/char_model_test.cpp pins a
  // checksum of the values, so a libm that differs there would be noticed).
  splitmix64 rng{seed ^ (0xd1b54a32d192ed03ull * static_cast<std::uint64_t>(layer + 1))};
  const std::size_t weights = shape.in * shape.out;
  for (std::size_t i = 0; i < weights; i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(rng.uniform()));
    const double angle = 2.0 * std::numbers::pi * rng.uniform();
    out[i] = static_cast<float>(scale * radius * std::cos(angle));
    if (i + 1 < weights) out[i + 1] = static_cast<float>(scale * radius * std::sin(angle));
  }
  std::fill(out + weights, out + shape.elements(), 0.0f);
}

// -------------------------------------------------------------------------------- bf16

void to_bf16(const float* in, std::size_t n, std::uint16_t* out) noexcept {
  for (std::size_t i = 0; i < n; ++i) out[i] = terrace::detail::float_to_bf16(in[i]);
}

void from_bf16(const std::uint16_t* in, std::size_t n, float* out) noexcept {
  for (std::size_t i = 0; i < n; ++i) out[i] = terrace::detail::bf16_to_float(in[i]);
}

// -------------------------------------------------------------------------- call order

namespace detail {

void call_order::check_forward(int layer, const void* params) const {
  TERRACE_EXPECTS(in_batch_, "char_model::forward before begin_batch");
  TERRACE_EXPECTS(layer >= 0 && layer < layers_, "char_model::forward: layer out of range");
  if (layer != next_forward_) {
    throw logic_error("terrace: char_model::forward(" + std::to_string(layer) + ") out of order: " +
                      (next_forward_ >= layers_ ? std::string("forward is complete")
                                                : "expected layer " + std::to_string(next_forward_)));
  }
  TERRACE_EXPECTS(params != nullptr, "char_model::forward: null params");
}

void call_order::done_forward() noexcept {
  if (++next_forward_ == layers_) next_backward_ = layers_ - 1;
}

void call_order::check_loss() const {
  TERRACE_EXPECTS(in_batch_ && next_forward_ == layers_,
                  "char_model::loss before the forward pass of a batch is complete");
}

void call_order::check_backward(int layer, const void* params, const void* grad) const {
  TERRACE_EXPECTS(in_batch_, "char_model::backward before begin_batch");
  TERRACE_EXPECTS(layer >= 0 && layer < layers_, "char_model::backward: layer out of range");
  TERRACE_EXPECTS(next_forward_ == layers_, "char_model::backward before the forward pass is complete");
  if (layer != next_backward_) {
    throw logic_error("terrace: char_model::backward(" + std::to_string(layer) + ") out of order: " +
                      (next_backward_ < 0 ? std::string("backward is complete")
                                          : "expected layer " + std::to_string(next_backward_)));
  }
  TERRACE_EXPECTS(params != nullptr && grad != nullptr, "char_model::backward: null params or grad");
}

bool call_order::done_backward() noexcept {
  if (--next_backward_ >= 0) return false;
  in_batch_ = false;
  return true;
}

std::vector<std::uint8_t> check_tokens(const char_model_config& c, const std::uint8_t* tokens) {
  TERRACE_EXPECTS(tokens != nullptr, "char_model::begin_batch: null tokens");
  const std::size_t row = static_cast<std::size_t>(c.context) + 1;
  std::vector<std::uint8_t> copy(tokens, tokens + row * static_cast<std::size_t>(c.batch));
  for (std::size_t i = 0; i < copy.size(); ++i) {
    if (copy[i] >= c.vocab) {
      throw logic_error("terrace: char_model::begin_batch: token " + std::to_string(copy[i]) +
                        " (row " + std::to_string(i / row) + ", position " + std::to_string(i % row) +
                        ") is not below vocab " + std::to_string(c.vocab));
    }
  }
  return copy;
}

int default_cpu_threads() noexcept {
  const unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(hw, 1u, 16u));
}

}  // namespace detail

// ------------------------------------------------------------------------------ factory

int effective_cpu_threads(const char_model_config& config) noexcept {
  return config.cpu_threads > 0 ? config.cpu_threads : detail::default_cpu_threads();
}

std::unique_ptr<char_model> make_char_model(const char_model_config& config, device_backend& device,
                                            caching_allocator& activations, stream_ref stream) {
  validate(config);
  if (&activations.device() != &device) {
    throw logic_error("terrace: make_char_model: the activation allocator is over another device "
                      "than the model's");
  }
  const auto& props = device.properties();
  if (props.name.rfind("cuda", 0) == 0) {
#if defined(TERRACE_MODEL_WITH_CUDA)
    return detail::make_cuda_char_model(config, device, activations, stream);
#else
    throw logic_error("terrace: make_char_model: device '" + props.name +
                      "' needs the cuda implementation, and this build has none (configure with "
                      "-DTERRACE_ENABLE_CUDA=ON)");
#endif
  }
  if (!props.touches_memory || props.name != "sim") {
    throw logic_error("terrace: make_char_model: device '" + props.name +
                      "' has no memory the host can compute on (the cpu implementation needs "
                      "'sim')");
  }
  return detail::make_cpu_char_model(config, device, activations, stream);
}

}  // namespace terrace::model
