// SPDX-License-Identifier: Apache-2.0
// The planned policy: steady-state detection over the token stream of allocations and frees, the
// plan (offsets per allocation of one iteration), and its O(1) replay with a safety check that
// makes correctness independent of the plan being right.
//
// Safety argument. The plan's offsets never overlap for slots whose planned lifetimes overlap (same
// stream; each stream has its own region and holes, so an address is reused only in its stream's
// order, as the caching allocator does, and two streams' slots never share an address). So each
// stream is replayed as a lane of its own (its own cursor and iterations: streams may shift
// against each other across a boundary). In sync, a slot is handed out only to a request of its
// stream with its key, at most once per lane iteration, and only when (space_free): every slot of
// its lane whose planned free precedes it is free now (due lists, checked for every slot up to it,
// skipped ones included: a freed slot stays free in the iteration, and a skipped slot is taken
// later only if it is due after every slot handed out since); every live block of the lane's
// previous iteration lies elsewhere (checked by address); and, for a slot behind the cursor, its
// planned free comes after the alloc of every slot handed out since. The live arena blocks of the
// lane's iteration are then slots whose planned lifetimes overlap its own, which the planner kept
// apart from it; other lanes' blocks lie elsewhere. At a lane's wrap no block of it older than its
// previous iteration may be live. Requests the plan does not serve go to the fallback, or to a
// claimed hole's tail beyond every slot's extent (from_tail). Out of sync, nothing new goes to the
// arena.
// The "arena" is the open reservation plus the fallback's holes the plan claimed: a claimed hole is
// an allocation of the fallback (it never hands it out) until the plan is uninstalled, which
// happens only when no slot block is live (blocks in hole tails then become the fallback's own).
// A hole is split between streams by address (its stream's slots first, another's above their
// extent), never shared at one address; the device is synchronised when the holes are claimed
// and, if a stream used another's hole, before they go back.
// A library of plans (iterations of several shapes) shares one arena: each plan alone is laid out
// as above, and every plan's slots of a stream lie in that stream's part of it, so that an address
// belongs to one stream whichever plan is active. The active plan changes only among a marked
// iteration's first requests, when no slot is live: what the others' slots held is then free, and
// work still queued on it is the same stream's (stream order covers it) or was waited for
// (guests, record_stream: deferred per stream, for every stream of the library).
#include "allocator/plan_front.hpp"

#include <algorithm>
#include <bit>
#include <chrono>
#include <functional>
#include <iterator>
#include <numeric>
#include <string>
#include <utility>

#include "terrace/error.hpp"

