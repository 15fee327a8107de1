// SPDX-License-Identifier: Apache-2.0
/// @file stats.hpp
/// @brief Allocator statistics with PyTorch's memory_stats() names and semantics.
///
/// Each counter family is a `{current, peak, allocated, freed}` stat for three pools: all, the small
/// pool and the large pool. The names flatten exactly as torch.cuda.memory_stats() does, e.g.
/// `allocated_bytes.large_pool.peak`, so that users read them the same way.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace terrace {

/// @brief One counter. `allocated` and `freed` grow until reset_accumulated() zeroes them, as
/// PyTorch's resetAccumulatedStats does; `current - allocated + freed` is then what was current
/// at that reset.
struct stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t freed = 0;

  void increase(std::int64_t n) noexcept {
    current += n;
    allocated += n;
    if (current > peak) peak = current;
  }
  void decrease(std::int64_t n) noexcept {
    current -= n;
    freed += n;
  }
  void reset_peak() noexcept { peak = current; }
  void reset_accumulated() noexcept {
    allocated = 0;
    freed = 0;
  }
};

enum class stat_pool : int { all = 0, small_pool = 1, large_pool = 2 };
inline constexpr const char* stat_pool_names[] = {"all", "small_pool", "large_pool"};

/// @brief The per-pool stat families, in PyTorch's order: X(field, "name").
#define TERRACE_POOL_STATS(X)                      \
  X(allocation, "allocation")                      \
  X(allocated_bytes, "allocated_bytes")            \
  X(segment, "segment")                            \
  X(reserved_bytes, "reserved_bytes")              \
  X(active, "active")                              \
  X(active_bytes, "active_bytes")                  \
  X(inactive_split, "inactive_split")              \
  X(inactive_split_bytes, "inactive_split_bytes")  \
  X(requested_bytes, "requested_bytes")

/// @brief The plain event counters: X(field, "name").
#define TERRACE_EVENT_COUNTERS(X)            \
  X(num_alloc_retries, "num_alloc_retries")  \
  X(num_ooms, "num_ooms")                    \
  X(num_device_alloc, "num_device_alloc")    \
  X(num_device_free, "num_device_free")      \
  X(num_sync_all_streams, "num_sync_all_streams")

/// @brief The stat families PyTorch keeps without pools, in its order: X(field, "name"). Both
/// count against max_split_size, so they stay 0 while it is unlimited (the default):
/// oversize_allocations the live blocks of at least max_split_size, oversize_segments the plain
/// segments of at least that size (expandable segments ignore max_split_size). Under
/// policy:planned they count the caching fallback's blocks and segments (the arena is neither).
#define TERRACE_SINGLE_STATS(X)                    \
  X(oversize_allocations, "oversize_allocations")  \
  X(oversize_segments, "oversize_segments")

using stat_array = std::array<stat, 3>;

struct allocator_stats {
#define TERRACE_DECLARE_POOL_STAT(field, name) stat_array field{};
  TERRACE_POOL_STATS(TERRACE_DECLARE_POOL_STAT)
#undef TERRACE_DECLARE_POOL_STAT
#define TERRACE_DECLARE_SINGLE_STAT(field, name) stat field{};
  TERRACE_SINGLE_STATS(TERRACE_DECLARE_SINGLE_STAT)
#undef TERRACE_DECLARE_SINGLE_STAT
#define TERRACE_DECLARE_COUNTER(field, name) std::int64_t field = 0;
  TERRACE_EVENT_COUNTERS(TERRACE_DECLARE_COUNTER)
#undef TERRACE_DECLARE_COUNTER

  // What PyTorch lacks. Computed when the stats are read, not maintained on the hot path.
  std::int64_t largest_free_block = 0;   ///< the largest block a request could get without new memory
  std::int64_t cached_free_bytes = 0;    ///< reserved but not active
  /// 1 - largest_free_block / cached_free_bytes: how scattered the unused reserved memory is
  /// (0 when nothing is cached).
  double external_fragmentation = 0.0;
  /// 1 - active_bytes.all.current / reserved_bytes.all.current: reserved but unused now.
  double fragmentation = 0.0;
  /// 1 - active_bytes.all.peak / reserved_bytes.all.peak: the figure GMLake reports.
  double peak_fragmentation = 0.0;
};

/// @brief The stats as one flat JSON object keyed like torch.cuda.memory_stats().
std::string to_json(const allocator_stats& s);

/// @brief A human-readable table whose per-pool rows add up to the `all` row.
std::string to_text(const allocator_stats& s);

/// @brief A byte count for people: "512 B", "1.50 MiB", "2.00 GiB" (binary units). Every
/// message and report of terrace that states a size uses it.
std::string human_bytes(std::int64_t n);
/// @brief The same for unsigned sizes (size_t, capacities), up to 16 EiB.
std::string human_bytes(std::uint64_t n);

}  // namespace terrace
