// SPDX-License-Identifier: Apache-2.0
// The AVX-512 kernels with AVX512_BF16's converter for the bf16 stores. Compiled with the
// AVX-512 flags plus -mavx512bf16 (optimizer/CMakeLists.txt) and entered only when CPUID reports
// avx512_bf16 (dispatch.cpp); see adam_avx512.cpp for why everything here has internal linkage.
//
// Why: with bf16 moments and a bf16 copy (20 bytes per parameter) the step stores three bf16
// vectors per 16 elements, and the integer round-to-nearest-even (shift, and, two adds, shift,
// NaN compare and blend, vpmovdw) was a third of the loop's vector instructions: enough that the
// arithmetic no longer hid under memory time. vcvtneps2bf16 does it in one.
#include "optimizer/adam_avx512_traits.hpp"

namespace terrace::detail {
namespace {

struct avx512bf16_traits : avx512_traits {
  // vcvtneps2bf16 rounds normal values to nearest even exactly as float_to_bf16 does, but it
  // treats denormal inputs as zero and keeps a NaN's sign and payload, where float_to_bf16 rounds
  // the denormal and writes 0x7fc0. A vector holding either takes the integer path, so the bits
  // never depend on which kernel ran. Such vectors are rare (moments decaying through the
  // denormal range after many zero gradients, a NaN no finite check stopped), so the branch is
  // predicted; a tensor full of them costs what the integer path always cost.
  static void store_bf16(std::uint16_t* p, F x) noexcept {
    constexpr int nan_or_denormal = 0x01 | 0x80 | 0x20;  // vfpclassps: QNaN, SNaN, denormal
    if (__builtin_expect(_mm512_fpclass_ps_mask(x, nan_or_denormal) != 0, 0)) {
      avx512_traits::store_bf16(p, x);
      return;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
  }
};

constexpr adam_kernels avx512bf16_kernels{simd_isa::avx512, &adam_update<avx512bf16_traits>,
                                          &grad_scan<avx512bf16_traits>};

}  // namespace

const adam_kernels& kernels_avx512bf16() noexcept { return avx512bf16_kernels; }

}  // namespace terrace::detail