namespace terrace::detail {

namespace {

constexpr std::size_t kRound = 512;
constexpr std::size_t kWindow = 16;                   // tokens in the window that proposes periods
constexpr std::size_t kMaxRecordTokens = 1u << 22;    // a recording longer than this starts over
// In sync, a request may take a slot up to this many slots ahead of the cursor (skipping the ones
// between) or one skipped at most this far behind it: the same iteration with a request more or
// less, or with two streams interleaved in another order, stays planned.
constexpr std::size_t kLookahead = 16;
// Consecutive requests that match no slot before the rest of the iteration goes to the fallback.
constexpr std::uint32_t kMaxMisses = 8;
// Requests outside the plan per lane iteration that may borrow free arena space (lend_arena_space).
constexpr std::uint32_t kMaxMissLoans = 2;
// Iterations in a row that leave the plan before it is set aside (suspend), and how long it sits
// out: kFirstSuspension iterations, doubling up to kMaxSuspension while it keeps failing; as many
// iterations kept in a row restore the first length.
constexpr std::uint32_t kMaxLostInRow = 3;
// ... or that leave it this often among the last kOutcomeWindow (iterations of two shapes drawn at
// random: the plan fits one, the other leaves it every other iteration, and each loss empties the
// fallback's cache when the plan comes back; planning.md, "Iterations of several shapes").
constexpr int kOutcomeWindow = 8;
constexpr int kMaxLostInWindow = 4;
// Changes of shape among the last 16 marked iterations that make a re-plan for another shape
// alternation rather than a new phase (plan_front::shape_changes).
constexpr std::size_t kMinShapeChanges = 4;
// The shape noted for an iteration that left the plan part way (not recorded whole): not the
// plan's, otherwise unknown.
constexpr std::uint64_t kUnknownShape = 1;
// Plans a library holds: the shapes of iterations that alternate (sequence-length buckets), laid
// out together in one arena. More shapes than this are left to the caching allocator.
constexpr std::size_t kMaxPlans = 8;
// Requests of a marked iteration that may go to the fallback while more than one plan of the
// library starts with them (choose_plan); then the active plan, if among them, or the first.
constexpr std::uint32_t kMaxUndecided = 16;
// A marked iteration's first requests recorded in sync as well (try_allocate's shadow), so that
// one that leaves the plan among them is recorded whole (and the undecided ones before them).
constexpr std::uint32_t kShadowRequests = 16;
// Planned iterations after which a plan of the library that none of them picked leaves it
// (drop_unused_plans). A bucket drawn 1 time in 8 goes unpicked that long with odds of 1e-15.
constexpr std::int64_t kUnusedIterations = 256;
constexpr std::uint32_t kFirstSuspension = 8;
constexpr std::uint32_t kMaxSuspension = 1024;
// A plan that allows for every order of frees seen may need more memory than the order it was
// recorded in: at most this much more (the sum of each stream's largest live bytes, in the
// recorded order and with every free at its latest). Orders that vary more than that are not a
// training step's timing jitter: they stay with the caching allocator, or with the plan as it is.
constexpr double kMaxWidening = 1.10;
constexpr std::uint64_t kMod = (std::uint64_t{1} << 61) - 1;
constexpr std::uint64_t kBase = 0x2545f4914f6cdd1dull % kMod;

std::uint64_t mulmod(std::uint64_t a, std::uint64_t b) noexcept {
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  std::uint64_t r = static_cast<std::uint64_t>(p & kMod) + static_cast<std::uint64_t>(p >> 61);
  if (r >= kMod) r -= kMod;
  return r;
}

// The polynomial hash of a token sequence, extended by one token (range_hash's prefix hashes and
// streams_hash's per-stream ones).
std::uint64_t extend_hash(std::uint64_t h, std::uint64_t token) noexcept {
  return (mulmod(h, kBase) + (token % (kMod - 1)) + 1) % kMod;
}

std::uint64_t mix(std::uint64_t x) noexcept {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

std::size_t round_up(std::size_t n) noexcept { return (n + kRound - 1) / kRound * kRound; }

}  // namespace

plan_front::plan_front(device_backend& device, const allocator_config& config, bool live)
    : device_(device), config_(config), live_mode_(live) {
  stats_.enabled = true;
  stats_.counterfactual = !live;
}

plan_front::~plan_front() {
  try {
    finish_deferred();
    // Work queued before a stream-ordered free may still use arena blocks: release() requires
    // that none does (the caching allocator's own destructor waits likewise, but runs after this).
    if (arena_ != nullptr) device_.synchronize_device();
  } catch (...) {  // a failed device: its work is over either way
  }
  for (event_ref e : event_pool_) device_.destroy_event(e);
  // Arena blocks still live are leaked to the device, as the caching allocator leaks its blocks.
  if (arena_ != nullptr && arena_live_count_ == tail_live_.size()) give_arena_back();
}

std::uint64_t plan_front::key_of(std::size_t rounded, std::uintptr_t stream,
                                 std::string_view tag) const {
  std::uint64_t k = mix(rounded * 0x9e3779b97f4a7c15ull ^ mix(stream + 1));
  if (!tag.empty()) k = mix(k ^ std::hash<std::string_view>{}(tag));
  return k;
}

std::uint64_t plan_front::range_hash(std::size_t lo, std::size_t hi) const noexcept {
  const std::uint64_t sub = mulmod(prefix_hash_[lo], pow_[hi - lo]);
  const std::uint64_t h = prefix_hash_[hi];
  return h >= sub ? h - sub : h + kMod - sub;
}

// Each stream's own tokens of [lo, hi), hashed in that stream's order, then combined in stream
// order: equal for two iterations whose streams did the same things each, however the host's
// calls for the different streams interleaved. The plan needs no more: streams never share an
// address, so a slot's space is reused only in its own stream's order (the lanes replay it so).
std::uint64_t plan_front::streams_hash(std::size_t lo, std::size_t hi) const {
  struct stream_sum {
    std::uintptr_t stream;
    std::uint64_t hash;
    std::size_t count;
  };
  std::vector<stream_sum> sums;
  for (std::size_t i = lo; i < hi; ++i) {
    auto it = std::find_if(sums.begin(), sums.end(),
                           [&](const stream_sum& x) { return x.stream == token_stream_[i]; });
    if (it == sums.end()) it = sums.insert(sums.end(), {token_stream_[i], 0, 0});
    it->hash = extend_hash(it->hash, tokens_[i]);
    ++it->count;
  }
  std::sort(sums.begin(), sums.end(),
            [](const stream_sum& a, const stream_sum& b) { return a.stream < b.stream; });
  std::uint64_t h = 0;
  for (const stream_sum& x : sums) h = mix(h ^ mix(x.stream + 1) ^ mix(x.hash + x.count));
  return h;
}

void plan_front::reset_recording() {
  prefix_hash_.assign(1, 0);
  pow_.assign(1, 1);
  prefix_bytes_.assign(1, 0);
  tokens_.clear();
  rec_alloc_pos_.clear();
  rec_free_pos_.clear();
  rec_size_.clear();
  rec_stream_.clear();
  rec_key_.clear();
  token_stream_.clear();
  lead_seen_ = 0;
  window_seen_.clear();
  explicit_begin_ = SIZE_MAX;
  request_rec_ = -1;
  for (auto& [addr, e] : live_) e.rec_id = -1;
}

void plan_front::push_token(std::uint64_t token, std::int64_t delta, std::uintptr_t stream) {
  tokens_.push_back(token);
  token_stream_.push_back(stream);
  if (!lanes_.empty() && stream == lanes_.front().stream) {
    lead_window_[lead_seen_++ % kLeadRing] = token;
  }
  prefix_hash_.push_back(extend_hash(prefix_hash_.back(), token));
  pow_.push_back(mulmod(pow_.back(), kBase));
  prefix_bytes_.push_back(prefix_bytes_.back() + delta);
}

// A period P is accepted at token n when the last 2P tokens are two equal halves (by hash), the
// live bytes are the same P tokens apart (an iteration gives back what it takes), and P is at least
// plan_min_period. Candidates come from the last earlier occurrence of the current window, so each
// token costs O(1).
void plan_front::detect_steady_state() {
  const std::size_t n = tokens_.size();
  if (explicit_ || n < kWindow) return;
  const std::uint64_t w = range_hash(n - kWindow, n);
  auto [it, inserted] = window_seen_.try_emplace(w, static_cast<std::uint32_t>(n));
  if (inserted) return;
  const std::size_t p = n - it->second;
  it->second = static_cast<std::uint32_t>(n);
  if (p < std::max<std::size_t>(config_.plan_min_period, kWindow) || n < 2 * p) return;
  if (prefix_bytes_[n] != prefix_bytes_[n - p]) return;
  const std::uint64_t h = range_hash(n - p, n);
  if (h != range_hash(n - 2 * p, n - p)) return;
  // The boundary: where the recorded live bytes are lowest inside the last period, so that the
  // fewest blocks cross it.
  std::size_t m = n - p;
  for (std::size_t i = n - p; i < n; ++i) {
    if (prefix_bytes_[i] < prefix_bytes_[m]) m = i;
  }
  if (stats_.plans > 0) {
    // The same period is taken for the same iteration seen at another phase: the anchor resyncs.
    if (p == plan_period_) return;
    // A steady state much shorter than the plan is a loop inside the iteration, not a new one.
    if (p < plan_period_ / 2) return;
  }
  replan_pending_ = true;
  replan_adds_ = false;
  replan_orders_.clear();
  replan_lo_ = m - p;
  replan_hi_ = m;
  if (arena_quiet()) make_plan(replan_lo_, replan_hi_);
}

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
  observed_due_.assign(slots.size(), 0);
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
  freed_gen_.assign(slots_.size(), 0);
  taken_gen_.assign(slots_.size(), 0);
  plan_requests_ = explicit_ ? shape_of(lo, hi) : iteration_shape{};
  if (explicit_ && plan_requests_.requests_hash != old_requests && suspend_left_ > 0 &&
      !set_aside_for_shapes_ && (joins_library || shape_changes() < kMinShapeChanges)) {
    // The old plan was set aside for the iterations it lost, which were of this new shape (a
    // phase of another shape: an evaluation, say; or one of the shapes that alternate, which the
    // library now holds beside it): the plans start at once.
    end_suspension();
  }
  replan_orders_.clear();
  plan_period_ = hi - lo;
  // The anchor: the lead stream's last tokens before the boundary (its own order; the other
  // streams may interleave with it differently from one step to the next).
  {
    std::vector<std::uint64_t> last;
    for (std::size_t i = hi; !lanes_.empty() && i-- > lo && last.size() < kAnchorTokens;) {
      if (token_stream_[i] == lanes_.front().stream) last.push_back(tokens_[i]);
    }
    std::reverse(last.begin(), last.end());
    anchor_len_ = last.size();
    anchor_hash_ = window_hash(last.data(), last.size(), 0);
    lead_seen_ = 0;  // the window fills again from the next lead token on
  }
  mode_ = mode::seeking;
  publish_plan_stats();
  stats_.arena_bytes = static_cast<std::int64_t>(live_mode_ ? plan_.arena_bytes : arena_bytes_);
  stats_.heuristic = heuristic;
  stats_.plan_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  note_totals(last_totals_);
}

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

plan_front::iteration_shape plan_front::shape_of(std::size_t lo, std::size_t hi) const {
  const auto first = std::lower_bound(rec_alloc_pos_.begin(), rec_alloc_pos_.end(), lo);
  const auto last = std::lower_bound(rec_alloc_pos_.begin(), rec_alloc_pos_.end(), hi);
  iteration_shape shape;
  shape.requests = static_cast<std::size_t>(last - first);
  std::vector<std::vector<std::uint32_t>> alloc_at;
  const auto order_of = [&](std::uintptr_t stream) {
    auto x = std::find_if(shape.streams.begin(), shape.streams.end(),
                          [&](const stream_order& o) { return o.stream == stream; });
    if (x == shape.streams.end()) {
      x = shape.streams.insert(shape.streams.end(), {stream, {}, {}});
      alloc_at.emplace_back();
    }
    return static_cast<std::size_t>(x - shape.streams.begin());
  };
  for (auto it = first; it != last; ++it) {
    const auto i = static_cast<std::size_t>(it - rec_alloc_pos_.begin());
    const std::size_t x = order_of(rec_stream_[i]);
    shape.streams[x].keys.push_back(rec_key_[i]);
    alloc_at[x].push_back(rec_alloc_pos_[i]);
  }
  for (auto it = first; it != last; ++it) {
    const auto i = static_cast<std::size_t>(it - rec_alloc_pos_.begin());
    const std::size_t x = order_of(rec_stream_[i]);
    const std::uint32_t f = rec_free_pos_[i];
    shape.streams[x].frees.push_back(
        f == UINT32_MAX || f >= hi
            ? kOutlives
            : static_cast<std::uint32_t>(std::upper_bound(alloc_at[x].begin(), alloc_at[x].end(), f) -
                                         alloc_at[x].begin()));
  }
  std::sort(shape.streams.begin(), shape.streams.end(),
            [](const stream_order& a, const stream_order& b) { return a.stream < b.stream; });
  for (const stream_order& o : shape.streams) {
    std::uint64_t sum = 0;  // a multiset's hash: the order of the requests does not enter it
    for (std::uint64_t k : o.keys) sum += mix(k);
    shape.requests_hash = mix(shape.requests_hash ^ mix(o.stream + 1) ^ mix(sum + o.keys.size()));
  }
  return shape;
}

// `order`'s frees in the positions of a lane whose requests are `keys` (the same multiset, in
// another order; a request is the same one when it is the same occurrence of its key). A block
// that `order` freed after its first d requests must be planned apart from each of them: in the
// lane, until after the latest of their positions. `latest` keeps, per position, the largest such
// due index; false (and `latest` untouched) when the requests differ.
bool plan_front::map_frees(const stream_order& order, const std::vector<std::uint64_t>& keys,
                           std::vector<std::uint32_t>& latest) {
  const std::size_t n = keys.size();
  if (order.keys.size() != n || order.frees.size() != n || latest.size() != n) return false;
  std::unordered_map<std::uint64_t, std::vector<std::uint32_t>> where;
  for (std::size_t p = n; p-- > 0;) where[keys[p]].push_back(static_cast<std::uint32_t>(p));
  std::vector<std::uint32_t> position(n);  // order's request q is the lane's position[q]
  std::vector<std::uint32_t> furthest(n);  // the largest position among its first q + 1
  for (std::size_t q = 0; q < n; ++q) {
    auto w = where.find(order.keys[q]);
    if (w == where.end() || w->second.empty()) return false;
    position[q] = w->second.back();  // occurrences in the lane's order
    w->second.pop_back();
    furthest[q] = std::max(position[q], q > 0 ? furthest[q - 1] : 0u);
  }
  for (std::size_t q = 0; q < n; ++q) {
    const std::uint32_t d = order.frees[q];  // >= q + 1: freed after its own request
    const std::uint32_t due = d == kOutlives ? kOutlives : furthest[d - 1] + 1;
    latest[position[q]] = std::max(latest[position[q]], due);
  }
  return true;
}

// The installed plan as a shape: its slots' planned frees (those it leaves to the fallback as
// outliving the iteration).
plan_front::iteration_shape plan_front::plan_shape() const {
  iteration_shape shape;
  shape.requests_hash = plan_requests_.requests_hash;
  shape.requests = plan_requests_.requests;
  for (const lane& l : lanes_) {
    stream_order o;
    o.stream = l.stream;
    for (std::uint32_t k : l.slots) {
      o.keys.push_back(slots_[k].key);
      o.frees.push_back(slots_[k].planned ? slots_[k].due_at : kOutlives);
    }
    shape.streams.push_back(std::move(o));
  }
  std::sort(shape.streams.begin(), shape.streams.end(),
            [](const stream_order& a, const stream_order& b) { return a.stream < b.stream; });
  return shape;
}

// True when every request of `shape` that the plan places was freed where the plan allows.
bool plan_front::plan_allows(const iteration_shape& shape) const {
  for (const lane& l : lanes_) {
    const auto x = std::find_if(shape.streams.begin(), shape.streams.end(),
                                [&](const stream_order& o) { return o.stream == l.stream; });
    std::vector<std::uint64_t> keys;
    for (std::uint32_t k : l.slots) keys.push_back(slots_[k].key);
    std::vector<std::uint32_t> latest(keys.size(), 0);
    if (x == shape.streams.end() || !map_frees(*x, keys, latest)) return false;
    for (std::size_t p = 0; p < l.slots.size(); ++p) {
      const slot& s = slots_[l.slots[p]];
      if (s.planned && latest[p] > s.due_at) return false;
    }
  }
  return true;
}

// n tokens of a ring of kLeadRing from `first` on (or of a plain array, with first 0).
std::uint64_t plan_front::window_hash(const std::uint64_t* ring, std::size_t n,
                                      std::size_t first) noexcept {
  std::uint64_t h = 0x9ae16a3b2f90404full;
  for (std::size_t i = 0; i < n; ++i) h = mix(h ^ ring[(first + i) % kLeadRing]);
  return h;
}

// Seeking, a request with slot 0's key: is this the boundary? When the lead stream's last tokens
// are those before the planned boundary.
bool plan_front::boundary_anchor_matches(std::uint64_t key) const noexcept {
  if (slots_.empty() || slot_live_ != 0 || replan_pending_ || key != slots_[0].key) return false;
  if (lead_seen_ < anchor_len_) return false;
  // The ring holds the last min(lead_seen_, kLeadRing) lead tokens; hash the last anchor_len_.
  const std::size_t first = (lead_seen_ - anchor_len_) % kLeadRing;
  return window_hash(lead_window_.data(), anchor_len_, first) == anchor_hash_;
}

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
  for (const fallback_hole& h : holes_) release_hole_(reinterpret_cast<void*>(h.addr));
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
  stats_.arena_reserved_bytes = stats_.hole_bytes = 0;
  if (had_holes && fallback_totals_) last_totals_ = fallback_totals_();
}

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

