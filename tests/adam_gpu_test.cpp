// SPDX-License-Identifier: Apache-2.0
// The fused GPU Adam kernel (kernels/adam.hpp) against the same float64 reference as the CPU
// kernels, with the scalars computed by the same host function. Every case skips (GTEST_SKIP in
// SetUp) when no GPU is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/adam.hpp"
#include "optimizer/adam_kernel.hpp"
#include "optimizer/adam_reference.hpp"
#include "tests/adam_test_support.hpp"
#include "tests/cuda_test_support.hpp"

namespace terrace {
namespace {

using testing::cuda_ok;
using testing::device_buffer;

class AdamGpu : public testing::gpu_test {};

kernels::adam_gpu_scalars to_gpu(const detail::adam_scalars& s) {
  return {s.beta1, s.beta2, s.one_minus_beta1, s.one_minus_beta2, s.eps, s.step_size,
          s.inv_bc2_sqrt, s.coupled_wd, s.decay, s.grad_mul};
}

void run_against_reference(adam_mode mode, dtype grad_type) {
  constexpr std::size_t n = 100003;
  constexpr int steps = 20;
  constexpr float loss_scale = 256.0f;
  adam_options o;
  o.mode = mode;
  o.lr = 1e-2;
  o.weight_decay = 0.05;
  testing::typed_buffer p(dtype::f32, n), m(dtype::f32, n), v(dtype::f32, n), g(grad_type, n),
      copy(dtype::bf16, n);
  auto rng = testing::rng(5);
  std::normal_distribution<float> normal;
  for (std::size_t i = 0; i < n; ++i) p.set(i, normal(rng));
  reference::adam_state ref;
  for (std::size_t i = 0; i < n; ++i) {
    ref.param.push_back(p.get(i));
    ref.exp_avg.push_back(0);
    ref.exp_avg_sq.push_back(0);
    m.set(i, 0);
    v.set(i, 0);
  }
  device_buffer dp(p.bytes()), dm(m.bytes()), dv(v.bytes()), dg(g.bytes()), dc(copy.bytes());
  cuda_ok(cudaMemcpy(dp.ptr, p.data(), p.bytes(), cudaMemcpyHostToDevice), "copy p");
  cuda_ok(cudaMemcpy(dm.ptr, m.data(), m.bytes(), cudaMemcpyHostToDevice), "copy m");
  cuda_ok(cudaMemcpy(dv.ptr, v.data(), v.bytes(), cudaMemcpyHostToDevice), "copy v");
  for (int step = 1; step <= steps; ++step) {
    std::vector<double> grads(n);
    for (std::size_t i = 0; i < n; ++i) {
      g.set(i, normal(rng) * loss_scale);
      grads[i] = g.get(i);
    }
    cuda_ok(cudaMemcpy(dg.ptr, g.data(), g.bytes(), cudaMemcpyHostToDevice), "copy g");
    const auto s = detail::make_adam_scalars(o, step, loss_scale, 1.0f);
    cuda_ok(kernels::adam_step(static_cast<float*>(dp.ptr), static_cast<float*>(dm.ptr),
                               static_cast<float*>(dv.ptr), dg.ptr, static_cast<int>(grad_type), dc.ptr,
                               kernels::adam_gpu_bf16, n, to_gpu(s), nullptr, nullptr),
            "adam_step");
    reference::adam_step(o, step, grads, 1.0 / loss_scale, ref);
  }
  cuda_ok(cudaDeviceSynchronize(), "sync");
  cuda_ok(cudaMemcpy(p.data(), dp.ptr, p.bytes(), cudaMemcpyDeviceToHost), "copy back p");
  cuda_ok(cudaMemcpy(m.data(), dm.ptr, m.bytes(), cudaMemcpyDeviceToHost), "copy back m");
  cuda_ok(cudaMemcpy(v.data(), dv.ptr, v.bytes(), cudaMemcpyDeviceToHost), "copy back v");
  cuda_ok(cudaMemcpy(copy.data(), dc.ptr, copy.bytes(), cudaMemcpyDeviceToHost), "copy back copy");
  const auto tol = testing::tolerances_for(dtype::f32);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double p_tol = steps * (tol.param * std::abs(ref.param[i]) + tol.param_abs_per_lr * o.lr);
    // The unscaled gradients are N(0, 1): the moments' absolute floors are as in adam_test.cpp.
    const double m_tol = tol.moment * (std::abs(ref.exp_avg[i]) + 0.1);
    const double v_tol = tol.moment * (std::abs(ref.exp_avg_sq[i]) + 0.01);
    if (std::abs(p.get(i) - ref.param[i]) > p_tol || std::abs(m.get(i) - ref.exp_avg[i]) > m_tol ||
        std::abs(v.get(i) - ref.exp_avg_sq[i]) > v_tol) {
      if (++bad <= 5) {
        ADD_FAILURE() << "element " << i << ": param " << p.get(i) << " vs " << ref.param[i] << ", m "
                      << m.get(i) << " vs " << ref.exp_avg[i] << ", v " << v.get(i) << " vs "
                      << ref.exp_avg_sq[i];
      }
    }
    ASSERT_EQ(static_cast<const std::uint16_t*>(copy.data())[i], detail::float_to_bf16(p.get(i)));
  }
  EXPECT_EQ(bad, 0u);
}

TEST_F(AdamGpu, AdamWFp32GradsMatchReference) { run_against_reference(adam_mode::adamw, dtype::f32); }
TEST_F(AdamGpu, AdamBf16GradsMatchReference) { run_against_reference(adam_mode::adam, dtype::bf16); }
TEST_F(AdamGpu, AdamWFp16GradsMatchReference) { run_against_reference(adam_mode::adamw, dtype::f16); }

TEST_F(AdamGpu, SkipFlagLeavesStateUnchanged) {
  constexpr std::size_t n = 4096;
  std::vector<float> host(n, 0.5f), back(n);
  device_buffer dp(n * 4), dm(n * 4), dv(n * 4), dg(n * 4), flag(sizeof(int));
  for (void* ptr : {dp.ptr, dm.ptr, dv.ptr, dg.ptr}) {
    cuda_ok(cudaMemcpy(ptr, host.data(), n * 4, cudaMemcpyHostToDevice), "copy");
  }
  const int one = 1;
  cuda_ok(cudaMemcpy(flag.ptr, &one, sizeof one, cudaMemcpyHostToDevice), "flag");
  const auto s = detail::make_adam_scalars(adam_options{}, 1, 1.0f, 1.0f);
  cuda_ok(kernels::adam_step(static_cast<float*>(dp.ptr), static_cast<float*>(dm.ptr),
                             static_cast<float*>(dv.ptr), dg.ptr, kernels::adam_gpu_f32, nullptr,
                             kernels::adam_gpu_bf16, n, to_gpu(s), static_cast<const int*>(flag.ptr), nullptr),
          "adam_step");
  cuda_ok(cudaDeviceSynchronize(), "sync");
  for (void* ptr : {dp.ptr, dm.ptr, dv.ptr}) {
    cuda_ok(cudaMemcpy(back.data(), ptr, n * 4, cudaMemcpyDeviceToHost), "copy back");
    EXPECT_EQ(std::memcmp(back.data(), host.data(), n * 4), 0);
  }
}

// A launch returns its own status: an error the caller left pending (here cudaSetDevice(-1)'s) is
// neither reported as the kernel's nor cleared from under the caller (found in review: the launch
// check was cudaGetLastError(), which did both).
TEST_F(AdamGpu, ALaunchNeitherReportsNorClearsTheCallersPendingError) {
  constexpr std::size_t n = 1024;
  device_buffer dp(n * 4), dm(n * 4), dv(n * 4), dg(n * 4);
  for (void* ptr : {dp.ptr, dm.ptr, dv.ptr, dg.ptr}) cuda_ok(cudaMemset(ptr, 0, n * 4), "zero");
  ASSERT_NE(cudaSetDevice(-1), cudaSuccess);  // leaves cudaErrorInvalidDevice pending
  const auto s = detail::make_adam_scalars(adam_options{}, 1, 1.0f, 1.0f);
  EXPECT_EQ(kernels::adam_step(static_cast<float*>(dp.ptr), static_cast<float*>(dm.ptr),
                               static_cast<float*>(dv.ptr), dg.ptr, kernels::adam_gpu_f32, nullptr,
                               kernels::adam_gpu_bf16, n, to_gpu(s), nullptr, nullptr),
            cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidDevice);
  cuda_ok(cudaDeviceSynchronize(), "sync");
}

// As torch and the CPU kernels: no weight decay adds no penalty term, so an infinite weight does
// not put NaN (0 * inf) into the moments.
TEST_F(AdamGpu, ZeroWeightDecayKeepsAnInfiniteWeightsMomentsFinite) {
  constexpr std::size_t n = 257;
  std::vector<float> p(n, 1.0f), g(n, 0.5f), m(n), v(n);
  p[3] = std::numeric_limits<float>::infinity();
  device_buffer dp(n * 4), dm(n * 4), dv(n * 4), dg(n * 4);
  cuda_ok(cudaMemcpy(dp.ptr, p.data(), n * 4, cudaMemcpyHostToDevice), "copy p");
  cuda_ok(cudaMemcpy(dg.ptr, g.data(), n * 4, cudaMemcpyHostToDevice), "copy g");
  cuda_ok(cudaMemset(dm.ptr, 0, n * 4), "zero m");
  cuda_ok(cudaMemset(dv.ptr, 0, n * 4), "zero v");
  adam_options o;
  o.mode = adam_mode::adam;
  o.weight_decay = 0.0;
  const auto s = detail::make_adam_scalars(o, 1, 1.0f, 1.0f);
  cuda_ok(kernels::adam_step(static_cast<float*>(dp.ptr), static_cast<float*>(dm.ptr),
                             static_cast<float*>(dv.ptr), dg.ptr, kernels::adam_gpu_f32, nullptr,
                             kernels::adam_gpu_bf16, n, to_gpu(s), nullptr, nullptr),
          "adam_step");
  cuda_ok(cudaMemcpy(m.data(), dm.ptr, n * 4, cudaMemcpyDeviceToHost), "copy back m");
  cuda_ok(cudaMemcpy(v.data(), dv.ptr, n * 4, cudaMemcpyDeviceToHost), "copy back v");
  EXPECT_EQ(m[3], m[0]);
  EXPECT_EQ(v[3], v[0]);
  EXPECT_TRUE(std::isfinite(m[0]) && std::isfinite(v[0]));
}

// Found in review: the GPU wrote a NaN parameter's copy as 0x7fff (bf16 and f16), the CPU
// kernels as 0x7fc0 (bf16) and sign | 0x7e00 (f16). Both copies are compared with the CPU's
// conversion, for a NaN of each sign and a few finite values.
TEST_F(AdamGpu, TheParameterCopyHasTheCpuKernelsBitsForNaN) {
  constexpr std::size_t n = 6;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> p0 = {nan, -nan, 1.0f, -2.5f, 65504.0f, 3.0e-5f};
  std::vector<float> zeros(n, 0.0f);
  adam_options o;
  o.lr = 1e-3;
  const auto s = detail::make_adam_scalars(o, 1, 1.0f, 1.0f);
  for (int copy_type : {kernels::adam_gpu_bf16, kernels::adam_gpu_f16}) {
    SCOPED_TRACE("copy dtype " + std::to_string(copy_type));
    device_buffer dp(n * 4), dm(n * 4), dv(n * 4), dg(n * 4), dc(n * 2);
    cuda_ok(cudaMemcpy(dp.ptr, p0.data(), n * 4, cudaMemcpyHostToDevice), "copy p");
    cuda_ok(cudaMemcpy(dg.ptr, zeros.data(), n * 4, cudaMemcpyHostToDevice), "zero g");
    cuda_ok(cudaMemset(dm.ptr, 0, n * 4), "zero m");
    cuda_ok(cudaMemset(dv.ptr, 0, n * 4), "zero v");
    cuda_ok(kernels::adam_step(static_cast<float*>(dp.ptr), static_cast<float*>(dm.ptr),
                               static_cast<float*>(dv.ptr), dg.ptr, kernels::adam_gpu_f32, dc.ptr, copy_type,
                               n, to_gpu(s), nullptr, nullptr),
            "adam_step");
    std::vector<float> p(n);
    std::vector<std::uint16_t> copy(n);
    cuda_ok(cudaMemcpy(p.data(), dp.ptr, n * 4, cudaMemcpyDeviceToHost), "copy back p");
    cuda_ok(cudaMemcpy(copy.data(), dc.ptr, n * 2, cudaMemcpyDeviceToHost), "copy back copy");
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint16_t cpu =
          copy_type == kernels::adam_gpu_bf16 ? detail::float_to_bf16(p[i]) : detail::float_to_f16(p[i]);
      EXPECT_EQ(copy[i], cpu) << "element " << i << " (" << p[i] << ")";
    }
  }
}

