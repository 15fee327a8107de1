// SPDX-License-Identifier: Apache-2.0
// The cuda char model (kernels/char_model_cuda.cu) against the cpu one (checked against a
// float64 reference by char_model_test): the same weights and batches, losses and gradients within
// float tolerance (the GEMMs sum in different orders); runs bitwise repeatable on the GPU; and its
// activations counted by, and returned to, the device's allocator. Every case skips (GTEST_SKIP in
// SetUp) when no GPU is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/char_model.hpp"
#include "terrace/caching_allocator.hpp"
#include "tests/char_model_test_support.hpp"
#include "tests/cuda_test_support.hpp"

namespace terrace::model {
namespace {

using terrace::testing::cuda_ok;
using terrace::testing::device_buffer;

class CharModelGpu : public terrace::testing::gpu_test {};

struct step_result {
  float loss = 0;
  std::vector<std::vector<float>> grads;
};

// A device, its allocator and a stream, and a model made for them by make_char_model.
struct rig {
  std::unique_ptr<device_backend> dev;
  std::unique_ptr<caching_allocator> memory;
  stream_ref stream;
  std::unique_ptr<char_model> model;
  rig(const char* kind, const char_model_config& c) {
    dev = make_device(kind, {});
    memory = std::make_unique<caching_allocator>(*dev);
    stream = dev->create_stream();
    model = make_char_model(c, *dev, *memory, stream);
  }
  ~rig() {
    model.reset();
    dev->synchronize_device();
    dev->destroy_stream(stream);
  }
};

// One batch on the cuda model: parameters copied into device memory, gradients copied back.
step_result run_gpu(char_model& m, const testing::model_weights& w, const std::vector<std::uint8_t>& tokens) {
  const std::size_t n = w.bf16.size();
  std::vector<std::unique_ptr<device_buffer>> params, grads;
  for (const auto& layer : w.bf16) {
    params.push_back(std::make_unique<device_buffer>(layer.size() * 2));
    grads.push_back(std::make_unique<device_buffer>(layer.size() * 4));
    cuda_ok(cudaMemcpy(params.back()->ptr, layer.data(), layer.size() * 2, cudaMemcpyHostToDevice), "copy params");
    cuda_ok(cudaMemset(grads.back()->ptr, 0xff, layer.size() * 4), "poison grads");  // NaN: "writes"
  }
  cuda_ok(cudaDeviceSynchronize(), "sync");
  step_result r;
  m.begin_batch(tokens.data());
  for (std::size_t l = 0; l < n; ++l) m.forward(int(l), static_cast<const std::uint16_t*>(params[l]->ptr));
  r.loss = m.loss();
  for (std::size_t l = n; l-- > 0;) {
    m.backward(int(l), static_cast<const std::uint16_t*>(params[l]->ptr), static_cast<float*>(grads[l]->ptr));
  }
  cuda_ok(cudaDeviceSynchronize(), "sync");
  r.grads.resize(n);
  for (std::size_t l = 0; l < n; ++l) {
    r.grads[l].resize(w.bf16[l].size());
    cuda_ok(cudaMemcpy(r.grads[l].data(), grads[l]->ptr, r.grads[l].size() * 4, cudaMemcpyDeviceToHost), "copy grads");
  }
  return r;
}

// The same on the cpu model (sim memory is host memory).
step_result run_cpu(char_model& m, const testing::model_weights& w, const std::vector<std::uint8_t>& tokens) {
  const std::size_t n = w.bf16.size();
  step_result r;
  m.begin_batch(tokens.data());
  for (std::size_t l = 0; l < n; ++l) m.forward(int(l), w.bf16[l].data());
  r.loss = m.loss();
  r.grads.resize(n);
  for (std::size_t l = n; l-- > 0;) {
    r.grads[l].assign(w.bf16[l].size(), NAN);
    m.backward(int(l), w.bf16[l].data(), r.grads[l].data());
  }
  return r;
}

char_model_config small() {
  char_model_config c;
  c.width = 256;
  c.layers = 4;
  c.batch = 32;
  return c;
}

TEST_F(CharModelGpu, MatchesTheCpuImplementation) {
  const auto c = small();
  rig gpu("cuda", c), cpu("sim", c);
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    const auto w = testing::make_weights(c, seed);
    const auto tokens = testing::random_tokens(c, seed + 100);
    const auto g = run_gpu(*gpu.model, w, tokens);
    const auto h = run_cpu(*cpu.model, w, tokens);
    EXPECT_NEAR(g.loss, h.loss, 1e-5 * h.loss) << "seed " << seed;
    for (std::size_t l = 0; l < h.grads.size(); ++l) {
      double scale = 0;
      for (float v : h.grads[l]) scale = std::max(scale, double(std::abs(v)));
      ASSERT_GT(scale, 0.0) << "layer " << l;
      for (std::size_t i = 0; i < h.grads[l].size(); ++i) {
        ASSERT_NEAR(g.grads[l][i], h.grads[l][i], 1e-4 * scale + 1e-3 * std::abs(h.grads[l][i]))
            << "seed " << seed << " layer " << l << " element " << i;
      }
    }
  }
}

TEST_F(CharModelGpu, RunsAreBitwiseRepeatable) {
  const auto c = small();
  const auto w = testing::make_weights(c, 7);
  std::vector<step_result> runs;
  for (int run = 0; run < 2; ++run) {
    rig gpu("cuda", c);
    step_result last;
    for (std::uint64_t batch = 0; batch < 2; ++batch) last = run_gpu(*gpu.model, w, testing::random_tokens(c, batch));
    runs.push_back(std::move(last));
  }
  EXPECT_EQ(std::memcmp(&runs[0].loss, &runs[1].loss, sizeof(float)), 0);
  for (std::size_t l = 0; l < runs[0].grads.size(); ++l) {
    EXPECT_EQ(std::memcmp(runs[0].grads[l].data(), runs[1].grads[l].data(), runs[0].grads[l].size() * 4), 0)
        << "layer " << l;
  }
}

// Activation checkpointing on the GPU: the same bits as without it (the same GEMMs on the same
// inputs, and bias_relu_kernel does what block_forward_kernel does to r).
TEST_F(CharModelGpu, RecomputedBlocksGiveTheSameBits) {
  auto c = small();
  const auto w = testing::make_weights(c, 11);
  const auto tokens = testing::random_tokens(c, 12);
  std::vector<step_result> runs;
  for (const bool recompute : {false, true}) {
    c.recompute_blocks = recompute;
    rig gpu("cuda", c);
    runs.push_back(run_gpu(*gpu.model, w, tokens));
  }
  EXPECT_EQ(std::memcmp(&runs[0].loss, &runs[1].loss, sizeof(float)), 0);
  for (std::size_t l = 0; l < runs[0].grads.size(); ++l) {
    EXPECT_EQ(std::memcmp(runs[0].grads[l].data(), runs[1].grads[l].data(), runs[0].grads[l].size() * 4), 0)
        << "layer " << l;
  }
}

TEST_F(CharModelGpu, ActivationsCountAgainstTheDeviceAndAreFreed) {
  const auto c = small();
  rig gpu("cuda", c);
  const auto w = testing::make_weights(c, 3);
  const auto tokens = testing::random_tokens(c, 4);
  const auto allocated = [&] { return gpu.memory->stats().allocated_bytes[0].current; };
  ASSERT_EQ(allocated(), 0);
  std::vector<std::unique_ptr<device_buffer>> params;
  for (const auto& layer : w.bf16) {
    params.push_back(std::make_unique<device_buffer>(layer.size() * 2));
    cuda_ok(cudaMemcpy(params.back()->ptr, layer.data(), layer.size() * 2, cudaMemcpyHostToDevice), "copy");
  }
  gpu.model->begin_batch(tokens.data());
  for (std::size_t l = 0; l < params.size(); ++l) {
    gpu.model->forward(int(l), static_cast<const std::uint16_t*>(params[l]->ptr));
  }
  // At least the residual stream: (h, r) per block at batch x width floats.
  EXPECT_GE(allocated(), std::int64_t(2) * c.layers * c.batch * c.width * 4);
  EXPECT_TRUE(std::isfinite(gpu.model->loss()));
  device_buffer grad(layers(c)[1].elements * 4);  // the largest layer here
  for (std::size_t l = params.size(); l-- > 0;) {
    gpu.model->backward(int(l), static_cast<const std::uint16_t*>(params[l]->ptr), static_cast<float*>(grad.ptr));
  }
  EXPECT_EQ(allocated(), 0);
  gpu.dev->synchronize_device();
  gpu.memory->check_invariants();
}

}  // namespace
}  // namespace terrace::model
