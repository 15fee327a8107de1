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
//
// This file holds the request path (try_allocate, on_free, record_stream), the replay of a plan
// lane by lane, and the iteration marks. The rest of the policy is in plan_front_recording.cpp
// (tokens and the steady state), plan_front_planning.cpp (slots and their layout),
// plan_front_arena.cpp (the arena's memory), plan_front_library.cpp (plans of several shapes)
// and plan_front_report.cpp (stats, snapshot, invariants); plan_front_common.hpp has the tuning
// constants they share.
#include "allocator/plan_front.hpp"

#include <algorithm>
#include <bit>
#include <new>
#include <utility>

#include "allocator/plan_front_common.hpp"
#include "terrace/error.hpp"

namespace terrace::detail {

using namespace plan_tuning;

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
      count_accumulated(acc_allocated_, 2, 1, static_cast<std::int64_t>(rounded),
                        static_cast<std::int64_t>(bytes));
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

void plan_front::on_fallback_alloc(void* p, std::size_t bytes, stream_ref stream) {
  live_entry e;
  e.size = round_up(bytes);
  e.requested = bytes;
  e.stream = reinterpret_cast<std::uintptr_t>(stream.native);
  e.rec_id = request_rec_;  // recorded, if try_allocate recorded the request
  const std::int64_t j = std::exchange(pending_slot_, -1);
  lane* l = j >= 0 ? &lanes_[slots_[static_cast<std::size_t>(j)].lane] : nullptr;
  if (l != nullptr) {
    e.slot = static_cast<std::int32_t>(j);
    e.gen = l->gen;
  }
  // The entry first: if the host has no memory for it, nothing is counted (the caller gives
  // the block back to the fallback).
  live_.emplace(reinterpret_cast<std::uintptr_t>(p), e);
  if (l != nullptr) {
    ++slot_live_;
    ++l->live;
    ++l->gen_live;
  } else {
    track_unplanned(static_cast<std::int64_t>(e.size));
  }
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
  const bool recorded = mode_ != mode::in_sync || shadow_left_ > 0;
  if (recorded) {
    if (tokens_.size() >= kMaxRecordTokens) reset_recording();
    reserve_recording(/*request=*/false);  // before the entry goes: a failure frees nothing
  }
  const live_entry e = it->second;
  live_.erase(it);
  if (recorded) {
    if (e.rec_id >= 0 && static_cast<std::size_t>(e.rec_id) < rec_free_pos_.size()) {
      rec_free_pos_[static_cast<std::size_t>(e.rec_id)] = static_cast<std::uint32_t>(tokens_.size());
    }
    push_token(mix(e.key ^ 0x5bd1e995ull) ^ e.size, -static_cast<std::int64_t>(e.size), e.stream);
    try {
      detect_steady_state();
    } catch (const std::bad_alloc&) {
      // The free has happened: a host with no memory to look for the steady state (or plan it)
      // skips the look rather than fail the free. The next token looks again.
    }
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
  count_accumulated(acc_freed_, 2, 1, static_cast<std::int64_t>(e.size),
                    static_cast<std::int64_t>(e.requested));
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

void plan_front::begin_iteration() {
  // Marked again before any request of the iteration it started (a trainer's loop and a library
  // under it both marking the step): the same start, not an iteration that left the plan.
  if (explicit_ && mode_ == mode::in_sync && shadow_left_ == kShadowRequests) return;
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
  // This closes [lo, hi): an end_iteration again before the next begin_iteration would otherwise
  // compare the iteration with itself and find it repeated.
  explicit_begin_ = hi;
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

void plan_front::end_suspension() noexcept {
  suspend_left_ = 0;
  set_aside_for_shapes_ = false;
  outcomes_ = 0;
}

}  // namespace terrace::detail
