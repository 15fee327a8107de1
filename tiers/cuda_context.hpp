// SPDX-License-Identifier: Apache-2.0
// Whether the calling thread has a current CUDA context, for code that switches devices and must
// give the caller's back (tiers' device_scope, the demo model's device_guard). Plain C++17 and no
// CUDA header, so that nvcc-compiled sources include it too. Defined in tiers/cuda_device.cpp
// (CUDA builds only).
#pragma once

namespace terrace::detail {

/// True when the thread has a current context, or when the driver cannot be asked (then restoring
/// the caller's device is the safe guess). A thread without one must not get cudaSetDevice(0) on
/// the way out: that creates device 0's primary context, hundreds of MiB on a GPU the thread never
/// used.
bool thread_has_cuda_context() noexcept;

}  // namespace terrace::detail
