// SPDX-License-Identifier: Apache-2.0
// The stream-order half of the fuzz tests' model devices (planned_policy_fuzz_test,
// allocator_threads_fuzz_test): streams, events and the work queued on them, and what freed space
// is still used by work the allocator may not yet reuse it over. Each test's model_device keeps
// its own address space and memory books and hands its stream and event calls to this book.
//
// Why vector clocks: "that work is over" is not one fact the host either knows or not. Stream S is
// ordered after work w of stream T when the host learnt that w completed (a synchronize, a query
// that said true), or when S was made to wait on the device for an event recorded on T after w,
// which the host never sees complete. And orderings compose: if T waited for U's event and S then
// waits for one of T's, S is after U's work too. One counter of launched work per stream (W), a
// vector of host-known completion (H), and per stream a vector of what its queue is ordered after
// (vc[S]) capture exactly that; an event carries its stream's vector at record time. A scalar
// "last completed" per stream would miss device-side waits or, worse, accept reuse that is only
// transitively unordered.
//
// Work completes nondeterministically: a query of unfinished work completes it with probability
// query_p, so the allocator's "still pending" and "done" paths both run.
//
// Not thread-safe: a device called from several threads holds its own lock around every call.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "fuzz_support.hpp"
#include "terrace/device.hpp"
#include "terrace/error.hpp"

namespace terrace::fuzz {

// One piece of work that used a block: the `work`-th launch on `stream`.
struct stream_use {
  int stream;
  long work;
};

// Streams are numbered handles; 0 is the default stream (stream_ref{}).
inline int stream_index(stream_ref s) {
  return static_cast<int>(reinterpret_cast<std::uintptr_t>(s.native));
}

template <int MaxStreams>
class stream_order_book {
 public:
  using vclock = std::array<long, MaxStreams>;

  // ---- the program's side

  // Queues one piece of work on stream s (a kernel using some block) and returns its number.
  long launch(int s) { return ++launched_[s]; }

  // Completion of stream t's work that the host knows of.
  long host_known(int t) const { return host_known_[t]; }

  // A block at [p, p+n) was freed after the uses `u`: those still unfinished stay on its space
  // until a block handed out over it proves itself ordered after them.
  void retire(std::uintptr_t p, std::size_t n, const std::vector<stream_use>& u) {
    std::vector<stream_use> pending;
    for (const stream_use& x : u) {
      if (host_known_[x.stream] < x.work) pending.push_back(x);
    }
    cut(p, p + n);
    if (!pending.empty()) retired_.emplace(p, uses{p + n, std::move(pending)});
  }

  // REQUIRES: [p, p+n) was just handed out on stream s. Fails (fuzz_failure) unless s is ordered
  // after every unfinished use of that space; then the space is the new block's.
  void claim(std::uintptr_t p, std::size_t n, int s) {
    for (auto it = first_overlapping(p); it != retired_.end() && it->first < p + n; ++it) {
      for (const stream_use& x : it->second.u) {
        if (ordered(s, x.stream, x.work)) continue;
        fail("stream-ordered reuse violated: block [" + hex(p) + ",+" + std::to_string(n) +
             ") on stream " + std::to_string(s) + " over [" + hex(it->first) + "," +
             hex(it->second.hi) + ") last used by stream " + std::to_string(x.stream) + " work " +
             std::to_string(x.work) + " (host knows " + std::to_string(host_known_[x.stream]) +
             ", stream " + std::to_string(s) + " waited for " +
             std::to_string(ordered_after_[s][x.stream]) + ")");
      }
    }
    cut(p, p + n);
  }

  // The first use of space in [lo, hi) whose work the host does not know complete, or null: the
  // allocator must not give such space back to the device.
  const stream_use* first_unfinished(std::uintptr_t lo, std::uintptr_t hi) const {
    for (auto it = first_overlapping(lo); it != retired_.end() && it->first < hi; ++it) {
      for (const stream_use& x : it->second.u) {
        if (host_known_[x.stream] < x.work) return &x;
      }
    }
    return nullptr;
  }

