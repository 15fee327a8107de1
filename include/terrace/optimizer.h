/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file optimizer.h
 * @brief The C ABI of terrace's CPU Adam/AdamW (terrace/adam.hpp), for ctypes and C trainers.
 *
 * Exported by libterrace.so next to terrace.h's allocator functions. Status codes are
 * terrace.h's: 0 on success, a negative TERRACE_E* code on failure, after which
 * terrace_last_error() describes it (per thread). No C++ exception crosses this ABI.
 *
 * Buffers are caller-owned. Tensor lists are passed as parallel arrays of `count` entries;
 * `param_copies` may be NULL (no copy written). Element types: params are float32; m and v are
 * the optimizer's state dtype; grads and copies are given per call.
 */
#ifndef TERRACE_OPTIMIZER_H_
#define TERRACE_OPTIMIZER_H_

#include <stddef.h>
#include <stdint.h>

#include "terrace/terrace.h"

#ifdef __cplusplus
extern "C" {
#endif

enum terrace_dtype { TERRACE_DTYPE_F32 = 0, TERRACE_DTYPE_BF16 = 1, TERRACE_DTYPE_F16 = 2 };
enum terrace_adam_mode {
  TERRACE_ADAM = 0,  /* torch.optim.Adam: weight decay added to the gradient */
  TERRACE_ADAMW = 1, /* torch.optim.AdamW: decoupled weight decay */
  TERRACE_LION = 2   /* Lion: sign update, decoupled weight decay, exp_avg only (terrace/adam.hpp) */
};

typedef struct terrace_adam terrace_adam;

/** @brief Creates an optimizer. `threads` 0: one per core. `state_dtype`: F32 or BF16.
 *  TERRACE_EINVAL on bad hyperparameters (lr <= 0, betas outside [0,1), eps <= 0, wd < 0). */
TERRACE_API int terrace_adam_create(int mode, double lr, double beta1, double beta2, double eps,
                                    double weight_decay, int state_dtype, int threads,
                                    terrace_adam** out);
/** @brief Destroys what terrace_adam_create returned. NULL is ignored. */
TERRACE_API void terrace_adam_destroy(terrace_adam* adam);

/** @brief One step over `count` tensors (TERRACE_LION: `exp_avg_sqs` may be NULL, or hold NULLs).
 *  `grad_scale` is the loss scale to divide out (1: none),
 *  `clip_coef` multiplies the unscaled gradients (1: none). With `check_finite`, a step whose
 *  gradients hold inf/NaN changes nothing and *stepped is 0; otherwise *stepped is 1.
 *  `stepped` may be NULL. TERRACE_EINVAL on null or misaligned buffers or bad arguments; nothing
 *  is written then. */
TERRACE_API int terrace_adam_step(terrace_adam* adam, size_t count, float* const* params,
                                  void* const* exp_avgs, void* const* exp_avg_sqs,
                                  const void* const* grads, void* const* param_copies,
                                  const size_t* sizes, int grad_dtype, int copy_dtype,
                                  float grad_scale, float clip_coef, int check_finite,
                                  int* stepped);

/** @brief L2 norm of grad / grad_scale over `count` tensors, and whether all are finite. */
TERRACE_API int terrace_adam_grad_norm(terrace_adam* adam, size_t count, const void* const* grads,
                                       const size_t* sizes, int grad_dtype, float grad_scale,
                                       double* norm, int* finite);

/** @brief The step counter (torch's state["step"]); set it when resuming. */
TERRACE_API int terrace_adam_get_step(const terrace_adam* adam, int64_t* step);
TERRACE_API int terrace_adam_set_step(terrace_adam* adam, int64_t step);
/** @brief Changes the learning rate (for schedulers). */
TERRACE_API int terrace_adam_set_lr(terrace_adam* adam, double lr);
/** @brief "scalar", "avx2" or "avx512": the kernels this optimizer runs; "" for NULL. */
TERRACE_API const char* terrace_adam_isa(const terrace_adam* adam);

#ifdef __cplusplus
}
#endif

#endif /* TERRACE_OPTIMIZER_H_ */