// Calls f(p) with each plan of the library active in turn (p = 0: the active one), and leaves the
// active one as it was. f must not change which plans there are.
template <class F>
void plan_front::for_each_plan(F&& f) {
  f(std::size_t{0});
  for (std::size_t i = 0; i < shelf_.size(); ++i) {
    struct restore {
      plan_front* front;
      plan_state* state;
      ~restore() { front->exchange_plan(*state); }
    } guard{this, &shelf_[i]};
    exchange_plan(shelf_[i]);
    f(i + 1);
  }
}

bool plan_front::library_has_items() const noexcept {
  return !plan_items_.empty() ||
         std::any_of(shelf_.begin(), shelf_.end(),
                     [](const plan_state& p) { return !p.plan_items.empty(); });
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
  std::sort(claimed.begin(), claimed.end(),
            [](const fallback_hole& a, const fallback_hole& b) { return a.addr < b.addr; });
  auto give_back = [&](std::size_t h) { release_hole_(reinterpret_cast<void*>(claimed[h].addr)); };

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

  void* arena = nullptr;
  if (open_total > 0) {
    try {
      arena = device_.reserve(open_total);
    } catch (const out_of_memory&) {
      // Reserved whole, the arena needs its memory beside the blocks the iteration before the
      // installation left live (the fallback's, freed during the first planned iteration).
      // With virtual memory, its pages are mapped as slots reach them instead (map_arena).
      arena = reserve_lazy_arena(open_total);
    }
    if (arena == nullptr) {
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
  }
  std::vector<std::size_t> used(claimed.size(), 0);  // per hole: the end of its last slot
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
  std::vector<std::int64_t> memo_index(claimed.size(), -1);
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
  stats_.arena_reserved_bytes = static_cast<std::int64_t>(arena_resident_bytes());
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
  const double limit = static_cast<double>(props.capacity) * config_.memory_fraction;
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

// An iteration left the plan for the fallback. A plan that keeps losing its iterations (a trace
// whose streams interleave differently every step, say) costs more than it saves: each lost
// iteration runs on the fallback beside the arena, and each return reinstalls the plan after
// emptying the fallback's cache. So after kMaxLostInRow in a row it is set aside for a while.
void plan_front::note_lost_iteration() {
  ++stats_.lost_iterations;
  kept_in_row_ = 0;
  outcomes_ = (outcomes_ << 1) | 1u;
  const auto lost_in_row = std::countr_one(outcomes_);
  const auto lost_lately = std::popcount(outcomes_ & ((1u << kOutcomeWindow) - 1));
  if (lost_in_row < static_cast<int>(kMaxLostInRow) && lost_lately < kMaxLostInWindow) return;
  set_aside();
}

// The caching allocator serves every iteration for a while (suspend_left_), a while that doubles
// each time the plan is set aside again without kFirstSuspension iterations kept in between, and
// is at least `at_least` iterations.
void plan_front::set_aside(std::uint32_t at_least) {
  outcomes_ = 0;
  ++stats_.suspensions;
  // Set aside, the caching allocator serves everything: with its own segment sizes again.
  if (fallback_exact_) fallback_exact_(false);
  suspend_left_ = std::max(suspend_next_, at_least);
  suspend_next_ = std::min(suspend_next_ * 2, kMaxSuspension);
}

// The bookkeeping of one iteration of the plan (the lead lane's): whether the last one kept to the
// plan, and the new one's count.
void plan_front::count_iteration() {
  if (mode_ == mode::in_sync) {  // the last iteration kept to the plan
    outcomes_ <<= 1;
    if (++kept_in_row_ >= kFirstSuspension) suspend_next_ = kFirstSuspension;
  }
  iteration_deviated_ = false;
  ++stats_.iterations;
}

// Starts lane l's next iteration. Its last iteration's blocks may still be live (another stream
// frees them later than the recording did); its new slots are checked against where they lie
// (none from before it: every caller checks l.live == l.gen_live).
void plan_front::start_lane(lane& l) {
  l.cursor = 0;
  l.checked_upto = 0;
  l.late.clear();  // still held, they are among the old blocks
  l.skipped.clear();
  l.misses_in_row = 0;
  l.misses = 0;
  ++l.gen;
  l.old_blocks.clear();
  if (l.live != 0) {
    const auto index = static_cast<std::uint32_t>(&l - lanes_.data());
    for (const auto& [addr, e] : live_) {
      if (e.slot < 0) continue;
      const auto j = static_cast<std::size_t>(e.slot);
      if (slots_[j].lane == index) l.old_blocks.emplace_back(slot_pos(j), slots_[j].size);
    }
  }
  l.gen_live = 0;
}

plan_front::lane* plan_front::lane_of(std::uintptr_t stream) noexcept {
  for (lane& l : lanes_) {
    if (l.stream == stream) return &l;
  }
  return nullptr;
}

// Lane l wraps on its own: its requests of the next iteration have begun.
void plan_front::wrap_lane(lane& l) {
  if (&l == &lanes_.front()) count_iteration();
  start_lane(l);
}

bool plan_front::lanes_done() const noexcept {
  return std::all_of(lanes_.begin(), lanes_.end(),
                     [](const lane& l) { return l.cursor == l.slots.size(); });
}

// Every lane starts an iteration of the plan (at a boundary found in the token stream, or the
// caller's begin_iteration).
void plan_front::start_iteration() {
  if (suspend_left_ > 0) {  // set aside: the fallback serves this iteration too
    if (--suspend_left_ == 0) set_aside_for_shapes_ = false;
    mode_ = mode::seeking;
    return;
  }
  if (!ensure_arena()) {
    mode_ = mode::seeking;
    return;
  }
  count_iteration();
  mode_ = mode::in_sync;
  for (lane& l : lanes_) start_lane(l);
  // In sync nothing is recorded: the recording restarts at the next deviation.
  reset_recording();
}

// This iteration left the plan somewhere (counted once per iteration).
void plan_front::note_deviation() noexcept {
  if (!iteration_deviated_) ++stats_.deviating_iterations;
  iteration_deviated_ = true;
}

void plan_front::deviate() {
  choosing_ = false;
  if (mode_ == mode::in_sync) note_lost_iteration();
  note_deviation();
  mode_ = mode::seeking;
  // Among a marked iteration's first requests, it was recorded from its start (try_allocate);
  // otherwise it is recorded from here.
  if (std::exchange(shadow_left_, 0) == 0) reset_recording();
  release_idle_arena();
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
  stats_.arena_reserved_bytes = static_cast<std::int64_t>(arena_mapped_bytes_);
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

// REQUIRES: no queued work uses the arena.
void plan_front::give_arena_back() noexcept {
  if (arena_ == nullptr) return;
  if (!arena_lazy_) {
    device_.release(arena_, arena_bytes_);
    return;
  }
  unmap_arena_pages(std::vector<bool>(arena_mapped_.size(), false));
  device_.release_address_range(arena_, arena_range_bytes_);
  arena_lazy_ = false;
  arena_mapped_.clear();
  arena_mapped_bytes_ = arena_range_bytes_ = 0;
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
    try {
      device_.map(reinterpret_cast<void*>(base + p * arena_page_), (q - p) * arena_page_);
    } catch (const out_of_memory&) {
      if (emptied || !release_fallback_cache_) return false;
      emptied = true;
      last_totals_ = release_fallback_cache_();
      continue;  // the same run again
    }
    for (std::size_t k = p; k < q; ++k) arena_mapped_[k] = true;
    arena_mapped_bytes_ += (q - p) * arena_page_;
    p = q;
  }
  stats_.arena_reserved_bytes = static_cast<std::int64_t>(arena_mapped_bytes_);
  note_totals(last_totals_);
  return true;
}

void plan_front::track_unplanned(std::int64_t delta) noexcept {
  unplanned_live_ += delta;
  if (stats_.plans > 0) stats_.unplanned_live_peak = std::max(stats_.unplanned_live_peak, unplanned_live_);
}

// Where slot j lies: its address once installed, its offset in the plan without holes otherwise
// (counterfactual); either way, two slots overlap in memory exactly when these ranges do.
std::uintptr_t plan_front::slot_pos(std::size_t j) const noexcept {
  return live_mode_ ? slots_[j].addr : slots_[j].offset;
}

bool plan_front::slot_taken(std::size_t j) const noexcept {
  return taken_gen_[j] == lanes_[slots_[j].lane].gen;
}

bool plan_front::slot_held(std::size_t j) const noexcept {
  const std::uint32_t gen = lanes_[slots_[j].lane].gen;
  return taken_gen_[j] == gen && freed_gen_[j] != gen;
}

bool plan_front::slots_overlap(std::size_t a, std::size_t b) const noexcept {
  const std::uintptr_t pa = slot_pos(a), pb = slot_pos(b);
  return pa < pb + slots_[b].size && pb < pa + slots_[a].size;
}

// Whether slot j's space is free now. Only its lane's slots can share its space. Every one the
// plan frees before j is allocated must be free (due lists), or lie elsewhere: a free that comes
// later than planned (timing reorders a training step's fetches and evictions) holds up only the
// slots planned over its block, not every one after it. A slot handed out behind the cursor
// (its request came late) must also overlap, in the plan, every slot handed out after it, which the
// planner has kept apart from it in space: those are the slots before the cursor, so its planned
// free must come after the cursor's alloc. Slots at or ahead of the cursor have not been handed
// out in this iteration of the lane.
bool plan_front::space_free(std::size_t j) const noexcept {
  const slot& s = slots_[j];
  if (!s.planned) return true;  // the fallback serves it
  const lane& l = lanes_[s.lane];
  // The lane's last iteration's blocks still live (freed later than the plan's order said,
  // typically when another stream used them): the plan does not keep them apart from this
  // iteration's, so check the space.
  if (!l.old_blocks.empty()) {
    const std::uintptr_t a = slot_pos(j);
    for (const auto& [b, n] : l.old_blocks) {
      if (a < b + n && b < a + s.size) return false;
    }
  }
  // Guests (lend_arena_space) lie where the plan did not expect them.
  for (const auto& [b, n] : guests_) {
    const std::uintptr_t a = slot_pos(j);
    if (a < b + n && b < a + s.size) return false;
  }
  // Every slot whose planned free precedes j, i.e. due before any slot up to j: those due before
  // checked_upto were found free when a slot was handed out and stay so (a slot is taken once
  // per iteration, and one behind the cursor only if it is due at or after the cursor), or were
  // still held then (late).
  const auto in_the_way = [&](std::uint32_t d) { return slot_held(d) && slots_overlap(d, j); };
  if (std::any_of(l.late.begin(), l.late.end(), in_the_way)) return false;
  for (std::size_t k = l.checked_upto; k <= s.pos; ++k) {
    if (std::any_of(l.due[k].begin(), l.due[k].end(), in_the_way)) return false;
  }
  return s.pos >= l.cursor || s.due_at >= l.cursor;
}

// The slot of lane l to serve a request with `key` from, or -1 (then `blocked` names a slot with
// that key whose space is not free yet, or -1). In order: a slot skipped earlier in this iteration
// (its request comes late: the oldest first), the cursor's, then one at most kLookahead ahead (the
// slots in between are skipped: requests that did not come, or that come later), then one at most
// kLookahead behind that was freed early in this iteration.
std::int64_t plan_front::match_slot(const lane& l, std::uint64_t key, std::int64_t& blocked) const {
  blocked = -1;
  for (std::uint32_t p : l.skipped) {
    // A skipped slot whose space is not free stays skipped: the request may take another.
    const std::uint32_t j = l.slots[p];
    if (slots_[j].key == key && !slot_taken(j) && space_free(j)) return j;
  }
  const std::size_t end = std::min(l.slots.size(), static_cast<std::size_t>(l.cursor) + kLookahead);
  for (std::size_t p = l.cursor; p < end; ++p) {
    const std::uint32_t j = l.slots[p];
    if (slots_[j].key != key) continue;
    // The first slot ahead with this key is this request's (a later one is another request's).
    if (space_free(j)) return static_cast<std::int64_t>(j);
    blocked = static_cast<std::int64_t>(j);
    return -1;
  }
  // A slot of this iteration whose block was freed early and is requested again (a tensor
  // dropped and fetched again before its planned free: a delayed update's params, published over
  // the copies prefetched for the next forward): its space is its own until its planned free,
  // which no slot handed out so far follows (space_free), so it is served there again.
  const std::size_t back = l.cursor > kLookahead ? l.cursor - kLookahead : 0;
  for (std::size_t p = l.cursor; p-- > back;) {
    const std::uint32_t j = l.slots[p];
    if (slots_[j].key == key && slots_[j].planned && slot_taken(j) && !slot_held(j) &&
        space_free(j)) {
      return static_cast<std::int64_t>(j);
    }
  }
  return -1;
}

// Hands slot j out (or, with served_elsewhere, marks it used by a request the fallback served) and
// moves its lane's cursor past it; the slots jumped over are remembered as skipped for kLookahead
// slots.
void plan_front::take_slot(std::size_t j, bool served_elsewhere) {
  const slot& s = slots_[j];
  lane& l = lanes_[s.lane];
  const bool again = taken_gen_[j] == l.gen;  // freed early and served again (match_slot)
  taken_gen_[j] = l.gen;
  if (served_elsewhere) {
    freed_gen_[j] = l.gen;  // nothing of it is live in the arena
  } else if (again) {
    freed_gen_[j] = l.gen - 1;  // held again; the due lists up to it were checked the first time
  } else if (s.planned) {
    // space_free(j) checked the due lists up to j; the slots in them still held (elsewhere than
    // j) are late, and the slots after j are checked against them. Not for a slot the fallback
    // serves (its space_free checks nothing): moving past it would leave a late free unchecked,
    // and the next slot would be handed out over a block that is still live.
    for (std::size_t k = l.checked_upto; k <= s.pos; ++k) {
      for (std::uint32_t d : l.due[k]) {
        if (slot_held(d)) l.late.push_back(d);
      }
    }
    std::erase_if(l.late, [&](std::uint32_t d) { return !slot_held(d); });
    l.checked_upto = std::max<std::size_t>(l.checked_upto, s.pos + 1);
  }
  if (s.pos >= l.cursor) {
    for (std::uint32_t p = l.cursor; p < s.pos; ++p) l.skipped.push_back(p);
    if (s.pos > l.cursor) note_deviation();
    l.cursor = s.pos + 1;
  }
  // Forget skipped slots that were taken or fell out of reach.
  std::erase_if(l.skipped, [&](std::uint32_t p) {
    return slot_taken(l.slots[p]) || p + kLookahead < l.cursor;
  });
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

void* plan_front::try_allocate(std::size_t bytes, stream_ref stream, std::string_view tag) {
  pending_slot_ = -1;
  recorded_pending_ = false;
  request_rec_ = -1;
  const std::size_t rounded = round_up(bytes);
  const auto st = reinterpret_cast<std::uintptr_t>(stream.native);
  const std::uint64_t key = key_of(rounded, st, tag);
  if (mode_ == mode::seeking && !explicit_ && boundary_anchor_matches(key)) start_iteration();
  if (choosing_) choose_plan(st, key);
  if (shadow_left_ > 0 && mode_ == mode::in_sync) {
    // A marked iteration's first requests are recorded in sync too: one that leaves the plan
    // among them is then recorded whole, and its shape, once it recurs, is planned (a shape
    // whose first requests are the plan's would otherwise be recorded only from where it left,
    // and never planned). Past them the recording is left as it is: a deviation starts it over.
    --shadow_left_;
    record_request(key, rounded, st);
    recorded_pending_ = true;
  }
  // Counted from the first planned iteration on: the allocations before it were learning.
  if (!slots_.empty() && stats_.iterations > 0) ++stats_.allocs_under_plan;
  // The request's lane; a stream the plan has none for makes requests outside the plan.
  lane* l = mode_ == mode::in_sync ? lane_of(st) : nullptr;
  if (l != nullptr && l->cursor == l->slots.size() && !explicit_) {
    // The lane's previous iteration's allocations are done: this one starts its next. Its blocks
    // may still be live (another stream frees them later than the plan's order said); the new
    // iteration's slots wait until their space is free (space_free).
    if (l->live == l->gen_live) {
      wrap_lane(*l);
    } else {
      deviate();  // a block of the iteration before the last is still live: not this plan's
    }
  }
  if (mode_ == mode::in_sync) {
    std::int64_t blocked = -1;
    std::int64_t j = l != nullptr ? match_slot(*l, key, blocked) : -1;
    if (j < 0 && blocked < 0 && l != nullptr && !explicit_ && l->live == l->gen_live &&
        key == slots_[l->slots[0]].key && l->cursor + kLookahead >= l->slots.size()) {
      // The lane's iteration ended without its last few slots (skipped, not requested): the next
      // one starts here, as it would have at the wrap.
      wrap_lane(*l);
      j = match_slot(*l, key, blocked);
    }
    if (j >= 0 && live_mode_ && slots_[static_cast<std::size_t>(j)].planned &&
        !map_arena(slots_[static_cast<std::size_t>(j)].addr, rounded)) {
      // A lazily mapped arena the device has no page for, even with the fallback's cache given
      // back: the plan does not fit beside what else is live. As a refused installation, the
      // iteration is lost (a plan refused again and again is set aside, rather than empty the
      // fallback's cache at every try) and the fallback serves the request.
      ++stats_.map_refusals;
      ++stats_.arena_refusals;
      deviate();
      j = -1;
    }
    if (j >= 0) {
      l->misses_in_row = 0;
      const auto k = static_cast<std::size_t>(j);
      take_slot(k);
      const slot& s = slots_[k];
      if (!s.planned) {
        ++stats_.unplanned_allocs;
        return nullptr;
      }
      ++stats_.planned_hits;
      if (!live_mode_) {
        pending_slot_ = j;  // counterfactual: served by the fallback, tracked as the slot
        return nullptr;
      }
      void* p = reinterpret_cast<void*>(s.addr);
      order_after_frees(s.addr, rounded, st);
      live_entry e;
      e.key = key;
      e.size = rounded;
      e.requested = bytes;
      e.stream = st;
      e.slot = static_cast<std::int32_t>(j);
      e.gen = l->gen;
      e.in_arena = true;
      e.rec_id = request_rec_;
      live_.emplace(reinterpret_cast<std::uintptr_t>(p), e);
      ++slot_live_;
      ++l->live;
      ++l->gen_live;
      ++arena_live_count_;
      arena_live_bytes_ += rounded;
      arena_live_requested_ += bytes;
      note_totals(last_totals_);
      return p;
    }
    if (mode_ == mode::in_sync) {
      // A request the plan cannot serve now (an extra one, one whose slot's space is still held
      // by a late free, or one too far from the cursor): the fallback serves it and the plan goes
      // on, since the requests after it usually match again (a training step that fetches one
      // block more than the last, or two streams interleaving differently). A slot whose space
      // was held is used up: its request has been served. Many misses in a row mean another
      // iteration altogether: then the rest of it goes to the fallback, as before.
      if (blocked >= 0) take_slot(static_cast<std::size_t>(blocked), /*served_elsewhere=*/true);
      note_deviation();
      // It is served from a claimed hole's tail when one fits (else the fallback, whose free
      // blocks the plan claimed, would reserve anew); a tail block that outlives the plan becomes
      // the fallback's own (uninstall). It still counts as a miss: a run of them is another shape.
      const bool another_shape = l != nullptr && ++l->misses_in_row >= kMaxMisses;
      if (void* p = another_shape ? nullptr : from_tail(rounded, st)) {
        live_entry e;
        e.key = key;
        e.size = rounded;
        e.requested = bytes;
        e.stream = st;
        e.rec_id = request_rec_;
        return hand_out_unplanned(reinterpret_cast<std::uintptr_t>(p), e);
      }
      if (!another_shape) {
        // An occasional request outside the plan borrows arena space; many are another shape,
        // whose blocks would pin the arena while the fallback grows beside it.
        if (l != nullptr && ++l->misses <= kMaxMissLoans) {
          if (void* p = lend_arena_space(bytes, stream, /*by_choice=*/true)) return p;
        }
        return nullptr;  // on_fallback_alloc: unplanned
      }
      deviate();
    }
  }

  // Learning or seeking: record the token (unless the shadow of a marked iteration's start did,
  // before it left the plan); the fallback serves it.
  pending_slot_ = -1;
  if (request_rec_ < 0) record_request(key, rounded, st);
  const std::int64_t plans_before = stats_.plans;
  const bool replan_before = replan_pending_;
  detect_steady_state();
  // Undoable while no plan was made from it (forget_refused_request).
  recorded_pending_ = stats_.plans == plans_before && replan_pending_ == replan_before;
  return nullptr;
}

void plan_front::record_request(std::uint64_t key, std::size_t rounded, std::uintptr_t stream) {
  if (tokens_.size() >= kMaxRecordTokens) reset_recording();
  request_rec_ = static_cast<std::int64_t>(rec_alloc_pos_.size());
  rec_alloc_pos_.push_back(static_cast<std::uint32_t>(tokens_.size()));
  rec_free_pos_.push_back(UINT32_MAX);
  rec_size_.push_back(rounded);
  rec_stream_.push_back(stream);
  rec_key_.push_back(key);
  push_token(key, static_cast<std::int64_t>(rounded), stream);
}

void plan_front::forget_refused_request() noexcept {
  if (!recorded_pending_) return;
  recorded_pending_ = false;
  request_rec_ = -1;
  if (!lanes_.empty() && token_stream_.back() == lanes_.front().stream) --lead_seen_;
  tokens_.pop_back();
  token_stream_.pop_back();
  prefix_hash_.pop_back();
  pow_.pop_back();
  prefix_bytes_.pop_back();
  rec_alloc_pos_.pop_back();
  rec_free_pos_.pop_back();
  rec_size_.pop_back();
  rec_stream_.pop_back();
  rec_key_.pop_back();
  // window_seen_ may keep the popped window's position: a candidate period is checked against
  // the tokens themselves before it is taken, so a stale one only costs a check.
}

void plan_front::on_fallback_alloc(void* p, std::size_t bytes, stream_ref stream) {
  live_entry e;
  e.size = round_up(bytes);
  e.requested = bytes;
  e.stream = reinterpret_cast<std::uintptr_t>(stream.native);
  e.rec_id = request_rec_;  // recorded, if try_allocate recorded the request
  if (pending_slot_ >= 0) {
    e.slot = static_cast<std::int32_t>(pending_slot_);
    lane& l = lanes_[slots_[static_cast<std::size_t>(pending_slot_)].lane];
    e.gen = l.gen;
    ++slot_live_;
    ++l.live;
    ++l.gen_live;
  } else {
    track_unplanned(static_cast<std::int64_t>(e.size));
  }
  pending_slot_ = -1;
  live_.emplace(reinterpret_cast<std::uintptr_t>(p), e);
}

std::size_t plan_front::block_size(const void* p) const {
  const auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
  return it == live_.end() ? 0 : it->second.size;
}

bool plan_front::on_free(void* p, arena_free* freed) {
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  auto it = live_.find(addr);
  if (it == live_.end()) {
    // Not a live block. At a claimed hole's start the fallback would free the hole itself, which
    // the arena is using: refuse (a double free of the arena block that lay there).
    const auto h = std::lower_bound(holes_.begin(), holes_.end(), addr,
                                    [](const fallback_hole& x, std::uintptr_t a) { return x.addr < a; });
    if (h != holes_.end() && h->addr == addr) {
      throw logic_error("terrace: free of a planned block that is not allocated (double free?)");
    }
    return false;
  }
  const live_entry e = it->second;
  live_.erase(it);
  if (mode_ != mode::in_sync || shadow_left_ > 0) {
    if (tokens_.size() >= kMaxRecordTokens) reset_recording();
    if (e.rec_id >= 0 && static_cast<std::size_t>(e.rec_id) < rec_free_pos_.size()) {
      rec_free_pos_[static_cast<std::size_t>(e.rec_id)] = static_cast<std::uint32_t>(tokens_.size());
    }
    push_token(mix(e.key ^ 0x5bd1e995ull) ^ e.size, -static_cast<std::int64_t>(e.size), e.stream);
    detect_steady_state();
  }
  if (e.slot >= 0) {
    const auto j = static_cast<std::size_t>(e.slot);
    lane& l = lanes_[slots_[j].lane];
    if (e.gen == l.gen) {
      freed_gen_[j] = l.gen;
      --l.gen_live;
      if (mode_ == mode::in_sync && explicit_ && !widening_refused_ && slots_[j].planned &&
          l.cursor > slots_[j].due_at) {
        observed_due_[j] = std::max(observed_due_[j], l.cursor);
        later_frees_ = true;
      }
    } else {
      const std::uintptr_t pos = slot_pos(j);
      const auto o = std::find_if(l.old_blocks.begin(), l.old_blocks.end(),
                                  [&](const auto& b) { return b.first == pos; });
      if (o != l.old_blocks.end()) l.old_blocks.erase(o);
    }
    --l.live;
    --slot_live_;
  } else {
    track_unplanned(-static_cast<std::int64_t>(e.size));
  }
  if (!e.in_arena) {
    if (replan_pending_ && arena_quiet()) make_plan(replan_lo_, replan_hi_);
    return false;
  }
  if (freed != nullptr) *freed = {e.stream, e.size, e.requested};
  std::vector<std::uintptr_t> users;  // streams other than its own that used the block
  if (e.synced_streams) {
    if (auto s = arena_streams_.find(addr); s != arena_streams_.end()) {
      users = std::move(s->second);
      arena_streams_.erase(s);
    }
  }
  if (e.guest) {
    // Any lane may reuse a guest's space: each one's stream waits for the guest's work (and its
    // users') before its next block there.
    guests_.erase(std::find(guests_.begin(), guests_.end(), std::make_pair(addr, e.size)));
    for (const std::uintptr_t stream : owner_streams_) {  // every plan's lanes
      std::vector<std::uintptr_t> all = users;
      if (stream != e.stream) all.push_back(e.stream);
      std::erase(all, stream);
      if (!all.empty()) defer_reuse(addr, e.size, stream, all);
    }
  } else if (!users.empty()) {
    // Other streams used the block: the space is reused only after their work queued so far.
    defer_reuse(addr, e.size, e.stream, users);
  }
  if (e.slot < 0 && !e.guest) {
    // A block from a hole's tail (from_tail).
    const auto t = std::lower_bound(tail_live_.begin(), tail_live_.end(),
                                    std::pair<std::uintptr_t, std::size_t>{addr, 0});
    if (t != tail_live_.end() && t->first == addr) tail_live_.erase(t);
  }
  --arena_live_count_;
  arena_live_bytes_ -= e.size;
  arena_live_requested_ -= e.requested;
  release_idle_arena();
  if (replan_pending_ && arena_quiet()) make_plan(replan_lo_, replan_hi_);
  return true;
}

bool plan_front::record_stream(void* p, stream_ref stream) {
  auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == live_.end() || !it->second.in_arena) return false;
  const auto st = reinterpret_cast<std::uintptr_t>(stream.native);
  if (st != it->second.stream) {
    it->second.synced_streams = true;
    arena_streams_[it->first].push_back(st);
  }
  return true;
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
  for (std::uintptr_t user : users) {
    const event_ref e = acquire_event();
    device_.record(e, stream_ref{reinterpret_cast<void*>(user)});
    r.events.push_back(e);
  }
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

void plan_front::begin_iteration() {
  explicit_ = true;
  choosing_ = false;
  if (!slots_.empty() && !replan_pending_) {
    if (mode_ == mode::in_sync && !lanes_done()) deviate();
    if (slot_live_ == 0) {
      if (later_frees_ && arena_quiet()) widen_plan();
      drop_unused_plans();
      start_iteration();
      // No slot is live: the iteration's first request may pick another plan of the library, or,
      // once the shape of iterations keeps changing, tell one of a shape no plan holds.
      choosing_ = mode_ == mode::in_sync &&
                  (!shelf_.empty() || shape_changes() >= kMinShapeChanges);
      shadow_left_ = mode_ == mode::in_sync ? kShadowRequests : 0;
      // In sync, start_iteration reset the recording; set aside (or with no room for the arena)
      // it did not, and this iteration is recorded from here.
      if (mode_ != mode::in_sync) reset_recording();
      explicit_begin_ = 0;
      return;
    }
    deviate();
  }
  if (mode_ != mode::in_sync) {
    reset_recording();
    explicit_begin_ = 0;
  }
}

void plan_front::end_iteration() {
  explicit_ = true;
  choosing_ = false;
  if (mode_ == mode::in_sync) {
    const bool kept = lanes_done();
    note_shape(kept ? plan_requests_.requests_hash : kUnknownShape);
    if (!kept) {
      deviate();
    } else if (std::exchange(shadow_left_, 0) > 0) {
      reset_recording();  // a short iteration: the shadow covered it all
    }
    return;
  }
  if (explicit_begin_ == SIZE_MAX) {  // the recording does not cover a whole iteration
    note_shape(kUnknownShape);
    return;
  }
  const std::size_t lo = explicit_begin_, hi = tokens_.size();
  if (hi == lo) return;
  // Iterations are compared stream by stream: a training step's streams interleave in ways that
  // depend on timing (a copy stream's fetch before or after the compute stream's frees), which
  // the plan does not depend on. A stream's own order can vary too: with optimizer state on NVMe,
  // when reads land and evictions leave decides where a free falls among the copy stream's
  // requests, so that no order may ever recur. So an iteration is planned when its order equals
  // one of the last few (planned as recorded), or when its requests equal those of two of them
  // although no order recurred (planned for every order seen with those requests, each free at
  // its latest); either way a later iteration with a free later still widens the plan. (Planning from one order and replaying it
  // in others was tried and dropped: the requests whose slots late frees held went to the
  // fallback, whose memory beside the arena cost more than the plan saved; planning.md.)
  const std::uint64_t h = streams_hash(lo, hi);
  iteration_shape shape = shape_of(lo, hi);
  bool repeated = false;
  std::vector<iteration_shape> orders;
  for (const recent_iteration& r : recent_iterations_) {
    if (r.tokens == 0 || !r.shape.same_requests(shape)) continue;
    repeated = repeated || (r.order_hash == h && r.tokens == hi - lo);
    orders.push_back(r.shape);
  }
  const std::size_t alike = orders.size();
  orders.push_back(shape);
  recent_iterations_[recent_iteration_next_] = {h, hi - lo, std::move(shape)};
  const iteration_shape& current = recent_iterations_[recent_iteration_next_].shape;
  recent_iteration_next_ = (recent_iteration_next_ + 1) % recent_iterations_.size();
  note_shape(current.requests_hash);
  // Set aside because shapes alternated, and the last 16 iterations were all of one shape: that
  // shape is planned again (a short run of one shape among random ones is no such run).
  if (set_aside_for_shapes_ && shape_changes() == 0) end_suspension();
  const bool plan_alike = !slots_.empty() && plan_requests_.same_requests(current);
  if (std::any_of(shelf_.begin(), shelf_.end(), [&](const plan_state& other) {
        return other.plan_requests.same_requests(current);
      })) {
    return;  // the library has its plan (the iteration's first requests picked another)
  }
  if (plan_alike) {
    // (A plan narrowed for want of room is not planned again for all the orders seen, which
    // would not fit either; it may still widen for the later frees of its own iterations.)
    if (widening_refused_ || narrowed_ || plan_allows(current)) return;
    orders.push_back(plan_shape());  // the plan's requests again, with a free later than it allows
  } else if (!repeated && alike < 2) {
    return;
  } else if (repeated) {
    // An order that recurs is planned as recorded: a plan for every order seen costs memory for
    // frees that may never come late again (the first steps of a training loop are often unlike
    // the rest: on the engine's trace, 29.40 MiB against 25.41). Frees later than it allows
    // widen it in sync, as they are seen.
    orders.clear();
  }
  replan_adds_ = false;
  if (!slots_.empty() && !plan_alike && shape_changes() >= kMinShapeChanges) {
    // A re-plan for other requests while the iterations' shape keeps changing: iterations of
    // several shapes alternate (planning.md, "Iterations of several shapes"). Planning each in
    // turn would lay out, reserve and release an arena at every change of shape, and lose the
    // iterations of the other shapes meanwhile. So the new plan joins the active one in a
    // library: all its plans are laid out in one arena, and each iteration's first request picks
    // its own (choose_plan).
    if (!set_aside_for_shapes_ && shelf_.empty()) ++stats_.shape_alternations;
    if (!set_aside_for_shapes_ && shelf_.size() + 1 < kMaxPlans) {
      replan_adds_ = true;
    } else {
      // More shapes than the library holds: the caching allocator serves them until 16 iterations
      // in a row are of one shape (or 1024 have passed). (Lost iterations are not recorded, so
      // this is usually seen while the plan is already set aside for them: the suspension is
      // lengthened.)
      if (suspend_left_ == 0) {
        set_aside(kMaxSuspension);
      } else {
        suspend_left_ = std::max(suspend_left_, kMaxSuspension);
      }
      set_aside_for_shapes_ = true;
      return;
    }
  }
  replan_pending_ = true;
  replan_orders_ = std::move(orders);
  replan_lo_ = lo;
  replan_hi_ = hi;
  if (arena_quiet()) make_plan(lo, hi);
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

void plan_front::end_suspension() noexcept {
  suspend_left_ = 0;
  set_aside_for_shapes_ = false;
  outcomes_ = 0;
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
}

void plan_front::reset_peaks(const fallback_totals& t) noexcept {
  peak_reserved_ = peak_allocated_ = peak_requested_ = 0;
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
