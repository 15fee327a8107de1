// SPDX-License-Identifier: Apache-2.0
// The CPU Adam/AdamW kernels against the float64 reference, for every instruction set this CPU
// has, both modes and every dtype combination; skipped steps, resume, thread-count invariance,
// the gradient norm and argument checking.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "optimizer/adam_kernel.hpp"
#include "optimizer/adam_reference.hpp"
#include "optimizer/half.hpp"
#include "terrace/adam.hpp"
#include "terrace/error.hpp"
#include "tests/adam_test_support.hpp"

namespace terrace {
namespace {

using testing::tolerances_for;
using testing::typed_buffer;

std::vector<simd_isa> available_isas() {
  std::vector<simd_isa> isas{simd_isa::scalar};
  if (best_simd_isa() >= simd_isa::avx2) isas.push_back(simd_isa::avx2);
  if (best_simd_isa() >= simd_isa::avx512) isas.push_back(simd_isa::avx512);
  return isas;
}

// One tensor's buffers plus the reference's float64 copy of its state.
struct tensor_data {
  tensor_data(std::size_t n, dtype state, dtype grad, bool copy, dtype copy_type)
      : param(dtype::f32, n), m(state, n), v(state, n), g(grad, n),
        copy(copy ? typed_buffer(copy_type, n) : typed_buffer()) {}
  adam_tensor view() {
    return {static_cast<float*>(param.data()), m.data(), v.data(), g.data(),
            copy.size() != 0 ? copy.data() : nullptr, param.size()};
  }
  typed_buffer param, m, v, g, copy;
};

void fill_params(tensor_data& t, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    t.param.set(i, normal(rng));
    t.m.set(i, 0.0f);
    t.v.set(i, 0.0f);
  }
}

// Gradients of unit scale times `scale` (what a loss-scaled backward pass produces).
void fill_grads(tensor_data& t, std::mt19937_64& rng, float scale) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t i = 0; i < t.g.size(); ++i) t.g.set(i, normal(rng) * scale);
}

reference::adam_state reference_of(const tensor_data& t) {
  reference::adam_state s;
  for (std::size_t i = 0; i < t.param.size(); ++i) {
    s.param.push_back(t.param.get(i));
    s.exp_avg.push_back(t.m.get(i));
    s.exp_avg_sq.push_back(t.v.get(i));
  }
  return s;
}

using config = std::tuple<simd_isa, adam_mode, dtype /*grad*/, dtype /*state*/, int /*copy: -1 none*/>;

class AdamReference : public ::testing::TestWithParam<config> {};

TEST_P(AdamReference, MatchesFloat64ReferenceOverManySteps) {
  const auto [isa, mode, grad_type, state_type, copy_code] = GetParam();
  const bool has_copy = copy_code >= 0;
  const dtype copy_type = has_copy ? static_cast<dtype>(copy_code) : dtype::bf16;
  adam_options o;
  o.mode = mode;
  o.lr = 1e-2;
  o.weight_decay = 0.05;
  o.state_dtype = state_type;
  o.isa = isa;
  o.threads = 2;
  adam_optimizer adam(o);
  ASSERT_EQ(adam.options().isa, isa);

  // Two tensors with odd sizes: SIMD bodies, scalar tails and a tensor boundary.
  auto rng = testing::rng(42);
  std::vector<tensor_data> tensors;
  for (std::size_t n : {1003u, 2053u}) {
    tensors.emplace_back(n, state_type, grad_type, has_copy, copy_type);
    fill_params(tensors.back(), rng);
  }
  std::vector<reference::adam_state> ref;
  for (auto& t : tensors) ref.push_back(reference_of(t));

  constexpr int steps = 30;
  constexpr float loss_scale = 1024.0f;
  constexpr float clip = 0.5f;
  for (int step = 1; step <= steps; ++step) {
    std::vector<adam_tensor> views;
    for (auto& t : tensors) {
      fill_grads(t, rng, loss_scale);
      views.push_back(t.view());
    }
    adam_step_options so;
    so.grad_dtype = grad_type;
    so.copy_dtype = copy_type;
    so.grad_scale = loss_scale;
    so.clip_coef = clip;
    so.check_finite = step % 2 == 0;
    ASSERT_TRUE(adam.step(views, so));
    for (std::size_t k = 0; k < tensors.size(); ++k) {
      std::vector<double> g(tensors[k].g.size());
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = tensors[k].g.get(i);
      reference::adam_step(o, step, g, static_cast<double>(clip) / loss_scale, ref[k]);
    }
  }
  EXPECT_EQ(adam.step_count(), steps);

  const auto tol = tolerances_for(state_type);
  const double typical_g = clip;  // the unscaled, clipped gradients are N(0, clip^2)
  std::size_t bad = 0;
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    const tensor_data& t = tensors[k];
    for (std::size_t i = 0; i < t.param.size(); ++i) {
      const double p = ref[k].param[i];
      const double m = ref[k].exp_avg[i];
      const double v = ref[k].exp_avg_sq[i];
      const double p_tol = steps * (tol.param * std::abs(p) + tol.param_abs_per_lr * o.lr);
      const double m_tol = tol.moment * (std::abs(m) + 0.1 * typical_g);
      const double v_tol = tol.moment * (std::abs(v) + 0.01 * typical_g * typical_g);
      const bool ok = std::abs(t.param.get(i) - p) <= p_tol && std::abs(t.m.get(i) - m) <= m_tol &&
                      std::abs(t.v.get(i) - v) <= v_tol;
      if (!ok && ++bad <= 5) {
        ADD_FAILURE() << "tensor " << k << " element " << i << ": param " << t.param.get(i) << " vs "
                      << p << " (tol " << p_tol << "), m " << t.m.get(i) << " vs " << m << " (tol "
                      << m_tol << "), v " << t.v.get(i) << " vs " << v << " (tol " << v_tol << ")";
      }
      // The copy is the stored fp32 param, rounded to nearest even: bit for bit.
      if (has_copy) {
        typed_buffer expect(copy_type, 1);
        expect.set(0, t.param.get(i));
        ASSERT_EQ(std::memcmp(static_cast<const char*>(t.copy.data()) + i * size_of(copy_type),
                              expect.data(), size_of(copy_type)),
                  0)
            << "copy of element " << i;
      }
    }
  }
  EXPECT_EQ(bad, 0u);
}

