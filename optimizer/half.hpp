// SPDX-License-Identifier: Apache-2.0
// Scalar conversions between float and the 16-bit types (bf16, IEEE binary16), rounding to nearest
// even as torch and the hardware converters do. Used by the scalar kernel, the tails of the SIMD
// kernels, the reference and the tests.
//
// Everything here has internal linkage (unnamed namespace) and uses no std:: template: this header
// is included by translation units compiled with -mavx512f / -mavx2, and an inline function with
// external linkage emitted there could be the copy the linker keeps for the whole program, which
// would then fault on a CPU without those instructions.
#pragma once

#include <cstdint>

namespace terrace::detail {
namespace {

inline std::uint32_t float_bits(float x) noexcept { return __builtin_bit_cast(std::uint32_t, x); }
inline float bits_float(std::uint32_t b) noexcept { return __builtin_bit_cast(float, b); }

inline float bf16_to_float(std::uint16_t h) noexcept {
  return bits_float(static_cast<std::uint32_t>(h) << 16);
}

// Round to nearest even on the 16 bits that are dropped; NaN becomes the canonical quiet NaN
// (rounding could otherwise carry a NaN's payload into the exponent and make it infinite).
inline std::uint16_t float_to_bf16(float x) noexcept {
  const std::uint32_t b = float_bits(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<std::uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

inline float f16_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    return bits_float(sign | float_bits(static_cast<float>(mantissa) * 0x1p-24f));
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline std::uint16_t float_to_f16(float x) noexcept {
  const std::uint32_t b = float_bits(x);
  const auto sign = static_cast<std::uint16_t>((b >> 16) & 0x8000u);
  const std::uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);  // NaN
  // 65520 and up round to infinity (65504 is the largest finite half).
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (a < 0x38800000u) {
    // Below 2^-14 the result is subnormal: the count of 2^-24 units, rounded to nearest even in
    // integers (adding 0.5f and letting the FPU round followed the caller's rounding mode, where
    // vcvtps2ph and every other path here round to nearest even). 2^-25 and below round to zero.
    if (a <= 0x33000000u) return sign;
    const std::uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - (a >> 23);  // 14 (just below 2^-14) to 24 (just above 2^-25)
    const std::uint32_t units = mantissa >> shift;
    const std::uint32_t rest = mantissa & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    const std::uint32_t up = rest > half || (rest == half && (units & 1u) != 0) ? 1u : 0u;
    return static_cast<std::uint16_t>(sign | (units + up));  // 0x400 if it rounds up to 2^-14
  }
  // Normal: rebias the exponent, then round the 13 dropped bits to nearest even.
  const std::uint32_t odd = (a >> 13) & 1u;
  const std::uint32_t r = a + 0xfffu + odd - (112u << 23);
  return static_cast<std::uint16_t>(sign | (r >> 13));
}

}  // namespace
}  // namespace terrace::detail
