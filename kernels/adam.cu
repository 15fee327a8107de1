// SPDX-License-Identifier: Apache-2.0
// The fused GPU Adam/AdamW step of adam.hpp: one grid-stride pass that reads each buffer once and
// writes each output once, with the arithmetic of optimizer/adam_body.hpp in the same order
// (fmaf where the CPU kernels use fused multiply-add).
#include "kernels/adam.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/launch.cuh"

namespace terrace::kernels {

namespace {

constexpr unsigned threads_per_block = 256;

template <int T>
__device__ float load(const void* base, std::size_t i) {
  if constexpr (T == adam_gpu_f32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (T == adam_gpu_bf16) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  } else {
    return __half2float(static_cast<const __half*>(base)[i]);
  }
}

// A NaN is written as the CPU kernels write it (optimizer/half.hpp: bf16 0x7fc0, f16 the sign
// and 0x7e00), so that the two copies agree bit for bit; cvt.rn writes 0x7fff for both.
template <int T>
__device__ void store(void* base, std::size_t i, float x) {
  if constexpr (T == adam_gpu_f32) {
    static_cast<float*>(base)[i] = x;
  } else if constexpr (T == adam_gpu_bf16) {
    if (isnan(x)) static_cast<unsigned short*>(base)[i] = 0x7fc0;
    else static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x);
  } else {
    if (isnan(x)) {
      static_cast<unsigned short*>(base)[i] =
          static_cast<unsigned short>(((__float_as_uint(x) >> 16) & 0x8000u) | 0x7e00u);
    } else {
      static_cast<__half*>(base)[i] = __float2half_rn(x);
    }
  }
}

template <int G, int C, bool Copy>
__global__ void adam_kernel(float* __restrict__ param, float* __restrict__ exp_avg,
                            float* __restrict__ exp_avg_sq, const void* __restrict__ grad,
                            void* __restrict__ copy, std::size_t n, adam_gpu_scalars s,
                            const int* skip) {
  if (skip != nullptr && *skip != 0) return;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float g = load<G>(grad, i) * s.grad_mul;
    float p = param[i];
    if (s.coupled_wd != 0.0f) g = fmaf(s.coupled_wd, p, g);  // as torch: 0 * inf would be NaN
    p = p * s.decay;
    const float m = fmaf(s.beta1, exp_avg[i], s.one_minus_beta1 * g);
    const float v = fmaf(s.beta2, exp_avg_sq[i], (s.one_minus_beta2 * g) * g);
    const float denom = fmaf(sqrtf(v), s.inv_bc2_sqrt, s.eps);
    p = fmaf(-s.step_size, __fdiv_rn(m, denom), p);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (Copy) store<C>(copy, i, p);
  }
}

template <int G, int C, bool Copy>
cudaError_t launch_step(float* p, float* m, float* v, const void* g, void* c, std::size_t n,
                   const adam_gpu_scalars& s, const int* skip, cudaStream_t stream) {
  // Enough blocks to fill any current GPU several times over; the grid-stride loop does the rest.
  const std::size_t blocks = std::min<std::size_t>((n + threads_per_block - 1) / threads_per_block, 65536);
  return launch(adam_kernel<G, C, Copy>, static_cast<unsigned>(blocks), threads_per_block, stream, p, m, v, g,
                c, n, s, skip);
}

template <int G>
cudaError_t launch_copy(float* p, float* m, float* v, const void* g, void* c, int copy_dtype,
                        std::size_t n, const adam_gpu_scalars& s, const int* skip,
                        cudaStream_t stream) {
  if (c == nullptr) return launch_step<G, adam_gpu_f32, false>(p, m, v, g, c, n, s, skip, stream);
  switch (copy_dtype) {
    case adam_gpu_f32: return launch_step<G, adam_gpu_f32, true>(p, m, v, g, c, n, s, skip, stream);
    case adam_gpu_bf16: return launch_step<G, adam_gpu_bf16, true>(p, m, v, g, c, n, s, skip, stream);
    case adam_gpu_f16: return launch_step<G, adam_gpu_f16, true>(p, m, v, g, c, n, s, skip, stream);
    default: return cudaErrorInvalidValue;
  }
}

// Any gradient whose product with grad_mul (the value the step uses) is not finite sets *flag;
// one store per block that found one.
template <int G>
__global__ void nonfinite_kernel(const void* __restrict__ grad, std::size_t n, float grad_mul, int* flag) {
  int bad = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    bad |= !isfinite(load<G>(grad, i) * grad_mul);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, 1);
}

template <int G>
cudaError_t launch_flag(const void* grad, std::size_t n, float grad_mul, int* flag, cudaStream_t stream) {
  const std::size_t blocks = std::min<std::size_t>((n + threads_per_block - 1) / threads_per_block, 4096);
  return launch(nonfinite_kernel<G>, static_cast<unsigned>(blocks), threads_per_block, stream, grad, n, grad_mul, flag);
}

}  // namespace

cudaError_t flag_nonfinite(const void* grad, int grad_dtype, std::size_t n, float grad_mul, int* flag,
                           cudaStream_t stream) noexcept {
  if (n == 0) return cudaSuccess;
  switch (grad_dtype) {
    case adam_gpu_f32: return launch_flag<adam_gpu_f32>(grad, n, grad_mul, flag, stream);
    case adam_gpu_bf16: return launch_flag<adam_gpu_bf16>(grad, n, grad_mul, flag, stream);
    case adam_gpu_f16: return launch_flag<adam_gpu_f16>(grad, n, grad_mul, flag, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t adam_step(float* param, float* exp_avg, float* exp_avg_sq, const void* grad,
                      int grad_dtype, void* param_copy, int copy_dtype, std::size_t n,
                      const adam_gpu_scalars& scalars, const int* skip,
                      cudaStream_t stream) noexcept {
  if (n == 0) return cudaSuccess;
  switch (grad_dtype) {
    case adam_gpu_f32:
      return launch_copy<adam_gpu_f32>(param, exp_avg, exp_avg_sq, grad, param_copy, copy_dtype, n, scalars, skip, stream);
    case adam_gpu_bf16:
      return launch_copy<adam_gpu_bf16>(param, exp_avg, exp_avg_sq, grad, param_copy, copy_dtype, n, scalars, skip, stream);
    case adam_gpu_f16:
      return launch_copy<adam_gpu_f16>(param, exp_avg, exp_avg_sq, grad, param_copy, copy_dtype, n, scalars, skip, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace terrace::kernels
