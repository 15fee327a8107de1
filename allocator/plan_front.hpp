// SPDX-License-Identifier: Apache-2.0
// The planned policy's front: detects the steady-state iteration, plans it (planner.hpp), and serves
// matching allocations from one arena in O(1); everything else falls back to the caching allocator,
// which the owner (caching_allocator) calls. Internal to allocator/.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "terrace/config.hpp"
#include "terrace/device.hpp"
#include "terrace/planner.hpp"
#include "terrace/stats.hpp"
#include "terrace/trace.hpp"

namespace terrace::detail {

/// The fallback allocator's current totals, read after each call to keep combined peaks exact.
struct fallback_totals {
  std::int64_t reserved = 0;
  std::int64_t allocated = 0;
  std::int64_t requested = 0;
  std::int64_t allocations = 0;  // allocation.all.current
  // Of those, the small pool's (allocation, allocated_bytes, requested_bytes .small_pool.current).
  std::int64_t small_allocations = 0, small_allocated = 0, small_requested = 0;
};

/// A free block of the fallback that the front took over (claimed as an allocation of its own).
struct fallback_hole {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::uintptr_t stream = 0;
  bool small_pool = false;
};

/// What on_free tells of an arena block it freed (for the owner's trace).
struct arena_free {
  std::uintptr_t stream = 0;
  std::size_t size = 0;       ///< rounded
  std::size_t requested = 0;
};

class plan_front {
 public:
  /// `live` = policy planned (arena blocks are handed out); otherwise counterfactual.
  plan_front(device_backend& device, const allocator_config& config, bool live);
  ~plan_front();
  plan_front(const plan_front&) = delete;
  plan_front& operator=(const plan_front&) = delete;

  /// Every call below requires mutex() held by the caller, which also serialises the fallback.
  std::mutex& mutex() noexcept { return mutex_; }

  /// An arena address for this request, or nullptr: then the caller allocates from the fallback
  /// and reports it with on_fallback_alloc (or, if that throws, with forget_refused_request).
  void* try_allocate(std::size_t bytes, stream_ref stream, std::string_view tag);
  void on_fallback_alloc(void* p, std::size_t bytes, stream_ref stream);
  /// The request try_allocate just passed on was refused by the fallback too: it never became
  /// live, so it leaves the recording (its bytes would otherwise count as live for good, and a
  /// workspace request that fails every iteration would become a slot of the plan).
  void forget_refused_request() noexcept;
  /// The caching allocator ran out of memory for a request. The plan leaves this iteration, and
  /// if no block is live in its arena it gives the arena back at once: true, then the caller
  /// retries. False: nothing was freed (the arena is given back when its last block is).
  bool release_under_pressure();
  /// empty_cache(): an arena no block is live in, between two iterations of the plan, is cached
  /// memory like the fallback's free segments; it is given back (to the fallback, which then
  /// returns it whole). The next iteration's start installs the plan again; no iteration is lost.
  void release_cached_arena();
  /// The caching allocator ran out of memory while the arena holds live blocks: serve the request
  /// from free space of the open arena (a guest block, which slots keep clear of while it lives),
  /// or nullptr when there is none. Call only after release_under_pressure() returned false.
  void* lend_under_pressure(std::size_t bytes, stream_ref stream);
  /// The caching allocator ran out of memory and no arena space could be lent: the pages of a
  /// lazily mapped arena that hold no live block go back to the device (after a device
  /// synchronisation), true when some did; then the caller retries. A slot that needs one of them
  /// again maps it again, or, if the device refuses, its iteration leaves the plan.
  bool unmap_under_pressure();
  /// Records the free. True when `p` was an arena block (now free); false when the caller must
  /// free it in the fallback (also for pointers this front never saw).
  /// @throws terrace::logic_error for the start of a claimed hole that holds no live block.
  bool on_free(void* p, arena_free* freed = nullptr);
  /// The rounded size of the live block at `p` (0 if this front does not track it).
  std::size_t block_size(const void* p) const;
  /// True when `p` is an arena block: its free then records an event on `stream`, and the next
  /// arena block handed out over its space makes its own stream wait on that event (on the device).
  bool record_stream(void* p, stream_ref stream);