std::string config_name(const ::testing::TestParamInfo<config>& info) {
  const auto [isa, mode, grad, state, copy] = info.param;
  const char* rule = mode == adam_mode::adam ? "adam" : mode == adam_mode::adamw ? "adamw" : "lion";
  return std::string(to_string(isa)) + "_" + rule + "_g" +
         std::string(to_string(grad)) + "_s" + std::string(to_string(state)) + "_c" +
         (copy < 0 ? std::string("none") : std::string(to_string(static_cast<dtype>(copy))));
}

INSTANTIATE_TEST_SUITE_P(
    AllConfigs, AdamReference,
    ::testing::Combine(::testing::ValuesIn(available_isas()),
                       ::testing::Values(adam_mode::adam, adam_mode::adamw, adam_mode::lion),
                       ::testing::Values(dtype::f32, dtype::bf16, dtype::f16),
                       ::testing::Values(dtype::f32, dtype::bf16), ::testing::Values(-1, 0, 1, 2)),
    config_name);

// ------------------------------------------------------------------------- one run, replayable

struct run_result {
  std::vector<tensor_data> tensors;
};

adam_options small_options(simd_isa isa, dtype state, unsigned threads) {
  adam_options o;
  o.lr = 3e-3;
  o.weight_decay = 0.01;
  o.isa = isa;
  o.state_dtype = state;
  o.threads = threads;
  return o;
}

// Steps `from`..`to` (1-based, inclusive) with gradients that depend only on the step number.
void run_steps(adam_optimizer& adam, std::vector<tensor_data>& tensors, int from, int to, dtype grad_type) {
  for (int step = from; step <= to; ++step) {
    auto rng = testing::rng(1000 + step);
    std::vector<adam_tensor> views;
    for (auto& t : tensors) {
      fill_grads(t, rng, 1.0f);
      views.push_back(t.view());
    }
    adam_step_options so;
    so.grad_dtype = grad_type;
    ASSERT_TRUE(adam.step(views, so));
  }
}

std::vector<tensor_data> make_tensors(const std::vector<std::size_t>& sizes, dtype state, dtype grad,
                                      bool copy) {
  auto rng = testing::rng(7);
  std::vector<tensor_data> tensors;
  for (std::size_t n : sizes) {
    tensors.emplace_back(n, state, grad, copy, dtype::bf16);
    fill_params(tensors.back(), rng);
  }
  return tensors;
}

bool same_state(const std::vector<tensor_data>& a, const std::vector<tensor_data>& b) {
  for (std::size_t k = 0; k < a.size(); ++k) {
    if (!a[k].param.same_bytes(b[k].param) || !a[k].m.same_bytes(b[k].m) ||
        !a[k].v.same_bytes(b[k].v) || !a[k].copy.same_bytes(b[k].copy)) {
      return false;
    }
  }
  return true;
}

class AdamPerIsa : public ::testing::TestWithParam<simd_isa> {};

TEST_P(AdamPerIsa, ResumeFromSavedStepCounterIsBitwiseIdentical) {
  for (dtype state : {dtype::f32, dtype::bf16}) {
    auto straight = make_tensors({5000, 77}, state, dtype::bf16, true);
    adam_optimizer a(small_options(GetParam(), state, 2));
    run_steps(a, straight, 1, 10, dtype::bf16);

    auto resumed = make_tensors({5000, 77}, state, dtype::bf16, true);
    {
      adam_optimizer first(small_options(GetParam(), state, 2));
      run_steps(first, resumed, 1, 4, dtype::bf16);
      EXPECT_EQ(first.step_count(), 4);
    }
    adam_optimizer second(small_options(GetParam(), state, 2));  // a new process, as it were
    second.set_step_count(4);
    run_steps(second, resumed, 5, 10, dtype::bf16);
    EXPECT_EQ(second.step_count(), 10);
    EXPECT_TRUE(same_state(straight, resumed)) << to_string(state);
  }
}

TEST_P(AdamPerIsa, SkippedStepLeavesEveryByteUnchanged) {
  for (dtype grad : {dtype::f32, dtype::bf16, dtype::f16}) {
    for (float poison : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                         std::numeric_limits<float>::quiet_NaN()}) {
      auto tensors = make_tensors({3001, 64}, dtype::f32, grad, true);
      adam_optimizer adam(small_options(GetParam(), dtype::f32, 2));
      run_steps(adam, tensors, 1, 3, grad);
      const auto before = tensors;  // deep copy of every buffer
      tensors[1].g.set(63, poison);  // the very last element: found after everything else
      std::vector<adam_tensor> views{tensors[0].view(), tensors[1].view()};
      adam_step_options so;
      so.grad_dtype = grad;
      so.check_finite = true;
      so.grad_scale = 65536.0f;
      EXPECT_FALSE(adam.step(views, so));
      EXPECT_EQ(adam.step_count(), 3);
      EXPECT_TRUE(same_state(before, tensors)) << to_string(grad) << " " << poison;
      // The same gradients in front of clipping: the norm pass reports them.
      EXPECT_FALSE(adam.grad_norm(views, grad).finite);
    }
  }
}

