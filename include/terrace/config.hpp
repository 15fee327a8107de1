// SPDX-License-Identifier: Apache-2.0
/// @file config.hpp
/// @brief The allocator's options: one struct, filled from code or from TERRACE_ALLOC_CONF.
///
/// TERRACE_ALLOC_CONF mirrors PYTORCH_CUDA_ALLOC_CONF: `key:value,key:value`, each key once. Sizes
/// accept the suffixes B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB (all binary, any case). Booleans
/// accept true/false/1/0 (any case).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace terrace {

enum class alloc_policy { caching, expandable, planned };

/// @brief "caching", "expandable" or "planned".
std::string_view to_string(alloc_policy p) noexcept;

struct allocator_config {
  // --- device backend (used by the C ABI and the tools; a C++ user passes a backend directly)
  /// key `device`: auto | sim | null | cuda | cuda-vmm. The C ABI takes auto as cuda on a GPU
  /// (cuda-vmm when expandable_segments is on, as PyTorch's expandable_segments:True needs no
  /// more), else sim.
  std::string device = "auto";
  std::size_t device_capacity = 0;        ///< key `device_capacity`: sim/null capacity (0 = default)
  double copy_bandwidth = 0.0;            ///< key `copy_bandwidth`: sim copy bytes/s (0 = unlimited)

  // --- pools and segments (PyTorch's defaults)
  std::size_t small_size = 1u << 20;           ///< key `small_size`: requests <= this use the small pool
  std::size_t small_segment_size = 2u << 20;   ///< key `small_segment_size`
  std::size_t large_segment_size = 20u << 20;  ///< key `large_segment_size`: for requests < min_large_alloc
  std::size_t min_large_alloc = 10u << 20;     ///< key `min_large_alloc`: at or above, segments are exact
  std::size_t large_round = 2u << 20;          ///< key `large_round`: exact segments round up to this
  /// key `max_split_size_mb` (MiB): free blocks of plain segments this large or larger never split
  /// and serve only requests of at least this size less than large_segment_size smaller than them.
  /// Expandable segments ignore it (PyTorch's split rule for them): their blocks always split, and
  /// any free page of theirs can be unmapped. TERRACE_ALLOC_CONF requires it larger than
  /// large_segment_size, as PyTorch requires > 20 MiB (a freed whole segment would otherwise be a
  /// block no small request may take, and each would reserve a new segment).
  std::size_t max_split_size = SIZE_MAX;
  unsigned roundup_power2_divisions = 0;       ///< key `roundup_power2_divisions`: 0 = off, else 1, 2, 4 .. 64
  double garbage_collection_threshold = 0.0;   ///< key `garbage_collection_threshold`: 0 = off, (0,1)
  bool expandable_segments = false;            ///< key `expandable_segments`: needs a VMM backend
  double memory_fraction = 1.0;                ///< key `memory_fraction`: (0,1] of the device capacity

  // --- placement policy (planner.hpp)
  /// key `policy`: caching | expandable (sets expandable_segments) | planned (lifetime-aware: the
  /// steady-state iteration is planned into one arena; everything else is cached as usual).
  alloc_policy policy = alloc_policy::caching;
  /// key `plan_counterfactual`: under caching/expandable, run the planner beside the live policy and
  /// only report what it would have saved (caching_allocator::plan_stats()).
  bool plan_counterfactual = false;
  /// key `plan_min_period`: the shortest iteration, in allocations plus frees, that the steady-state
  /// detector accepts (shorter repeats are loops inside an iteration); at least 16.
  std::size_t plan_min_period = 64;

  // --- observability
  bool record_trace = false;                   ///< key `record_trace`
  std::size_t trace_max_events = 1u << 22;     ///< key `trace_max_events`: ring size; oldest dropped
};

/// @brief The keys parse_alloc_conf accepts, in declaration order.
const std::vector<std::string_view>& alloc_conf_keys();

/// @brief A key that a caller sets by other means (a tool's own flag): parse_alloc_conf refuses it
/// in the text, giving `reason`, where it would otherwise be ignored or overwritten.
struct alloc_conf_reserved_key {
  std::string_view key;
  std::string_view reason;  ///< what to do instead, e.g. "use --device"
};

/// @brief Applies `key:value,...` pairs over `base`; `base` is left as it was when one is refused.
/// A comma inside square brackets does not end an item; an empty item is skipped.
/// @throws terrace::logic_error naming the offending pair: listing the valid keys for an unknown
/// key or a missing colon; for a key given twice, a key in `reserved`, a malformed number or size,
/// a value out of range, or keys that contradict each other (policy:caching with
/// expandable_segments:true, device:cuda with expandable segments, small_segment_size below
/// small_size, max_split_size_mb not above large_segment_size).
allocator_config parse_alloc_conf(std::string_view text, allocator_config base = {},
                                  const std::vector<alloc_conf_reserved_key>& reserved = {});

/// @brief parse_alloc_conf(getenv("TERRACE_ALLOC_CONF")), or defaults when it is unset.
/// @throws terrace::logic_error as parse_alloc_conf.
allocator_config alloc_conf_from_env();

/// @brief Parses a size with an optional binary suffix ("512", "2MiB", "1.5G").
/// @throws terrace::logic_error when malformed.
std::size_t parse_size(std::string_view text);

}  // namespace terrace