  void begin_iteration();
  void end_iteration();
  /// Called (under mutex()) just before the arena is reserved: the owner empties the fallback's
  /// cache there, so that the arena replaces the learning iterations' cached segments.
  /// `fn` returns the fallback's totals afterwards.
  void set_release_fallback_cache(std::function<fallback_totals()> fn) {
    release_fallback_cache_ = std::move(fn);
  }

  /// `claim` takes every free block of the fallback's plain segments (as allocations
  /// the front owns); `release` gives one back (a fallback free); `totals` reads the fallback's
  /// totals. Without them the arena is one new reservation.
  void set_fallback_holes(std::function<std::vector<fallback_hole>()> claim,
                          std::function<void(void*)> release,
                          std::function<fallback_totals()> totals) {
    claim_holes_ = std::move(claim);
    release_hole_ = std::move(release);
    fallback_totals_ = std::move(totals);
  }

  /// `adopt(addr, size, requested, streams)` makes a live block in a hole that was just given back
  /// an allocation of the fallback (freed there from now on; `streams` as record_stream named).
  void set_fallback_adopt(std::function<void(std::uintptr_t, std::size_t, std::size_t,
                                             const std::vector<std::uintptr_t>&)> adopt) {
    adopt_ = std::move(adopt);
  }
  /// `segment(p, size, stream)` makes the arena a segment of the fallback when the plan is
  /// uninstalled (without it the arena goes back to the device).
  void set_fallback_segment(std::function<void(void*, std::size_t, std::uintptr_t)> segment) {
    adopt_segment_ = std::move(segment);
  }
  /// `trace(action, p, size, stream)` records the arena's own device memory in the owner's trace, as the
  /// fallback records its segments: segment_alloc and segment_free for an arena reserved whole,
  /// segment_map and segment_unmap for the pages of a lazily mapped one. An adopted arena is the
  /// fallback's segment from then on (its segment_free comes from there).
  void set_segment_trace(
      std::function<void(trace_action, const void*, std::size_t, std::uintptr_t)> trace) {
    trace_segment_ = std::move(trace);
  }
  /// `exact(true)` from a plan's installation until it is set aside: the fallback then cuts large
  /// segments to the request.
  void set_fallback_sizing(std::function<void(bool)> exact) { fallback_exact_ = std::move(exact); }
  /// `room()` is how many bytes more the memory fraction allows (the fallback's segments and the
  /// arena together); `allowed()` how many it allows in all (the fraction in force, which
  /// set_memory_fraction may have changed since the config); `resident(bytes)` tells the fallback
  /// how much of the arena is resident, which the fraction caps beside its segments.
  void set_fallback_budget(std::function<std::size_t()> room, std::function<std::size_t()> allowed,
                           std::function<void(std::size_t)> resident) {
    fallback_room_ = std::move(room);
    fallback_allowed_ = std::move(allowed);
    fallback_resident_ = std::move(resident);
  }

  void note_totals(const fallback_totals& t) noexcept;
  void reset_peaks(const fallback_totals& t) noexcept;
  /// Zeroes the counters merge_into adds to the fallback's (the arena's device reservations, its
  /// blocks' allocations and frees, and the holes' corrections).
  void reset_accumulated() noexcept {
    arena_reservations_ = 0;
    for (int i = 0; i < 3; ++i) acc_allocated_[i] = acc_freed_[i] = {};
  }
  /// Adds the arena (a segment) and its live blocks to the fallback's stats; combined peaks.
  void merge_into(allocator_stats& s) const;
  void add_to_snapshot(memory_snapshot& snap) const;
  /// @throws terrace::logic_error: live arena blocks overlap or leave the arena, or counts drift.
  void check_invariants() const;
  planner_stats stats() const;