TEST_P(AdamPerIsa, ManySmallTensorsEqualOneFlatBuffer) {
  // 300 tensors of assorted sizes against one buffer holding them end to end.
  std::vector<std::size_t> sizes;
  auto rng = testing::rng(3);
  std::size_t total = 0;
  for (int i = 0; i < 300; ++i) {
    sizes.push_back(1 + rng() % 700);
    total += sizes.back();
  }
  auto many = make_tensors(sizes, dtype::f32, dtype::f32, false);
  std::vector<tensor_data> flat;
  flat.emplace_back(total, dtype::f32, dtype::f32, false, dtype::bf16);
  std::size_t at = 0;
  for (auto& t : many) {
    for (std::size_t i = 0; i < t.param.size(); ++i) flat[0].param.set(at + i, t.param.get(i));
    at += t.param.size();
  }
  adam_optimizer a(small_options(GetParam(), dtype::f32, 2));
  adam_optimizer b(small_options(GetParam(), dtype::f32, 2));
  for (int step = 1; step <= 3; ++step) {
    auto g = testing::rng(step);
    std::normal_distribution<float> normal;
    std::vector<adam_tensor> views;
    at = 0;
    for (auto& t : many) {
      for (std::size_t i = 0; i < t.g.size(); ++i) {
        const float x = normal(g);
        t.g.set(i, x);
        flat[0].g.set(at + i, x);
      }
      at += t.g.size();
      views.push_back(t.view());
    }
    ASSERT_TRUE(a.step(views));
    const adam_tensor one = flat[0].view();
    ASSERT_TRUE(b.step(std::span<const adam_tensor>(&one, 1)));
  }
  // Elementwise the same math; the SIMD/tail split differs, so compare to float rounding.
  at = 0;
  for (auto& t : many) {
    for (std::size_t i = 0; i < t.param.size(); ++i) {
      ASSERT_NEAR(t.param.get(i), flat[0].param.get(at + i), 1e-6 * (1 + std::abs(t.param.get(i))));
    }
    at += t.param.size();
  }
}

TEST_P(AdamPerIsa, GradNormMatchesFloat64) {
  for (dtype grad : {dtype::f32, dtype::bf16, dtype::f16}) {
    auto tensors = make_tensors({100001, 5, 70000}, dtype::f32, grad, false);
    auto rng = testing::rng(11);
    double sum = 0;
    std::vector<adam_tensor> views;
    for (auto& t : tensors) {
      fill_grads(t, rng, 8.0f);
      for (std::size_t i = 0; i < t.g.size(); ++i) sum += static_cast<double>(t.g.get(i)) * t.g.get(i);
      views.push_back(t.view());
    }
    adam_optimizer adam(small_options(GetParam(), dtype::f32, 2));
    const grad_norm_result r = adam.grad_norm(views, grad, 8.0f);
    EXPECT_TRUE(r.finite);
    EXPECT_NEAR(r.norm, std::sqrt(sum) / 8.0, 1e-5 * std::sqrt(sum) / 8.0) << to_string(grad);
  }
}

// Found in review: the scan's pieces were cut anywhere and summed from their own starts, and the
// partial sums added in thread order, so the norm (and the clip coefficient from it) changed in
// its last bits with the thread count.
TEST_P(AdamPerIsa, GradNormIsTheSameBitsForEveryThreadCount) {
  for (dtype grad : {dtype::f32, dtype::bf16}) {
    auto tensors = make_tensors({100001, 5, 70000, 300000}, dtype::f32, grad, false);
    auto rng = testing::rng(12);
    std::vector<adam_tensor> views;
    for (auto& t : tensors) {
      fill_grads(t, rng, 8.0f);
      views.push_back(t.view());
    }
    std::vector<double> norms;
    for (unsigned threads : {1u, 2u, 3u}) {
      adam_optimizer adam(small_options(GetParam(), dtype::f32, threads));
      norms.push_back(adam.grad_norm(views, grad, 8.0f).norm);
    }
    EXPECT_EQ(std::memcmp(&norms[0], &norms[1], sizeof(double)), 0) << norms[0] << " " << norms[1];
    EXPECT_EQ(std::memcmp(&norms[0], &norms[2], sizeof(double)), 0) << norms[0] << " " << norms[2];
  }
}

TEST_P(AdamPerIsa, HugeFiniteGradientsHaveAFiniteNormAndClipToATinyCoefficient) {
  // Squares above float's range (|x| > ~1.8e19): the float block sums overflowed to inf, the
  // clip coefficient became 0 and the step refused it. torch (fp32 clip_grad_norm_ of the
  // unscaled gradients) gives 10.
  for (dtype grad : {dtype::f32, dtype::bf16}) {
    auto tensors = make_tensors({100, 5000}, dtype::f32, grad, false);
    std::vector<adam_tensor> views;
    for (std::size_t i = 0; i < tensors[0].g.size(); ++i) tensors[0].g.set(i, 1e20f);
    for (std::size_t i = 0; i < tensors[1].g.size(); ++i) tensors[1].g.set(i, 0.0f);
    const double element = tensors[0].g.get(0);  // 1e20 as this dtype holds it
    for (auto& t : tensors) views.push_back(t.view());
    adam_optimizer adam(small_options(GetParam(), dtype::f32, 2));
    const grad_norm_result r = adam.grad_norm(views, grad, 1e20f);
    EXPECT_TRUE(r.finite);
    const double expected = std::sqrt(100.0) * element / static_cast<double>(1e20f);
    EXPECT_NEAR(r.norm, expected, 1e-6 * expected) << to_string(grad);
    adam_step_options so;
    so.grad_dtype = grad;
    so.grad_scale = 1e20f;
    so.clip_coef = clip_coefficient(r.norm, 1e-9);  // tiny, not zero
    EXPECT_GT(so.clip_coef, 0.0f);
    EXPECT_TRUE(adam.step(views, so));
    so.clip_coef = 0.0f;  // torch's coefficient for an infinite norm: a step on zeroed gradients
    EXPECT_TRUE(adam.step(views, so));
  }
}

