// SPDX-License-Identifier: Apache-2.0
// The AVX2 kernels: 8 floats per vector. Compiled with -mavx2 -mfma -mf16c
// (optimizer/CMakeLists.txt) and entered only after dispatch.cpp has checked the CPU; see
// adam_avx512.cpp for why everything here has internal linkage.
#include <immintrin.h>

#include "optimizer/adam_body.hpp"

namespace terrace::detail {
namespace {

struct avx2_traits {
  using F = __m256;
  static constexpr std::size_t N = 8;
  static F set1(float x) noexcept { return _mm256_set1_ps(x); }
  static F add(F a, F b) noexcept { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) noexcept { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) noexcept { return _mm256_fmadd_ps(a, b, c); }
  static F sqrt(F a) noexcept { return _mm256_sqrt_ps(a); }
  static F div(F a, F b) noexcept { return _mm256_div_ps(a, b); }
  static F sign(F a) noexcept {
    const F zero = _mm256_setzero_ps();
    F r = _mm256_blendv_ps(a, _mm256_set1_ps(1.0f), _mm256_cmp_ps(a, zero, _CMP_GT_OQ));
    return _mm256_blendv_ps(r, _mm256_set1_ps(-1.0f), _mm256_cmp_ps(a, zero, _CMP_LT_OQ));
  }
  static F load_f32(const float* p) noexcept { return _mm256_loadu_ps(p); }
  static F load_bf16(const std::uint16_t* p) noexcept {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static F load_f16(const std::uint16_t* p) noexcept {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f32(float* p, F x) noexcept { _mm256_storeu_ps(p, x); }
  // Round to nearest even, NaN to 0x7fc0: the same bits as float_to_bf16.
  static void store_bf16(std::uint16_t* p, F x) noexcept {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    // Every lane is below 0x10000, so the unsigned saturating pack is exact.
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  // Round to nearest even, NaN to sign | 0x7e00: the same bits as float_to_f16. vcvtps2ph keeps
  // a NaN's payload, so a NaN lane is first made the quiet NaN of its sign with no payload.
  static void store_f16(std::uint16_t* p, F x) noexcept {
    const F quiet_nan = _mm256_or_ps(_mm256_and_ps(x, _mm256_set1_ps(-0.0f)),
                                     _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
    x = _mm256_blendv_ps(x, quiet_nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static float reduce_add(F x) noexcept {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

constexpr adam_kernels avx2_kernels{simd_isa::avx2, &adam_update<avx2_traits>,
                                    &grad_scan<avx2_traits>};

}  // namespace

const adam_kernels& kernels_avx2() noexcept { return avx2_kernels; }

}  // namespace terrace::detail