 private:
  struct slot {
    std::uint64_t key = 0;
    std::size_t size = 0;       // rounded
    std::uintptr_t stream = 0;
    bool planned = false;       // freed inside the iteration: placed in the arena
    std::size_t offset = 0;     // in the plan without holes (planner quality, counterfactual)
    std::uintptr_t addr = 0;    // where it is served once the plan is installed (live policy)
    std::uint32_t lane = 0;     // its stream's lane (lanes_)
    std::uint32_t pos = 0;      // its index in the lane
    std::uint32_t due_at = 0;   // the lane index before whose alloc its planned free happens
    // The same in the last layout installed, or until one is, in the recorded order alone (0: not
    // placed): what narrow_plan goes back to.
    std::uint32_t fitting_due = 0;
  };
  // The replay of one stream's slots. Streams share no address in the plan (each has its own
  // region and its own part of every hole), so each stream keeps to the plan on its own: its own
  // cursor, its own iterations (it may run a few requests ahead of, or behind, the others across
  // a boundary), and it checks only its own slots' space.
  struct lane {
    std::uintptr_t stream = 0;
    std::vector<std::uint32_t> slots;                // slot indices, in the plan's order
    std::vector<std::vector<std::uint32_t>> due;     // per lane index (+1 for the end): slots
                                                     // whose planned free precedes its alloc
    std::uint32_t cursor = 0;                        // lane index of the next slot expected
    std::uint32_t gen = 0;                           // the lane's current iteration
    std::size_t checked_upto = 0;                    // due lists below this were checked:
    std::vector<std::uint32_t> late;                 // their slots still held then (maybe now)
    std::vector<std::uint32_t> skipped;              // lane indices jumped over, still takeable
    std::uint32_t misses_in_row = 0;                 // requests in a row that matched no slot
    std::uint32_t misses = 0;                        // requests outside the plan, this iteration
    // The lane's previous iteration's blocks still live, as (slot_pos, size); gen_live counts
    // this iteration's, live all of its slot-holding blocks.
    std::vector<std::pair<std::uintptr_t, std::size_t>> old_blocks;
    std::size_t gen_live = 0;
    std::size_t live = 0;
  };
  struct live_entry {
    std::uint64_t key = 0;
    std::size_t size = 0;
    std::size_t requested = 0;
    std::uintptr_t stream = 0;
    std::int64_t rec_id = -1;   // alloc index in the current recording, -1 if none
    std::int32_t slot = -1;     // plan slot (arena or counterfactual), -1 if none
    std::uint32_t gen = 0;      // the planned iteration it belongs to
    bool in_arena = false;
    bool synced_streams = false;  // record_stream named other streams
    bool guest = false;           // lent out of the open arena under memory pressure
  };
  enum class mode { learning, in_sync, seeking };
  // One marked iteration as a plan must allow for it, stream by stream: the stream's requests
  // (keys, in its order) and, per request, the index of the stream's request before which it was
  // freed (kOutlives: not freed inside the iteration). Iterations with the same requests whose
  // order varies (timing decides where a free falls among the requests, or which of two fetches
  // comes first) are planned for all the orders seen (make_plan, map_frees), so that a plan is
  // safe for each of them, not only for the one it was recorded in.
  static constexpr std::uint32_t kOutlives = UINT32_MAX;
  struct stream_order {
    std::uintptr_t stream = 0;
    std::vector<std::uint64_t> keys;
    std::vector<std::uint32_t> frees;
  };
  struct iteration_shape {
    std::uint64_t requests_hash = 0;  // each stream's requests as a multiset
    std::size_t requests = 0;
    std::vector<stream_order> streams;  // by stream
    bool same_requests(const iteration_shape& o) const noexcept {
      return requests == o.requests && requests_hash == o.requests_hash &&
             streams.size() == o.streams.size();
    }
  };
  struct recent_iteration {
    std::uint64_t order_hash = 0;  // streams_hash
    std::size_t tokens = 0;        // 0: none recorded yet
    iteration_shape shape;
  };
  // One plan's state: its slots, their layout and its replay. The active plan's is in the
  // members below (from slots_ to memo_off_); the library's other plans (iterations of several
  // shapes) keep theirs here, and exchange_plan swaps one in.
  struct plan_state {
    std::vector<slot> slots;
    std::vector<plan_interval> plan_items;
    placement_plan plan;
    std::vector<std::uint32_t> plan_item_slot;
    std::vector<std::pair<std::uintptr_t, std::uint32_t>> by_addr;
    std::size_t max_slot_size = 0;
    iteration_shape plan_requests;
    std::vector<std::uint32_t> observed_due;
    bool later_frees = false;
    bool widening_refused = false;
    bool narrowed = false;
    std::size_t refused_bound = SIZE_MAX;
    std::size_t base_bound = 0;
    std::uint64_t anchor_hash = 0;
    std::size_t anchor_len = 0;
    std::size_t plan_period = 0;
    std::size_t outside_floor = 0;
    std::vector<lane> lanes;
    std::vector<std::uint32_t> freed_gen;
    std::vector<std::uint32_t> taken_gen;
    std::vector<std::int64_t> memo_where;
    std::vector<std::size_t> memo_off;
    std::int64_t last_pick = 0;
  };

