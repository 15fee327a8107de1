// SPDX-License-Identifier: Apache-2.0
// What the planned policy reports: its stats, its arena and blocks merged into the fallback's
// stats and snapshot (combined peaks kept exact), and the invariant checks of the plan and of the
// live arena blocks.
#include "allocator/plan_front.hpp"

#include <algorithm>
#include <functional>
#include <iterator>
#include <string>
#include <utility>

#include "allocator/plan_front_common.hpp"
#include "terrace/error.hpp"

namespace terrace::detail {

using namespace plan_tuning;

// The active plan's figures (and the library's: its lower bound is its largest plan's).
void plan_front::publish_plan_stats() noexcept {
  stats_.active = !slots_.empty();
  stats_.period_allocs = static_cast<std::int64_t>(slots_.size());
  stats_.planned_slots = static_cast<std::int64_t>(plan_items_.size());
  std::size_t bound = plan_.lower_bound;
  for (const plan_state& other : shelf_) bound = std::max(bound, other.plan.lower_bound);
  stats_.lower_bound_bytes = static_cast<std::int64_t>(bound);
  stats_.library_plans = slots_.empty() ? 0 : static_cast<std::int64_t>(1 + shelf_.size());
}

// Counterfactual: the arena the library's plans would share, its largest plan's (each plan's
// placement made without holes).
std::size_t plan_front::counterfactual_arena_bytes() const noexcept {
  std::size_t bytes = plan_.arena_bytes;
  for (const plan_state& other : shelf_) bytes = std::max(bytes, other.plan.arena_bytes);
  return bytes;
}

void plan_front::track_unplanned(std::int64_t delta) noexcept {
  unplanned_live_ += delta;
  if (stats_.plans > 0) stats_.unplanned_live_peak = std::max(stats_.unplanned_live_peak, unplanned_live_);
}

void plan_front::note_totals(const fallback_totals& t) noexcept {
  last_totals_ = t;
  const auto arena = live_mode_ ? static_cast<std::int64_t>(arena_resident_bytes()) : 0;
  // Claimed holes are the fallback's allocations but the arena's memory: count its blocks instead.
  const auto holes = static_cast<std::int64_t>(hole_bytes_);
  peak_reserved_ = std::max(peak_reserved_, t.reserved + arena);
  peak_allocated_ = std::max(peak_allocated_,
                             t.allocated - holes + static_cast<std::int64_t>(arena_live_bytes_));
  peak_requested_ = std::max(
      peak_requested_, t.requested - holes + static_cast<std::int64_t>(arena_live_requested_));
  peak_allocations_ = std::max(peak_allocations_,
                               t.allocations - static_cast<std::int64_t>(holes_.size()) +
                                   static_cast<std::int64_t>(arena_live_count_));
  // Per pool: the small pool loses its claimed holes; the large pool loses the others and holds
  // the arena's blocks.
  const auto sn = static_cast<std::int64_t>(small_holes_);
  const auto sb = static_cast<std::int64_t>(small_hole_bytes_);
  const acc_delta now[3] = {
      {},
      {t.small_allocations - sn, t.small_allocated - sb, t.small_requested - sb},
      {t.allocations - t.small_allocations - (static_cast<std::int64_t>(holes_.size()) - sn) +
           static_cast<std::int64_t>(arena_live_count_),
       t.allocated - t.small_allocated - (holes - sb) + static_cast<std::int64_t>(arena_live_bytes_),
       t.requested - t.small_requested - (holes - sb) +
           static_cast<std::int64_t>(arena_live_requested_)}};
  for (int i : {1, 2}) {
    pool_peak_[i].n = std::max(pool_peak_[i].n, now[i].n);
    pool_peak_[i].bytes = std::max(pool_peak_[i].bytes, now[i].bytes);
    pool_peak_[i].requested = std::max(pool_peak_[i].requested, now[i].requested);
  }
}

void plan_front::reset_peaks(const fallback_totals& t) noexcept {
  peak_reserved_ = peak_allocated_ = peak_requested_ = peak_allocations_ = 0;
  for (acc_delta& p : pool_peak_) p = {};
  holes_since_reset_ = !holes_.empty();
  note_totals(t);
}

void plan_front::merge_into(allocator_stats& s) const {
  if (live_mode_ && installed_) {
    // The claimed holes leave the fallback's allocations (they are counted there, as the front's)
    // and the arena's live blocks, wherever they lie, join them.
    // Pool 1 (small) only loses its claimed holes; the arena's blocks count as large (pool 2).
    const auto sn = static_cast<std::int64_t>(small_holes_);
    const auto sb = static_cast<std::int64_t>(small_hole_bytes_);
    const auto n = static_cast<std::int64_t>(arena_live_count_);
    const auto b = static_cast<std::int64_t>(arena_live_bytes_);
    const auto r = static_cast<std::int64_t>(arena_live_requested_);
    for (int i : {0, 1, 2}) {
      // Holes leaving pool i, and arena blocks joining it.
      const std::int64_t hn = i == 0 ? static_cast<std::int64_t>(holes_.size())
                                     : i == 1 ? sn : static_cast<std::int64_t>(holes_.size()) - sn;
      const std::int64_t hb = i == 0 ? static_cast<std::int64_t>(hole_bytes_)
                                     : i == 1 ? sb : static_cast<std::int64_t>(hole_bytes_) - sb;
      const bool joins = i != 1;
      if (arena_ != nullptr && joins) {
        s.segment[i].current += 1;
        s.reserved_bytes[i].current += static_cast<std::int64_t>(arena_resident_bytes());
      }
      s.allocation[i].current += (joins ? n : 0) - hn;
      s.active[i].current += (joins ? n : 0) - hn;
      s.allocated_bytes[i].current += (joins ? b : 0) - hb;
      s.active_bytes[i].current += (joins ? b : 0) - hb;
      s.requested_bytes[i].current += (joins ? r : 0) - hb;
    }
  }
  if (live_mode_) {
    s.num_device_alloc += arena_reservations_;
    // The front sees every change of the combined totals, so its peaks are exact; the fallback's
    // own allocated peaks would count claimed holes as live.
    s.reserved_bytes[0].peak = std::max(s.reserved_bytes[0].peak, peak_reserved_);
    s.allocated_bytes[0].peak = peak_allocated_;
    s.active_bytes[0].peak =
        holes_since_reset_ ? peak_allocated_ : std::max(s.active_bytes[0].peak, peak_allocated_);
    s.requested_bytes[0].peak = peak_requested_;
    // The counts likewise: the fallback's count the claimed holes and miss the arena's blocks.
    s.allocation[0].peak = peak_allocations_;
    s.active[0].peak =
        holes_since_reset_ ? peak_allocations_ : std::max(s.active[0].peak, peak_allocations_);
    for (int i : {1, 2}) {
      s.allocation[i].peak = pool_peak_[i].n;
      s.allocated_bytes[i].peak = pool_peak_[i].bytes;
      s.requested_bytes[i].peak = pool_peak_[i].requested;
      s.active[i].peak =
          holes_since_reset_ ? pool_peak_[i].n : std::max(s.active[i].peak, pool_peak_[i].n);
      s.active_bytes[i].peak = holes_since_reset_ ? pool_peak_[i].bytes
                                                  : std::max(s.active_bytes[i].peak, pool_peak_[i].bytes);
    }
    // Accumulated counts: the arena's blocks join the fallback's, the holes and adoptions leave.
    for (int i = 0; i < 3; ++i) {
      const acc_delta& a = acc_allocated_[i];
      const acc_delta& f = acc_freed_[i];
      for (stat* st : {&s.allocation[i], &s.active[i]}) st->allocated += a.n, st->freed += f.n;
      for (stat* st : {&s.allocated_bytes[i], &s.active_bytes[i]}) {
        st->allocated += a.bytes;
        st->freed += f.bytes;
      }
      s.requested_bytes[i].allocated += a.requested;
      s.requested_bytes[i].freed += f.requested;
    }
    for (int i : {0, 2}) {
      for (stat* st : {&s.segment[i], &s.reserved_bytes[i], &s.allocation[i], &s.active[i],
                       &s.allocated_bytes[i], &s.active_bytes[i], &s.requested_bytes[i]}) {
        st->peak = std::max(st->peak, st->current);
      }
    }
    const auto& rb = s.reserved_bytes[0];
    const auto& ab = s.active_bytes[0];
    s.cached_free_bytes = rb.current - ab.current;
    s.fragmentation = rb.current > 0 ? 1.0 - static_cast<double>(ab.current) /
                                                 static_cast<double>(rb.current)
                                     : 0.0;
    s.peak_fragmentation =
        rb.peak > 0 ? 1.0 - static_cast<double>(ab.peak) / static_cast<double>(rb.peak) : 0.0;
  }
}

void plan_front::add_to_snapshot(memory_snapshot& snap) const {
  if (!live_mode_ || !installed_) return;
  std::vector<std::pair<std::uintptr_t, const live_entry*>> blocks;
  for (const auto& [addr, e] : live_) {
    if (e.in_arena) blocks.emplace_back(addr, &e);
  }
  std::sort(blocks.begin(), blocks.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  // The arena's blocks in [lo, hi), with the free gaps between them, appended to `out`.
  auto fill = [&](snapshot_segment& seg, std::uintptr_t lo, std::uintptr_t hi,
                  std::vector<snapshot_block>& out) {
    auto it = std::lower_bound(blocks.begin(), blocks.end(), lo,
                               [](const auto& x, std::uintptr_t a) { return x.first < a; });
    std::uintptr_t cursor = lo;
    for (; it != blocks.end() && it->first < hi; ++it) {
      const live_entry* e = it->second;
      if (it->first > cursor) out.push_back({cursor, it->first - cursor, 0, "inactive", {}});
      out.push_back({it->first, e->size, e->requested, "active_allocated", "planned"});
      seg.allocated_size += e->size;
      seg.active_size += e->size;
      seg.requested_size += e->requested;
      cursor = it->first + e->size;
    }
    if (cursor < hi) out.push_back({cursor, hi - cursor, 0, "inactive", {}});
  };
  if (!holes_.empty()) {
    // The fallback shows a claimed hole as one allocated block: show what the arena has there.
    for (snapshot_segment& seg : snap.segments) {
      std::vector<snapshot_block> out;
      bool changed = false;
      for (snapshot_block& b : seg.blocks) {
        const auto h = std::lower_bound(
            holes_.begin(), holes_.end(), b.addr,
            [](const fallback_hole& x, std::uintptr_t a) { return x.addr < a; });
        if (h == holes_.end() || h->addr != b.addr || b.state != "active_allocated") {
          out.push_back(b);
          continue;
        }
        changed = true;
        seg.allocated_size -= b.size;
        seg.active_size -= b.size;
        seg.requested_size -= b.requested;
        fill(seg, b.addr, b.addr + b.size, out);
      }
      if (changed) seg.blocks = std::move(out);  // else `out` is unused and seg.blocks intact
    }
  }
  if (arena_ == nullptr) return;
  snapshot_segment seg;
  seg.addr = reinterpret_cast<std::uintptr_t>(arena_);
  seg.total_size = arena_bytes_;
  fill(seg, seg.addr, seg.addr + arena_bytes_, seg.blocks);
  snap.segments.push_back(std::move(seg));
}

void plan_front::check_invariants() const {
  if (!plan_items_.empty() && plan_.offsets.size() == plan_items_.size()) {
    check_placement(plan_items_, plan_, kRound);  // the plan made without holes (counterfactual)
  }
  std::vector<std::pair<std::uintptr_t, std::size_t>> arena;
  std::size_t bytes = 0, slot_holders = 0;
  for (const auto& [addr, e] : live_) {
    if (e.slot >= 0) ++slot_holders;
    if (!e.in_arena) continue;
    arena.emplace_back(addr, e.size);
    bytes += e.size;
  }
  auto fail = [](const std::string& what) {
    throw logic_error("terrace: planned policy invariant: " + what);
  };
  if (slot_holders != slot_live_) fail("slot-holding block count drifted");
  // The prefix sums keep their sentinel and one entry per token; every recorded request one each.
  if (prefix_hash_.size() != tokens_.size() + 1 || prefix_bytes_.size() != prefix_hash_.size() ||
      prefix_hash_.empty() || tokens_.size() > kMaxRecordTokens ||
      rec_free_pos_.size() != rec_alloc_pos_.size()) {
    fail("the recording's arrays disagree");
  }
  if (arena_lazy_ && static_cast<std::size_t>(std::count(arena_mapped_.begin(), arena_mapped_.end(),
                                                          true)) * arena_page_ !=
                         arena_mapped_bytes_) {
    fail("the lazily mapped arena's page count drifted");
  }
  if (arena.size() != arena_live_count_ || bytes != arena_live_bytes_) fail("arena counts drifted");
  std::sort(arena.begin(), arena.end());
  const auto lo = reinterpret_cast<std::uintptr_t>(arena_);
  // Inside the open arena or inside one claimed hole.
  auto inside = [&](std::uintptr_t a, std::size_t n) {
    if (arena_ != nullptr && a >= lo && a + n <= lo + arena_bytes_) return true;
    const auto h = std::upper_bound(holes_.begin(), holes_.end(), a,
                                    [](std::uintptr_t x, const fallback_hole& y) { return x < y.addr; });
    return h != holes_.begin() && a + n <= std::prev(h)->addr + std::prev(h)->size;
  };
  if (installed_) {
    check_installed(slots_, plan_items_, plan_item_slot_, inside);
    for (const plan_state& other : shelf_) {
      check_installed(other.slots, other.plan_items, other.plan_item_slot, inside);
    }
    // Across the library's plans, an address belongs to one stream: a change of plan must never
    // hand one stream space another may still be using.
    std::vector<stream_span> spans;
    const auto add = [&](const std::vector<slot>& slots, const std::vector<std::uint32_t>& placed) {
      for (std::uint32_t k : placed) spans.push_back({slots[k].addr, slots[k].size, slots[k].stream});
    };
    add(slots_, plan_item_slot_);
    for (const plan_state& other : shelf_) add(other.slots, other.plan_item_slot);
    std::sort(spans.begin(), spans.end(),
              [](const stream_span& a, const stream_span& b) { return a.addr < b.addr; });
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> open;  // (end, stream) of spans reaching on
    for (const stream_span& s : spans) {
      std::erase_if(open, [a = s.addr](const auto& o) { return o.first <= a; });
      for (const auto& o : open) {
        if (o.second != s.stream) fail("two streams' slots share an address in the library");
      }
      open.emplace_back(s.addr + s.size, s.stream);
    }
  }
  for (std::size_t i = 0; i < arena.size(); ++i) {
    if (!inside(arena[i].first, arena[i].second)) fail("a live block lies outside the arena");
    if (arena_lazy_ && arena[i].first >= lo && arena[i].first < lo + arena_range_bytes_) {
      for (std::size_t p = (arena[i].first - lo) / arena_page_;
           p * arena_page_ < arena[i].first - lo + arena[i].second; ++p) {
        if (!arena_mapped_[p]) fail("a live block lies on an unmapped page of the arena");
      }
    }
    if (i > 0 && arena[i - 1].first + arena[i - 1].second > arena[i].first) {
      fail("two live arena blocks overlap");
    }
  }
}

// The installed layout of one plan, in address space: inside the arena and its holes, and
// overlapping lifetimes apart.
void plan_front::check_installed(const std::vector<slot>& slots,
                                 const std::vector<plan_interval>& items,
                                 const std::vector<std::uint32_t>& item_slot,
                                 const std::function<bool(std::uintptr_t, std::size_t)>& inside) {
  std::uintptr_t base = UINTPTR_MAX, top = 0;
  for (std::uint32_t k : item_slot) {
    const slot& sl = slots[k];
    if (!inside(sl.addr, sl.size)) {
      throw logic_error("terrace: planned policy invariant: a planned slot lies outside the arena "
                        "and its holes");
    }
    base = std::min(base, sl.addr);
    top = std::max(top, sl.addr + sl.size);
  }
  if (item_slot.empty()) return;
  placement_plan installed;
  installed.arena_bytes = top - base;
  for (std::uint32_t k : item_slot) installed.offsets.push_back(slots[k].addr - base);
  check_placement(items, installed, 1);  // sizes are rounded; addresses need not be
}

planner_stats plan_front::stats() const {
  planner_stats s = stats_;
  s.deviations = s.allocs_under_plan - s.planned_hits - s.unplanned_allocs;
  return s;
}

}  // namespace terrace::detail
