// SPDX-License-Identifier: Apache-2.0
/// @file device.hpp
/// @brief The device backend contract: raw segments, virtual memory, streams, events, async copies.
///
/// The caching allocator (allocator/) is pure policy over address ranges; every byte it hands out
/// comes from one of these backends (tiers/). Four implementations exist:
///   - "sim":      host memory with a capacity limit; each stream is an ordered queue run by a worker
///                 thread; copies may follow a bandwidth model. The default when no GPU is present.
///   - "null":     address ranges only, never touched: replays traces with a 70 GB peak on a laptop.
///   - "cuda":     cudaMalloc / cudaFree, CUDA streams and events.
///   - "cuda-vmm": cuMemCreate / cuMemAddressReserve / cuMemMap through cudaGetDriverEntryPoint.
///
/// Every method is thread-safe. Streams and events are opaque handles so that no core header needs
/// cuda_runtime_api.h; on the CUDA backends `native` is the cudaStream_t / cudaEvent_t itself, and the
/// null handle is the legacy default stream.
///
/// The public methods are non-virtual and call private virtuals (the rmm device_memory_resource
/// pattern). The base class owns the one mechanism that is common to all backends: fault injection,
/// so that tests can make any backend fail its next reserve or map.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

namespace terrace {

/// @brief An opaque stream. `native == nullptr` is the backend's default stream.
struct stream_ref {
  void* native = nullptr;
  friend bool operator==(stream_ref a, stream_ref b) { return a.native == b.native; }
};

/// @brief An opaque event created by device_backend::create_event.
struct event_ref {
  void* native = nullptr;
  friend bool operator==(event_ref a, event_ref b) { return a.native == b.native; }
};

enum class copy_kind { host_to_device, device_to_host, device_to_device, host_to_host };

/// @brief What a backend is and what it can do. Fixed for the backend's lifetime.
struct device_properties {
  std::string name;                  ///< "sim", "null", "cuda" or "cuda-vmm"
  std::size_t capacity = 0;          ///< bytes of device memory this backend may hand out in total
  std::size_t alignment = 512;       ///< every segment and mapping starts on this boundary
  bool touches_memory = true;        ///< false for "null": its addresses must never be dereferenced
  bool supports_vmm = false;         ///< reserve_address_range / map / unmap are available
  std::size_t map_granularity = 0;   ///< map/unmap sizes and offsets are multiples of this (VMM only)
  int device_index = 0;
};

/// @brief Options for make_device. Zero means "the backend's default".
struct device_options {
  std::size_t capacity = 0;          ///< sim / null: bytes available (default 8 GiB sim, 1 TiB null)
  /// sim: bytes per second of each direction of the host link (host to device, device to host),
  /// shared by all streams; 0 = as fast as memcpy. Device-to-device and host-to-host copies take
  /// their memcpy's time.
  double copy_bandwidth = 0.0;
  std::size_t map_granularity = 0;   ///< sim / null: VMM page size (default 2 MiB)
  int device_index = 0;              ///< cuda / cuda-vmm: the CUDA device ordinal
};

/// @brief The backend contract. See the file comment for the implementations.
class device_backend {
 public:
  device_backend() = default;
  device_backend(const device_backend&) = delete;
  device_backend& operator=(const device_backend&) = delete;
  virtual ~device_backend() = default;

  const device_properties& properties() const noexcept { return properties_; }

  // ---------------------------------------------------------------- segments
  /// @brief Reserves `bytes` (> 0) of device memory aligned to properties().alignment.
  /// @throws terrace::out_of_memory when the device has too little free memory (or an injected OOM);
  ///         terrace::device_error on any other failure.
  void* reserve(std::size_t bytes);
  /// @brief Returns a segment from reserve(). REQUIRES: `p`, `bytes` exactly as reserved; no work
  /// that uses it is still queued on any stream. Never throws.
  void release(void* p, std::size_t bytes) noexcept { do_release(p, bytes); }

  // ------------------------------------------------- virtual memory (supports_vmm only)
  /// @brief Reserves address space without physical memory. `bytes` is a multiple of
  /// map_granularity. @throws terrace::out_of_memory when the address space is exhausted;
  /// device_error if unsupported or on any other failure.
  void* reserve_address_range(std::size_t bytes);
  /// @brief Returns an address range. REQUIRES: every page in it is unmapped. Never throws.
  void release_address_range(void* p, std::size_t bytes) noexcept {
    do_release_address_range(p, bytes);
  }
  /// @brief Backs [p, p+bytes) with physical memory, readable and writable from the device.
  /// REQUIRES: inside a reserved range, granularity-aligned, currently unmapped.
  /// @throws terrace::out_of_memory when physical memory is exhausted; device_error otherwise.
  void map(void* p, std::size_t bytes);
  /// @brief Frees the physical memory behind [p, p+bytes); the addresses stay reserved.
  /// REQUIRES: granularity-aligned, mapped, no queued work uses it. Never throws.
  void unmap(void* p, std::size_t bytes) noexcept { do_unmap(p, bytes); }

  /// @brief Physical bytes currently held through reserve() and map().
  std::size_t used_bytes() const noexcept { return do_used_bytes(); }

  // ---------------------------------------------------------------- pinned host memory
  /// @brief Reserves `bytes` (> 0) of page-locked host memory that async copies to and from this
  /// device can use at full speed: cudaHostAlloc on the CUDA backends; on sim and null, mmap with
  /// transparent huge pages, populated and mlock'ed. Page aligned. Not counted in used_bytes().
  /// @throws terrace::out_of_memory when the host refuses, naming the memlock limit when that is
  ///         the cause (or an injected OOM); device_error on any other failure.
  void* reserve_pinned_host(std::size_t bytes);
  /// @brief Returns memory from reserve_pinned_host. REQUIRES: `p`, `bytes` exactly as reserved;
  /// no queued copy still uses it. Never throws; a region that is not live (a double or foreign
  /// release) or a wrong size aborts with a message, since munmap would quietly drop whatever
  /// mapping now lies there.
  void release_pinned_host(void* p, std::size_t bytes) noexcept;

