// SPDX-License-Identifier: Apache-2.0
// The planned policy's plans: slots from a recorded iteration (make_plan), their offsets laid out
// per stream by the planner (planner.hpp), and the layout widened for frees later than recorded,
// or narrowed back when the device has no room for it.
#include "allocator/plan_front.hpp"

#include <algorithm>
#include <chrono>
#include <iterator>
#include <string>
#include <utility>

#include "allocator/plan_front_common.hpp"

namespace terrace::detail {

using namespace plan_tuning;

void plan_front::make_plan(std::size_t lo, std::size_t hi) {
  const auto t0 = std::chrono::steady_clock::now();
  replan_pending_ = false;
  const bool joins_library = std::exchange(replan_adds_, false);
  const auto first = std::lower_bound(rec_alloc_pos_.begin(), rec_alloc_pos_.end(), lo);
  const auto last = std::lower_bound(rec_alloc_pos_.begin(), rec_alloc_pos_.end(), hi);
  const auto i0 = static_cast<std::size_t>(first - rec_alloc_pos_.begin());
  const auto i1 = static_cast<std::size_t>(last - rec_alloc_pos_.begin());
  const std::size_t n = i1 - i0;

  std::vector<slot> slots(n);
  std::vector<lane> lanes;
  std::vector<plan_interval> items;
  std::vector<std::uint32_t> item_slot;
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = i0 + k;
    slot& s = slots[k];
    s.key = rec_key_[i];
    s.size = rec_size_[i];
    s.stream = rec_stream_[i];
    auto l = std::find_if(lanes.begin(), lanes.end(), [&](const lane& x) { return x.stream == s.stream; });
    if (l == lanes.end()) {
      lanes.emplace_back().stream = s.stream;
      l = std::prev(lanes.end());
    }
    s.lane = static_cast<std::uint32_t>(l - lanes.begin());
    s.pos = static_cast<std::uint32_t>(l->slots.size());
    l->slots.push_back(static_cast<std::uint32_t>(k));
    const std::uint32_t f = rec_free_pos_[i];
    s.planned = f != UINT32_MAX && f < hi;
  }
  // Due lists, per lane: a planned slot's free happens before the first alloc of its lane that
  // comes after it in the recording (other lanes' slots never share its space), or, when other
  // marked iterations with the same requests freed it later (replan_orders_, mapped onto this
  // order by map_frees), before the first alloc after the latest of those frees; a slot one of
  // them did not free inside the iteration is left to the fallback. The intervals are in half
  // tokens, so that such a free can lie just after an alloc of the recording.
  std::vector<std::pair<std::uint32_t, plan_interval>> planned;  // (slot, interval)
  std::vector<plan_interval> recorded_items;  // the same in the recorded order (kMaxWidening)
  std::vector<std::uint32_t> recorded_slot;
  for (lane& l : lanes) {
    l.due.assign(l.slots.size() + 1, {});
    std::vector<std::uint32_t> alloc_at;
    std::vector<std::uint64_t> keys;
    for (std::uint32_t k : l.slots) {
      alloc_at.push_back(rec_alloc_pos_[i0 + k]);
      keys.push_back(slots[k].key);
    }
    std::vector<std::uint32_t> latest(l.slots.size(), 0);
    for (const iteration_shape& other : replan_orders_) {
      for (const stream_order& order : other.streams) {
        if (order.stream == l.stream) map_frees(order, keys, latest);
      }
    }
    for (std::size_t p = 0; p < l.slots.size(); ++p) {
      const std::uint32_t k = l.slots[p];
      slot& s = slots[k];
      if (!s.planned) continue;
      const auto next = std::upper_bound(alloc_at.begin(), alloc_at.end(), rec_free_pos_[i0 + k]);
      s.due_at = static_cast<std::uint32_t>(next - alloc_at.begin());
      s.fitting_due = s.due_at;
      std::uint64_t end = 2 * std::uint64_t{rec_free_pos_[i0 + k] - lo};
      recorded_items.push_back({s.size, 2 * std::uint64_t{rec_alloc_pos_[i0 + k] - lo}, end});
      recorded_slot.push_back(k);
      if (latest[p] > s.due_at) {
        if (latest[p] == kOutlives) {
          s.planned = false;
          continue;
        }
        s.due_at = latest[p];
        end = 2 * std::uint64_t{alloc_at[s.due_at - 1] - lo} + 1;
      }
      l.due[s.due_at].push_back(k);
      planned.push_back({k, {s.size, 2 * std::uint64_t{rec_alloc_pos_[i0 + k] - lo}, end}});
    }
  }
  std::sort(planned.begin(), planned.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [k, item] : planned) {
    items.push_back(item);
    item_slot.push_back(k);
  }
  const std::size_t recorded_bound = per_stream_bound(recorded_items, recorded_slot, slots);
  if (!replan_orders_.empty() &&
      static_cast<double>(per_stream_bound(items, item_slot, slots)) >
          kMaxWidening * static_cast<double>(recorded_bound)) {
    // The orders seen vary too much to plan for all of them (none recurred, or the plan there is
    // was outrun by a later free): nothing is planned; the caching allocator serves these
    // iterations, or the plan there is goes on serving them as it did. (A recurring order comes
    // here with no other orders: end_iteration plans it as recorded.)
    replan_orders_.clear();
    replan_pending_ = false;
    return;
  }

