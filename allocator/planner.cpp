// SPDX-License-Identifier: Apache-2.0
// Offline placement of a recorded iteration (dynamic storage allocation): two greedy heuristics with
// best-fit gap search, the max-live lower bound, and an overlap checker that does not trust either.
#include "terrace/planner.hpp"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <queue>
#include <set>
#include <string>
#include <utility>

#include "terrace/error.hpp"

namespace terrace {

namespace {

std::size_t align_up(std::size_t n, std::size_t a) noexcept { return (n + a - 1) & ~(a - 1); }

// Bytes and times past which the arithmetic could overflow: every offset the heuristics choose is
// at most the sum of the sizes placed before it (plus the holes), the lower bound sums sizes in
// int64, and the checker doubles times. 2^62 bytes is far past any device.
constexpr std::uint64_t kMaxPlanned = std::uint64_t{1} << 62;

void check_inputs(const std::vector<plan_interval>& items, std::size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > kMaxPlanned) {
    throw logic_error("terrace: plan alignment " + std::to_string(alignment) +
                      " is not a power of two up to 2^62");
  }
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (items[i].end <= items[i].begin) {
      throw logic_error("terrace: plan interval " + std::to_string(i) + " ends (" +
                        std::to_string(items[i].end) + ") before it begins (" +
                        std::to_string(items[i].begin) + ")");
    }
    if (items[i].end > kMaxPlanned) {
      throw logic_error("terrace: plan interval " + std::to_string(i) + " ends at time " +
                        std::to_string(items[i].end) + ", past 2^62");
    }
    // Checked before aligning: align_up of a size near SIZE_MAX wraps to 0.
    if (items[i].size > kMaxPlanned || (total += align_up(items[i].size, alignment)) > kMaxPlanned) {
      throw logic_error("terrace: plan intervals up to " + std::to_string(i) + " hold " +
                        "more than 2^62 bytes (interval " + std::to_string(i) + ": " +
                        std::to_string(items[i].size) + " bytes)");
    }
  }
}

// The placed blocks as parallel arrays, kept in offset order: the overlap scan is the hot loop, and
// it then yields the busy ranges already sorted (sorting them per item was most of the planning
// time on large iterations).
struct placed_set {
  std::vector<std::uint64_t> begin, end;
  std::vector<std::size_t> lo, hi;
  void add(std::uint64_t b, std::uint64_t e, std::size_t l, std::size_t h) {
    const auto at = std::upper_bound(lo.begin(), lo.end(), l) - lo.begin();
    begin.insert(begin.begin() + at, b);
    end.insert(end.begin() + at, e);
    lo.insert(lo.begin() + at, l);
    hi.insert(hi.begin() + at, h);
  }
  void truncate(std::size_t n) {
    begin.resize(n), end.resize(n), lo.resize(n), hi.resize(n);
  }
};

// Places the items in `order`, each at the best-fitting gap among placed blocks live at the same
// time (smallest gap that holds it; lowest offset on ties), or above all of them. With
// `prune_ended`, the order must be by begin time: a placed block that ended before the current
// item began can never overlap a later one and is dropped from the scan.
// `fixed` holds ranges busy at all times (the separators around holes); they are never pruned.
placement_plan place(const std::vector<plan_interval>& items, const std::vector<std::size_t>& order,
                     std::size_t alignment, bool prune_ended,
                     const std::vector<std::pair<std::size_t, std::size_t>>& fixed) {
  placement_plan plan;
  plan.offsets.assign(items.size(), 0);
  placed_set placed;
  for (const auto& [lo, hi] : fixed) placed.add(0, std::numeric_limits<std::uint64_t>::max(), lo, hi);
  std::vector<std::pair<std::size_t, std::size_t>> busy;  // [lo, hi) of overlapping blocks
  for (std::size_t idx : order) {
    const plan_interval& it = items[idx];
    const std::size_t size = align_up(it.size, alignment);
    busy.clear();
    // One pass: drop the ended blocks (compacting in order) and collect the overlapping ones.
    std::size_t w = 0;
    for (std::size_t k = 0; k < placed.begin.size(); ++k) {
      if (prune_ended && placed.end[k] <= it.begin) continue;
      if (placed.begin[k] < it.end && it.begin < placed.end[k]) {
        busy.emplace_back(placed.lo[k], placed.hi[k]);
      }
      if (w != k) {
        placed.begin[w] = placed.begin[k], placed.end[w] = placed.end[k];
        placed.lo[w] = placed.lo[k], placed.hi[w] = placed.hi[k];
      }
      ++w;
    }
    placed.truncate(w);
    std::size_t cursor = 0;
    std::size_t best = std::numeric_limits<std::size_t>::max();
    std::size_t best_gap = std::numeric_limits<std::size_t>::max();
    for (const auto& [lo, hi] : busy) {
      if (lo > cursor) {
        const std::size_t gap = lo - cursor;
        if (gap >= size && gap < best_gap) {
          best_gap = gap;
          best = cursor;
        }
      }
      cursor = std::max(cursor, hi);
    }
    const std::size_t offset = best != std::numeric_limits<std::size_t>::max() ? best : cursor;
    plan.offsets[idx] = offset;
    plan.arena_bytes = std::max(plan.arena_bytes, offset + size);
    placed.add(it.begin, it.end, offset, offset + size);
  }
  return plan;
}