  // ---------------------------------------------------------------- streams and events
  // Below, device_error is what the device reports. On sim, which keeps books, a stream or event
  // it does not know (destroyed, or another device's) and a copy outside live memory or between
  // overlapping ranges are the caller's errors instead: logic_error, nothing queued. (CUDA
  // reports what it detects of these as device_error.)
  /// @throws device_error
  stream_ref create_stream() { return do_create_stream(); }
  /// REQUIRES: a stream from create_stream(). Waits for its queued work. Never throws.
  void destroy_stream(stream_ref s) noexcept { do_destroy_stream(s); }
  /// @brief Blocks the host until all work queued on `s` so far has completed. @throws device_error
  void synchronize(stream_ref s) { do_synchronize_stream(s); }
  /// @brief Blocks the host until all work on all streams has completed. @throws device_error
  void synchronize_device() { do_synchronize_device(); }

  /// @throws device_error
  event_ref create_event() { return do_create_event(); }
  /// Never throws.
  void destroy_event(event_ref e) noexcept { do_destroy_event(e); }
  /// @brief Captures the work queued on `s` so far; query/synchronize then track it.
  void record(event_ref e, stream_ref s) { do_record(e, s); }
  /// @brief True once all work captured by the last record() has completed (true if never recorded).
  bool query(event_ref e) { return do_query(e); }
  /// @brief Work queued on `s` after this call starts only after `e` completes. Does not block.
  void wait(stream_ref s, event_ref e) { do_wait(s, e); }
  /// @brief Blocks the host until `e` completes.
  void synchronize(event_ref e) { do_synchronize_event(e); }

  // ---------------------------------------------------------------- copies
  /// @brief Queues a copy of `bytes` from `src` to `dst` on `s`. Host pointers must stay valid until
  /// the copy completes (use an event). A no-op on backends that do not touch memory.
  /// @throws device_error
  void copy_async(void* dst, const void* src, std::size_t bytes, copy_kind kind, stream_ref s) {
    if (bytes != 0) do_copy_async(dst, src, bytes, kind, s);
  }

  // ---------------------------------------------------------------- fault injection
  /// @brief The next `n` calls to reserve()/map()/reserve_pinned_host() throw out_of_memory as if
  /// the device (or host) were full.
  void inject_out_of_memory(int n) noexcept { injected_oom_.store(n, std::memory_order_relaxed); }
  /// @brief The next `n` calls to reserve()/map()/reserve_pinned_host() throw device_error.
  void inject_device_error(int n) noexcept { injected_error_.store(n, std::memory_order_relaxed); }

 protected:
  device_properties properties_;

  // Default: mmap + MADV_HUGEPAGE + mlock (tiers/host_pinning.cpp); the CUDA backends override,
  // and a backend may call these from its own (sim waits for queued copies first).
  virtual void* do_reserve_pinned_host(std::size_t bytes);
  virtual void do_release_pinned_host(void* p, std::size_t bytes) noexcept;

 private:
  void throw_if_injected(std::size_t bytes, const char* what);

  virtual void* do_reserve(std::size_t bytes) = 0;
  virtual void do_release(void* p, std::size_t bytes) noexcept = 0;
  virtual void* do_reserve_address_range(std::size_t bytes);
  virtual void do_release_address_range(void* p, std::size_t bytes) noexcept;
  virtual void do_map(void* p, std::size_t bytes);
  virtual void do_unmap(void* p, std::size_t bytes) noexcept;
  virtual std::size_t do_used_bytes() const noexcept = 0;

  virtual stream_ref do_create_stream() = 0;
  virtual void do_destroy_stream(stream_ref s) noexcept = 0;
  virtual void do_synchronize_stream(stream_ref s) = 0;
  virtual void do_synchronize_device() = 0;
  virtual event_ref do_create_event() = 0;
  virtual void do_destroy_event(event_ref e) noexcept = 0;
  virtual void do_record(event_ref e, stream_ref s) = 0;
  virtual bool do_query(event_ref e) = 0;
  virtual void do_wait(stream_ref s, event_ref e) = 0;
  virtual void do_synchronize_event(event_ref e) = 0;
  virtual void do_copy_async(void* dst, const void* src, std::size_t bytes, copy_kind kind,
                             stream_ref s) = 0;

  std::atomic<int> injected_oom_{0};
  std::atomic<int> injected_error_{0};

  std::mutex pinned_mutex_;  // guards pinned_regions_
  std::map<std::uintptr_t, std::size_t> pinned_regions_;  // live reserve_pinned_host regions
};

/// @brief True when this build has CUDA support and a CUDA device is present and usable.
bool cuda_device_available() noexcept;

/// @brief Creates a backend by name: "sim", "null", "cuda", "cuda-vmm", or "auto" (cuda when a
/// GPU is present, else sim).
/// @throws terrace::logic_error for an unknown name, or for sim / null a map_granularity that is
/// not a power of two of at least a page (sim) or 512 B (null), or (sim) a copy_bandwidth that is
/// negative or not finite; device_error when a CUDA backend is asked for and no GPU (or no CUDA
/// support in this build) is present.
std::unique_ptr<device_backend> make_device(std::string_view name, const device_options& options = {});

}  // namespace terrace