// Found in review: the check looked at the raw gradients, GradScaler at the unscaled ones. With a
// loss scale below 1 (GradScaler backs off below 1 after enough overflows) a finite 3e38 became inf
// when unscaled: the step went ahead and wrote inf into m and v and NaN into the weight, for good.
// And a grad_scale below 1/FLT_MAX made the multiplier itself inf: every zero gradient NaN.
TEST_P(AdamPerIsa, GradientThatOverflowsWhenUnscaledSkipsTheStep) {
  for (dtype grad : {dtype::f32, dtype::bf16}) {  // (f16 holds nothing that 0.5 can overflow)
    for (std::size_t at : {5ul, 3000ul}) {         // SIMD body, scalar tail
      auto tensors = make_tensors({3001}, dtype::f32, grad, true);
      adam_optimizer adam(small_options(GetParam(), dtype::f32, 2));
      run_steps(adam, tensors, 1, 2, grad);
      tensors[0].g.set(at, 3e38f);  // finite; 6e38 unscaled
      const auto before = tensors;
      const std::vector<adam_tensor> views{tensors[0].view()};
      adam_step_options so;
      so.grad_dtype = grad;
      so.grad_scale = 0.5f;
      so.check_finite = true;
      const std::string what = std::string(to_string(grad)) + " element " + std::to_string(at);
      EXPECT_FALSE(adam.step(views, so)) << what;
      EXPECT_EQ(adam.step_count(), 2) << what;
      EXPECT_TRUE(same_state(before, tensors)) << what;
      // The norm pass, whose finiteness a caller passes on as grads_known_finite, says the same.
      EXPECT_FALSE(adam.grad_norm(views, grad, 0.5f).finite) << what;
      EXPECT_TRUE(adam.grad_norm(views, grad, 1.0f).finite) << what;
      // grads_finite is the step's own check, clip_coef included (grad_norm leaves it out).
      EXPECT_FALSE(adam.grads_finite(views, so)) << what;
      adam_step_options clipped = so;
      clipped.clip_coef = 0.25f;  // 1.5e38: the step would take it
      EXPECT_TRUE(adam.grads_finite(views, clipped)) << what;
      clipped.grad_scale = 1.0f;
      clipped.clip_coef = 2.0f;  // 6e38 once clipped
      EXPECT_FALSE(adam.grads_finite(views, clipped)) << what;
      EXPECT_EQ(adam.step_count(), 2) << what;
      EXPECT_TRUE(same_state(before, tensors)) << what;
    }
  }
  auto tensors = make_tensors({100}, dtype::f32, dtype::f32, false);
  for (std::size_t i = 0; i < 100; ++i) tensors[0].g.set(i, 0.0f);
  const auto before = tensors;
  adam_optimizer adam(small_options(GetParam(), dtype::f32, 1));
  adam_step_options so;
  so.grad_scale = 1e-39f;  // finite and > 0, but 1 / 1e-39 is beyond float
  const std::vector<adam_tensor> views{tensors[0].view()};
  try {
    adam.step(views, so);
    ADD_FAILURE() << "a multiplier of inf accepted";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("grad_scale is too small"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(same_state(before, tensors));
}

// Found in review: the AVX2 and AVX-512 f16 stores (vcvtps2ph) kept a NaN's sign and the top of
// its payload (0x7fc12345 became 0x7e09), where the scalar kernel, the SIMD kernels' own tails, the
// GPU kernel and torch's conversion write sign | 0x7e00: a NaN weight's f16 copy depended on the
// ISA and on where in the vector the element fell. Payload NaNs of both signs, body and tail.
TEST_P(AdamPerIsa, NanParamCopyHasTheScalarConversionsBits) {
  for (dtype copy : {dtype::f16, dtype::bf16}) {
    adam_options o;
    o.isa = GetParam();
    o.threads = 1;
    adam_optimizer adam(o);
    constexpr std::size_t n = 37;  // SIMD body and tail
    std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n, 0.0f);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t sign = i % 2 != 0 ? 0x80000000u : 0u;
      p[i] = detail::bits_float(sign | 0x7fc00000u | ((0x12345u * (i + 1)) & 0x3fffffu));
    }
    typed_buffer out(copy, n);
    const adam_tensor t{p.data(), m.data(), v.data(), g.data(), out.data(), n};
    adam_step_options so;
    so.copy_dtype = copy;
    ASSERT_TRUE(adam.step(std::span<const adam_tensor>(&t, 1), so));
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(std::isnan(p[i]));
      const std::uint16_t expected = copy == dtype::f16 ? detail::float_to_f16(p[i]) : detail::float_to_bf16(p[i]);
      EXPECT_EQ(static_cast<const std::uint16_t*>(out.data())[i], expected)
          << to_string(copy) << " element " << i << ", param bits " << std::hex << detail::float_bits(p[i]);
    }
  }
}