  std::uint64_t key_of(std::size_t rounded, std::uintptr_t stream, std::string_view tag) const;
  void reserve_recording(bool request);
  void push_token(std::uint64_t token, std::int64_t delta, std::uintptr_t stream);
  static std::uint64_t window_hash(const std::uint64_t* ring, std::size_t n,
                                   std::size_t first) noexcept;
  std::uint64_t range_hash(std::size_t lo, std::size_t hi) const noexcept;
  std::uint64_t streams_hash(std::size_t lo, std::size_t hi) const;
  void reset_recording();
  void detect_steady_state();
  void make_plan(std::size_t lo, std::size_t hi);
  struct stream_group {
    std::vector<plan_interval> items;
    std::vector<std::size_t> index;  // each item's index in the whole list
  };
  static std::vector<stream_group> group_by_stream(const std::vector<plan_interval>& items,
                                                   const std::vector<std::uint32_t>& item_slot,
                                                   const std::vector<slot>& slots);
  placement_plan place_by_stream(const std::vector<plan_interval>& items,
                                 const std::vector<std::uint32_t>& item_slot,
                                 const std::vector<slot>& slots, std::string& heuristic) const;
  std::size_t per_stream_bound(const std::vector<plan_interval>& items,
                               const std::vector<std::uint32_t>& item_slot,
                               const std::vector<slot>& slots) const;
  void widen_plan();
  bool narrow_plan();
  bool lay_out_again(const std::vector<std::uint32_t>& due, std::size_t most);
  iteration_shape shape_of(std::size_t lo, std::size_t hi) const;
  static bool map_frees(const stream_order& order, const std::vector<std::uint64_t>& keys,
                        std::vector<std::uint32_t>& latest);
  iteration_shape plan_shape() const;
  bool plan_allows(const iteration_shape& shape) const;
  void deviate();
  void note_deviation() noexcept;
  void note_lost_iteration();
  void set_aside(std::uint32_t at_least = 0);
  std::size_t shape_changes() const noexcept;
  void note_shape(std::uint64_t requests) noexcept;
  void end_suspension() noexcept;
  void start_iteration();
  void start_lane(lane& l);
  void wrap_lane(lane& l);
  bool lanes_done() const noexcept;
  void count_iteration();
  lane* lane_of(std::uintptr_t stream) noexcept;
  bool ensure_arena();
  void uninstall();
  void layout_in_holes(const std::vector<fallback_hole>& claimed,
                       std::vector<std::vector<std::int64_t>>& where,
                       std::vector<std::vector<std::size_t>>& off, std::size_t& open_total,
                       std::string& heuristic, bool& shared);
  void exchange_plan(plan_state& other) noexcept;
  template <class F>
  void for_each_plan(F&& f);
  bool library_has_items() const noexcept;
  void choose_plan(std::uintptr_t stream, std::uint64_t key);
  void drop_unused_plans();
  void record_request(std::uint64_t key, std::size_t rounded, std::uintptr_t stream);
  void publish_plan_stats() noexcept;
  std::size_t counterfactual_arena_bytes() const noexcept;
  static void check_installed(const std::vector<slot>& slots, const std::vector<plan_interval>& items,
                              const std::vector<std::uint32_t>& item_slot,
                              const std::function<bool(std::uintptr_t, std::size_t)>& inside);
  void release_idle_arena();
  bool boundary_anchor_matches(std::uint64_t key) const noexcept;
  bool slot_held(std::size_t j) const noexcept;
  bool slot_taken(std::size_t j) const noexcept;
  std::uintptr_t slot_pos(std::size_t j) const noexcept;
  bool slots_overlap(std::size_t a, std::size_t b) const noexcept;  // in the arena
  bool space_free(std::size_t j) const noexcept;
  std::int64_t match_slot(const lane& l, std::uint64_t key, std::int64_t& blocked) const;
  void take_slot(std::size_t j, bool served_elsewhere = false);
  void* from_tail(std::size_t rounded, std::uintptr_t stream);
  void track_unplanned(std::int64_t delta) noexcept;
  void defer_reuse(std::uintptr_t addr, std::size_t size, std::uintptr_t stream,
                   const std::vector<std::uintptr_t>& users);
  void order_after_frees(std::uintptr_t addr, std::size_t size, std::uintptr_t stream);
  void finish_deferred();
  event_ref acquire_event();
  bool arena_quiet() const noexcept;
  bool arena_idle() const noexcept;
  void* lend_arena_space(std::size_t bytes, stream_ref stream, bool by_choice);
  std::size_t slots_before_reuse(std::uintptr_t at, std::size_t size, std::uintptr_t stream,
                                 bool& foreign) const;
  void* hand_out_unplanned(std::uintptr_t at, live_entry e);
  void* reserve_lazy_arena(std::size_t bytes);
  bool map_arena(std::uintptr_t at, std::size_t size);
  std::size_t arena_resident_bytes() const noexcept;
  // Publishes arena_resident_bytes() (stats, and the fallback's memory fraction).
  void note_arena_resident();
  // Whether the memory fraction leaves room for `bytes` more of arena.
  bool fraction_allows(std::size_t bytes) const;
  bool arena_adoptable() const noexcept;
  void give_arena_back() noexcept;
  void trace_arena_memory(trace_action a, std::uintptr_t addr, std::size_t size) const noexcept;
  void unmap_arena_pages(const std::vector<bool>& keep) noexcept;

