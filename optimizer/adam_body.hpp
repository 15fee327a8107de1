// SPDX-License-Identifier: Apache-2.0
// The Adam and Lion updates and the gradient scan, written once over a vector-traits type V and
// included by each instruction-set translation unit. V provides F (a vector of N floats), set1,
// add, mul, fmadd (a*b+c), sqrt, div, sign (1, -1, or x itself for zeros and NaN), and loads/stores
// of N elements as f32, bf16 and f16, all unaligned.
//
// Internal linkage throughout (see half.hpp): each translation unit gets its own copy, compiled
// for its own instruction set.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "optimizer/adam_kernel.hpp"
#include "optimizer/half.hpp"

namespace terrace::detail {
namespace {

// One float per "vector": the tails of the SIMD loops, and the whole scalar kernel.
struct scalar_traits {
  using F = float;
  static constexpr std::size_t N = 1;
  static F set1(float x) noexcept { return x; }
  static F add(F a, F b) noexcept { return a + b; }
  static F mul(F a, F b) noexcept { return a * b; }
  static F fmadd(F a, F b, F c) noexcept { return a * b + c; }
  static F sqrt(F a) noexcept { return __builtin_sqrtf(a); }
  static F div(F a, F b) noexcept { return a / b; }
  static F sign(F a) noexcept { return a > 0.0f ? 1.0f : a < 0.0f ? -1.0f : a; }
  static F load_f32(const float* p) noexcept { return *p; }
  static F load_bf16(const std::uint16_t* p) noexcept { return bf16_to_float(*p); }
  static F load_f16(const std::uint16_t* p) noexcept { return f16_to_float(*p); }
  static void store_f32(float* p, F x) noexcept { *p = x; }
  static void store_bf16(std::uint16_t* p, F x) noexcept { *p = float_to_bf16(x); }
  static void store_f16(std::uint16_t* p, F x) noexcept { *p = float_to_f16(x); }
  static float reduce_add(F x) noexcept { return x; }
};

template <class V, dtype T>
typename V::F load(const void* base, std::size_t i) noexcept {
  if constexpr (T == dtype::f32) {
    return V::load_f32(static_cast<const float*>(base) + i);
  } else if constexpr (T == dtype::bf16) {
    return V::load_bf16(static_cast<const std::uint16_t*>(base) + i);
  } else {
    return V::load_f16(static_cast<const std::uint16_t*>(base) + i);
  }
}

template <class V, dtype T>
void store(void* base, std::size_t i, typename V::F x) noexcept {
  if constexpr (T == dtype::f32) {
    V::store_f32(static_cast<float*>(base) + i, x);
  } else if constexpr (T == dtype::bf16) {
    V::store_bf16(static_cast<std::uint16_t*>(base) + i, x);
  } else {
    V::store_f16(static_cast<std::uint16_t*>(base) + i, x);
  }
}

// The step's scalars, broadcast once per span. Read through the adam_scalars reference inside
// the loop, every one would be reloaded and re-broadcast each iteration (and -step_size negated
// again): as far as the compiler knows, the float stores may alias the struct. Same values, so
// the same bits as broadcasting them in the loop.
template <class V>
struct adam_vectors {
  using F = typename V::F;
  explicit adam_vectors(const adam_scalars& s) noexcept
      : grad_mul(V::set1(s.grad_mul)), coupled_wd(V::set1(s.coupled_wd)), decay(V::set1(s.decay)),
        beta1(V::set1(s.beta1)), one_minus_beta1(V::set1(s.one_minus_beta1)), beta2(V::set1(s.beta2)),
        one_minus_beta2(V::set1(s.one_minus_beta2)), inv_bc2_sqrt(V::set1(s.inv_bc2_sqrt)),
        eps(V::set1(s.eps)), neg_step_size(V::set1(-s.step_size)), coupled(s.coupled_wd != 0.0f) {}
  F grad_mul, coupled_wd, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps,
      neg_step_size;
  bool coupled;  // torch adds the penalty only for a nonzero decay: 0 * inf would be NaN
};

// The update of V::N consecutive elements starting at i. The order of operations follows
// torch's single-tensor Adam; fmadd fuses where torch rounds twice (within float rounding).
// `a` must be a local copy (see adam_update_t).
template <class V, dtype G, dtype S, bool Copy, dtype C, bool Lion>
inline void adam_elements(const adam_vectors<V>& k, const adam_span& a, std::size_t i) noexcept {
  using F = typename V::F;
  if constexpr (Lion) {
    // Decoupled decay, the sign of the interpolation, then the moment (adam.hpp); one moment.
    const F g = V::mul(load<V, G>(a.grad, i), k.grad_mul);
    F p = V::mul(V::load_f32(a.param + i), k.decay);
    F m = load<V, S>(a.exp_avg, i);
    const F c = V::fmadd(k.beta1, m, V::mul(k.one_minus_beta1, g));
    p = V::fmadd(k.neg_step_size, V::sign(c), p);
    m = V::fmadd(k.beta2, m, V::mul(k.one_minus_beta2, g));
    V::store_f32(a.param + i, p);
    store<V, S>(a.exp_avg, i, m);
    if constexpr (Copy) store<V, C>(a.copy, i, p);
    return;
  }
  F g = V::mul(load<V, G>(a.grad, i), k.grad_mul);
  F p = V::load_f32(a.param + i);
  if (k.coupled) g = V::fmadd(k.coupled_wd, p, g);  // same for every element: predicted
  p = V::mul(p, k.decay);
  F m = load<V, S>(a.exp_avg, i);
  F v = load<V, S>(a.exp_avg_sq, i);
  m = V::fmadd(k.beta1, m, V::mul(k.one_minus_beta1, g));
  v = V::fmadd(k.beta2, v, V::mul(V::mul(k.one_minus_beta2, g), g));
  const F denom = V::fmadd(V::sqrt(v), k.inv_bc2_sqrt, k.eps);
  p = V::fmadd(k.neg_step_size, V::div(m, denom), p);
  V::store_f32(a.param + i, p);
  store<V, S>(a.exp_avg, i, m);
  store<V, S>(a.exp_avg_sq, i, v);
  if constexpr (Copy) store<V, C>(a.copy, i, p);
}

template <class V, dtype G, dtype S, bool Copy, dtype C, bool Lion>
void adam_update_t(const adam_scalars& s, const adam_span& span) noexcept {
  // A local copy of the pointers, for the same reason as adam_vectors: otherwise each store
  // forces the five pointers to be reloaded from *span.
  const adam_span a = span;
  std::size_t i = 0;
  if constexpr (V::N > 1) {
    const adam_vectors<V> k(s);
    if constexpr (S == dtype::bf16) {
      // With bf16 moments the loop does the same arithmetic on fewer bytes (20 per parameter with
      // a bf16 copy), so the out-of-order window, full of arithmetic, reaches too few cache lines
      // ahead for one core to keep enough misses in flight: 0.82-0.88 of the probe at 1 thread.
      // Prefetching every stream 1024 elements ahead (4 KiB of params, 2 KiB of each 16-bit
      // stream) brings it to ~1.0 (docs/optimizer.md). Not done with fp32 moments: there the
      // window suffices and the extra prefetches cost 3-8% at 1 thread.
      constexpr std::size_t ahead = 1024;
      const auto* grad = static_cast<const char*>(a.grad);
      const auto* m = static_cast<const char*>(a.exp_avg);
      const auto* v = static_cast<const char*>(a.exp_avg_sq);
      const auto* copy = static_cast<const char*>(a.copy);
      // (Not terrace::size_of: an inline function with external linkage, see half.hpp.)
      constexpr std::size_t grad_width = G == dtype::f32 ? 4 : 2, copy_width = C == dtype::f32 ? 4 : 2;
      for (; i + ahead + V::N <= a.n; i += V::N) {
        const std::size_t j = i + ahead;
        __builtin_prefetch(a.param + j, 1);
        __builtin_prefetch(m + 2 * j, 1);
        if constexpr (!Lion) __builtin_prefetch(v + 2 * j, 1);
        __builtin_prefetch(grad + grad_width * j, 0);
        if constexpr (Copy) __builtin_prefetch(copy + copy_width * j, 1);
        adam_elements<V, G, S, Copy, C, Lion>(k, a, i);
      }
    }
    for (; i + V::N <= a.n; i += V::N) adam_elements<V, G, S, Copy, C, Lion>(k, a, i);
  }
  const adam_vectors<scalar_traits> k1(s);
  for (; i < a.n; ++i) adam_elements<scalar_traits, G, S, Copy, C, Lion>(k1, a, i);
}

template <class V, dtype G, dtype S, bool Copy, dtype C>
void adam_update_rule(const adam_scalars& s, const adam_config& c, const adam_span& a) noexcept {
  if (c.lion) return adam_update_t<V, G, S, Copy, C, true>(s, a);
  adam_update_t<V, G, S, Copy, C, false>(s, a);
}

// Turns the runtime configuration into one of the 3 x 2 x 4 x 2 instantiations.
template <class V, dtype G, dtype S>
void adam_update_copy(const adam_scalars& s, const adam_config& c, const adam_span& a) noexcept {
  if (!c.has_copy) return adam_update_rule<V, G, S, false, dtype::f32>(s, c, a);
  switch (c.copy) {
    case dtype::f32: return adam_update_rule<V, G, S, true, dtype::f32>(s, c, a);
    case dtype::bf16: return adam_update_rule<V, G, S, true, dtype::bf16>(s, c, a);
    case dtype::f16: return adam_update_rule<V, G, S, true, dtype::f16>(s, c, a);
  }
}

template <class V, dtype G>
void adam_update_state(const adam_scalars& s, const adam_config& c, const adam_span& a) noexcept {
  if (c.state == dtype::bf16) return adam_update_copy<V, G, dtype::bf16>(s, c, a);
  return adam_update_copy<V, G, dtype::f32>(s, c, a);
}

template <class V>
void adam_update(const adam_scalars& s, const adam_config& c, const adam_span& a) noexcept {
  switch (c.grad) {
    case dtype::f32: return adam_update_state<V, dtype::f32>(s, c, a);
    case dtype::bf16: return adam_update_state<V, dtype::bf16>(s, c, a);
    case dtype::f16: return adam_update_state<V, dtype::f16>(s, c, a);
  }
}

// A block's sum of squares in double: for a block whose float sum overflowed although every
// element is finite (|x| above ~1.8e19, possible in f32 and bf16).
template <dtype G>
double sum_of_squares_in_double(const void* grad, std::size_t begin, std::size_t end) noexcept {
  double sum = 0;
  for (std::size_t i = begin; i < end; ++i) {
    const double x = load<scalar_traits, G>(grad, i);
    sum += x * x;
  }
  return sum;
}

// Sum of squares and finiteness in one read. x * 0 is 0 for every finite x and NaN otherwise, so
// one extra add carries the finiteness check without a branch; it is taken of x * grad_mul, the
// value the update computes (a finite x whose unscaled value overflows would otherwise pass and
// put inf and NaN into the moments and the weight). Squares are summed in float within
// blocks of a few thousand elements and the blocks in double: accurate to ~1e-6 relative. A block
// of finite values whose float sum overflows is summed again in double, so a finite gradient
// always has a finite norm.
template <class V, dtype G>
grad_scan_result grad_scan_t(const void* grad, std::size_t n, float grad_mul) noexcept {
  using F = typename V::F;
  constexpr std::size_t block = 4096;
  double total = 0;
  float poison = 0;
  const F zero = V::set1(0.0f);
  const F mul = V::set1(grad_mul);
  for (std::size_t begin = 0; begin < n; begin += block) {
    const std::size_t end = begin + block < n ? begin + block : n;
    F sum = zero;
    F nan_if_bad = zero;
    std::size_t i = begin;
    if constexpr (V::N > 1) {
      for (; i + V::N <= end; i += V::N) {
        const F x = load<V, G>(grad, i);
        sum = V::fmadd(x, x, sum);
        nan_if_bad = V::fmadd(V::mul(x, mul), zero, nan_if_bad);
      }
    }
    float tail = 0;
    float tail_poison = 0;
    for (; i < end; ++i) {
      const float x = load<scalar_traits, G>(grad, i);
      tail += x * x;
      tail_poison += x * grad_mul * 0.0f;
    }
    const float block_poison = V::reduce_add(nan_if_bad) + tail_poison;
    const double block_sum = static_cast<double>(V::reduce_add(sum)) + tail;
    const bool overflowed = block_poison == 0.0f && !(block_sum <= std::numeric_limits<double>::max());
    total += overflowed ? sum_of_squares_in_double<G>(grad, begin, end) : block_sum;
    poison += block_poison;
  }
  return {total, poison == 0.0f};
}

template <class V>
grad_scan_result grad_scan(const void* grad, dtype grad_dtype, std::size_t n, float grad_mul) noexcept {
  switch (grad_dtype) {
    case dtype::f32: return grad_scan_t<V, dtype::f32>(grad, n, grad_mul);
    case dtype::bf16: return grad_scan_t<V, dtype::bf16>(grad, n, grad_mul);
    case dtype::f16: return grad_scan_t<V, dtype::f16>(grad, n, grad_mul);
  }
  return {0, true};
}

}  // namespace
}  // namespace terrace::detail
