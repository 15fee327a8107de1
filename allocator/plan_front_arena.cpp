// SPDX-License-Identifier: Apache-2.0
// The planned policy's memory: the arena a plan is installed in (an open reservation plus the
// fallback's holes, or a lazily mapped range), what else may use it (claimed holes' tails,
// guests lent under memory pressure), its stream-ordered reuse (events recorded at a free that
// the next block over the space waits on), and its return to the fallback or the device.
#include "allocator/plan_front.hpp"

#include <algorithm>
#include <chrono>
#include <functional>
#include <iterator>
#include <string>
#include <utility>

#include "allocator/plan_front_common.hpp"
#include "allocator/stream_uses.hpp"
#include "terrace/error.hpp"

namespace terrace::detail {

using namespace plan_tuning;

// REQUIRES: no slot block is live in the arena (blocks served from hole tails may be).
void plan_front::uninstall() {
  choosing_ = false;  // no plan to pick from
  finish_deferred();  // the fallback reuses the space in its own order
  if (arena_ != nullptr) {
    if (arena_adoptable()) {
      // The fallback serves what comes next (a deviating iteration) from the arena's memory, on
      // the lead stream; the other streams' work in it must be done first.
      if (owner_streams_.size() > 1) device_.synchronize_device();
      adopt_segment_(arena_, arena_bytes_, lanes_.front().stream);
    } else {
      // Work queued on a block freed in stream order may still use the arena.
      device_.synchronize_device();
      give_arena_back();
    }
  }
  arena_ = nullptr;
  arena_bytes_ = 0;
  // A stream's slots in another stream's hole: the fallback will reuse that space in the hole
  // stream's order, so the work queued on the others must be done first.
  if (memo_.shared && !holes_.empty()) device_.synchronize_device();
  for (const fallback_hole& h : holes_) {
    release_hole_(reinterpret_cast<void*>(h.addr));
    count_hole(acc_freed_, h);
  }
  // Blocks served from hole tails outlive the plan as the fallback's own: carved back out of the
  // holes just returned, so that a request outside the plan never pins the arena.
  // Guests likewise, out of the arena the fallback just took as a segment (on the lead stream:
  // a guest of another stream names its own among the streams the fallback waits for).
  if (!tail_live_.empty() || !guests_.empty()) {
    for (auto& [addr, e] : live_) {
      if (!e.in_arena) continue;
      std::vector<std::uintptr_t> streams;
      if (auto s = arena_streams_.find(addr); s != arena_streams_.end()) {
        streams = std::move(s->second);
        arena_streams_.erase(s);
      }
      if (e.guest) streams.push_back(e.stream);
      adopt_(addr, e.size, e.requested, streams);
      // Allocated once already: the fallback's count of it is taken back out, and a block of a
      // small-pool hole moves from the arena's pool (large) to the small one.
      const auto h = std::upper_bound(holes_.begin(), holes_.end(), addr,
                                      [](std::uintptr_t a, const fallback_hole& x) { return a < x.addr; });
      const bool small = h != holes_.begin() && std::prev(h)->small_pool &&
                         addr < std::prev(h)->addr + std::prev(h)->size;
      const auto b = static_cast<std::int64_t>(e.size);
      const auto r = static_cast<std::int64_t>(e.requested);
      if (small) {
        acc_allocated_[0].n -= 1, acc_allocated_[0].bytes -= b, acc_allocated_[0].requested -= r;
        acc_freed_[2].n += 1, acc_freed_[2].bytes += b, acc_freed_[2].requested += r;
      } else {
        count_accumulated(acc_allocated_, 2, -1, -b, -r);
      }
      e.in_arena = false;
      e.guest = false;
      e.synced_streams = false;
      --arena_live_count_;
      arena_live_bytes_ -= e.size;
      arena_live_requested_ -= e.requested;
    }
  }
  const bool had_holes = !holes_.empty();
  holes_.clear();
  tails_.clear();
  tail_live_.clear();
  guests_.clear();
  by_addr_.clear();
  owners_.clear();
  owner_streams_.clear();
  max_owner_size_ = 0;
  hole_bytes_ = small_holes_ = small_hole_bytes_ = 0;
  installed_ = false;
  note_arena_resident();  // none: given back, or the fallback's segment now
  stats_.hole_bytes = 0;
  if (had_holes && fallback_totals_) last_totals_ = fallback_totals_();
  // Blocks adopted out of small-pool holes moved from the arena's (large) pool to the small one.
  note_totals(last_totals_);
}

// Plans each stream's slots into the claimed holes first, then an open region; fills `where` (the
// claimed hole, or -1) and `off` per plan of the library and plan item, and the open region's
// total size. A stream takes its own holes first, then what the streams before it left of the
// others' (the part above their extent): the streams share no address, so each still reuses space
// only in its own order, and the work the fallback queued on a hole was finished by the
// synchronisation that emptied its cache. The plans of a library are laid out stream by stream,
// each from the same start, and the next stream starts above the furthest any of them reached:
// so a stream's slots lie in the same part of the arena whichever plan is active, and a change of
// plan never hands one stream an address another may still be using. `shared` tells whether some
// stream uses another's hole (uninstall then synchronises).
void plan_front::layout_in_holes(const std::vector<fallback_hole>& claimed,
                                 std::vector<std::vector<std::int64_t>>& where,
                                 std::vector<std::vector<std::size_t>>& off,
                                 std::size_t& open_total, std::string& heuristic, bool& shared) {
  std::vector<std::uintptr_t> streams;  // in the order the plans first name them
  for_each_plan([&](std::size_t p) {
    where[p].assign(plan_items_.size(), -1);
    off[p].assign(plan_items_.size(), 0);
    for (std::uint32_t k : plan_item_slot_) {
      if (std::find(streams.begin(), streams.end(), slots_[k].stream) == streams.end()) {
        streams.push_back(slots_[k].stream);
      }
    }
  });
  std::vector<std::size_t> taken(claimed.size(), 0);  // per hole: the extent streams placed so far
  std::size_t open_at = 0;
  for (const std::uintptr_t stream : streams) {
    std::vector<std::size_t> reach(claimed.size(), 0);  // per hole: this stream's furthest extent
    std::size_t open_most = 0;
    for_each_plan([&](std::size_t p) {
      std::vector<std::size_t> mine;  // indices into plan_items_
      for (std::size_t j = 0; j < plan_items_.size(); ++j) {
        if (slots_[plan_item_slot_[j]].stream == stream) mine.push_back(j);
      }
      if (mine.empty()) return;
      // Holes smaller than every slot of the stream can hold nothing (and would slow the planner).
      std::size_t smallest = SIZE_MAX;
      for (std::size_t j : mine) smallest = std::min(smallest, round_up(plan_items_[j].size));
      std::vector<std::size_t> holes;  // indices into claimed: this stream's first
      for (const bool own : {true, false}) {
        for (std::size_t h = 0; h < claimed.size(); ++h) {
          const std::size_t left = claimed[h].size - taken[h];
          if ((claimed[h].stream == stream) == own && claimed[h].size % kRound == 0 &&
              left >= smallest) {
            holes.push_back(h);
          }
        }
      }
      std::vector<plan_interval> items;
      std::vector<std::size_t> sizes;
      for (std::size_t j : mine) items.push_back(plan_items_[j]);
      for (std::size_t h : holes) sizes.push_back(claimed[h].size - taken[h]);
      const placement_plan part = plan_placement(items, sizes, kRound);  // no holes: the plain plan
      open_most = std::max(open_most, part.arena_bytes - part.open_base);
      if (heuristic.find(part.heuristic) == std::string::npos) {
        heuristic += heuristic.empty() ? part.heuristic : "+" + part.heuristic;
      }
      for (std::size_t k = 0; k < mine.size(); ++k) {
        const std::size_t j = mine[k];
        if (const std::size_t v = part.offsets[k]; v >= part.open_base) {
          off[p][j] = open_at + (v - part.open_base);
        } else {
          const auto hb = std::upper_bound(part.hole_base.begin(), part.hole_base.end(), v);
          const auto i = static_cast<std::size_t>(hb - part.hole_base.begin()) - 1;
          const std::size_t h = holes[i];
          where[p][j] = static_cast<std::int64_t>(h);
          off[p][j] = taken[h] + (v - part.hole_base[i]);
          reach[h] = std::max(reach[h], v - part.hole_base[i] + round_up(plan_items_[j].size));
          shared = shared || claimed[h].stream != stream;
        }
      }
    });
    for (std::size_t h = 0; h < claimed.size(); ++h) taken[h] += reach[h];
    open_at += open_most;
  }
  open_total = open_at;
}

// Installs the plan. The learning iterations' allocator interleaved long-lived blocks (parameters,
// optimizer state) with transient ones; once those are free, the holes between long-lived blocks
// stay reserved and nothing but the fallback could use them. Emptying the cache returns the wholly
// free segments; the remaining holes are claimed and each stream's slots are planned into its
// holes first, so that only what does not fit there is reserved anew.
bool plan_front::ensure_arena() {
  if (!live_mode_ || installed_ || !library_has_items()) return true;
  const auto t0 = std::chrono::steady_clock::now();
  if (release_fallback_cache_) last_totals_ = release_fallback_cache_();
  std::vector<fallback_hole> claimed;
  if (claim_holes_ && release_hole_) claimed = claim_holes_();
  for (const fallback_hole& h : claimed) count_hole(acc_allocated_, h);
  std::sort(claimed.begin(), claimed.end(),
            [](const fallback_hole& a, const fallback_hole& b) { return a.addr < b.addr; });
  auto give_back = [&](std::size_t h) {
    release_hole_(reinterpret_cast<void*>(claimed[h].addr));
    count_hole(acc_freed_, claimed[h]);
  };
  // Claimed, the holes are allocations of this front: until the installation settles each one
  // (a slot's hole, or given back), an exception on the way (a device error reserving the arena,
  // bad_alloc) gives them all back. Else the fallback would have lost them for good.
  struct unsettled_holes {
    std::function<void()> give_all_back;
    ~unsettled_holes() {
      if (give_all_back) give_all_back();
    }
  } unsettled{[&] {
    for (std::size_t h = 0; h < claimed.size(); ++h) give_back(h);
  }};

  // Per plan of the library and plan item: the claimed hole it lies in (or -1: the open region)
  // and its offset there.
  const std::size_t plans = 1 + shelf_.size();
  std::vector<std::vector<std::int64_t>> where(plans);
  std::vector<std::vector<std::size_t>> off(plans);
  std::size_t open_total = 0;
  std::string heuristic;
  // A deviating iteration uninstalls the plan; when it comes back, the holes it used are usually
  // free again at the same addresses: reuse that layout instead of planning again.
  bool reuse = memo_.valid;
  std::vector<std::size_t> memo_at(memo_.holes.size());
  for (std::size_t m = 0; reuse && m < memo_.holes.size(); ++m) {
    const auto c = std::lower_bound(claimed.begin(), claimed.end(), memo_.holes[m].addr,
                                    [](const fallback_hole& x, std::uintptr_t a) { return x.addr < a; });
    reuse = c != claimed.end() && c->addr == memo_.holes[m].addr &&
            c->stream == memo_.holes[m].stream && c->size >= memo_.holes[m].size;
    if (reuse) memo_at[m] = static_cast<std::size_t>(c - claimed.begin());
  }
  if (reuse) {
    for_each_plan([&](std::size_t p) {
      where[p].assign(plan_items_.size(), -1);
      for (std::size_t j = 0; j < plan_items_.size(); ++j) {
        const std::int64_t m = memo_where_[j];
        if (m >= 0) where[p][j] = static_cast<std::int64_t>(memo_at[static_cast<std::size_t>(m)]);
      }
      off[p] = memo_off_;
    });
    open_total = memo_.open;
    heuristic = stats_.heuristic;
  } else {
    memo_.shared = false;
    layout_in_holes(claimed, where, off, open_total, heuristic, memo_.shared);
  }

  // Room for everything the installation below records, made before the arena is reserved: a
  // host out of memory then gives the holes back (unsettled) and leaves no arena reserved and
  // no plan half installed.
  std::vector<std::size_t> used(claimed.size(), 0);  // per hole: the end of its last slot
  std::vector<std::int64_t> memo_index(claimed.size(), -1);
  std::size_t all_items = 0, all_lanes = 0;
  for_each_plan([&](std::size_t) {
    memo_where_.reserve(plan_items_.size());
    memo_off_.reserve(plan_items_.size());
    by_addr_.reserve(plan_item_slot_.size());
    all_items += plan_item_slot_.size();
    all_lanes += lanes_.size();
  });
  memo_.holes.reserve(claimed.size());
  owners_.reserve(owners_.size() + all_items);
  owner_streams_.reserve(owner_streams_.size() + all_lanes);
  holes_.reserve(claimed.size());
  tails_.reserve(claimed.size());

  void* arena = nullptr;
  if (open_total > 0) {
    if (fraction_allows(open_total)) {
      try {
        arena = device_.reserve(open_total);
      } catch (const out_of_memory&) {
      }
    }
    if (arena == nullptr) {
      // Reserved whole, the arena needs its memory beside the blocks the iteration before the
      // installation left live (the fallback's, freed during the first planned iteration).
      // With virtual memory, its pages are mapped as slots reach them instead (map_arena).
      arena = reserve_lazy_arena(open_total);
    }
    if (arena == nullptr) {
      unsettled.give_all_back = nullptr;
      for (std::size_t h = 0; h < claimed.size(); ++h) give_back(h);
      if (fallback_totals_) last_totals_ = fallback_totals_();
      // A plan widened for other orders may fit once it allows for the recorded one alone.
      if (narrow_plan()) return ensure_arena();
      // No room: the caching allocator serves this iteration. Each try empties its cache, so a
      // plan that does not fit is tried less and less often (as one that loses its iterations).
      ++stats_.arena_refusals;
      note_lost_iteration();
      return false;
    }
    ++arena_reservations_;
    if (!arena_lazy_) {
      trace_arena_memory(trace_action::segment_alloc, reinterpret_cast<std::uintptr_t>(arena), open_total);
    }
  }
  for (std::size_t p = 0; p < plans; ++p) {
    for (std::size_t j = 0; j < where[p].size(); ++j) {
      if (where[p][j] < 0) continue;
      const auto h = static_cast<std::size_t>(where[p][j]);
      const plan_interval& item = p == 0 ? plan_items_[j] : shelf_[p - 1].plan_items[j];
      used[h] = std::max(used[h], off[p][j] + round_up(item.size));
    }
  }
  // The layout, for the next installation of the library.
  memo_.valid = true;
  memo_.open = open_total;
  memo_.holes.clear();
  for (std::size_t h = 0; h < claimed.size(); ++h) {
    if (used[h] == 0) continue;
    memo_index[h] = static_cast<std::int64_t>(memo_.holes.size());
    fallback_hole kept = claimed[h];
    kept.size = used[h];  // what the layout needs of it
    memo_.holes.push_back(kept);
  }
  for_each_plan([&](std::size_t p) {
    memo_where_.assign(plan_items_.size(), -1);
    memo_off_ = off[p];
    for (std::size_t j = 0; j < plan_items_.size(); ++j) {
      std::uintptr_t addr = reinterpret_cast<std::uintptr_t>(arena) + off[p][j];
      if (where[p][j] >= 0) {
        const auto h = static_cast<std::size_t>(where[p][j]);
        addr = claimed[h].addr + off[p][j];
        memo_where_[j] = memo_index[h];
      }
      slots_[plan_item_slot_[j]].addr = addr;
    }
    by_addr_.clear();
    max_slot_size_ = 0;
    for (std::uint32_t k : plan_item_slot_) {
      by_addr_.emplace_back(slots_[k].addr, k);
      max_slot_size_ = std::max(max_slot_size_, slots_[k].size);
    }
    std::sort(by_addr_.begin(), by_addr_.end());
    for (slot& sl : slots_) sl.fitting_due = sl.planned ? sl.due_at : 0;
    for (std::uint32_t k : plan_item_slot_) {
      owners_.push_back({slots_[k].addr, slots_[k].size, slots_[k].stream});
      max_owner_size_ = std::max(max_owner_size_, slots_[k].size);
    }
    for (const lane& l : lanes_) {
      if (std::find(owner_streams_.begin(), owner_streams_.end(), l.stream) == owner_streams_.end()) {
        owner_streams_.push_back(l.stream);
      }
    }
  });
  std::sort(owners_.begin(), owners_.end(),
            [](const stream_span& a, const stream_span& b) { return a.addr < b.addr; });
  holes_.clear();
  tails_.clear();
  hole_bytes_ = small_holes_ = small_hole_bytes_ = 0;
  std::size_t hole_extent = 0;
  unsettled.give_all_back = nullptr;
  for (std::size_t h = 0; h < claimed.size(); ++h) {
    hole_extent += used[h];
    if (used[h] == 0) {
      give_back(h);  // no slot landed there: the fallback keeps it
    } else {
      holes_.push_back(claimed[h]);
      if (used[h] + kRound <= claimed[h].size) {
        tails_.push_back({claimed[h].addr + round_up(used[h]), claimed[h].size - round_up(used[h]),
                          claimed[h].stream});
      }
      hole_bytes_ += claimed[h].size;
      if (claimed[h].small_pool) {
        ++small_holes_;
        small_hole_bytes_ += claimed[h].size;
      }
    }
  }
  if (!claimed.empty() && fallback_totals_) last_totals_ = fallback_totals_();
  arena_ = arena;
  arena_bytes_ = open_total;
  installed_ = true;
  if (fallback_exact_) fallback_exact_(true);
  holes_since_reset_ = holes_since_reset_ || !holes_.empty();
  note_arena_resident();
  stats_.hole_bytes = static_cast<std::int64_t>(hole_bytes_);
  // The installed plan's footprint, to compare with the lower bound: the new reservation plus the
  // extent it uses of each hole (a hole's tail beyond it was idle before the plan too).
  stats_.arena_bytes = static_cast<std::int64_t>(arena_bytes_ + hole_extent);
  stats_.heuristic = heuristic;
  stats_.plan_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  note_totals(last_totals_);
  return true;
}

// An address range for an arena of `bytes` with no page mapped, or nullptr when the device has no
// virtual memory or no address space for it.
void* plan_front::reserve_lazy_arena(std::size_t bytes) {
  const device_properties& props = device_.properties();
  if (!props.supports_vmm || props.map_granularity == 0) return nullptr;
  const std::size_t page = props.map_granularity;
  const std::size_t range = (bytes + page - 1) / page * page;
  // Only when the arena, fully mapped, fits beside what stays outside it in the steady state:
  // the memory others hold on the device, the caching allocator's blocks from before the
  // recording (the claimed holes among them), and the recorded iteration's floor outside the
  // plan, and a page more for the requests an iteration makes beyond the recorded one (the
  // arena lends them free space only where its pages are mapped). Else the arena's pages, once
  // mapped, would starve the caching allocator.
  const fallback_totals now = fallback_totals_ ? fallback_totals_() : last_totals_;
  std::int64_t recorded_live = 0;
  for (std::size_t i = 0; i < rec_free_pos_.size(); ++i) {
    if (rec_free_pos_[i] == UINT32_MAX) recorded_live += static_cast<std::int64_t>(rec_size_[i]);
  }
  const auto used = static_cast<std::int64_t>(device_.used_bytes());
  const std::int64_t others = std::max<std::int64_t>(used - now.reserved, 0);
  const std::int64_t before = std::max<std::int64_t>(now.allocated - recorded_live, 0);
  const double limit = fallback_allowed_ ? static_cast<double>(fallback_allowed_())
                                         : static_cast<double>(props.capacity) * config_.memory_fraction;
  if (static_cast<double>(others + before) + static_cast<double>(range) +
          static_cast<double>(outside_floor_ + page) > limit) {
    return nullptr;
  }
  void* p = nullptr;
  try {
    p = device_.reserve_address_range(range);
  } catch (const device_error&) {
    return nullptr;
  } catch (const out_of_memory&) {
    return nullptr;
  }
  arena_lazy_ = true;
  arena_page_ = page;
  arena_range_bytes_ = range;
  arena_mapped_.assign(range / page, false);
  arena_mapped_bytes_ = 0;
  ++stats_.lazy_arenas;
  return p;
}

// Out of sync, nothing new goes to the arena: while the fallback serves a deviating iteration (a
// dynamic shape), the arena and its holes would sit idle beside the fallback's new segments. Once no
// arena block is live they go back (the holes to the fallback, which can use them); the next
// planned iteration installs the plan again, after emptying the fallback's cache.
void plan_front::release_idle_arena() {
  if (live_mode_ && installed_ && mode_ != mode::in_sync && !choosing_ && arena_idle()) {
    uninstall();
  }
}

bool plan_front::release_under_pressure() {
  if (!live_mode_ || !installed_ || !arena_idle()) return false;
  if (mode_ == mode::in_sync) {
    deviate();  // gives the idle arena back
  } else {
    choosing_ = false;  // an undecided iteration stays with the fallback
    release_idle_arena();
  }
  if (installed_) return false;
  ++stats_.pressure_releases;
  return true;
}

void plan_front::release_cached_arena() {
  if (!live_mode_ || !installed_ || !arena_idle()) return;
  if (mode_ == mode::in_sync) {
    // Within an iteration the plan is about to use the arena: it stays. Between two, the replay
    // stops here (its slots would lie in memory given back) and resumes at the next boundary.
    if (!lanes_done()) return;
    choosing_ = false;
    mode_ = mode::seeking;
    shadow_left_ = 0;
    reset_recording();
  }
  uninstall();
}

void* plan_front::lend_under_pressure(std::size_t bytes, stream_ref stream) {
  return lend_arena_space(bytes, stream, /*by_choice=*/false);
}

bool plan_front::unmap_under_pressure() {
  if (!live_mode_ || !installed_ || !arena_lazy_) return false;
  if (mode_ == mode::in_sync) {
    // The device cannot hold the arena beside what the caching allocator needs: as a refused
    // installation, the iteration is lost, and a plan refused again and again is set aside.
    ++stats_.arena_refusals;
    deviate();
    if (!installed_) return true;  // it was idle after all: given back
  }
  const auto base = reinterpret_cast<std::uintptr_t>(arena_);
  std::vector<bool> busy(arena_mapped_.size(), false);
  for (const auto& [addr, e] : live_) {
    if (!e.in_arena || addr < base || addr >= base + arena_range_bytes_) continue;
    const std::size_t last = (addr - base + e.size - 1) / arena_page_;
    for (std::size_t p = (addr - base) / arena_page_; p <= last; ++p) busy[p] = true;
  }
  bool any = false;
  for (std::size_t p = 0; p < busy.size(); ++p) any = any || (arena_mapped_[p] && !busy[p]);
  if (!any) return false;
  // Blocks freed in stream order: work queued before their frees may still use the pages.
  device_.synchronize_device();
  unmap_arena_pages(busy);
  ++stats_.pressure_unmaps;
  note_arena_resident();
  return true;
}

// How many of its lane's slots come before one that uses [at, at + size) again (the next use of
// that space, by the plan); SIZE_MAX when no slot does. A slot taken in this lane iteration comes
// again in the next one. `foreign` tells whether a slot of a stream other than `stream` uses it.
std::size_t plan_front::slots_before_reuse(std::uintptr_t at, std::size_t size,
                                           std::uintptr_t stream, bool& foreign) const {
  std::size_t best = SIZE_MAX;
  foreign = false;
  auto it = std::lower_bound(by_addr_.begin(), by_addr_.end(),
                             std::make_pair(at > max_slot_size_ ? at - max_slot_size_ : 0,
                                            std::uint32_t{0}));
  for (; it != by_addr_.end() && it->first < at + size; ++it) {
    const slot& s = slots_[it->second];
    if (it->first + s.size <= at) continue;
    const lane& l = lanes_[s.lane];
    std::size_t d = 0;
    if (slot_taken(it->second)) {
      d = l.slots.size() - l.cursor + s.pos;
    } else if (s.pos >= l.cursor) {
      d = s.pos - l.cursor;
    }
    best = std::min(best, d);
  }
  // Another stream's part of the arena in any plan of the library (a change of plan would
  // otherwise find its slot over a block of this stream).
  const std::uintptr_t from = at > max_owner_size_ ? at - max_owner_size_ : 0;
  auto o = std::lower_bound(owners_.begin(), owners_.end(), from,
                            [](const stream_span& x, std::uintptr_t a) { return x.addr < a; });
  for (; o != owners_.end() && o->addr < at + size; ++o) {
    if (o->addr + o->size > at && o->stream != stream) foreign = true;
  }
  return best;
}

// A request the plan does not serve borrows free space of the open arena as a guest: slots whose
// space it overlaps stay unserved while it lives (their requests go elsewhere), other streams
// reuse its space after device-side waits, and when the plan is uninstalled the fallback adopts it
// with the arena. Of the free space, the part the plan reuses last. Under memory pressure any free
// space will do, after the host waits for the device (every stream's work in it is done). By
// choice (a request outside the plan, in sync) only space of the borrower's own stream's part
// (stream order then covers the slots' work there; no wait on another stream, which would cost
// the overlap of a prefetch) that no slot needs within the next kLookahead slots of its lane.
void* plan_front::lend_arena_space(std::size_t bytes, stream_ref stream, bool by_choice) {
  if (!live_mode_ || !installed_ || arena_ == nullptr) return nullptr;
  const auto st = reinterpret_cast<std::uintptr_t>(stream.native);
  const std::size_t rounded = round_up(bytes);
  const auto lo = reinterpret_cast<std::uintptr_t>(arena_);
  const std::uintptr_t hi = lo + arena_bytes_;
  std::vector<std::pair<std::uintptr_t, std::size_t>> used;
  for (const auto& [addr, e] : live_) {
    if (e.in_arena && addr >= lo && addr < hi) used.emplace_back(addr, e.size);
  }
  std::sort(used.begin(), used.end());
  used.emplace_back(hi, 0);  // the end of the last gap
  std::uintptr_t best_at = 0;
  std::size_t best_score = 0;
  bool found = false;
  std::uintptr_t gap = lo;
  for (const auto& [addr, size] : used) {
    if (addr >= gap + rounded) {
      for (const std::uintptr_t at : {gap, addr - rounded}) {  // either end of the gap
        bool foreign = false;
        const std::size_t score = slots_before_reuse(at, rounded, st, foreign);
        if (by_choice && (foreign || score < kLookahead)) continue;
        if (!found || score > best_score) {
          best_at = at;
          best_score = score;
          found = true;
        }
      }
    }
    gap = std::max(gap, addr + size);
  }
  if (!found) return nullptr;
  const std::uintptr_t at = best_at;
  if (!map_arena(at, rounded)) return nullptr;
  // Whatever any stream did in this space before must be done first. Under pressure, where the
  // alternative is failing, the host waits for the device (as the caching allocator's own
  // out-of-memory path does before it gives memory back); by choice the space is the borrower's
  // stream's own, and the waits record_stream asked for are the deferred ranges'.
  if (!by_choice) device_.synchronize_device();
  order_after_frees(at, rounded, st);
  guests_.insert(std::upper_bound(guests_.begin(), guests_.end(), std::make_pair(at, rounded)),
                 {at, rounded});
  live_entry e;
  e.size = rounded;
  e.requested = bytes;
  e.stream = st;
  e.guest = true;
  e.rec_id = request_rec_;  // recorded, if try_allocate recorded the request
  ++(by_choice ? stats_.miss_loans : stats_.pressure_loans);
  return hand_out_unplanned(at, e);
}

// An arena block outside the plan (a hole's tail, a guest) becomes live and counted.
void* plan_front::hand_out_unplanned(std::uintptr_t at, live_entry e) {
  e.in_arena = true;
  live_.emplace(at, e);
  track_unplanned(static_cast<std::int64_t>(e.size));
  ++arena_live_count_;
  arena_live_bytes_ += e.size;
  arena_live_requested_ += e.requested;
  count_accumulated(acc_allocated_, 2, 1, static_cast<std::int64_t>(e.size),
                    static_cast<std::int64_t>(e.requested));
  note_totals(last_totals_);
  return reinterpret_cast<void*>(at);
}

// Whether the arena can be uninstalled now: no slot block is live in it. Blocks from hole tails,
// and guests once the fallback takes the arena as a segment, become the fallback's own.
bool plan_front::arena_idle() const noexcept {
  return arena_live_count_ == tail_live_.size() + (arena_adoptable() ? guests_.size() : 0);
}

bool plan_front::arena_quiet() const noexcept {
  return slot_live_ == 0 && (arena_adoptable() || guests_.empty());
}

// The fallback takes a reserved arena as one of its plain segments. A lazily mapped one is an
// address range with pages missing: it goes back to the device instead.
bool plan_front::arena_adoptable() const noexcept {
  return adopt_segment_ && !arena_lazy_;
}

std::size_t plan_front::arena_resident_bytes() const noexcept {
  return arena_lazy_ ? arena_mapped_bytes_ : arena_bytes_;
}

// The memory fraction caps the arena (reserved whole, or its mapped pages) as it caps the
// fallback's segments: together.
bool plan_front::fraction_allows(std::size_t bytes) const {
  return !fallback_room_ || bytes <= fallback_room_();
}

void plan_front::note_arena_resident() {
  stats_.arena_reserved_bytes = static_cast<std::int64_t>(arena_resident_bytes());
  if (fallback_resident_) fallback_resident_(arena_resident_bytes());
}

// REQUIRES: no queued work uses the arena.
void plan_front::give_arena_back() noexcept {
  if (arena_ == nullptr) return;
  if (!arena_lazy_) {
    device_.release(arena_, arena_bytes_);
    trace_arena_memory(trace_action::segment_free, reinterpret_cast<std::uintptr_t>(arena_), arena_bytes_);
    return;
  }
  unmap_arena_pages(std::vector<bool>(arena_mapped_.size(), false));
  device_.release_address_range(arena_, arena_range_bytes_);
  arena_lazy_ = false;
  arena_mapped_.clear();
  arena_mapped_bytes_ = arena_range_bytes_ = 0;
}

// On the lead stream, as the fallback takes an adopted arena. Never throws: a trace event that
// cannot be recorded is counted lost by the owner, and device memory is given back regardless.
void plan_front::trace_arena_memory(trace_action a, std::uintptr_t addr, std::size_t size) const noexcept {
  if (!trace_segment_) return;
  try {
    trace_segment_(a, reinterpret_cast<const void*>(addr), size, lanes_.empty() ? 0 : lanes_.front().stream);
  } catch (...) {
  }
}

// Unmaps the mapped pages of a lazily mapped arena that `keep` does not name, one unmap per run.
// REQUIRES: no queued work uses them.
void plan_front::unmap_arena_pages(const std::vector<bool>& keep) noexcept {
  const auto base = reinterpret_cast<std::uintptr_t>(arena_);
  for (std::size_t p = 0; p < arena_mapped_.size();) {
    if (!arena_mapped_[p] || keep[p]) {
      ++p;
      continue;
    }
    std::size_t q = p;
    while (q < arena_mapped_.size() && arena_mapped_[q] && !keep[q]) arena_mapped_[q++] = false;
    device_.unmap(reinterpret_cast<void*>(base + p * arena_page_), (q - p) * arena_page_);
    trace_arena_memory(trace_action::segment_unmap, base + p * arena_page_, (q - p) * arena_page_);
    arena_mapped_bytes_ -= (q - p) * arena_page_;
    p = q;
  }
}

// Backs [at, at + size) of a lazily mapped arena with memory, page by page. When the device is
// full, the fallback's cache goes back first (its free segments are what the blocks of the
// iteration before the installation left behind), once. False when even then the device refuses:
// the caller serves the request elsewhere, and the pages mapped so far stay for the next slot.
bool plan_front::map_arena(std::uintptr_t at, std::size_t size) {
  const auto base = reinterpret_cast<std::uintptr_t>(arena_);
  // Not lazy, every page mapped (the steady state: the hot path stops here), or a claimed hole.
  if (!arena_lazy_ || arena_mapped_bytes_ == arena_range_bytes_ || at < base ||
      at >= base + arena_range_bytes_) {
    return true;
  }
  const std::size_t first = (at - base) / arena_page_;
  const std::size_t end = (at - base + size + arena_page_ - 1) / arena_page_;
  bool emptied = false;
  for (std::size_t p = first; p < end;) {
    if (arena_mapped_[p]) {
      ++p;
      continue;
    }
    std::size_t q = p;
    while (q < end && !arena_mapped_[q]) ++q;
    bool mapped = false;
    if (fraction_allows((q - p) * arena_page_)) {
      try {
        device_.map(reinterpret_cast<void*>(base + p * arena_page_), (q - p) * arena_page_);
        mapped = true;
      } catch (const out_of_memory&) {
      }
    }
    if (!mapped) {
      if (emptied || !release_fallback_cache_) return false;
      emptied = true;
      last_totals_ = release_fallback_cache_();
      continue;  // the same run again
    }
    for (std::size_t k = p; k < q; ++k) arena_mapped_[k] = true;
    trace_arena_memory(trace_action::segment_map, base + p * arena_page_, (q - p) * arena_page_);
    arena_mapped_bytes_ += (q - p) * arena_page_;
    note_arena_resident();
    p = q;
  }
  note_totals(last_totals_);
  return true;
}

// A request outside the plan, served from the tail of a claimed hole: the part beyond the extent
// the layout uses there, which no slot ever touches. Without it the fallback, whose free blocks the
// plan claimed, would reserve a new segment for an occasional extra request. First fit; only the
// hole's own stream, so that the space is reused in that stream's order, as the caching allocator
// does (and as the fallback will, should the block outlive the plan).
void* plan_front::from_tail(std::size_t rounded, std::uintptr_t stream) {
  if (!live_mode_ || !installed_) return nullptr;
  for (const stream_span& t : tails_) {
    if (t.stream != stream || t.size < rounded) continue;
    auto it = std::lower_bound(tail_live_.begin(), tail_live_.end(),
                               std::pair<std::uintptr_t, std::size_t>{t.addr, 0});
    std::uintptr_t at = t.addr;
    for (; it != tail_live_.end() && it->first < t.addr + t.size; ++it) {
      if (it->first - at >= rounded) break;
      at = it->first + it->second;
    }
    if (at + rounded <= t.addr + t.size) {
      tail_live_.insert(it, {at, rounded});
      order_after_frees(at, rounded, stream);
      return reinterpret_cast<void*>(at);
    }
  }
  return nullptr;
}

event_ref plan_front::acquire_event() {
  if (event_pool_.empty()) return device_.create_event();
  const event_ref e = event_pool_.back();
  event_pool_.pop_back();
  return e;
}

// An arena block at [addr, addr + size) is freed while `users` (streams other than `stream`) may
// still have work queued on it: an event on each marks that work, to be waited for by `stream`,
// which reuses the space (a slot block's own stream: its slots and its holes' tails; every lane's
// stream for a guest's), so the range is kept under it until a block of it covers the range.
void plan_front::defer_reuse(std::uintptr_t addr, std::size_t size, std::uintptr_t stream,
                             const std::vector<std::uintptr_t>& users) {
  deferred_range r;
  r.size = size;
  r.events = detail::mark_stream_uses(
      device_, users, [&] { return acquire_event(); },
      [&](event_ref e) { event_pool_.push_back(e); });
  if (r.events.empty()) return;  // the host waited for the users' work: nothing to defer
  // Ranges of one stream stay disjoint: a guest's range may cover ones deferred before it came.
  std::map<std::uintptr_t, deferred_range>& ranges = deferred_[stream];
  std::uintptr_t first = addr, last = addr + size;
  auto it = ranges.lower_bound(addr);
  if (it != ranges.begin() && std::prev(it)->first + std::prev(it)->second.size > addr) --it;
  while (it != ranges.end() && it->first < addr + size) {
    first = std::min(first, it->first);
    last = std::max(last, it->first + it->second.size);
    r.events.insert(r.events.end(), it->second.events.begin(), it->second.events.end());
    it = ranges.erase(it);
  }
  r.size = last - first;
  ranges.emplace(first, std::move(r));
}

// An arena block of `stream` is handed out at [addr, addr + size): its stream first waits on the
// device for the work marked on every deferred range it overlaps. Later blocks of the stream come
// after that wait in its order, so the ranges are done with.
void plan_front::order_after_frees(std::uintptr_t addr, std::size_t size, std::uintptr_t stream) {
  const auto d = deferred_.find(stream);
  if (d == deferred_.end() || d->second.empty()) return;
  std::map<std::uintptr_t, deferred_range>& ranges = d->second;
  auto it = ranges.lower_bound(addr);
  if (it != ranges.begin() && std::prev(it)->first + std::prev(it)->second.size > addr) --it;
  while (it != ranges.end() && it->first < addr + size) {
    for (event_ref e : it->second.events) {
      device_.wait(stream_ref{reinterpret_cast<void*>(stream)}, e);
      event_pool_.push_back(e);  // a wait takes the event's state when it is issued
      ++stats_.stream_waits;
    }
    it = ranges.erase(it);
  }
}

// Before the arena's space leaves the plan (to the fallback, or back to the device), the host
// waits for every deferred range's work; this happens only when the plan is uninstalled.
void plan_front::finish_deferred() {
  std::vector<event_ref> pending;
  for (auto& [stream, ranges] : deferred_) {
    for (auto& [addr, r] : ranges) pending.insert(pending.end(), r.events.begin(), r.events.end());
  }
  deferred_.clear();
  event_pool_.insert(event_pool_.end(), pending.begin(), pending.end());  // destroyed with the front
  for (event_ref e : pending) device_.synchronize(e);
}

}  // namespace terrace::detail
