// SPDX-License-Identifier: Apache-2.0
// The contract between the optimizer front (adam.cpp) and its kernels, one set per instruction
// set (adam_scalar.cpp, adam_avx2.cpp, adam_avx512.cpp). Only plain structs and function pointers
// cross it, so the SIMD translation units need no standard-library template (see half.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "terrace/adam.hpp"

namespace terrace::detail {

// Everything a step needs besides the buffers, precomputed once per step in float, as torch does.
struct adam_scalars {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float step_size;     // lr / (1 - beta1^t); Lion: lr
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^t); Lion: unused
  float coupled_wd;    // Adam: weight_decay, added to the gradient; AdamW: 0
  float decay;         // AdamW, Lion: 1 - lr * weight_decay, multiplies the param; Adam: 1
  float grad_mul;      // clip_coef / grad_scale
};

// The scalars of step number `step` (from 1), computed as torch does (in double, from Python
// floats) and rounded to float. Shared by the CPU step and the GPU kernel's tests, so that both
// run exactly the same arithmetic setup.
adam_scalars make_adam_scalars(const adam_options& o, std::int64_t step, float grad_scale,
                               float clip_coef) noexcept;

struct adam_config {
  dtype grad;
  dtype state;
  dtype copy;
  bool has_copy;
  bool lion;  // the Lion update (exp_avg_sq unused, null); otherwise Adam/AdamW
};

// One contiguous piece of one tensor. REQUIRES: pointers valid for n elements of their type and
// aligned to their element size; copy may be null only when the config has no copy, exp_avg_sq
// only for Lion.
struct adam_span {
  float* param;
  void* exp_avg;
  void* exp_avg_sq;
  const void* grad;
  void* copy;
  std::size_t n;
};

struct grad_scan_result {
  double sum_squares;  // of the raw gradient values
  bool finite;         // of the gradient values times grad_mul, as the update sees them
};

struct adam_kernels {
  simd_isa isa;
  void (*update)(const adam_scalars&, const adam_config&, const adam_span&) noexcept;
  // `grad_mul` is the step's clip_coef / grad_scale: a finite gradient whose unscaled value
  // overflows float (grad_scale < 1) is not finite for the update, and GradScaler, which checks
  // after unscaling, skips that step.
  grad_scan_result (*scan)(const void* grad, dtype grad_dtype, std::size_t n, float grad_mul) noexcept;
};

const adam_kernels& kernels_scalar() noexcept;
const adam_kernels& kernels_avx2() noexcept;    // REQUIRES: avx2, fma, f16c
const adam_kernels& kernels_avx512() noexcept;  // REQUIRES: avx512f, bw, vl, dq
// The same kernels, bit for bit, with vcvtneps2bf16 for the bf16 stores (adam_avx512bf16.cpp).
const adam_kernels& kernels_avx512bf16() noexcept;  // REQUIRES: as kernels_avx512, and avx512bf16

// The kernels for `isa` (automatic: the best supported). Throws terrace::logic_error if the CPU
// lacks it.
const adam_kernels& select_kernels(simd_isa isa);

}  // namespace terrace::detail