  device_backend& device_;
  allocator_config config_;
  const bool live_mode_;
  std::mutex mutex_;
  mode mode_ = mode::learning;
  bool explicit_ = false;  // begin_iteration() was called: boundaries come from the caller

  // --- recording: tokens (allocs and frees), prefix hashes and prefix live bytes
  std::vector<std::uint64_t> prefix_hash_{0};
  std::vector<std::uint64_t> pow_{1};
  std::vector<std::int64_t> prefix_bytes_{0};
  std::vector<std::uint64_t> tokens_;
  std::size_t token_room_ = 0;    // tokens every token array has room for (reserve_recording)
  std::size_t request_room_ = 0;  // requests every rec_ array has room for
  std::vector<std::uint32_t> rec_alloc_pos_;   // token position of recorded alloc i
  std::vector<std::uint32_t> rec_free_pos_;    // token position of its free, or UINT32_MAX
  std::vector<std::size_t> rec_size_;
  std::vector<std::uintptr_t> rec_stream_;
  std::vector<std::uint64_t> rec_key_;
  std::vector<std::uintptr_t> token_stream_;  // the stream of each token (a free: its block's)
  std::unordered_map<std::uint64_t, std::uint32_t> window_seen_;
  std::size_t explicit_begin_ = 0;             // token position of begin_iteration()
  // The last explicitly marked iterations, a ring.
  std::array<recent_iteration, 4> recent_iterations_{};
  std::size_t recent_iteration_next_ = 0;
  // The marked iterations with the pending re-plan's requests whose orders it must allow for
  // (empty for a steady state found in the token stream).
  std::vector<iteration_shape> replan_orders_;

