// SPDX-License-Identifier: Apache-2.0
// The AVX-512 kernels: 16 floats per vector. Compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512dq -mfma -mf16c (optimizer/CMakeLists.txt) and entered only after dispatch.cpp has
// checked the CPU, so nothing outside the unnamed namespace may be an inline function or a
// template another translation unit could share.
#include "optimizer/adam_avx512_traits.hpp"

namespace terrace::detail {
namespace {

constexpr adam_kernels avx512_kernels{simd_isa::avx512, &adam_update<avx512_traits>,
                                      &grad_scan<avx512_traits>};

}  // namespace

const adam_kernels& kernels_avx512() noexcept { return avx512_kernels; }

}  // namespace terrace::detail