  std::string heuristic;
  // Under the live policy the placement is made when the plan is installed, into the fallback's
  // holes of that moment (ensure_arena); planning twice would double the cost on large iterations.
  const bool deferred = live_mode_ && claim_holes_ && release_hole_;
  placement_plan whole = deferred ? placement_plan{} : place_by_stream(items, item_slot, slots, heuristic);
  whole.lower_bound = items.empty() ? 0 : max_live_bytes(items, kRound);
  // The old arena is empty here (plans are made only when no slot is live). The new one is
  // installed at the first planned iteration's start, when the fallback's transient blocks are free.
  if (live_mode_) uninstall();
  memo_.valid = false;  // a new plan: its layout is made at its first installation
  const std::uint64_t old_requests = plan_requests_.requests_hash;
  if (joins_library && !slots_.empty()) {
    shelf_.emplace_back();
    exchange_plan(shelf_.back());  // the active plan joins the library; the new one replaces it
  } else if (!joins_library) {
    shelf_.clear();  // a plan of its own: a new phase, or one steady iteration
  }
  // The fewest bytes the recorded iteration keeps live outside the arena at any moment (blocks
  // from before it, and those it allocates but frees after it): what a lazily mapped arena must
  // leave room for beside it.
  {
    std::vector<std::int64_t> delta(hi - lo + 1, 0);
    for (std::size_t i = 0; i < i1; ++i) {
      const std::uint32_t f = rec_free_pos_[i];
      const bool outside = i < i0 ? f == UINT32_MAX || f > lo : !slots[i - i0].planned;
      if (!outside) continue;
      const auto size = static_cast<std::int64_t>(rec_size_[i]);
      delta[rec_alloc_pos_[i] > lo ? rec_alloc_pos_[i] - lo : 0] += size;
      if (f != UINT32_MAX && f < hi) delta[f - lo] -= size;
    }
    std::int64_t live = 0, floor = INT64_MAX;
    for (std::size_t t = 0; t < hi - lo; ++t) {
      live += delta[t];
      floor = std::min(floor, live);
    }
    outside_floor_ = floor == INT64_MAX ? 0 : static_cast<std::size_t>(std::max<std::int64_t>(floor, 0));
  }
  for (std::size_t j = 0; j < whole.offsets.size(); ++j) slots[item_slot[j]].offset = whole.offsets[j];
  // Everything the installation below allocates is made first: a host out of memory then leaves
  // the plan there was (the members below are moved in, which cannot fail).
  std::vector<std::uint32_t> observed_due(slots.size(), 0);
  std::vector<std::uint32_t> freed_gen(slots.size(), 0);
  std::vector<std::uint32_t> taken_gen(slots.size(), 0);
  iteration_shape requests = explicit_ ? shape_of(lo, hi) : iteration_shape{};
  // The anchor: the lead stream's last tokens before the boundary (its own order; the other
  // streams may interleave with it differently from one step to the next).
  std::vector<std::uint64_t> anchor;
  for (std::size_t i = hi; !lanes.empty() && i-- > lo && anchor.size() < kAnchorTokens;) {
    if (token_stream_[i] == lanes.front().stream) anchor.push_back(tokens_[i]);
  }
  std::reverse(anchor.begin(), anchor.end());

