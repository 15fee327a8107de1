// SPDX-License-Identifier: Apache-2.0
// The AVX-512 vector traits (16 floats per vector), shared by adam_avx512.cpp and
// adam_avx512bf16.cpp. Include only from translation units compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mfma -mf16c (optimizer/CMakeLists.txt); internal linkage throughout, for
// the reason given in half.hpp.
#pragma once

#include <immintrin.h>

#include "optimizer/adam_body.hpp"

namespace terrace::detail {
namespace {

struct avx512_traits {
  using F = __m512;
  static constexpr std::size_t N = 16;
  static F set1(float x) noexcept { return _mm512_set1_ps(x); }
  static F add(F a, F b) noexcept { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) noexcept { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) noexcept { return _mm512_fmadd_ps(a, b, c); }
  static F sqrt(F a) noexcept { return _mm512_sqrt_ps(a); }
  static F div(F a, F b) noexcept { return _mm512_div_ps(a, b); }
  static F sign(F a) noexcept {
    const F zero = _mm512_setzero_ps();
    F r = _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
    return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
  }
  static F load_f32(const float* p) noexcept { return _mm512_loadu_ps(p); }
  static F load_bf16(const std::uint16_t* p) noexcept {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static F load_f16(const std::uint16_t* p) noexcept {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f32(float* p, F x) noexcept { _mm512_storeu_ps(p, x); }
  // Round to nearest even, NaN to 0x7fc0: the same bits as float_to_bf16.
  static void store_bf16(std::uint16_t* p, F x) noexcept {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  // Round to nearest even, NaN to sign | 0x7e00: the same bits as float_to_f16. vcvtps2ph keeps
  // a NaN's payload (0x7fc12345 becomes 0x7e09), so a NaN lane is first made the quiet NaN of
  // its sign with no payload, which converts to exactly that.
  static void store_f16(std::uint16_t* p, F x) noexcept {
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    const F quiet_nan = _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_set1_epi32(0x7fc00000)));
    x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), quiet_nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static float reduce_add(F x) noexcept { return _mm512_reduce_add_ps(x); }
};

}  // namespace
}  // namespace terrace::detail
