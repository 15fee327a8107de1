// SPDX-License-Identifier: Apache-2.0
// The planned policy's recording: every allocation and free as a token of one stream, prefix
// hashes and live bytes over it, the steady state found in it (a period that repeats, or the
// caller's marked iterations), and the shapes of marked iterations (their requests, stream by
// stream, and where each was freed) that plans are made for and checked against.
#include "allocator/plan_front.hpp"

#include <algorithm>
#include <utility>

#include "allocator/plan_front_common.hpp"
#include "allocator/reserve_room.hpp"

namespace terrace::detail {

using namespace plan_tuning;

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
  // Nothing recorded is left for forget_refused_request to take back (the pressure path may
  // leave the plan, and so restart the recording, between a request and its refusal).
  recorded_pending_ = false;
  for (auto& [addr, e] : live_) e.rec_id = -1;
}

// The recording's arrays grow together: room for one more token (and, with `request`, one more
// request) in every one of them first, so that a host out of memory leaves them in agreement.
// Their sizes move in step (a token each, a request each) and their capacities only grow, so
// the room once made is known without asking each array (this runs on every recorded request).
void plan_front::reserve_recording(bool request) {
  if (tokens_.size() < token_room_ && (!request || rec_alloc_pos_.size() < request_room_)) return;
  reserve_room(tokens_, 1);
  reserve_room(token_stream_, 1);
  reserve_room(prefix_hash_, 1);
  reserve_room(pow_, 1);
  reserve_room(prefix_bytes_, 1);
  // The prefix arrays hold one entry more than there are tokens (their sentinel).
  token_room_ = std::min({tokens_.capacity(), token_stream_.capacity(), prefix_hash_.capacity() - 1,
                          pow_.capacity() - 1, prefix_bytes_.capacity() - 1});
  if (!request) return;
  reserve_room(rec_alloc_pos_, 1);
  reserve_room(rec_free_pos_, 1);
  reserve_room(rec_size_, 1);
  reserve_room(rec_stream_, 1);
  reserve_room(rec_key_, 1);
  request_room_ = std::min({rec_alloc_pos_.capacity(), rec_free_pos_.capacity(), rec_size_.capacity(),
                            rec_stream_.capacity(), rec_key_.capacity()});
}

// REQUIRES: reserve_recording() made room (the pushes below then cannot fail).
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
  // Before the scan below (O(p)): while a plan's iteration repeats, every token gets this far,
  // and scanning first made a seeking iteration O(p^2) (28 s for one of 100,000 events).
  if (stats_.plans > 0) {
    // The same period is taken for the same iteration seen at another phase: the anchor resyncs.
    if (p == plan_period_) return;
    // A steady state much shorter than the plan is a loop inside the iteration, not a new one.
    if (p < plan_period_ / 2) return;
  }
  // The boundary: where the recorded live bytes are lowest inside the last period, so that the
  // fewest blocks cross it.
  std::size_t m = n - p;
  for (std::size_t i = n - p; i < n; ++i) {
    if (prefix_bytes_[i] < prefix_bytes_[m]) m = i;
  }
  replan_pending_ = true;
  replan_adds_ = false;
  replan_orders_.clear();
  replan_lo_ = m - p;
  replan_hi_ = m;
  if (arena_quiet()) make_plan(replan_lo_, replan_hi_);
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

void plan_front::record_request(std::uint64_t key, std::size_t rounded, std::uintptr_t stream) {
  if (tokens_.size() >= kMaxRecordTokens) reset_recording();
  reserve_recording(/*request=*/true);
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

}  // namespace terrace::detail
