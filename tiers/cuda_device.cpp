// SPDX-License-Identifier: Apache-2.0
// The "cuda" backend: cudaMalloc segments, CUDA streams and events, cudaMemcpyAsync. Also the parts
// that "cuda-vmm" (cuda_vmm_device.cpp) shares: errors, the device scope, driver entry points.
//
// The runtime is linked statically and the driver is reached only through the runtime (its own
// dlopen of libcuda.so.1, and cudaGetDriverEntryPointByVersion), so a binary built on a machine
// without a GPU loads there, reports no device, and runs on a GPU machine unchanged.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "terrace/device.hpp"
#include "terrace/error.hpp"
#include "tiers/backends.hpp"
#include "tiers/cuda_common.hpp"
#include "tiers/cuda_context.hpp"

namespace terrace::detail {

// ============================================================================ errors

std::string cuda_error_text(cudaError_t error) {
  std::string text = cudaGetErrorName(error);
  text += " (";
  text += cudaGetErrorString(error);
  text += ")";
  return text;
}

void throw_cuda_error(cudaError_t error, std::string_view call, int device) {
  // Non-sticky errors stay as the runtime's "last error" until read; clear this one so that the
  // next cudaGetLastError() (a kernel launch check, say) does not blame itself for it.
  (void)cudaGetLastError();
  throw device_error("terrace: " + std::string(call) + " on CUDA device " + std::to_string(device) +
                     " failed: " + cuda_error_text(error));
}

void report_noexcept_failure(cudaError_t error, std::string_view call, int device) noexcept {
  (void)cudaGetLastError();
  std::fprintf(stderr, "terrace: %.*s on CUDA device %d failed: %s (%s)\n",
               static_cast<int>(call.size()), call.data(), device, cudaGetErrorName(error),
               cudaGetErrorString(error));
}

namespace {

std::string hex(const void* p) {
  char buffer[2 + 16 + 1];
  std::snprintf(buffer, sizeof buffer, "0x%" PRIxPTR, reinterpret_cast<std::uintptr_t>(p));
  return buffer;
}

const char* copy_kind_name(copy_kind kind) {
  switch (kind) {
    case copy_kind::host_to_device:
      return "host_to_device";
    case copy_kind::device_to_host:
      return "device_to_host";
    case copy_kind::device_to_device:
      return "device_to_device";
    case copy_kind::host_to_host:
      return "host_to_host";
  }
  return "unknown";
}

cudaMemcpyKind to_cuda(copy_kind kind) {
  switch (kind) {
    case copy_kind::host_to_device:
      return cudaMemcpyHostToDevice;
    case copy_kind::device_to_host:
      return cudaMemcpyDeviceToHost;
    case copy_kind::device_to_device:
      return cudaMemcpyDeviceToDevice;
    case copy_kind::host_to_host:
      return cudaMemcpyHostToHost;
  }
  return cudaMemcpyDefault;
}

cudaStream_t native(stream_ref s) { return static_cast<cudaStream_t>(s.native); }
cudaEvent_t native(event_ref e) { return static_cast<cudaEvent_t>(e.native); }

// A context call device_scope can do without: nullptr when the driver lacks it.
void* driver_entry_point(const char* name) noexcept {
  try {
    return cuda_driver_entry_point(name, 4000);
  } catch (...) {  // device_error (or bad_alloc building its message)
    return nullptr;
  }
}

PFN_cuCtxGetCurrent_v4000 ctx_get_current() noexcept {
  static const auto fn = reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(driver_entry_point("cuCtxGetCurrent"));
  return fn;
}

PFN_cuCtxSetCurrent_v4000 ctx_set_current() noexcept {
  static const auto fn = reinterpret_cast<PFN_cuCtxSetCurrent_v4000>(driver_entry_point("cuCtxSetCurrent"));
  return fn;
}

}  // namespace

// ============================================================================ device scope

cuda_caller save_cuda_caller(int current_device) noexcept {
  cuda_caller caller;
  if (current_device < 0) return caller;
  const auto get_current = ctx_get_current();
  if (get_current == nullptr) {
    caller.device = current_device;
    return caller;
  }
  CUcontext context = nullptr;
  if (get_current(&context) != CUDA_SUCCESS || context == nullptr) return caller;
  caller.device = current_device;
  caller.context = context;
  return caller;
}

void restore_cuda_caller(const cuda_caller& caller) noexcept {
  if (caller.device < 0) return;
  // The caller's context goes back as it is: the runtime follows the current context, its device
  // included. cudaSetDevice first would bind and initialise the device's primary context, hundreds
  // of MiB on a GPU the caller uses only through a context of its own (cuCtxCreate).
  if (const auto set_current = ctx_set_current(); caller.context != nullptr && set_current != nullptr) {
    if (set_current(static_cast<CUcontext>(caller.context)) == CUDA_SUCCESS) return;
  }
  // The context is unknown (or the driver refused it): the device alone, the safe guess.
  if (cudaSetDevice(caller.device) != cudaSuccess) (void)cudaGetLastError();
}

device_scope::device_scope(int device) noexcept : device_(device) {
  int current = -1;
  const cudaError_t got = cudaGetDevice(&current);
  if (got == cudaSuccess && current == device) return;  // the common case
  if (got != cudaSuccess) {
    // Only our own failure is cleared: an error the embedder has yet to read (a launch of its
    // own that failed) must survive a call into terrace.
    (void)cudaGetLastError();
    current = -1;
  }
  caller_ = save_cuda_caller(current);
  error_ = cudaSetDevice(device);
  if (error_ != cudaSuccess) {
    (void)cudaGetLastError();
    caller_ = {};
  }
}

device_scope::~device_scope() { restore_cuda_caller(caller_); }

void device_scope::check() const {
  if (error_ != cudaSuccess) {
    throw device_error("terrace: cudaSetDevice(" + std::to_string(device_) +
                       ") failed: " + cuda_error_text(error_));
  }
}

// ============================================================================ driver entry points

void* cuda_driver_entry_point(const char* symbol, unsigned cuda_version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  const cudaError_t error =
      cudaGetDriverEntryPointByVersion(symbol, &fn, cuda_version, cudaEnableDefault, &status);
  if (error == cudaSuccess && status == cudaDriverEntryPointSuccess && fn != nullptr) return fn;
  (void)cudaGetLastError();
  std::string why;
  if (error != cudaSuccess) {
    why = cuda_error_text(error);
  } else if (status == cudaDriverEntryPointVersionNotSufficent) {
    why = "the driver's version of it is older than requested";
  } else {
    why = "symbol not found";
  }
  throw device_error("terrace: the CUDA driver has no entry point " + std::string(symbol) +
                     " (ABI version " + std::to_string(cuda_version) + "): " + why);
}

// ============================================================================ cuda_backend

cuda_backend::cuda_backend(const device_options& options, std::string name) {
  properties_.name = std::move(name);
  properties_.device_index = options.device_index;
  properties_.alignment = 512;  // cudaMalloc returns at least this; do_reserve checks it
  properties_.touches_memory = true;
  properties_.supports_vmm = false;
  properties_.map_granularity = 0;

  device_scope scope(device());
  scope.check();
  std::size_t free = 0;
  std::size_t total = 0;
  cuda_check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo", device());
  properties_.capacity = total;
}

cuda_backend::~cuda_backend() {
  std::lock_guard lock(segments_mutex_);
  if (segments_.empty()) return;
  device_scope scope(device());
  for (const auto& [p, bytes] : segments_) {
    if (cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
  }
}

// ---------------------------------------------------------------------------- segments

std::string describe_free_device_memory() noexcept {
  try {
    std::size_t free = 0;
    std::size_t total = 0;
    if (cudaMemGetInfo(&free, &total) == cudaSuccess) {
      return describe_bytes(free) + " free of " + describe_bytes(total);
    }
    (void)cudaGetLastError();
    return "an unknown amount free";
  } catch (...) {  // std::bad_alloc while building the text: the message loses its tail
    return {};
  }
}

void* cuda_backend::do_reserve(std::size_t bytes) {
  device_scope scope(device());
  scope.check();
  void* p = nullptr;
  const cudaError_t error = cudaMalloc(&p, bytes);
  if (error == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    const std::string free_text = describe_free_device_memory();
    throw out_of_memory("terrace: out of memory on device '" + properties_.name +
                        "' (CUDA device " + std::to_string(device()) + "): cudaMalloc of " +
                        describe_bytes(bytes) + " failed with " + cuda_error_text(error) +
                        "; the device has " + free_text);
  }
  if (error != cudaSuccess) {
    throw_cuda_error(error, "cudaMalloc(" + describe_bytes(bytes) + ")", device());
  }
  if (reinterpret_cast<std::uintptr_t>(p) % properties_.alignment != 0) {
    (void)cudaFree(p);
    throw device_error("terrace: cudaMalloc returned " + hex(p) + ", which is not aligned to the " +
                       std::to_string(properties_.alignment) + " bytes device '" +
                       properties_.name + "' promises");
  }
  try {
    std::lock_guard lock(segments_mutex_);
    segments_.emplace(p, bytes);
  } catch (...) {
    (void)cudaFree(p);
    throw;
  }
  add_used(bytes);
  return p;
}

void cuda_backend::do_release(void* p, std::size_t bytes) noexcept {
  {
    std::lock_guard lock(segments_mutex_);
    const auto it = segments_.find(p);
    if (it == segments_.end()) {
      contract_violation(properties_.name, "release(" + hex(p) + "): not a segment from reserve()");
    }
    if (it->second != bytes) {
      contract_violation(properties_.name, "release(" + hex(p) + ", " + std::to_string(bytes) +
                                               "): the segment was reserved with " +
                                               std::to_string(it->second) + " bytes");
    }
    segments_.erase(it);
  }
  sub_used(bytes);
  device_scope scope(device());
  if (const cudaError_t error = cudaFree(p); error != cudaSuccess) {
    report_noexcept_failure(error, "cudaFree(" + hex(p) + ")", device());
  }
}

// Pinned host memory through the runtime, so that the driver knows the pages are locked and
// cudaMemcpyAsync from them is a true DMA (mlock alone would still be staged).
void* cuda_backend::do_reserve_pinned_host(std::size_t bytes) {
  device_scope scope(device());
  scope.check();
  void* p = nullptr;
  const cudaError_t error = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
  if (error == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw out_of_memory("terrace: pinned host memory for device '" + properties_.name +
                        "': cudaHostAlloc of " + describe_bytes(bytes) + " failed with " +
                        cuda_error_text(error) + " (the host cannot lock that much memory)");
  }
  if (error != cudaSuccess) {
    throw_cuda_error(error, "cudaHostAlloc(" + describe_bytes(bytes) + ")", device());
  }
  return p;
}

void cuda_backend::do_release_pinned_host(void* p, std::size_t) noexcept {
  device_scope scope(device());
  if (const cudaError_t error = cudaFreeHost(p); error != cudaSuccess) {
    report_noexcept_failure(error, "cudaFreeHost(" + hex(p) + ")", device());
  }
}

std::size_t cuda_backend::do_used_bytes() const noexcept {
  return used_.load(std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------- streams

stream_ref cuda_backend::do_create_stream() {
  device_scope scope(device());
  scope.check();
  cudaStream_t s = nullptr;
  // Non-blocking: the allocator's streams must not serialise with the legacy default stream.
  cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
             "cudaStreamCreateWithFlags(cudaStreamNonBlocking)", device());
  return stream_ref{s};
}

void cuda_backend::do_destroy_stream(stream_ref s) noexcept {
  if (s.native == nullptr) return;  // the default stream is not ours to destroy
  device_scope scope(device());
  // The contract says destroy waits for queued work; cudaStreamDestroy alone would not.
  if (const cudaError_t error = cudaStreamSynchronize(native(s)); error != cudaSuccess) {
    report_noexcept_failure(error, "cudaStreamSynchronize(" + hex(s.native) + ")", device());
  }
  if (const cudaError_t error = cudaStreamDestroy(native(s)); error != cudaSuccess) {
    report_noexcept_failure(error, "cudaStreamDestroy(" + hex(s.native) + ")", device());
  }
}

void cuda_backend::do_synchronize_stream(stream_ref s) {
  device_scope scope(device());  // the null stream is the current device's
  scope.check();
  if (const cudaError_t error = cudaStreamSynchronize(native(s)); error != cudaSuccess) {
    throw_cuda_error(error, "cudaStreamSynchronize(" + hex(s.native) + ")", device());
  }
}

void cuda_backend::do_synchronize_device() {
  device_scope scope(device());
  scope.check();
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", device());
}

// ---------------------------------------------------------------------------- events

event_ref cuda_backend::do_create_event() {
  device_scope scope(device());
  scope.check();
  cudaEvent_t e = nullptr;
  cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
             "cudaEventCreateWithFlags(cudaEventDisableTiming)", device());
  return event_ref{e};
}

void cuda_backend::do_destroy_event(event_ref e) noexcept {
  if (e.native == nullptr) return;
  device_scope scope(device());
  if (const cudaError_t error = cudaEventDestroy(native(e)); error != cudaSuccess) {
    report_noexcept_failure(error, "cudaEventDestroy(" + hex(e.native) + ")", device());
  }
}

void cuda_backend::do_record(event_ref e, stream_ref s) {
  TERRACE_EXPECTS(e.native != nullptr, "cuda record() on a null event");
  device_scope scope(device());
  scope.check();
  if (const cudaError_t error = cudaEventRecord(native(e), native(s)); error != cudaSuccess) {
    throw_cuda_error(error, "cudaEventRecord(" + hex(e.native) + ", stream " + hex(s.native) + ")",
                     device());
  }
}

bool cuda_backend::do_query(event_ref e) {
  TERRACE_EXPECTS(e.native != nullptr, "cuda query() on a null event");
  // The device scope although the answer does not depend on the current device: on a thread with
  // no context yet, a runtime call makes the primary context of the thread's current device
  // (device 0), and every rank of a multi-GPU job would hold one there. One cudaGetDevice when
  // the device is already current.
  device_scope scope(device());
  scope.check();
  const cudaError_t error = cudaEventQuery(native(e));
  if (error == cudaSuccess) return true;
  if (error == cudaErrorNotReady) {
    // The runtime may keep it as the thread's last error, which the next launch check (ours,
    // after a kernel, reads cudaGetLastError) would then report as that kernel's failure.
    (void)cudaGetLastError();
    return false;
  }
  throw_cuda_error(error, "cudaEventQuery(" + hex(e.native) + ")", device());
}

void cuda_backend::do_wait(stream_ref s, event_ref e) {
  TERRACE_EXPECTS(e.native != nullptr, "cuda wait() on a null event");
  device_scope scope(device());
  scope.check();
  if (const cudaError_t error = cudaStreamWaitEvent(native(s), native(e), 0);
      error != cudaSuccess) {
    throw_cuda_error(error,
                     "cudaStreamWaitEvent(stream " + hex(s.native) + ", " + hex(e.native) + ")",
                     device());
  }
}

void cuda_backend::do_synchronize_event(event_ref e) {
  TERRACE_EXPECTS(e.native != nullptr, "cuda synchronize() on a null event");
  device_scope scope(device());  // as do_query
  scope.check();
  if (const cudaError_t error = cudaEventSynchronize(native(e)); error != cudaSuccess) {
    throw_cuda_error(error, "cudaEventSynchronize(" + hex(e.native) + ")", device());
  }
}

// ---------------------------------------------------------------------------- copies

void cuda_backend::do_copy_async(void* dst, const void* src, std::size_t bytes, copy_kind kind,
                                 stream_ref s) {
  device_scope scope(device());
  scope.check();
  const cudaError_t error = cudaMemcpyAsync(dst, src, bytes, to_cuda(kind), native(s));
  if (error != cudaSuccess) {
    throw_cuda_error(error,
                     "cudaMemcpyAsync(dst " + hex(dst) + ", src " + hex(src) + ", " +
                         describe_bytes(bytes) + ", " + copy_kind_name(kind) + ", stream " +
                         hex(s.native) + ")",
                     device());
  }
}

// ============================================================================ factory hooks

std::unique_ptr<device_backend> make_cuda_device(const device_options& options) {
  return std::make_unique<cuda_backend>(options, "cuda");
}

bool cuda_runtime_device_present() noexcept {
  // Without a driver, cudart_static's dlopen of libcuda.so.1 fails and this returns
  // cudaErrorInsufficientDriver; with only the toolkit's stub libcuda it returns
  // cudaErrorStubLibrary. Neither is an exception or a crash.
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

}  // namespace terrace::detail
