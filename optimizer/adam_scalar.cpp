// SPDX-License-Identifier: Apache-2.0
// The portable kernels: one float at a time, for CPUs without AVX2 (the compiler may still
// vectorise the f32 paths with the baseline SSE2; -fno-math-errno lets it, see CMakeLists.txt).
#include "optimizer/adam_body.hpp"

namespace terrace::detail {
namespace {

constexpr adam_kernels scalar_kernels{simd_isa::scalar, &adam_update<scalar_traits>,
                                      &grad_scan<scalar_traits>};

}  // namespace

const adam_kernels& kernels_scalar() noexcept { return scalar_kernels; }

}  // namespace terrace::detail