// The device-side overflow check (found in review: the skip flag had nothing on the device to
// set it). Each dtype's inf and NaN, at the first and the last element (the grid-stride tail).
TEST_F(AdamGpu, TheNonfiniteCheckSetsTheSkipFlag) {
  struct bad_value {
    int dtype;
    std::size_t bytes;
    std::uint32_t one, inf, nan;  // bit patterns of 1.0, +inf and a quiet NaN
  };
  constexpr std::size_t n = 100003;
  for (const bad_value& b : {bad_value{kernels::adam_gpu_f32, 4, 0x3f800000u, 0x7f800000u, 0x7fc00000u},
                             bad_value{kernels::adam_gpu_bf16, 2, 0x3f80u, 0x7f80u, 0x7fc0u},
                             bad_value{kernels::adam_gpu_f16, 2, 0x3c00u, 0x7c00u, 0x7e00u}}) {
    SCOPED_TRACE("dtype " + std::to_string(b.dtype));
    std::vector<unsigned char> host(n * b.bytes);
    const auto put = [&](std::size_t i, std::uint32_t bits) { std::memcpy(&host[i * b.bytes], &bits, b.bytes); };
    device_buffer dg(host.size()), flag(sizeof(int));
    const auto check = [&] {
      cuda_ok(cudaMemcpy(dg.ptr, host.data(), host.size(), cudaMemcpyHostToDevice), "copy");
      cuda_ok(cudaMemset(flag.ptr, 0, sizeof(int)), "zero the flag");
      cuda_ok(kernels::flag_nonfinite(dg.ptr, b.dtype, n, 1.0f, static_cast<int*>(flag.ptr), nullptr), "check");
      int got = -1;
      cuda_ok(cudaMemcpy(&got, flag.ptr, sizeof got, cudaMemcpyDeviceToHost), "flag back");
      return got;
    };
    for (std::size_t i = 0; i < n; ++i) put(i, b.one);
    EXPECT_EQ(check(), 0);
    for (std::size_t at : {std::size_t{0}, n - 1}) {
      for (std::uint32_t bad : {b.inf, b.nan}) {
        put(at, bad);
        EXPECT_EQ(check(), 1) << "element " << at << ", bits " << bad;
        put(at, b.one);
      }
    }
  }
  EXPECT_EQ(kernels::flag_nonfinite(nullptr, 7, 1, 1.0f, nullptr, nullptr), cudaErrorInvalidValue);
}