// Found in review: float_to_f16 rounded a value in the f16 subnormal range with the FPU (x + 0.5f),
// so under the caller's rounding mode (which the pool hands to every worker) and not to nearest
// even; the SIMD bodies' vcvtps2ph rounds to nearest even whatever the mode: under FE_UPWARD a
// 3e-6 weight's f16 copy was 0x0033 in the scalar kernel and the tails, 0x0032 in the SIMD body.
TEST_P(AdamPerIsa, F16CopyRoundsToNearestEvenUnderAnyRoundingMode) {
  for (int mode : {FE_UPWARD, FE_DOWNWARD, FE_TOWARDZERO}) {
    adam_options o;
    o.isa = GetParam();
    o.threads = 1;
    o.weight_decay = 0.0;
    adam_optimizer adam(o);
    constexpr std::size_t n = 37;  // SIMD body and tail
    std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n, 0.0f);
    for (std::size_t i = 0; i < n; ++i) p[i] = (i % 2 != 0 ? -1.0f : 1.0f) * (3.0e-6f + 1.7e-7f * static_cast<float>(i));
    typed_buffer out(dtype::f16, n);
    const adam_tensor t{p.data(), m.data(), v.data(), g.data(), out.data(), n};
    adam_step_options so;
    so.copy_dtype = dtype::f16;
    ASSERT_EQ(std::fesetround(mode), 0);
    const bool stepped = adam.step(std::span<const adam_tensor>(&t, 1), so);
    std::fesetround(FE_TONEAREST);
    ASSERT_TRUE(stepped);
    for (std::size_t i = 0; i < n; ++i) {
      // What vcvtps2ph writes: round to nearest even, the mode ignored.
      const double units = std::nearbyint(std::abs(static_cast<double>(p[i])) * 0x1p24);
      const auto expected = static_cast<std::uint16_t>((p[i] < 0 ? 0x8000 : 0) | static_cast<int>(units));
      EXPECT_EQ(static_cast<const std::uint16_t*>(out.data())[i], expected) << "mode " << mode << " element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, AdamPerIsa, ::testing::ValuesIn(available_isas()),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// ------------------------------------------------------------------------ threads and dispatch

TEST(AdamThreads, ResultsDoNotDependOnTheThreadCount) {
  // Large enough that 2 and 3 threads really split the work (32Ki elements per thread at least).
  std::vector<std::vector<tensor_data>> runs;
  for (unsigned threads : {1u, 2u, 3u}) {
    auto tensors = make_tensors({150001, 33, 90000}, dtype::bf16, dtype::f16, true);
    adam_optimizer adam(small_options(simd_isa::automatic, dtype::bf16, threads));
    EXPECT_EQ(adam.options().threads, threads);
    run_steps(adam, tensors, 1, 3, dtype::f16);
    runs.push_back(std::move(tensors));
  }
  EXPECT_TRUE(same_state(runs[0], runs[1]));
  EXPECT_TRUE(same_state(runs[0], runs[2]));
}

// Found in review: a worker thread keeps the floating-point environment it was started with, so
// a caller that turned on flush-to-zero after creating the optimizer (torch.set_flush_denormal)
// had its own part of a step flushed and the workers' parts not: m of 1e-38 (denormal) was 0 in
// the first half of the tensor and 1e-38 in the second.
#if defined(__x86_64__) || defined(__i386__)
TEST(AdamThreads, ResultsDoNotDependOnTheThreadCountUnderFlushToZero) {
  constexpr std::size_t n = 1 << 17;  // 2 threads really split it
  constexpr unsigned ftz_daz = 0x8040;
  std::vector<std::vector<float>> runs;
  for (unsigned threads : {1u, 2u}) {
    adam_optimizer adam(small_options(simd_isa::automatic, dtype::f32, threads));
    std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f), g(n, 1e-37f);  // m = 0.1 g: denormal
    const adam_tensor t{p.data(), m.data(), v.data(), g.data(), nullptr, n};
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | ftz_daz);  // after the pool's threads started
    const bool stepped = adam.step(std::span<const adam_tensor>(&t, 1));
    _mm_setcsr(saved);
    ASSERT_TRUE(stepped);
    EXPECT_EQ(m[0], 0.0f) << "the caller's part was not flushed";
    runs.push_back(std::move(m));
  }
  EXPECT_EQ(std::memcmp(runs[0].data(), runs[1].data(), n * sizeof(float)), 0)
      << "last element: " << runs[0][n - 1] << " with 1 thread, " << runs[1][n - 1] << " with 2";
}
#endif

TEST(AdamThreads, DistinctOptimizersStepConcurrently) {
  std::vector<std::vector<tensor_data>> data(2);
  std::vector<std::thread> threads;
  for (int k = 0; k < 2; ++k) {
    data[k] = make_tensors({70000}, dtype::f32, dtype::f32, false);
    threads.emplace_back([&, k] {
      adam_optimizer adam(small_options(simd_isa::automatic, dtype::f32, 2));
      run_steps(adam, data[k], 1, 3, dtype::f32);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_TRUE(same_state(data[0], data[1]));
}

// A scheduler's set_lr on one thread beside a reader of options() on another (a logger, the C
// ABI): the reader must get one of the rates set, read under the optimizer's lock. Under TSan
// (the AdamThreads cases run there) an unlocked read of lr is a reported data race.
TEST(AdamThreads, OptionsReadBesideSetLrSeesAWholeRate) {
  adam_optimizer adam(small_options(simd_isa::automatic, dtype::f32, 1));
  const double first = adam.options().lr;
  std::thread scheduler([&] {
    for (int i = 0; i < 2000; ++i) adam.set_lr(i % 2 == 0 ? 2e-3 : 3e-3);
  });
  for (int i = 0; i < 2000; ++i) {
    const double lr = adam.options().lr;
    ASSERT_TRUE(lr == first || lr == 2e-3 || lr == 3e-3) << lr;
  }
  scheduler.join();
  EXPECT_EQ(adam.options().lr, 3e-3);
}

// Found in review: a child forked without exec (multiprocessing's fork) inherits the optimizer but
// not its worker threads. Its first step large enough to split woke workers that do not exist and
// waited for them forever; destroying the optimizer there joined them, forever too. The child now
// runs every part itself (the same parts: the same bits as the parent's step).
TEST(AdamFork, AForkedChildStepsAndDestroysTheOptimizer) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "TSan does not follow a fork of a multithreaded process";
#else
  constexpr std::size_t n = 1 << 17;  // 2 threads really split it
  auto optimizer = std::make_unique<adam_optimizer>(small_options(simd_isa::automatic, dtype::f32, 2));
  std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f), g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = std::sin(static_cast<float>(i));
  const adam_tensor t{p.data(), m.data(), v.data(), g.data(), nullptr, n};
  ASSERT_TRUE(optimizer->step(std::span<const adam_tensor>(&t, 1)));
  std::fflush(nullptr);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(20);  // a hang ends as SIGALRM
    const bool stepped = optimizer->step(std::span<const adam_tensor>(&t, 1));
    std::vector<float> expected(n, 1.0f), em(n, 0.0f), ev(n, 0.0f);
    const adam_tensor e{expected.data(), em.data(), ev.data(), g.data(), nullptr, n};
    adam_optimizer one(small_options(simd_isa::automatic, dtype::f32, 1));
    one.step(std::span<const adam_tensor>(&e, 1));
    one.step(std::span<const adam_tensor>(&e, 1));
    const bool same = std::memcmp(p.data(), expected.data(), n * sizeof(float)) == 0;
    optimizer.reset();
    std::_Exit(!stepped ? 3 : !same ? 4 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << (WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status)) + " (14: hung)"
                              : "exit " + std::to_string(WEXITSTATUS(status)) + " (4: not the 1-thread bits)");
  // The parent's optimizer still steps with its threads.
  EXPECT_TRUE(optimizer->step(std::span<const adam_tensor>(&t, 1)));
#endif
}

