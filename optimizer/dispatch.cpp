// SPDX-License-Identifier: Apache-2.0
// Runtime choice of the kernel set by CPUID. GCC's and Clang's __builtin_cpu_supports also check
// that the OS saves the wide registers (XCR0), so a CPU with AVX-512 under an OS that does not
// enable it falls back to AVX2.
#include <cstdlib>
#include <string>
#include <string_view>

#include "optimizer/adam_kernel.hpp"
#include "terrace/error.hpp"

namespace terrace {

namespace {

bool has_avx2() noexcept {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

// The AVX-512 kernels are compiled with -mavx2 -mfma -mf16c as well (their scalar tails use FMA,
// their half conversions F16C), so they need those too: a virtual machine may hide FMA while it
// shows AVX-512.
bool has_avx512() noexcept {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// AVX512_BF16 does not change the results (adam_avx512bf16.cpp), only the speed of bf16 stores,
// so it is not an instruction set of its own: simd_isa::avx512 uses it where the CPU has it.
bool has_avx512_bf16() noexcept { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }

bool supported(simd_isa isa) noexcept {
  switch (isa) {
    case simd_isa::avx512: return has_avx512();
    case simd_isa::avx2: return has_avx2();
    default: return true;
  }
}

}  // namespace

simd_isa best_simd_isa() noexcept {
  if (has_avx512()) return simd_isa::avx512;
  if (has_avx2()) return simd_isa::avx2;
  return simd_isa::scalar;
}

std::string_view to_string(simd_isa isa) noexcept {
  switch (isa) {
    case simd_isa::automatic: return "auto";
    case simd_isa::scalar: return "scalar";
    case simd_isa::avx2: return "avx2";
    case simd_isa::avx512: return "avx512";
  }
  return "?";
}

namespace detail {

const adam_kernels& select_kernels(simd_isa isa) {
  if (isa == simd_isa::automatic) {
    // The environment can only lower the choice to what the CPU has: it exists to test the
    // fallbacks on a machine with AVX-512, not to crash one without it.
    isa = best_simd_isa();
    if (const char* env = std::getenv("TERRACE_ADAM_ISA"); env != nullptr && *env != '\0') {
      const std::string_view name(env);
      simd_isa wanted = simd_isa::automatic;
      for (simd_isa candidate : {simd_isa::scalar, simd_isa::avx2, simd_isa::avx512}) {
        if (name == to_string(candidate)) wanted = candidate;
      }
      TERRACE_EXPECTS(wanted != simd_isa::automatic,
                      "TERRACE_ADAM_ISA='" + std::string(name) + "' is not scalar, avx2 or avx512");
      TERRACE_EXPECTS(supported(wanted), "TERRACE_ADAM_ISA=" + std::string(name) +
                                             " but this CPU does not support it");
      isa = wanted;
    }
  }
  TERRACE_EXPECTS(supported(isa),
                  "adam: instruction set " + std::string(to_string(isa)) + " is not supported by this CPU");
  switch (isa) {
    case simd_isa::avx512: return has_avx512_bf16() ? kernels_avx512bf16() : kernels_avx512();
    case simd_isa::avx2: return kernels_avx2();
    default: return kernels_scalar();
  }
}

}  // namespace detail
}  // namespace terrace