// Greedy by start (items in begin order), in O(n log n): every placed block that has not ended
// overlaps the current item in time (it began no later and ends after the item begins), so the
// busy ranges are all the live ones, and the free ranges between them are kept in a best-fit
// index instead of being found by a scan per item. Places as place(..., prune_ended = true) does:
// the smallest gap that holds the item, the lowest on ties, else above every live block. A
// zero-size item takes no space (it is placed, and never in the way).
placement_plan place_by_start(const std::vector<plan_interval>& items,
                              const std::vector<std::size_t>& order, std::size_t alignment,
                              const std::vector<std::pair<std::size_t, std::size_t>>& fixed) {
  placement_plan plan;
  plan.offsets.assign(items.size(), 0);
  std::map<std::size_t, std::size_t> live;  // lo -> hi: the live blocks and the fixed ranges
  std::map<std::size_t, std::size_t> gaps;  // lo -> hi: the free ranges below the top
  std::set<std::pair<std::size_t, std::size_t>> by_fit;  // (size, lo) of the gaps
  using ending = std::pair<std::uint64_t, std::size_t>;  // (end time, lo) of a live block
  std::priority_queue<ending, std::vector<ending>, std::greater<>> ends;
  auto top = [&] { return live.empty() ? std::size_t{0} : std::prev(live.end())->second; };
  auto add_gap = [&](std::size_t lo, std::size_t hi) {
    if (hi <= lo) return;
    gaps.emplace(lo, hi);
    by_fit.emplace(hi - lo, lo);
  };
  auto drop_gap = [&](std::map<std::size_t, std::size_t>::iterator g) {
    by_fit.erase({g->second - g->first, g->first});
    return gaps.erase(g);
  };
  for (const auto& [lo, hi] : fixed) {  // in address order
    add_gap(top(), lo);
    live.emplace(lo, hi);
  }
  auto free_block = [&](std::size_t lo) {
    const auto b = live.find(lo);
    const std::size_t hi = b->second;
    live.erase(b);
    std::size_t from = lo, to = hi;
    auto next = gaps.lower_bound(lo);
    if (next != gaps.end() && next->first == hi) {
      to = next->second;
      next = drop_gap(next);
    }
    if (next != gaps.begin()) {
      if (const auto prev = std::prev(next); prev->second == lo) {
        from = prev->first;
        drop_gap(prev);
      }
    }
    // The top block: what lies above the new top is no gap.
    if (live.lower_bound(hi) != live.end()) add_gap(from, to);
  };
  for (std::size_t idx : order) {
    const plan_interval& it = items[idx];
    const std::size_t size = align_up(it.size, alignment);
    while (!ends.empty() && ends.top().first <= it.begin) {
      free_block(ends.top().second);
      ends.pop();
    }
    std::size_t offset = top();
    if (const auto f = by_fit.lower_bound({size, std::size_t{0}}); f != by_fit.end()) {
      offset = f->second;
      const auto g = gaps.find(offset);
      const std::size_t hi = g->second;
      drop_gap(g);
      add_gap(offset + size, hi);
    }
    plan.offsets[idx] = offset;
    plan.arena_bytes = std::max(plan.arena_bytes, offset + size);
    if (size > 0) {
      live.emplace(offset, offset + size);
      ends.emplace(it.end, offset);
    }
  }
  return plan;
}

}  // namespace

std::size_t max_live_bytes(const std::vector<plan_interval>& items, std::size_t alignment) {
  check_inputs(items, alignment);
  // Sweep: at equal times frees come first, since [begin, end) is half-open.
  std::vector<std::pair<std::uint64_t, std::int64_t>> edges;
  edges.reserve(items.size() * 2);
  for (const auto& it : items) {
    const auto size = static_cast<std::int64_t>(align_up(it.size, alignment));
    edges.emplace_back(it.begin, size);
    edges.emplace_back(it.end, -size);
  }
  std::sort(edges.begin(), edges.end());
  std::int64_t live = 0, peak = 0;
  for (const auto& [t, d] : edges) {
    live += d;
    peak = std::max(peak, live);
  }
  return static_cast<std::size_t>(peak);
}