TEST(AdamDispatch, AutomaticPicksTheBestSupported) {
  adam_options o;
  const adam_optimizer adam(o);
  if (const char* env = std::getenv("TERRACE_ADAM_ISA"); env == nullptr || *env == '\0') {
    EXPECT_EQ(adam.options().isa, best_simd_isa());
  }
  EXPECT_GE(adam.options().threads, 1u);
}

// Where the CPU has avx512_bf16, simd_isa::avx512 runs kernels_avx512bf16 (vcvtneps2bf16 for the
// bf16 stores), so every other test here checks that one. This checks that it writes the same bits
// as the plain AVX-512 kernels, on data built to reach the lanes where the instruction and
// float_to_bf16 differ: denormal moments and params, NaN, infinities, bf16 halfway cases, overflow.
TEST(AdamDispatch, Avx512Bf16KernelsMatchAvx512Bitwise) {
  if (best_simd_isa() < simd_isa::avx512 || !__builtin_cpu_supports("avx512bf16")) {
    GTEST_SKIP() << "no avx512_bf16 on this CPU";
  }
  adam_options o;
  o.lr = 1e-2;
  o.weight_decay = 0.05;
  const detail::adam_scalars s = detail::make_adam_scalars(o, 7, 1.0f, 1.0f);
  constexpr std::size_t n = 16 * 40 + 9;  // SIMD body and a scalar tail
  auto rng = testing::rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 9);
  // Mostly ordinary values; 1 in 10 special, so some vectors are clean and others mixed.
  auto value = [&](float scale) {
    const float x = normal(rng) * scale;
    switch (pick(rng)) {
      case 0: return x * 1e-39f;  // denormal (or a moment that becomes one)
      case 1: return detail::bits_float((detail::float_bits(x) & 0xffff0000u) | 0x8000u);  // bf16 tie
      case 2: return pick(rng) < 5 ? std::numeric_limits<float>::quiet_NaN() : -std::numeric_limits<float>::infinity();
      case 3: return x * 1e38f;  // overflows bf16 or the arithmetic
      default: return x;
    }
  };
  for (bool lion : {false, true})
  for (dtype grad : {dtype::f32, dtype::bf16, dtype::f16}) {
    for (dtype state : {dtype::f32, dtype::bf16}) {
      for (int copy : {-1, 0, 1, 2}) {
        const detail::adam_config c{grad, state, copy < 0 ? dtype::bf16 : static_cast<dtype>(copy), copy >= 0,
                                    lion};
        tensor_data a(n, state, grad, true, c.copy), b(n, state, grad, true, c.copy);
        for (std::size_t i = 0; i < n; ++i) {
          a.param.set(i, value(1.0f));
          a.m.set(i, value(0.1f));
          a.v.set(i, std::abs(value(0.01f)));
          a.g.set(i, value(grad == dtype::f16 ? 100.0f : 1.0f));
          if (i % 13 == 5) {  // certainly a denormal m (and p) to store
            a.param.set(i, 1e-39f);
            a.m.set(i, -1e-39f);
            a.g.set(i, 0.0f);
          }
          if (i % 13 == 6) a.g.set(i, std::numeric_limits<float>::quiet_NaN());
        }
        b = a;
        const auto span = [&](tensor_data& t) {
          return detail::adam_span{static_cast<float*>(t.param.data()), t.m.data(), t.v.data(), t.g.data(),
                                   t.copy.data(), n};
        };
        detail::kernels_avx512().update(s, c, span(a));
        detail::kernels_avx512bf16().update(s, c, span(b));
        const std::string what = std::string(lion ? "lion" : "adamw") + ", grad " +
                                 std::string(to_string(grad)) + ", state " +
                                 std::string(to_string(state)) + ", copy " + std::to_string(copy);
        EXPECT_TRUE(a.param.same_bytes(b.param)) << what;
        EXPECT_TRUE(a.m.same_bytes(b.m)) << what;
        EXPECT_TRUE(a.v.same_bytes(b.v)) << what;
        EXPECT_TRUE(a.copy.same_bytes(b.copy)) << what;
        if (state == dtype::bf16) {  // the data did reach the special lanes
          const auto* m = static_cast<const std::uint16_t*>(a.m.data());
          EXPECT_TRUE(std::any_of(m, m + n, [](std::uint16_t h) { return (h & 0x7f80) == 0 && (h & 0x7f) != 0; }))
              << what;
          EXPECT_TRUE(std::any_of(m, m + n, [](std::uint16_t h) { return h == 0x7fc0; })) << what;
        }
      }
    }
  }
}