  // --- the plan
  std::vector<slot> slots_;
  std::vector<plan_interval> plan_items_;  // the planned slots' intervals, for check_invariants
  placement_plan plan_;
  std::vector<std::uint32_t> plan_item_slot_;  // plan_items_[i] is slots_[plan_item_slot_[i]]
  std::unordered_map<std::uintptr_t, std::vector<std::uintptr_t>> arena_streams_;  // record_stream
  // Arena ranges freed while streams that record_stream named may still be using them: the events
  // recorded on those streams at the free, per owning stream (the only one that reuses the space),
  // by address; the ranges of one stream are disjoint. The next block handed out over such a range
  // makes its stream wait on them on the device (order_after_frees), so the host never blocks at a
  // free, as it does not under the caching allocator's deferred frees.
  struct deferred_range {
    std::size_t size = 0;
    std::vector<event_ref> events;
  };
  std::unordered_map<std::uintptr_t, std::map<std::uintptr_t, deferred_range>> deferred_;
  std::vector<event_ref> event_pool_;  // recorded events already waited on, for reuse
  // The installed plan's slots by address, and the largest (slots_before_reuse).
  std::vector<std::pair<std::uintptr_t, std::uint32_t>> by_addr_;
  std::size_t max_slot_size_ = 0;
  // Guest blocks (lend_arena_space), sorted by address: (addr, rounded size).
  std::vector<std::pair<std::uintptr_t, std::size_t>> guests_;
  iteration_shape plan_requests_;  // the recorded iteration the plan was made from (marked)
  // The requests (iteration_shape::requests_hash) of the last marked iterations, a ring (0:
  // none; an iteration in sync counts as the plan's, one lost part way as kUnknownShape). A
  // re-plan for other requests while they keep changing (kMinShapeChanges among the last 16)
  // means iterations of several shapes alternate (sequence-length buckets drawn at random): one
  // plan at a time would be laid out again at each change, so the new plan joins a library of
  // them (more shapes than it holds set the planner aside until 16 iterations in a row are of one
  // shape). A phase of another shape, as an evaluation between training steps, replaces the plan.
  std::array<std::uint64_t, 16> recent_shapes_{};
  std::size_t recent_shape_next_ = 0;
  // Per slot: the latest lane index before which an iteration in sync freed it (0: never later
  // than planned); later_frees_ when one did since the plan was laid out (widen_plan).
  std::vector<std::uint32_t> observed_due_;
  bool later_frees_ = false;
  bool widening_refused_ = false;  // the frees seen would cost too much: no more widening
  // The device had no room for a wider layout (narrow_plan): widening goes on only below the
  // per-stream bound of the smallest one refused.
  bool narrowed_ = false;
  std::size_t refused_bound_ = SIZE_MAX;
  std::size_t base_bound_ = 0;     // the recorded order's per-stream bound (kMaxWidening)
  // Resynchronisation after a deviation: the lead lane's stream's last tokens before the
  // boundary (anchor_len_ of them, hashed), and the last ones seen while seeking (a ring).
  static constexpr std::size_t kAnchorTokens = 16;
  std::uint64_t anchor_hash_ = 0;
  std::size_t anchor_len_ = 0;
  // One more than the anchor: forget_refused_request takes the last token back, and the anchor's
  // oldest must survive the slot that token overwrote.
  static constexpr std::size_t kLeadRing = kAnchorTokens + 1;
  std::array<std::uint64_t, kLeadRing> lead_window_{};
  std::size_t lead_seen_ = 0;
  std::size_t plan_period_ = 0;          // tokens per iteration
  void* arena_ = nullptr;
  std::size_t arena_bytes_ = 0;
  std::int64_t arena_reservations_ = 0;
  // A lazily mapped arena (when the device refused to reserve it whole and has virtual memory):
  // an address range of arena_range_bytes_ whose pages of arena_page_ bytes are mapped as slots
  // first reach them, so that the arena fills as the blocks of the iteration before the
  // installation (the fallback's) are freed. Pages stay mapped until the arena goes back, or until
  // the caching allocator runs out of memory and they hold no live block (unmap_under_pressure).
  bool arena_lazy_ = false;
  std::size_t arena_page_ = 0;
  std::size_t arena_range_bytes_ = 0;
  std::vector<bool> arena_mapped_;  // per page
  std::size_t arena_mapped_bytes_ = 0;
  std::size_t outside_floor_ = 0;  // make_plan: the recorded iteration's least live outside the plan
  std::function<fallback_totals()> release_fallback_cache_;
  std::function<std::vector<fallback_hole>()> claim_holes_;
  std::function<void(void*)> release_hole_;
  std::function<fallback_totals()> fallback_totals_;
  std::function<void(bool)> fallback_exact_;
  std::function<std::size_t()> fallback_room_;
  std::function<std::size_t()> fallback_allowed_;
  std::function<void(std::size_t)> fallback_resident_;
  std::function<void(void*, std::size_t, std::uintptr_t)> adopt_segment_;
  std::function<void(trace_action, const void*, std::size_t, std::uintptr_t)> trace_segment_;
  std::function<void(std::uintptr_t, std::size_t, std::size_t, const std::vector<std::uintptr_t>&)>
      adopt_;
  // The installed plan's memory: the open arena (arena_, arena_bytes_, may be empty) plus the
  // fallback's holes it reuses (holes_, sorted by address, hole_bytes_ in all). The fallback counts
  // the holes as allocated; the accounting below counts them as the arena's instead.
  bool installed_ = false;
  std::vector<fallback_hole> holes_;
  // A range of the arena that belongs to one stream.
  struct stream_span {
    std::uintptr_t addr = 0;
    std::size_t size = 0;
    std::uintptr_t stream = 0;
  };
  // The claimed holes' tails beyond the layout's extent, and the blocks served there (sorted by
  // address): requests outside the plan use them (from_tail).
  std::vector<stream_span> tails_;
  std::vector<std::pair<std::uintptr_t, std::size_t>> tail_live_;
  std::size_t hole_bytes_ = 0;
  std::size_t small_holes_ = 0, small_hole_bytes_ = 0;  // of those, in the small pool
  bool holes_since_reset_ = false;
  struct layout_memo {  // the last installation's layout of the library's plans
    bool valid = false;
    std::vector<fallback_hole> holes;  // the holes it used (size: the extent it needs)
    std::size_t open = 0;
    bool shared = false;               // some stream's slots lie in another stream's hole
  } memo_;  // the fallback's own peaks then count claimed holes
  // The active plan's part of it, per plan item: the index into memo_.holes (or -1: the open
  // region), and the offset there.
  std::vector<std::int64_t> memo_where_;
  std::vector<std::size_t> memo_off_;
  // The library: the plans of the other shapes of iterations that alternate (sequence-length
  // buckets), all laid out in the one installed arena, each stream's slots of every plan in that
  // stream's part of it. A marked iteration's first requests pick the plan (choose_plan).
  std::vector<plan_state> shelf_;
  std::int64_t last_pick_ = 0;  // stats_.iterations when the active plan was made or last picked
  // The installed library's slots, every plan's, by address (which stream's part of the arena
  // each address is), and the streams of all their lanes.
  std::vector<stream_span> owners_;
  std::size_t max_owner_size_ = 0;
  std::vector<std::uintptr_t> owner_streams_;
  // The next request is among a marked iteration's first, which pick the plan: the first one, or
  // one while several plans start with the requests so far (undecided: mode_ is seeking then).
  bool choosing_ = false;
  std::vector<std::uint32_t> candidates_;  // those plans: 0 the active one, i + 1 shelf_[i]
  std::vector<std::pair<std::uintptr_t, std::uint32_t>> undecided_;  // requests so far, by stream
  // Requests of a marked iteration in sync still recorded (try_allocate), and the recording's
  // index of the request try_allocate last saw (-1: not recorded).
  std::uint32_t shadow_left_ = 0;
  std::int64_t request_rec_ = -1;
  bool replan_adds_ = false;  // the pending re-plan joins the library (the active plan is kept)
  bool replan_pending_ = false;
  std::size_t replan_lo_ = 0, replan_hi_ = 0;