placement_plan plan_placement(const std::vector<plan_interval>& items, std::size_t alignment) {
  return plan_placement(items, std::vector<std::size_t>{}, alignment);
}

placement_plan plan_placement(const std::vector<plan_interval>& items,
                              const std::vector<std::size_t>& holes, std::size_t alignment) {
  check_inputs(items, alignment);
  // Holes side by side, each followed by a one-alignment separator busy at all times, so that no
  // block straddles two holes or a hole and the open region.
  std::vector<std::pair<std::size_t, std::size_t>> fixed;
  std::vector<std::size_t> hole_base;
  std::size_t base = 0;
  for (std::size_t h : holes) {
    if (h == 0 || h % alignment != 0) {
      throw logic_error("terrace: plan hole of " + std::to_string(h) +
                        " bytes is not a positive multiple of the alignment");
    }
    if (h > kMaxPlanned || base + h + alignment > kMaxPlanned) {
      throw logic_error("terrace: plan holes hold more than 2^62 bytes");
    }
    hole_base.push_back(base);
    fixed.emplace_back(base + h, base + h + alignment);
    base += h + alignment;
  }
  std::vector<std::size_t> by_size(items.size());
  std::iota(by_size.begin(), by_size.end(), std::size_t{0});
  // Largest first; among equals the longest-lived, then the earliest, for a deterministic plan.
  std::stable_sort(by_size.begin(), by_size.end(), [&](std::size_t a, std::size_t b) {
    const auto& x = items[a];
    const auto& y = items[b];
    if (x.size != y.size) return x.size > y.size;
    const auto lx = x.end - x.begin, ly = y.end - y.begin;
    if (lx != ly) return lx > ly;
    return x.begin < y.begin;
  });
  std::vector<std::size_t> by_start(items.size());
  std::iota(by_start.begin(), by_start.end(), std::size_t{0});
  std::stable_sort(by_start.begin(), by_start.end(),
                   [&](std::size_t a, std::size_t b) { return items[a].begin < items[b].begin; });

  placement_plan b = place_by_start(items, by_start, alignment, fixed);
  b.heuristic = "greedy-by-start";
  // Greedy by size scans every placed block per item (O(n^2)): 0.05 s at 4096 blocks, about 1 s
  // at 16,000 (2026-11-26). Above this size only greedy-by-start runs; on random sets of widely
  // varying sizes that costs a few points of arena (tests/planner_test.cpp,
  // LargeRandomSetsStayNearTheLowerBound: mean 1.03x the lower bound at 4096, 1.10x at 4097).
  constexpr std::size_t kMaxGreedyBySize = 4096;
  placement_plan a;
  if (items.size() <= kMaxGreedyBySize) {
    a = place(items, by_size, alignment, false, fixed);
    a.heuristic = "greedy-by-size";
  }
  placement_plan& best = a.heuristic.empty() || b.arena_bytes < a.arena_bytes ? b : a;
  best.lower_bound = max_live_bytes(items, alignment);
  best.open_base = base;
  best.arena_bytes = std::max(best.arena_bytes, base);
  best.hole_base = std::move(hole_base);
  return std::move(best);
}

void check_placement(const std::vector<plan_interval>& items, const placement_plan& plan,
                     std::size_t alignment) {
  check_inputs(items, alignment);
  if (plan.offsets.size() != items.size()) {
    throw logic_error("terrace: plan has " + std::to_string(plan.offsets.size()) +
                      " offsets for " + std::to_string(items.size()) + " intervals");
  }
  // Sweep over time keeping the live set ordered by offset: a new block must not overlap its
  // neighbours there. Frees before allocations at equal times (half-open intervals).
  std::vector<std::pair<std::uint64_t, std::size_t>> edges;  // (time*2 + is_alloc, index)
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::size_t size = align_up(items[i].size, alignment);
    // (Not offset + size > arena_bytes: that wraps for an offset near 2^64.)
    if (plan.offsets[i] % alignment != 0 || plan.offsets[i] > plan.arena_bytes ||
        size > plan.arena_bytes - plan.offsets[i]) {
      throw logic_error("terrace: plan places interval " + std::to_string(i) +
                        " outside the arena or misaligned");
    }
    if (size == 0) continue;  // occupies no byte: overlaps nothing, wherever it lies
    edges.emplace_back(items[i].begin * 2 + 1, i);
    edges.emplace_back(items[i].end * 2, i);
  }
  std::sort(edges.begin(), edges.end());
  // A tree, not a sorted vector: with tens of thousands of blocks live at once, inserting into and
  // erasing from a vector made this O(n * live) (2 s for 100,000 blocks live together).
  std::set<std::pair<std::size_t, std::size_t>> live;  // (offset, index)
  for (const auto& [key, i] : edges) {
    const std::pair<std::size_t, std::size_t> entry{plan.offsets[i], i};
    if ((key & 1) == 0) {
      live.erase(entry);
      continue;
    }
    auto pos = live.lower_bound(entry);
    const std::size_t lo = plan.offsets[i];
    const std::size_t hi = lo + align_up(items[i].size, alignment);
    auto clash = [&](std::size_t j) {
      throw logic_error("terrace: plan overlaps intervals " + std::to_string(j) + " and " +
                        std::to_string(i) + " in time and space");
    };
    if (pos != live.end() && pos->first < hi) clash(pos->second);
    if (pos != live.begin()) {
      const auto& prev = *std::prev(pos);
      if (prev.first + align_up(items[prev.second].size, alignment) > lo) clash(prev.second);
    }
    live.insert(pos, entry);
  }
}