// Lion's sign on the values that decide it: a zero interpolation leaves the param decayed only,
// an infinite one moves it by lr, a NaN one makes it NaN (numpy's sign; torch.sign gives 0, see
// docs/optimizer.md); every ISA alike.
// And Lion never touches exp_avg_sq, which may be null.
TEST(AdamLion, SignOfZeroInfinityAndNan) {
  for (simd_isa isa : available_isas()) {
    adam_options o;
    o.mode = adam_mode::lion;
    o.lr = 0.125;  // powers of two: the expected values are exact
    o.weight_decay = 0.5;
    o.beta1 = 0.5;
    o.beta2 = 0.75;
    o.isa = isa;
    o.threads = 1;
    adam_optimizer adam(o);
    constexpr std::size_t n = 37;  // SIMD body and tail
    std::vector<float> p(n, 2.0f), m(n, 0.0f), g(n, 0.0f);
    const float inf = std::numeric_limits<float>::infinity();
    g[3] = inf;
    g[4] = -inf;
    g[5] = std::numeric_limits<float>::quiet_NaN();
    g[20] = 1.0f;
    g[21] = -0.0f;
    g[36] = inf;
    const adam_tensor t{p.data(), m.data(), nullptr, g.data(), nullptr, n};
    ASSERT_TRUE(adam.step(std::span<const adam_tensor>(&t, 1)));
    const std::string what = "isa " + std::string(to_string(isa));
    const float decayed = 2.0f * (1.0f - 0.125f * 0.5f);  // 1.875
    for (std::size_t i : {0ul, 1ul, 21ul, 35ul}) EXPECT_EQ(p[i], decayed) << what << " element " << i;
    EXPECT_EQ(p[3], decayed - 0.125f) << what;
    EXPECT_EQ(p[4], decayed + 0.125f) << what;
    EXPECT_TRUE(std::isnan(p[5])) << what;
    EXPECT_EQ(p[20], decayed - 0.125f) << what;
    EXPECT_EQ(m[20], 0.25f) << what;  // (1 - beta2) * g
    EXPECT_EQ(p[36], decayed - 0.125f) << what;
    EXPECT_EQ(m[0], 0.0f) << what;
  }
}

// An infinite or NaN weight with no weight decay, as torch: Adam adds no penalty (0 * inf would
// put NaN in the moments), AdamW decays by 1. The moments are those of the gradient alone, the
// weight stays what it was; every ISA and the reference alike.
TEST(AdamNonfiniteWeights, ZeroDecayLeavesTheMomentsThoseOfTheGradient) {
  const float inf = std::numeric_limits<float>::infinity();
  for (adam_mode mode : {adam_mode::adam, adam_mode::adamw}) {
    for (simd_isa isa : available_isas()) {
      adam_options o;
      o.mode = mode;
      o.lr = 0.125;
      o.weight_decay = 0.0;
      o.isa = isa;
      o.threads = 1;
      adam_optimizer adam(o);
      constexpr std::size_t n = 37;  // SIMD body and tail
      std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f), g(n, 0.5f);
      p[2] = inf;
      p[17] = -inf;
      p[36] = std::numeric_limits<float>::quiet_NaN();
      const adam_tensor t{p.data(), m.data(), v.data(), g.data(), nullptr, n};
      ASSERT_TRUE(adam.step(std::span<const adam_tensor>(&t, 1)));
      const std::string what = std::string(mode == adam_mode::adam ? "adam" : "adamw") + " isa " +
                               std::string(to_string(isa));
      for (std::size_t i : {2ul, 17ul, 36ul}) {
        EXPECT_EQ(m[i], m[0]) << what << " element " << i;
        EXPECT_EQ(v[i], v[0]) << what << " element " << i;
      }
      EXPECT_TRUE(std::isfinite(m[0]) && std::isfinite(v[0])) << what;
      EXPECT_EQ(p[2], inf) << what;
      EXPECT_EQ(p[17], -inf) << what;
      EXPECT_TRUE(std::isnan(p[36])) << what;

      reference::adam_state r;
      r.param = {static_cast<double>(inf)};
      r.exp_avg = {0.0};
      r.exp_avg_sq = {0.0};
      const std::vector<double> rg{0.5};
      reference::adam_step(o, 1, rg, 1.0, r);
      EXPECT_FLOAT_EQ(static_cast<float>(r.exp_avg[0]), m[0]) << what;
      EXPECT_FLOAT_EQ(static_cast<float>(r.exp_avg_sq[0]), v[0]) << what;
      EXPECT_TRUE(std::isinf(r.param[0])) << what;
    }
  }
}

// --------------------------------------------------------------------------------- conversions

TEST(AdamConversions, HalfTypesRoundToNearestEven) {
  using detail::float_to_bf16;
  using detail::float_to_f16;
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(detail::bits_float(0x3f808000u)), 0x3f80);  // tie to even (down)
  EXPECT_EQ(float_to_bf16(detail::bits_float(0x3f818000u)), 0x3f82);  // tie to even (up)
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::quiet_NaN()), 0x7fc0);
  EXPECT_EQ(float_to_bf16(detail::bits_float(0x7fffffffu)), 0x7fc0);  // payload must not round to inf
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_f16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(float_to_f16(0x1p-24f), 0x0001);        // smallest subnormal
  EXPECT_EQ(float_to_f16(0x1p-25f), 0x0000);        // tie to even: zero
  EXPECT_EQ(float_to_f16(0x1.8p-24f), 0x0002);      // tie to even: 2
  EXPECT_EQ(float_to_f16(0x1p-14f), 0x0400);        // smallest normal
  EXPECT_EQ(float_to_f16(1.0f + 0x1p-11f), 0x3c00);  // tie to even (down)
  for (std::uint32_t h = 0; h < 0x10000; ++h) {  // every finite half survives the round trip
    if ((h & 0x7c00) == 0x7c00) continue;
    ASSERT_EQ(float_to_f16(detail::f16_to_float(static_cast<std::uint16_t>(h))), h);
  }
}

// --------------------------------------------------------------------------------- bad input

