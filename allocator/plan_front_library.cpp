// SPDX-License-Identifier: Apache-2.0
// The planned policy's library of plans: iterations of several shapes (sequence-length buckets)
// each keep a plan, laid out together in one arena; a marked iteration's first requests pick the
// plan (choose_plan), and plans no longer picked leave it. The safety argument for sharing the
// arena between them is at the top of plan_front.cpp.
#include "allocator/plan_front.hpp"

#include <algorithm>
#include <iterator>
#include <numeric>
#include <utility>

#include "allocator/plan_front_common.hpp"

namespace terrace::detail {

using namespace plan_tuning;

// The active plan's fields and `other`'s change places (the library: plan_state).
void plan_front::exchange_plan(plan_state& other) noexcept {
  std::swap(slots_, other.slots);
  std::swap(plan_items_, other.plan_items);
  std::swap(plan_, other.plan);
  std::swap(plan_item_slot_, other.plan_item_slot);
  std::swap(by_addr_, other.by_addr);
  std::swap(max_slot_size_, other.max_slot_size);
  std::swap(plan_requests_, other.plan_requests);
  std::swap(observed_due_, other.observed_due);
  std::swap(later_frees_, other.later_frees);
  std::swap(widening_refused_, other.widening_refused);
  std::swap(narrowed_, other.narrowed);
  std::swap(refused_bound_, other.refused_bound);
  std::swap(base_bound_, other.base_bound);
  std::swap(anchor_hash_, other.anchor_hash);
  std::swap(anchor_len_, other.anchor_len);
  std::swap(plan_period_, other.plan_period);
  std::swap(outside_floor_, other.outside_floor);
  std::swap(lanes_, other.lanes);
  std::swap(freed_gen_, other.freed_gen);
  std::swap(taken_gen_, other.taken_gen);
  std::swap(memo_where_, other.memo_where);
  std::swap(memo_off_, other.memo_off);
  std::swap(last_pick_, other.last_pick);
}

bool plan_front::library_has_items() const noexcept {
  return !plan_items_.empty() ||
         std::any_of(shelf_.begin(), shelf_.end(),
                     [](const plan_state& p) { return !p.plan_items.empty(); });
}

// A marked iteration's first requests, from the one with no slot live, pick the library's plan:
// the one whose lanes start with them, stream by stream. While several do (shapes whose first
// requests are alike: a batch of fixed bytes, a token budget split into more or fewer sequences)
// the choice waits: those requests go to the fallback, recorded as a seeking iteration's would be,
// and the plan picked in the end counts their slots as served elsewhere. A guess would lose the
// iteration whenever it is wrong (before, the active plan was always picked, and a shape that
// shared its first request with it was never planned: 4 buckets reserved 31% more than the
// caching allocator). After kMaxUndecided requests, or when a request fits none of the plans left
// (a request more or less, which replay allows for), the active plan is picked if among them,
// else the first of them on the shelf. If no plan starts with the first request, the iteration
// is of a shape the library does not hold: the fallback serves it and it is recorded whole, so
// that its shape, once it recurs, joins the library.
void plan_front::choose_plan(std::uintptr_t stream, std::uint64_t key) {
  const bool first = mode_ == mode::in_sync;  // else undecided since an earlier request
  if (first) {
    candidates_.resize(shelf_.size() + 1);
    std::iota(candidates_.begin(), candidates_.end(), 0u);  // 0: the active plan, i + 1: shelf_[i]
    undecided_.clear();
  }
  auto seen = std::find_if(undecided_.begin(), undecided_.end(),
                           [&](const auto& x) { return x.first == stream; });
  const std::uint32_t n = seen == undecided_.end() ? 0 : seen->second;
  const auto has_next = [&](std::uint32_t id) {
    const std::vector<lane>& lanes = id == 0 ? lanes_ : shelf_[id - 1].lanes;
    const std::vector<slot>& slots = id == 0 ? slots_ : shelf_[id - 1].slots;
    const auto l = std::find_if(lanes.begin(), lanes.end(),
                                [&](const lane& x) { return x.stream == stream; });
    return l != lanes.end() && n < l->slots.size() && slots[l->slots[n]].key == key;
  };
  std::vector<std::uint32_t> fitting;
  std::copy_if(candidates_.begin(), candidates_.end(), std::back_inserter(fitting), has_next);
  if (fitting.empty() && first) {
    // It costs what a lost iteration costs (the arena goes back to the fallback, and comes back
    // after emptying its cache), so it counts as one: shapes that never recur set the plan aside.
    choosing_ = false;
    shadow_left_ = 0;  // recorded as a seeking iteration, from here on
    note_lost_iteration();
    note_deviation();
    mode_ = mode::seeking;
    release_idle_arena();
    return;
  }
  const std::uint32_t undecided = std::accumulate(
      undecided_.begin(), undecided_.end(), 0u, [](std::uint32_t n, const auto& x) { return n + x.second; });
  if (fitting.size() > 1 && undecided < kMaxUndecided) {
    candidates_ = std::move(fitting);
    if (seen == undecided_.end()) {
      undecided_.emplace_back(stream, 1);
    } else {
      ++seen->second;
    }
    ++stats_.undecided_requests;
    mode_ = mode::seeking;  // the caller records the request, and the fallback serves it
    return;
  }
  const std::vector<std::uint32_t>& left = fitting.empty() ? candidates_ : fitting;
  const std::uint32_t id = left.front();  // in ascending order: the active plan if among them
  choosing_ = false;
  last_pick_ = stats_.iterations;
  if (id != 0) {
    exchange_plan(shelf_[id - 1]);  // the plan active so far takes its place on the shelf
    for (lane& l : lanes_) start_lane(l);
    ++stats_.plan_switches;
    publish_plan_stats();
  }
  if (first) return;
  // The requests so far were the fallback's: their slots are used up in this iteration. Their
  // recording goes on as the shadow of the iteration's first requests (try_allocate).
  mode_ = mode::in_sync;
  for (const auto& [st, count] : undecided_) {
    const lane* l = lane_of(st);
    if (l == nullptr) continue;
    for (std::uint32_t p = 0; p < count && p < l->slots.size(); ++p) {
      take_slot(l->slots[p], /*served_elsewhere=*/true);
    }
  }
}

// The plans of the library that no marked iteration picked in the last kUnusedIterations planned
// ones leave it (the shapes in use changed: a curriculum moved on to longer sequences, an
// evaluation phase ended). The layout is made again at the next installation, so an arena that
// was a dropped plan's size shrinks to the largest plan left, and the library has room for new
// shapes. A dropped shape that comes back is a shape the library does not hold: recorded, and
// planned again if it recurs. The active plan was picked last, so it is never dropped.
void plan_front::drop_unused_plans() {
  if (shelf_.empty() || !arena_quiet()) return;
  const std::size_t before = shelf_.size();
  std::erase_if(shelf_, [&](const plan_state& p) {
    return stats_.iterations - p.last_pick > kUnusedIterations;
  });
  if (shelf_.size() == before) return;
  stats_.dropped_plans += static_cast<std::int64_t>(before - shelf_.size());
  memo_.valid = false;
  if (live_mode_ && installed_) uninstall();
  if (!live_mode_) {
    arena_bytes_ = counterfactual_arena_bytes();
    stats_.arena_bytes = static_cast<std::int64_t>(arena_bytes_);
  }
  publish_plan_stats();
}

// Changes of requests between consecutive marked iterations among the last recent_shapes_.size():
// a phase of another shape has two (into it and out of it), shapes drawn at random many.
std::size_t plan_front::shape_changes() const noexcept {
  std::size_t changes = 0;
  for (std::size_t i = 1; i < recent_shapes_.size(); ++i) {
    const std::uint64_t a = recent_shapes_[(recent_shape_next_ + i - 1) % recent_shapes_.size()];
    const std::uint64_t b = recent_shapes_[(recent_shape_next_ + i) % recent_shapes_.size()];
    if (a != 0 && a != b) ++changes;
  }
  return changes;
}

void plan_front::note_shape(std::uint64_t requests) noexcept {
  recent_shapes_[recent_shape_next_] = requests;
  recent_shape_next_ = (recent_shape_next_ + 1) % recent_shapes_.size();
}

}  // namespace terrace::detail