  // --- replay of the plan
  std::vector<lane> lanes_;  // the first is slot 0's, the lead: its wraps count the iterations
  bool iteration_deviated_ = false;
  std::vector<std::uint32_t> freed_gen_;  // per slot: its lane's generation in which it was freed
  std::vector<std::uint32_t> taken_gen_;  // per slot: ... in which it was handed out
  std::uint32_t outcomes_ = 0;            // the last iterations under the plan, newest in bit 0:
                                          // 1 = it left the plan (its trailing ones: in a row)
  std::uint32_t kept_in_row_ = 0;         // iterations in a row that kept to it
  std::uint32_t suspend_left_ = 0;        // iterations the plan still sits out
  bool set_aside_for_shapes_ = false;     // ... because shapes alternate (shape_changes)
  std::uint32_t suspend_next_ = 8;        // the next suspension's length (kFirstSuspension)
  std::size_t slot_live_ = 0;             // live blocks holding a plan slot (arena or virtual)
  std::size_t arena_live_bytes_ = 0;
  std::size_t arena_live_requested_ = 0;
  std::size_t arena_live_count_ = 0;
  std::int64_t pending_slot_ = -1;        // the slot try_allocate chose for the fallback call
  bool recorded_pending_ = false;         // try_allocate recorded the request the fallback serves