TEST(AdamErrors, BadHyperparametersAreRejected) {
  auto rejects = [](auto change, const char* word) {
    adam_options o;
    change(o);
    try {
      adam_optimizer adam(o);
      ADD_FAILURE() << "accepted; expected an error about " << word;
    } catch (const logic_error& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  };
  rejects([](adam_options& o) { o.lr = 0; }, "lr");
  rejects([](adam_options& o) { o.lr = -1e-3; }, "lr");
  rejects([](adam_options& o) { o.lr = std::numeric_limits<double>::quiet_NaN(); }, "lr");
  rejects([](adam_options& o) { o.beta1 = 1.0; }, "beta1");
  rejects([](adam_options& o) { o.beta1 = -0.1; }, "beta1");
  rejects([](adam_options& o) { o.beta2 = 1.0; }, "beta2");
  rejects([](adam_options& o) { o.eps = 0; }, "eps");
  rejects([](adam_options& o) { o.weight_decay = -1; }, "weight_decay");
  rejects([](adam_options& o) { o.state_dtype = dtype::f16; }, "state_dtype");
  // Found in review: an unknown isa fell through dispatch's switch to the scalar kernels.
  rejects([](adam_options& o) { o.isa = static_cast<simd_isa>(7); }, "unknown isa 7");
  adam_optimizer adam(adam_options{});
  EXPECT_THROW(adam.set_lr(0), logic_error);
  EXPECT_THROW(adam.set_step_count(-1), logic_error);
  EXPECT_THROW(adam.set_step_count(INT64_MAX), logic_error);  // the next step would overflow
  adam.set_step_count(INT64_MAX - 1);
  EXPECT_EQ(adam.step_count(), INT64_MAX - 1);
  // Found in review: a step from INT64_MAX overflowed the counter (to INT64_MIN: bias corrections
  // of -inf, a NaN weight). The last step is allowed, the one after it refused, writing nothing.
  std::vector<float> p(4, 1.0f), m(4, 0.0f), v(4, 0.0f), g(4, 0.5f);
  const adam_tensor t{p.data(), m.data(), v.data(), g.data(), nullptr, 4};
  EXPECT_TRUE(adam.step(std::span<const adam_tensor>(&t, 1)));
  EXPECT_EQ(adam.step_count(), INT64_MAX);
  const std::vector<float> p_before = p, m_before = m, v_before = v;
  try {
    adam.step(std::span<const adam_tensor>(&t, 1));
    ADD_FAILURE() << "a step past INT64_MAX accepted";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("step counter is at its maximum"), std::string::npos) << e.what();
  }
  EXPECT_EQ(adam.step_count(), INT64_MAX);
  EXPECT_TRUE(p == p_before && m == m_before && v == v_before);
}

TEST(AdamErrorsDeathTest, ThreadsTheHostRefusesAreAnErrorNotATerminate) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizers' shadow memory does not run under an address-space limit";
#else
  // A thread the host refuses (here: no address space for its stack) unwound the pool's
  // constructor with joinable threads still in it: std::terminate, even through the C ABI.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto start_threads_in_1GiB_of_address_space = [] {
    rlimit limit{};
    limit.rlim_cur = limit.rlim_max = 1ull << 30;
    if (::setrlimit(RLIMIT_AS, &limit) != 0) std::_Exit(3);
    adam_options o;
    o.threads = 1000;  // 8 MiB of stack each
    try {
      adam_optimizer adam(o);
      std::_Exit(2);  // the host did not refuse: nothing tested
    } catch (const out_of_memory& e) {
      std::fprintf(stderr, "%s\n", e.what());
      std::_Exit(0);
    }
  };
  EXPECT_EXIT(start_threads_in_1GiB_of_address_space(), ::testing::ExitedWithCode(0),
              "cannot start 999 optimizer worker threads");
#endif
}

TEST(AdamErrors, BadBuffersAreRejectedAndNothingIsWritten) {
  auto tensors = make_tensors({256, 256}, dtype::f32, dtype::bf16, true);
  const auto before = tensors;
  adam_optimizer adam(small_options(simd_isa::automatic, dtype::f32, 2));
  adam_step_options so;
  so.grad_dtype = dtype::bf16;
  auto expect_error = [&](std::vector<adam_tensor> views, const adam_step_options& o, const char* word) {
    try {
      adam.step(views, o);
      ADD_FAILURE() << "accepted; expected an error about " << word;
    } catch (const logic_error& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  };
  auto views = [&] { return std::vector<adam_tensor>{tensors[0].view(), tensors[1].view()}; };

  auto v = views();
  v[1].param = nullptr;
  expect_error(v, so, "param is null");
  v = views();
  v[1].grad = static_cast<const char*>(v[1].grad) + 1;  // bf16 needs 2-byte alignment
  expect_error(v, so, "grad is not aligned");
  v = views();
  v[0].exp_avg = static_cast<char*>(v[0].exp_avg) + 2;  // f32 needs 4
  expect_error(v, so, "exp_avg is not aligned");
  v = views();
  v[0].param_copy = nullptr;  // a copy on one tensor only
  expect_error(v, so, "param_copy is set on 1 of 2");
  auto bad = so;
  bad.grad_scale = 0;
  expect_error(views(), bad, "grad_scale");
  bad = so;
  bad.clip_coef = std::numeric_limits<float>::infinity();
  expect_error(views(), bad, "clip_coef");
  bad = so;
  bad.grad_dtype = static_cast<dtype>(7);
  expect_error(views(), bad, "grad dtype");
  // Found in review: sizes were added unchecked. A negative length converted to size_t, or two
  // whose sum wrapped around, sent the kernels far past the buffers (a crash, at best).
  v = views();
  v[0].size = static_cast<std::size_t>(-1);
  expect_error(v, so, "tensor 0 has size 18446744073709551615");
  v = views();
  v[0].size = std::size_t{1} << 60;
  v[1].size = std::size_t{0} - (std::size_t{1} << 60) + 2;  // the sum wraps to 2
  expect_error(v, so, "tensor 1 has size");
  try {
    adam.grad_norm(v, so.grad_dtype);
    ADD_FAILURE() << "grad_norm accepted sizes that wrap around";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("a negative length converted to size_t"), std::string::npos) << e.what();
  }

  // Mismatched lengths through the flat overload.
  std::vector<float> p(100);
  std::vector<std::byte> m(400), sq(400), g(200), short_m(396);
  adam_buffers flat{p, m, sq, g, {}};
  EXPECT_TRUE(adam.step(flat, so));
  flat.exp_avg = short_m;
  try {
    adam.step(flat, so);
    ADD_FAILURE() << "mismatched lengths accepted";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("exp_avg holds 396 bytes"), std::string::npos) << e.what();
  }
  EXPECT_EQ(adam.step_count(), 1);  // only the good flat step counted
  EXPECT_TRUE(same_state(before, tensors));
}

}  // namespace
}  // namespace terrace
