// SPDX-License-Identifier: Apache-2.0
/// @file planner.hpp
/// @brief Lifetime-aware placement: offsets for a recorded iteration's allocations in one arena.
///
/// Placing blocks whose lifetimes (intervals of logical time) and sizes are known in advance so that
/// the arena is as small as possible is the dynamic storage allocation problem (NP-hard). The lower
/// bound is the largest sum of sizes live at one instant; plan_placement() runs two greedy
/// heuristics and keeps the better:
///   - greedy by size: largest block first, each into the best-fitting gap among the already placed
///     blocks whose lifetimes overlap its own (else on top of them);
///   - greedy by start: blocks in allocation order, same best-fit rule (what an ideal online
///     best-fit allocator with perfect merging would do).
/// Greedy by start is O(n log n) for n blocks (the gaps kept in a best-fit index); greedy by size
/// is O(n^2) and runs only up to 4096 blocks.
///
/// planner_stats is what the planned policy (and its counterfactual mode) reports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace terrace {

/// @brief One block to place: `size` bytes live during the logical times [begin, end).
struct plan_interval {
  std::size_t size = 0;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;  ///< > begin
};

struct placement_plan {
  std::vector<std::size_t> offsets;  ///< offsets[i] for interval i, multiples of the alignment
  std::size_t arena_bytes = 0;       ///< max(offset + aligned size)
  std::size_t lower_bound = 0;       ///< max live aligned bytes at any instant
  std::string heuristic;             ///< "greedy-by-size" or "greedy-by-start"
  /// With holes (the overload below): hole h spans [hole_base[h], hole_base[h] + holes[h]) and the
  /// open region starts at open_base, so the memory to obtain is arena_bytes - open_base.
  std::vector<std::size_t> hole_base;
  std::size_t open_base = 0;
};

/// @brief Plans offsets for `items` in one arena. Sizes round up to `alignment` (a power of two).
/// @throws terrace::logic_error for an interval with end <= begin or ending past 2^62, sizes
/// that sum past 2^62 bytes (where offsets could overflow), or a bad alignment.
placement_plan plan_placement(const std::vector<plan_interval>& items, std::size_t alignment = 512);

/// @brief Plans `items` into memory that is already there first: `holes` (sizes, multiples of
/// `alignment`) are free ranges at all times, separated from each other and from an open region
/// above them; an item goes into a hole only if it fits there whole. Same heuristics and best-fit
/// rule, so an item lands in the open region only when no hole (or gap between placed blocks) holds
/// it. With no holes this is plan_placement(items, alignment).
/// @throws terrace::logic_error as plan_placement, or for a hole size not a multiple of alignment.
placement_plan plan_placement(const std::vector<plan_interval>& items,
                              const std::vector<std::size_t>& holes, std::size_t alignment = 512);

/// @brief The lower bound: the largest sum of (aligned) sizes live at one logical time.
/// @throws terrace::logic_error as plan_placement.
std::size_t max_live_bytes(const std::vector<plan_interval>& items, std::size_t alignment = 512);

/// @brief Checks that no two intervals overlapping in time overlap in the arena and that every block
/// lies inside arena_bytes. @throws terrace::logic_error naming the first offending pair.
void check_placement(const std::vector<plan_interval>& items, const placement_plan& plan,
                     std::size_t alignment = 512);

