// SPDX-License-Identifier: Apache-2.0
// Who the calling thread was before code switched CUDA devices, so that it can be put back (tiers'
// device_scope, the demo model's device_guard). Plain C++17 and no CUDA header, so that
// nvcc-compiled sources include it too. Defined in tiers/cuda_device.cpp (CUDA builds only).
#pragma once

namespace terrace::detail {

/// The thread's device and current context. PyTorch's context is the device's primary one; an
/// embedder's may be one of its own (cuCtxCreate), which cudaSetDevice alone would not give back.
struct cuda_caller {
  int device = -1;          ///< -1: the thread had no context, and nothing is put back
  void* context = nullptr;  ///< its CUcontext; null when the driver cannot say
};

/// `current_device` is what cudaGetDevice answered (-1 if it failed). A thread without a current
/// context gets device -1: putting back device 0 would create that device's primary context,
/// hundreds of MiB on a GPU the thread never used. When the driver cannot be asked, the device
/// alone is put back (the safe guess).
cuda_caller save_cuda_caller(int current_device) noexcept;

/// Makes the caller's own context current again (cuCtxSetCurrent, which gives the runtime its
/// device too), or, when the context is unknown, its device (cudaSetDevice). Failures are cleared,
/// not reported: the caller's state is restored as far as it can be.
void restore_cuda_caller(const cuda_caller& caller) noexcept;

}  // namespace terrace::detail