  // Cuts [lo, hi) out of the retired intervals, keeping the parts outside it.
  void cut(std::uintptr_t lo, std::uintptr_t hi) {
    auto it = first_overlapping(lo);
    std::vector<std::pair<std::uintptr_t, uses>> keep;
    while (it != retired_.end() && it->first < hi) {
      const std::uintptr_t a = it->first;
      const std::uintptr_t b = it->second.hi;
      if (a < lo) keep.push_back({a, {lo, it->second.u}});
      if (b > hi) keep.push_back({hi, {b, it->second.u}});
      it = retired_.erase(it);
    }
    for (auto& [a, u] : keep) retired_.emplace(a, std::move(u));
  }

  // ---- the device's side: the stream and event calls of the backend contract

  stream_ref create_stream() {
    if (streams_ >= MaxStreams) throw device_error("model device: too many streams");
    return stream_ref{reinterpret_cast<void*>(static_cast<std::uintptr_t>(streams_++))};
  }
  void synchronize_stream(stream_ref s) {
    const int i = stream_index(s);
    complete_on_host(ordered_after_[i]);
    host_known_[i] = launched_[i];
  }
  void synchronize_device() { host_known_ = launched_; }

  event_ref create_event() {
    void* key = reinterpret_cast<void*>(next_event_++);
    events_[key] = {};
    return event_ref{key};
  }
  void destroy_event(event_ref e) {
    if (events_.erase(e.native) == 0) violate("destroy of an unknown event");
  }
  void record(event_ref e, stream_ref s) {
    event_state* ev = find_event(e, "record");
    if (ev == nullptr) return;
    const int i = stream_index(s);
    ev->vc = ordered_after_[i];
    ev->vc[i] = launched_[i];
  }
  // Unfinished work completes with probability query_p, drawn from rng only then.
  bool query(event_ref e, std::mt19937_64& rng, double query_p) {
    event_state* ev = find_event(e, "query");
    if (ev == nullptr) return true;
    bool done = true;
    for (int t = 0; t < MaxStreams; ++t) done = done && host_known_[t] >= ev->vc[t];
    if (done) return true;
    if (std::uniform_real_distribution<double>(0, 1)(rng) < query_p) {
      complete_on_host(ev->vc);
      return true;
    }
    return false;
  }
  void wait(stream_ref s, event_ref e) {
    event_state* ev = find_event(e, "wait");
    if (ev == nullptr) return;
    vclock& vc = ordered_after_[stream_index(s)];
    for (int t = 0; t < MaxStreams; ++t) vc[t] = std::max(vc[t], ev->vc[t]);
  }
  void synchronize_event(event_ref e) {
    if (event_state* ev = find_event(e, "synchronize")) complete_on_host(ev->vc);
  }

  // ---- contract violations

  // Records the first contract violation the allocator committed inside a device call (those are
  // noexcept or run under the allocator's frames, so they are recorded, not thrown).
  void violate(std::string what) {
    if (!violation_) violation_ = std::move(what);
  }
  const std::optional<std::string>& violation() const { return violation_; }

 private:
  struct event_state {
    vclock vc{};
  };
  // Unfinished uses of the space [key, hi) of freed blocks; intervals are disjoint.
  struct uses {
    std::uintptr_t hi;
    std::vector<stream_use> u;
  };
  using retired_map = std::map<std::uintptr_t, uses>;

  bool ordered(int s, int t, long w) const {
    return t == s || host_known_[t] >= w || ordered_after_[s][t] >= w;
  }

  typename retired_map::const_iterator first_overlapping(std::uintptr_t lo) const {
    auto it = retired_.lower_bound(lo);
    if (it != retired_.begin() && std::prev(it)->second.hi > lo) --it;
    return it;
  }

  void complete_on_host(const vclock& vc) {
    for (int t = 0; t < MaxStreams; ++t) host_known_[t] = std::max(host_known_[t], vc[t]);
  }

  event_state* find_event(event_ref e, const char* call) {
    auto it = events_.find(e.native);
    if (it != events_.end()) return &it->second;
    violate(std::string(call) + " of an event that was never created or already destroyed");
    return nullptr;
  }

  vclock launched_{};                                // W: work launched per stream
  vclock host_known_{};                              // H: completion the host knows of, per stream
  std::array<vclock, MaxStreams> ordered_after_{};  // vc[S]: what stream S's queue waits for
  std::map<void*, event_state> events_;
  std::uintptr_t next_event_ = 1;
  int streams_ = 1;  // the default stream is 0
  retired_map retired_;
  std::optional<std::string> violation_;
};

}  // namespace terrace::fuzz