/// @brief What the planned policy (or its counterfactual mode) did. Counters only grow.
struct planner_stats {
  bool enabled = false;          ///< policy `planned` or plan_counterfactual
  bool counterfactual = false;   ///< plans are made and matched but never handed out
  bool active = false;           ///< a plan exists now
  std::int64_t plans = 0;        ///< plans made (the first + re-plans)
  std::int64_t replans = 0;      ///< plans made because the old one kept deviating
  std::int64_t iterations = 0;   ///< iterations run under a plan
  std::int64_t deviating_iterations = 0;  ///< of those, iterations with at least one deviation
  std::int64_t lost_iterations = 0;  ///< of those, iterations that left the plan for the fallback
  /// Times the plan was set aside (three iterations in a row, or four of the last eight, left
  /// it): it then sits out 8, 16, 32, ... iterations, during which the caching allocator serves
  /// everything, before it is tried again. A plan made meanwhile for iterations of another shape
  /// (a new phase) ends the wait.
  std::int64_t suspensions = 0;
  /// Times marked iterations of several shapes were found to alternate (a re-plan for other
  /// requests while the shape changed at least 4 times in the last 16 iterations). The plans of
  /// the shapes are then kept together, a library laid out in one arena, and each iteration's
  /// first request picks its shape's plan. A shape more than the library holds (8 plans) sets the
  /// planner aside until 16 iterations in a row are of one shape (1024 at most).
  std::int64_t shape_alternations = 0;
  std::int64_t library_plans = 0;  ///< plans in the library now (1: a single plan; 0: none)
  std::int64_t plan_switches = 0;  ///< iterations whose first requests picked another plan of it
  /// Requests served by the fallback while several plans of the library started with the
  /// iteration's requests so far, so that none was picked yet (their slots count as served
  /// elsewhere in the plan picked in the end).
  std::int64_t undecided_requests = 0;
  /// Plans that left the library because no marked iteration picked them in the last 256
  /// planned ones (the layout is made again without them: the arena may shrink).
  std::int64_t dropped_plans = 0;
  /// Times marked iterations kept to the plan but freed some of its blocks later than it allowed,
  /// and the plan was laid out again with those frees at their latest (the allocations are the
  /// same; only the order of frees among them varied, with timing).
  std::int64_t widenings = 0;
  /// Times a plan so widened (or widened for all the orders seen when it was made) had no room on
  /// the device, and was laid out again as it last fitted, at first the order it was recorded in
  /// alone; it widens after that only to less than the layout refused.
  std::int64_t narrowings = 0;
  std::int64_t allocs_under_plan = 0;     ///< allocations while a plan was active
  std::int64_t planned_hits = 0;          ///< of those, served (or, counterfactually, servable) by the plan
  std::int64_t unplanned_allocs = 0;      ///< outside the plan by design: cross-iteration / long-lived
  std::int64_t deviations = 0;            ///< allocations that left the plan (size, order, late free)
  std::int64_t period_allocs = 0;         ///< allocations per planned iteration
  std::int64_t planned_slots = 0;         ///< of those, placed in the arena
  std::int64_t arena_bytes = 0;           ///< the plan's arena
  std::int64_t lower_bound_bytes = 0;     ///< max live bytes of the planned slots
  std::int64_t unplanned_live_peak = 0;   ///< peak live bytes outside the arena since the plan
  std::int64_t arena_reserved_bytes = 0;  ///< new memory the installed plan reserved (live policy)
  std::int64_t hole_bytes = 0;            ///< fallback holes the installed plan reuses instead
  /// Device-side waits the plan inserted: an arena block handed out over the space of one that a
  /// record_stream'd stream may still have been using at its free.
  std::int64_t stream_waits = 0;
  /// Installations the device refused for lack of memory, or whose lazily mapped arena it could
  /// not map a page of (counted as lost iterations too).
  std::int64_t arena_refusals = 0;
  /// Installations whose arena the device could not reserve whole, made instead as an address
  /// range whose pages are mapped as slots first reach them (backends with virtual memory).
  std::int64_t lazy_arenas = 0;
  /// Requests for slots of such an arena whose pages the device could not map even after the
  /// caching allocator's cache went back: each left the plan for the caching allocator (its
  /// iteration is lost, as is one whose arena is refused).
  std::int64_t map_refusals = 0;
  /// Times the caching allocator ran out of memory and a lazily mapped arena gave back the pages
  /// that held no live block.
  std::int64_t pressure_unmaps = 0;
  /// Requests the caching allocator could not serve for lack of memory while the plan held an
  /// idle arena: the plan gave its memory back for this iteration and the request was retried.
  std::int64_t pressure_releases = 0;
  /// Requests it could not serve while blocks were live in the arena: served from the arena's
  /// free space instead (the slots there wait until the block is freed).
  std::int64_t pressure_loans = 0;
  /// Requests outside the plan (in sync) served from free arena space that no slot needs soon,
  /// instead of the caching allocator.
  std::int64_t miss_loans = 0;
  double plan_seconds = 0.0;              ///< time spent planning, all plans
  std::string heuristic;                  ///< the last plan's winning heuristic

  /// planned_hits / allocs_under_plan (0 when no plan ran).
  double hit_rate() const noexcept {
    return allocs_under_plan > 0 ? static_cast<double>(planned_hits) /
                                       static_cast<double>(allocs_under_plan)
                                 : 0.0;
  }
};

/// @brief The planner stats as one flat JSON object ("plan.hits", ...).
std::string to_json(const planner_stats& s);

}  // namespace terrace