  std::unordered_map<std::uintptr_t, live_entry> live_;

  // --- accounting
  planner_stats stats_;
  std::int64_t unplanned_live_ = 0;
  fallback_totals last_totals_{};
  std::int64_t peak_reserved_ = 0, peak_allocated_ = 0, peak_requested_ = 0;
  std::int64_t peak_allocations_ = 0;  // allocation.all.peak, as peak_allocated_
  // What merge_into adds to the fallback's accumulated counts (`allocated` and `freed` of the
  // allocation, active, *_bytes families) per pool since reset_accumulated: the arena's blocks,
  // less the claimed holes (allocations of the fallback, never the caller's) and the blocks the
  // fallback adopted (allocated there once already). See count_accumulated.
  struct acc_delta {
    std::int64_t n = 0, bytes = 0, requested = 0;
  };
  acc_delta acc_allocated_[3], acc_freed_[3];
  // The small (1) and large (2) pools' peaks of allocation, allocated_bytes and requested_bytes,
  // kept as the `all` ones are (index 0 unused).
  acc_delta pool_peak_[3];
  void count_accumulated(acc_delta* side, int pool, std::int64_t n, std::int64_t bytes,
                         std::int64_t requested) noexcept {
    for (int i : {0, pool}) {
      side[i].n += n;
      side[i].bytes += bytes;
      side[i].requested += requested;
    }
  }
  void count_hole(acc_delta* side, const fallback_hole& h) noexcept {
    const auto b = static_cast<std::int64_t>(h.size);
    count_accumulated(side, h.small_pool ? 1 : 2, -1, -b, -b);  // claimed with requested = size
  }
};

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

}  // namespace terrace::detail