std::string to_json(const planner_stats& s) {
  char buf[4096];  // about 1,300 bytes with every counter at 19 digits: 2,100
  std::snprintf(
      buf, sizeof buf,
      "{\"plan.enabled\":%s,\"plan.counterfactual\":%s,\"plan.active\":%s,\"plan.plans\":%lld,"
      "\"plan.replans\":%lld,\"plan.iterations\":%lld,\"plan.deviating_iterations\":%lld,"
      "\"plan.lost_iterations\":%lld,\"plan.suspensions\":%lld,\"plan.shape_alternations\":%lld,\"plan.library_plans\":%lld,\"plan.plan_switches\":%lld,\"plan.undecided_requests\":%lld,\"plan.dropped_plans\":%lld,\"plan.widenings\":%lld,\"plan.narrowings\":%lld,"
      "\"plan.allocs_under_plan\":%lld,\"plan.hits\":%lld,\"plan.unplanned_allocs\":%lld,"
      "\"plan.deviations\":%lld,\"plan.period_allocs\":%lld,\"plan.planned_slots\":%lld,"
      "\"plan.arena_bytes\":%lld,\"plan.lower_bound_bytes\":%lld,"
      "\"plan.unplanned_live_peak\":%lld,\"plan.arena_reserved_bytes\":%lld,"
      "\"plan.hole_bytes\":%lld,\"plan.stream_waits\":%lld,\"plan.arena_refusals\":%lld,"
      "\"plan.lazy_arenas\":%lld,\"plan.map_refusals\":%lld,\"plan.pressure_unmaps\":%lld,\"plan.pressure_releases\":%lld,\"plan.pressure_loans\":%lld,\"plan.miss_loans\":%lld,\"plan.hit_rate\":%.6f,\"plan.plan_seconds\":%.6f,"
      "\"plan.heuristic\":\"%s\"}",
      s.enabled ? "true" : "false", s.counterfactual ? "true" : "false",
      s.active ? "true" : "false", static_cast<long long>(s.plans),
      static_cast<long long>(s.replans), static_cast<long long>(s.iterations),
      static_cast<long long>(s.deviating_iterations), static_cast<long long>(s.lost_iterations),
      static_cast<long long>(s.suspensions), static_cast<long long>(s.shape_alternations),
      static_cast<long long>(s.library_plans), static_cast<long long>(s.plan_switches),
      static_cast<long long>(s.undecided_requests), static_cast<long long>(s.dropped_plans),
      static_cast<long long>(s.widenings),
      static_cast<long long>(s.narrowings),
      static_cast<long long>(s.allocs_under_plan),
      static_cast<long long>(s.planned_hits), static_cast<long long>(s.unplanned_allocs),
      static_cast<long long>(s.deviations), static_cast<long long>(s.period_allocs),
      static_cast<long long>(s.planned_slots), static_cast<long long>(s.arena_bytes),
      static_cast<long long>(s.lower_bound_bytes), static_cast<long long>(s.unplanned_live_peak),
      static_cast<long long>(s.arena_reserved_bytes), static_cast<long long>(s.hole_bytes),
      static_cast<long long>(s.stream_waits), static_cast<long long>(s.arena_refusals),
      static_cast<long long>(s.lazy_arenas), static_cast<long long>(s.map_refusals),
      static_cast<long long>(s.pressure_unmaps),
      static_cast<long long>(s.pressure_releases), static_cast<long long>(s.pressure_loans),
      static_cast<long long>(s.miss_loans),
      s.hit_rate(), s.plan_seconds, s.heuristic.c_str());
  return buf;
}

}  // namespace terrace