  observed_due_ = std::move(observed_due);
  later_frees_ = false;
  widening_refused_ = false;
  narrowed_ = false;
  refused_bound_ = SIZE_MAX;
  base_bound_ = recorded_bound;


  if (stats_.plans > 0) ++stats_.replans;
  ++stats_.plans;
  last_pick_ = stats_.iterations;
  slots_ = std::move(slots);
  lanes_ = std::move(lanes);  // lanes_.front() is slot 0's: it was created first
  plan_items_ = std::move(items);
  plan_item_slot_ = std::move(item_slot);
  plan_ = std::move(whole);
  arena_bytes_ = live_mode_ ? 0 : counterfactual_arena_bytes();
  freed_gen_ = std::move(freed_gen);
  taken_gen_ = std::move(taken_gen);
  plan_requests_ = std::move(requests);
  if (explicit_ && plan_requests_.requests_hash != old_requests && suspend_left_ > 0 &&
      !set_aside_for_shapes_ && (joins_library || shape_changes() < kMinShapeChanges)) {
    // The old plan was set aside for the iterations it lost, which were of this new shape (a
    // phase of another shape: an evaluation, say; or one of the shapes that alternate, which the
    // library now holds beside it): the plans start at once.
    end_suspension();
  }
  replan_orders_.clear();
  plan_period_ = hi - lo;
  anchor_len_ = anchor.size();
  anchor_hash_ = window_hash(anchor.data(), anchor.size(), 0);
  lead_seen_ = 0;  // the window fills again from the next lead token on
  mode_ = mode::seeking;
  publish_plan_stats();
  stats_.arena_bytes = static_cast<std::int64_t>(live_mode_ ? plan_.arena_bytes : arena_bytes_);
  stats_.heuristic = std::move(heuristic);
  stats_.plan_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  note_totals(last_totals_);
}

// The plan's items split by stream (sorted by stream), each with the items' indices.
std::vector<plan_front::stream_group> plan_front::group_by_stream(
    const std::vector<plan_interval>& items, const std::vector<std::uint32_t>& item_slot,
    const std::vector<slot>& slots) {
  std::vector<std::uintptr_t> streams;
  for (std::uint32_t k : item_slot) streams.push_back(slots[k].stream);
  std::sort(streams.begin(), streams.end());
  streams.erase(std::unique(streams.begin(), streams.end()), streams.end());
  std::vector<stream_group> groups(streams.size());
  for (std::size_t j = 0; j < items.size(); ++j) {
    const auto g = std::lower_bound(streams.begin(), streams.end(), slots[item_slot[j]].stream);
    stream_group& group = groups[static_cast<std::size_t>(g - streams.begin())];
    group.items.push_back(items[j]);
    group.index.push_back(j);
  }
  return groups;
}

// One region per stream: an address is reused only in that stream's order.
placement_plan plan_front::place_by_stream(const std::vector<plan_interval>& items,
                                           const std::vector<std::uint32_t>& item_slot,
                                           const std::vector<slot>& slots,
                                           std::string& heuristic) const {
  placement_plan whole;
  whole.offsets.assign(items.size(), 0);
  for (const stream_group& group : group_by_stream(items, item_slot, slots)) {
    const placement_plan part = plan_placement(group.items, kRound);
    for (std::size_t g = 0; g < group.items.size(); ++g) {
      whole.offsets[group.index[g]] = whole.arena_bytes + part.offsets[g];
    }
    whole.arena_bytes += part.arena_bytes;
    if (heuristic.find(part.heuristic) == std::string::npos) {
      heuristic += heuristic.empty() ? part.heuristic : "+" + part.heuristic;
    }
  }
  return whole;
}

std::size_t plan_front::per_stream_bound(const std::vector<plan_interval>& items,
                                         const std::vector<std::uint32_t>& item_slot,
                                         const std::vector<slot>& slots) const {
  std::size_t bound = 0;
  for (const stream_group& group : group_by_stream(items, item_slot, slots)) {
    bound += max_live_bytes(group.items, kRound);
  }
  return bound;
}

