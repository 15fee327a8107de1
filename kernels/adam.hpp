// SPDX-License-Identifier: Apache-2.0
/// @file adam.hpp
/// @brief The GPU twin of the CPU Adam/AdamW step (terrace/adam.hpp): one fused kernel, for when
/// the optimizer state fits on the device.
///
/// Same semantics and the same arithmetic as the CPU kernels (optimizer/adam_body.hpp): the
/// caller computes the per-step scalars on the host with terrace::detail::make_adam_scalars and
/// copies them into adam_gpu_scalars field by field; the tests check both against one float64
/// reference (optimizer/adam_reference.hpp).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace terrace::kernels {

/// @brief Field for field terrace::detail::adam_scalars (optimizer/adam_kernel.hpp).
struct adam_gpu_scalars {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float step_size;
  float inv_bc2_sqrt;
  float coupled_wd;
  float decay;
  float grad_mul;
};

/// Element types, numbered as terrace::dtype: 0 f32, 1 bf16, 2 f16.
enum adam_gpu_dtype : int { adam_gpu_f32 = 0, adam_gpu_bf16 = 1, adam_gpu_f16 = 2 };

/// @brief Queues one Adam/AdamW step over n elements on `stream`: fp32 param, m and v in place,
/// grads of `grad_dtype`, and, when param_copy is not null, the updated param written as
/// `copy_dtype` (bf16 or f16) in the same pass. If `skip` is not null and *skip != 0 when the
/// kernel runs (a device flag set by an overflow check queued before), nothing is written.
/// Returns the launch's error (cudaErrorInvalidValue for an unknown dtype); kernel errors appear
/// at the next synchronisation. REQUIRES: device pointers, aligned to their element size.
cudaError_t adam_step(float* param, float* exp_avg, float* exp_avg_sq, const void* grad,
                      int grad_dtype, void* param_copy, int copy_dtype, std::size_t n,
                      const adam_gpu_scalars& scalars, const int* skip,
                      cudaStream_t stream) noexcept;

/// @brief Queues a check of n gradients of `grad_dtype` on `stream` that sets *flag to 1 if any
/// gradient times `grad_mul` is inf or NaN and leaves it as it was otherwise: zero the flag
/// (cudaMemsetAsync), check every gradient buffer of the step into it, then pass it to adam_step
/// as `skip` on the same stream. `grad_mul` is the step's adam_gpu_scalars::grad_mul: a finite
/// gradient that overflows once unscaled (grad_scale below 1) would put inf into m and v and NaN
/// into the weight. This is the CPU step's overflow check (adam_optimizer::step skips when a
/// gradient times grad_mul is not finite), split out so that one flag covers many buffers. The
/// step count stays the caller's: after a skipped step the next one must use the same t (read the
/// flag back first, as torch's GradScaler does), since no state changed.
/// Returns the launch's error (cudaErrorInvalidValue for an unknown dtype).
cudaError_t flag_nonfinite(const void* grad, int grad_dtype, std::size_t n, float grad_mul, int* flag,
                           cudaStream_t stream) noexcept;

}  // namespace terrace::kernels