// Found in review: the device check looked at the raw gradients, the CPU step (since the unscaled
// check, AdamPerIsa.GradientThatOverflowsWhenUnscaledSkipsTheStep) at gradient * grad_mul. A
// finite gradient that overflows once multiplied (grad_scale below 1) passed, and the step wrote
// inf into m and v and NaN into the weight. Each dtype's largest finite value, in the last element.
TEST_F(AdamGpu, TheNonfiniteCheckLooksAtTheGradientTimesItsMultiplier) {
  struct big_value {
    int dtype;
    std::size_t bytes;
    std::uint32_t one, big;  // bit patterns of 1.0 and of the dtype's largest finite value
    float grad_mul;          // finite times 1.0, infinite times `big`
  };
  constexpr std::size_t n = 100003;
  for (const big_value& b : {big_value{kernels::adam_gpu_f32, 4, 0x3f800000u, 0x7f7fffffu, 2.0f},
                             big_value{kernels::adam_gpu_bf16, 2, 0x3f80u, 0x7f7fu, 2.0f},
                             big_value{kernels::adam_gpu_f16, 2, 0x3c00u, 0x7bffu, 1e35f}}) {
    SCOPED_TRACE("dtype " + std::to_string(b.dtype));
    std::vector<unsigned char> host(n * b.bytes);
    const auto put = [&](std::size_t i, std::uint32_t bits) { std::memcpy(&host[i * b.bytes], &bits, b.bytes); };
    for (std::size_t i = 0; i < n; ++i) put(i, b.one);
    put(n - 1, b.big);
    device_buffer dg(host.size()), flag(sizeof(int));
    cuda_ok(cudaMemcpy(dg.ptr, host.data(), host.size(), cudaMemcpyHostToDevice), "copy");
    const auto check = [&](float grad_mul) {
      cuda_ok(cudaMemset(flag.ptr, 0, sizeof(int)), "zero the flag");
      cuda_ok(kernels::flag_nonfinite(dg.ptr, b.dtype, n, grad_mul, static_cast<int*>(flag.ptr), nullptr),
              "check");
      int got = -1;
      cuda_ok(cudaMemcpy(&got, flag.ptr, sizeof got, cudaMemcpyDeviceToHost), "flag back");
      return got;
    };
    EXPECT_EQ(check(1.0f), 0) << "the largest finite value is finite";
    EXPECT_EQ(check(b.grad_mul), 1) << "times " << b.grad_mul << " it is not";
  }
}

}  // namespace
}  // namespace terrace