// Iterations in sync freed some slots later than the plan allows (observed_due_; each such free
// held up the slots over its space, which then went elsewhere). The same requests are laid out
// again with those frees at their latest, unless that costs too much (kMaxWidening).
void plan_front::widen_plan() {
  later_frees_ = false;
  std::vector<std::uint32_t> due(slots_.size(), 0);
  for (std::size_t j = 0; j < slots_.size(); ++j) {
    if (slots_[j].planned) due[j] = std::max(slots_[j].due_at, observed_due_[j]);
  }
  // Below the bound of a layout the device had no room for (narrow_plan), too.
  const std::size_t most = std::min(
      static_cast<std::size_t>(kMaxWidening * static_cast<double>(base_bound_)), refused_bound_ - 1);
  if (!lay_out_again(due, most)) {
    widening_refused_ = true;  // the plan stays as it is; its late frees stay misses
    return;
  }
  ++stats_.widenings;
}

// The plan, widened for other orders or for later frees, has no room on the device
// (ensure_arena): it is laid out again as it was when it last fitted (at first, the recorded order
// alone). Widening goes on only below the bound of the layout refused, so that a plan tries at most
// one layout that does not fit beyond its first (observed_due_ keeps the frees that widened it).
// False when the plan is not wider than what fitted.
bool plan_front::narrow_plan() {
  std::vector<std::uint32_t> due(slots_.size(), 0);
  bool wider = false;
  for (std::size_t j = 0; j < slots_.size(); ++j) {
    due[j] = slots_[j].fitting_due;
    wider = wider || due[j] != (slots_[j].planned ? slots_[j].due_at : 0);
  }
  if (!wider) return false;
  refused_bound_ = std::min(refused_bound_, per_stream_bound(plan_items_, plan_item_slot_, slots_));
  narrowed_ = true;
  later_frees_ = false;
  lay_out_again(due, SIZE_MAX);
  ++stats_.narrowings;
  return true;
}

// Lays the plan's slots out again from the plan alone (nothing of the recording is needed): slot
// j is freed before its lane's due[j]-th request (0: not placed, the fallback serves it), so its
// interval in its lane is [its index, its due index) in half steps. False, and the plan as it
// was, when the sum of each stream's largest live bytes would exceed `most`. Requires no slot
// live.
bool plan_front::lay_out_again(const std::vector<std::uint32_t>& due, std::size_t most) {
  std::vector<plan_interval> items;
  std::vector<std::uint32_t> item_slot;
  for (std::size_t j = 0; j < slots_.size(); ++j) {
    if (due[j] == 0) continue;
    items.push_back({slots_[j].size, 2 * std::uint64_t{slots_[j].pos}, 2 * std::uint64_t{due[j]} - 1});
    item_slot.push_back(static_cast<std::uint32_t>(j));
  }
  if (per_stream_bound(items, item_slot, slots_) > most) return false;
  for (std::size_t j = 0; j < slots_.size(); ++j) {
    slots_[j].planned = due[j] != 0;
    slots_[j].due_at = due[j];
  }
  for (lane& l : lanes_) l.due.assign(l.slots.size() + 1, {});
  for (std::uint32_t j : item_slot) lanes_[slots_[j].lane].due[slots_[j].due_at].push_back(j);
  std::string heuristic;
  const bool deferred = live_mode_ && claim_holes_ && release_hole_;
  placement_plan whole = deferred ? placement_plan{} : place_by_stream(items, item_slot, slots_, heuristic);
  whole.lower_bound = plan_.lower_bound;  // the recorded order's (intervals of lanes no longer mix)
  for (std::size_t j = 0; j < whole.offsets.size(); ++j) slots_[item_slot[j]].offset = whole.offsets[j];
  if (live_mode_) uninstall();
  memo_.valid = false;
  plan_items_ = std::move(items);
  plan_item_slot_ = std::move(item_slot);
  plan_ = std::move(whole);
  arena_bytes_ = live_mode_ ? 0 : counterfactual_arena_bytes();
  publish_plan_stats();
  stats_.arena_bytes = static_cast<std::int64_t>(live_mode_ ? plan_.arena_bytes : arena_bytes_);
  if (!heuristic.empty()) stats_.heuristic = heuristic;
  note_totals(last_totals_);
  return true;
}

}  // namespace terrace::detail
