// SPDX-License-Identifier: Apache-2.0
// Internal to tiers/: what the "cuda" and "cuda-vmm" backends share. Both hand out streams, events
// and copies the same way; "cuda-vmm" adds virtual memory on top of the "cuda" backend, so it
// derives from it. Only tiers/ (and the GPU tests) include this header: it needs
// cuda_runtime_api.h, which no public header may.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "terrace/device.hpp"
#include "tiers/cuda_context.hpp"

namespace terrace::detail {

// ------------------------------------------------------------------------------------ errors

/// "cudaErrorInvalidValue (invalid argument)": the enum name for grep, the text for people.
std::string cuda_error_text(cudaError_t error);

/// Throws device_error "terrace: <call> on CUDA device <d> failed: <cuda_error_text>" and clears
/// the runtime's last error, so a later cudaGetLastError() does not report this failure again.
[[noreturn]] void throw_cuda_error(cudaError_t error, std::string_view call, int device);

/// Throws as throw_cuda_error unless `error` is cudaSuccess.
inline void cuda_check(cudaError_t error, std::string_view call, int device) {
  if (error != cudaSuccess) throw_cuda_error(error, call, device);
}

/// A failure inside a noexcept entry point that is not the caller's fault (e.g. cudaFree reporting
/// a sticky error from an earlier kernel): printed once per call, never thrown.
void report_noexcept_failure(cudaError_t error, std::string_view call, int device) noexcept;

/// "1.00 GiB (...) free of 80.00 GiB (...)" for the current device, or "an unknown amount free"
/// when cudaMemGetInfo fails (its error is cleared): the tail of every out-of-memory message.
std::string describe_free_device_memory() noexcept;

// --------------------------------------------------------------------------- current device

/// Makes `device` current on this thread for the scope and restores the caller's device after:
/// the backends are called from any thread, and an embedder (PyTorch) must not find its current
/// device changed behind its back. Never throws; callers check error().
class device_scope {
 public:
  explicit device_scope(int device) noexcept;
  ~device_scope();
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;
  cudaError_t error() const noexcept { return error_; }
  /// Throws device_error naming cudaSetDevice unless the switch succeeded.
  void check() const;

 private:
  int device_;
  cuda_caller caller_;  // put back on exit
  cudaError_t error_ = cudaSuccess;
};

// -------------------------------------------------------------------------- the cuda backend

/// "cuda": segments from cudaMalloc, non-blocking CUDA streams, timing-free events,
/// cudaMemcpyAsync. stream_ref{nullptr} is the legacy default stream.
class cuda_backend : public device_backend {
 public:
  /// Properties are read from the device; `name` is "cuda" or "cuda-vmm".
  /// @throws device_error when the device cannot be selected or queried.
  cuda_backend(const device_options& options, std::string name);
  /// Frees whatever segments the caller did not release (errors ignored: this may run after the
  /// CUDA runtime has begun to unload at exit).
  ~cuda_backend() override;

 protected:
  int device() const noexcept { return properties_.device_index; }
  void add_used(std::size_t bytes) noexcept { used_.fetch_add(bytes, std::memory_order_relaxed); }
  void sub_used(std::size_t bytes) noexcept { used_.fetch_sub(bytes, std::memory_order_relaxed); }

 private:
  void* do_reserve(std::size_t bytes) override;
  void do_release(void* p, std::size_t bytes) noexcept override;
  std::size_t do_used_bytes() const noexcept override;
  void* do_reserve_pinned_host(std::size_t bytes) override;
  void do_release_pinned_host(void* p, std::size_t bytes) noexcept override;

  stream_ref do_create_stream() override;
  void do_destroy_stream(stream_ref s) noexcept override;
  void do_synchronize_stream(stream_ref s) override;
  void do_synchronize_device() override;
  event_ref do_create_event() override;
  void do_destroy_event(event_ref e) noexcept override;
  void do_record(event_ref e, stream_ref s) override;
  bool do_query(event_ref e) override;
  void do_wait(stream_ref s, event_ref e) override;
  void do_synchronize_event(event_ref e) override;
  void do_copy_async(void* dst, const void* src, std::size_t bytes, copy_kind kind,
                     stream_ref s) override;

  std::atomic<std::size_t> used_{0};
  // Live cudaMalloc segments, so that release() can check its REQUIRES and the destructor can
  // free what was leaked.
  std::mutex segments_mutex_;
  std::unordered_map<void*, std::size_t> segments_;
};

// ------------------------------------------------------------------------ driver entry points

/// The driver function `symbol` at ABI version `cuda_version` (1000*major + 10*minor), looked up
/// through the runtime so that nothing links libcuda.
/// @throws device_error naming the symbol when the driver does not have it.
void* cuda_driver_entry_point(const char* symbol, unsigned cuda_version);

}  // namespace terrace::detail
