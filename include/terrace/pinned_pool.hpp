// SPDX-License-Identifier: Apache-2.0
/// @file pinned_pool.hpp
/// @brief The pinned host tier: exact-size page-locked host buffers carved out of a few large
/// pinned regions.
///
/// Pinning is expensive (cudaHostAlloc, or populating and mlock'ing pages), so regions are reserved
/// once, large, through device_backend::reserve_pinned_host, and sub-allocated best-fit by an
/// extent allocator. A buffer takes its size rounded up to `alignment` (4 KiB by default, what
/// O_DIRECT needs for NVMe staging), never to a power of two as PyTorch's CachingHostAllocator
/// does (up to 2x waste there).
///
/// Why not mimalloc's arenas (mi_manage_os_memory_ex + mi_heap_new_in_arena), which the design
/// first considered: mimalloc 2.0.9 (Debian 12) places every allocation above its 32 MiB segment
/// size at a 32 MiB-aligned segment of its own; measured, three 33 MiB buffers landed 64 MiB apart,
/// 1.94x the bytes, and an arena must itself be 32 MiB-aligned. Tensors of tens to hundreds of MiB
/// are exactly this tier's load, so it keeps its own extent allocator (shared with the NVMe store).
///
/// Thread-safe: one mutex; allocate and deallocate are O(log holes). A new region is reserved with
/// the mutex released, so requests that fit the regions held do not wait for its pages to be
/// populated. Regions are not inherited by a child forked without exec; there, allocate throws
/// device_error, deallocate and empty_cache do nothing, and the destructor forgets the regions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "terrace/device.hpp"
#include "terrace/stats.hpp"

namespace terrace {

/// @brief Options of a pinned_host_pool. Zero means the default.
struct pinned_pool_options {
  /// Regions are reserved in multiples of this (default 256 MiB); a larger request gets a region
  /// of its own size rounded up to 2 MiB, whose rest serves later requests.
  std::size_t region_size = 0;
  /// Every buffer starts on, and its size rounds up to, this power of two (64 B .. 2 MiB;
  /// default 4 KiB).
  std::size_t alignment = 0;
  /// The most pinned bytes the pool may hold (default: no limit of its own; the host decides).
  /// Any number of bytes: the region that reaches it is whole pages rather than whole 2 MiB.
  std::size_t capacity = 0;
};

/// @brief Pool counters in the style of the device allocator's memory_stats: each stat is
/// {current, peak, allocated, freed}.
struct pinned_pool_stats {
  stat allocation;       ///< live buffers
  stat allocated_bytes;  ///< bytes of live buffers, as rounded to the alignment
  stat requested_bytes;  ///< bytes the callers asked for
  stat segment;          ///< pinned regions held
  stat reserved_bytes;   ///< bytes of pinned regions held
  std::int64_t num_alloc_retries = 0;  ///< allocations that released free regions and retried
  std::int64_t num_ooms = 0;           ///< allocations that failed
  std::uint64_t largest_free_block = 0;

  /// @brief Flat JSON object: "allocated_bytes.current", ..., "num_ooms", "largest_free_block".
  std::string to_json() const;
};

/// @brief Exact-size pinned host buffers over a device backend's pinned regions.
class pinned_host_pool {
 public:
  /// @throws terrace::logic_error for an alignment that is not a power of two in [64 B, 2 MiB].
  explicit pinned_host_pool(device_backend& device, pinned_pool_options options = {});
  /// Returns every region to the device. REQUIRES: no copy still uses a buffer.
  ~pinned_host_pool();
  pinned_host_pool(const pinned_host_pool&) = delete;
  pinned_host_pool& operator=(const pinned_host_pool&) = delete;

  /// @brief A pinned buffer of at least `bytes`, aligned to options().alignment; nullptr for 0.
  /// @throws terrace::out_of_memory, after releasing free regions and retrying once, with a message
  ///         that states what was asked, what is held and free, and why the host refused (at
  ///         once for a request no region could hold); terrace::device_error when the device
  ///         fails otherwise, or in a child forked without exec.
  void* allocate(std::size_t bytes);
  /// @brief Returns a buffer. nullptr is ignored.
  /// @throws terrace::logic_error for a pointer this pool did not hand out or already took back.
  void deallocate(void* p);
  /// @brief The usable size of a live buffer. @throws terrace::logic_error for anything else.
  std::size_t allocation_size(const void* p) const;
  /// @brief True when `p` lies inside one of the pool's regions (live buffer or not).
  bool owns(const void* p) const;

  /// @brief Returns every region that holds no live buffer to the device.
  void empty_cache();
  pinned_pool_stats stats() const;
  void reset_peak_stats();
  const pinned_pool_options& options() const noexcept;

  /// @brief Checks the books (regions tile, holes agree with live buffers, stats recount);
  /// @throws terrace::logic_error naming the first broken invariant. For tests.
  void check_invariants() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace terrace
