// SPDX-License-Identifier: Apache-2.0
// The stream-ordered caching allocator. Policy only: every byte comes from a device_backend.
//
// Sections: sizes and pools / allocation / free and stream events / expandable segments /
// releasing cached memory / out-of-memory report / stats, snapshot, invariants.
#include "terrace/caching_allocator.hpp"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include "allocator/block.hpp"
#include "allocator/node_stash.hpp"
#include "allocator/reserve_room.hpp"
#include "allocator/plan_front.hpp"
#include "allocator/stream_uses.hpp"
#include "terrace/error.hpp"

namespace terrace {
namespace detail {

namespace {

constexpr std::size_t kMinBlockSize = 512;  // every size rounds up to this (PyTorch's kMinBlockSize)

std::size_t round_up(std::size_t n, std::size_t multiple) noexcept {
  return (n + multiple - 1) / multiple * multiple;
}
std::size_t round_down(std::size_t n, std::size_t multiple) noexcept {
  return n / multiple * multiple;
}

std::string format_bytes(std::size_t n) {
  char buf[64];
  const double v = static_cast<double>(n);
  if (n >= (std::size_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", v / (1 << 30));
  } else if (n >= (std::size_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", v / (1 << 20));
  } else if (n >= (std::size_t{1} << 10)) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", v / (1 << 10));
  } else {
    std::snprintf(buf, sizeof buf, "%zu bytes", n);
  }
  return buf;
}

std::string format_addr(std::uintptr_t a) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, a);
  return buf;
}

}  // namespace

class allocator_impl {
 public:
  allocator_impl(device_backend& device, allocator_config config)
      : device_(device), config_(std::move(config)), start_(std::chrono::steady_clock::now()) {
    const auto& props = device_.properties();
    TERRACE_EXPECTS(config_.memory_fraction > 0.0 && config_.memory_fraction <= 1.0,
                    "memory_fraction must be in (0, 1]");
    TERRACE_EXPECTS(!config_.expandable_segments || props.supports_vmm,
                    "expandable_segments needs a backend with virtual memory (sim, null, cuda-vmm); '" +
                        props.name + "' has none");
    TERRACE_EXPECTS(config_.small_segment_size >= config_.small_size,
                    "small_segment_size must be at least small_size");
    TERRACE_EXPECTS(config_.large_round > 0 && config_.large_segment_size > 0,
                    "segment sizes must be positive");
    // round_size's steps are 2^k / divisions: only a power of two keeps them whole granules
    // (3 gave sizes, and so block addresses, off the 512-byte boundary).
    const unsigned divisions = config_.roundup_power2_divisions;
    TERRACE_EXPECTS(divisions <= 64 && (divisions & (divisions - 1)) == 0,
                    "roundup_power2_divisions must be 0 (off) or a power of two from 1 to 64, got " +
                        std::to_string(divisions));
    // The bounds TERRACE_ALLOC_CONF holds these keys to (config.cpp), for a config made in code.
    const double gc = config_.garbage_collection_threshold;
    TERRACE_EXPECTS(gc >= 0.0 && gc < 1.0,  // false for NaN too
                    "garbage_collection_threshold must be in [0, 1) (0 = off), got " + std::to_string(gc));
    TERRACE_EXPECTS(config_.plan_min_period >= 16 && config_.plan_min_period <= (std::size_t{1} << 30),
                    "plan_min_period must be in [16, 2^30], got " + std::to_string(config_.plan_min_period));
    TERRACE_EXPECTS(config_.trace_max_events >= 1, "trace_max_events must be >= 1");
    granularity_ = std::max<std::size_t>(props.map_granularity, kMinBlockSize);
    tracing_ = config_.record_trace;
    memory_fraction_ = config_.memory_fraction;
    spare_blocks_.reserve(kSpareBlocksKept);  // delete_block's push_back never reallocates
  }

  ~allocator_impl() {
    std::lock_guard<std::mutex> lock(mutex_);
    try {
      wait_for_pending_frees();
      device_.synchronize_device();
    } catch (...) {
      // A failing device at teardown: the memory goes back below regardless.
    }
    for (auto it = segments_.begin(); it != segments_.end();) {
      segment* seg = it->second;
      ++it;
      give_back_segment(seg, /*even_if_used=*/true);
    }
    for (event_ref e : event_pool_) device_.destroy_event(e);
    for (block* b : spare_blocks_) delete b;
  }

  // ---------------------------------------------------------------- sizes and pools

  std::size_t round_size(std::size_t bytes) const noexcept {
    if (bytes < kMinBlockSize) return kMinBlockSize;
    const unsigned divisions = config_.roundup_power2_divisions;
    if (divisions > 1 && bytes > kMinBlockSize) {
      // Round up to one of `divisions` equal steps between the surrounding powers of two, which
      // bounds waste to 1/divisions while letting similar sizes share blocks.
      std::size_t floor_pow2 = std::size_t{1} << (63 - __builtin_clzll(bytes));
      if (floor_pow2 != bytes) {
        const std::size_t step = std::max(floor_pow2 / divisions, kMinBlockSize);
        return round_up(bytes, step);
      }
    }
    return round_up(bytes, kMinBlockSize);
  }

  bool is_small(std::size_t rounded) const noexcept { return rounded <= config_.small_size; }

  free_set& pool_of(bool small) noexcept { return small ? small_free_ : large_free_; }
  static int pool_index(bool small) noexcept { return small ? 1 : 2; }

  std::size_t segment_size_for(std::size_t rounded) const noexcept {
    if (is_small(rounded)) return config_.small_segment_size;
    // A large_round near SIZE_MAX would wrap the rounding past SIZE_MAX to a tiny size (0 bytes,
    // which backends refuse): no such segment exists, so ask for one no device can hold.
    if (rounded > SIZE_MAX - config_.large_round) return SIZE_MAX;
    const std::size_t exact = round_up(rounded, config_.large_round);
    // A large_segment_size below min_large_alloc leaves requests between the two: they get a
    // segment of their own size, never one smaller than themselves.
    if (rounded < config_.min_large_alloc && !exact_large_segments_) {
      return std::max(config_.large_segment_size, exact);
    }
    return exact;
  }

  // PyTorch's split rule: keep a remainder only if it is worth a block of its pool. Blocks of
  // expandable segments always split (as PyTorch's should_split does under expandable_segments):
  // they are carved from page-granular mappings, so keeping the remainder would hand out, and count
  // as allocated, up to a whole map granule per request; max_split_size guards plain segments that
  // can only go back whole, while any free page of an expandable segment can be unmapped.
  bool should_split(const block* b, std::size_t rounded) const noexcept {
    const std::size_t remaining = b->size - rounded;
    if (b->seg->small_pool || b->seg->expandable) return remaining >= kMinBlockSize;
    return rounded < config_.max_split_size && remaining > config_.small_size;
  }

  // PyTorch's oversize_segments: a plain segment of at least max_split_size, whose blocks serve
  // only oversize requests. Expandable segments are not (they ignore max_split_size, and their
  // size changes as they grow).
  bool is_oversize(const segment& seg) const noexcept {
    return !seg.expandable && seg.size >= config_.max_split_size;
  }

  std::size_t allowed_bytes() const noexcept {
    const std::size_t capacity = device_.properties().capacity;
    const double allowed = static_cast<double>(capacity) * memory_fraction_;
    // A capacity within 1 KiB of 2^64 is 2^64 as a double, which no size_t holds (converted, it
    // read as 0 on x86-64: every request refused on an empty device).
    return allowed >= static_cast<double>(capacity) ? capacity : static_cast<std::size_t>(allowed);
  }

  // Whether `more` bytes fit under the memory fraction beside what is held; `more` may be as
  // large as SIZE_MAX, which the sum capped_total() + more would wrap.
  bool fraction_allows(std::size_t more) const noexcept {
    const std::size_t allowed = allowed_bytes();
    const std::size_t held = capped_total();
    return held <= allowed && more <= allowed - held;
  }

  // ---------------------------------------------------------------- allocation

  // `final_try` false: the caller (the planned policy) has more ways to serve the request, so an
  // out-of-memory here is not yet the caller's: not counted, not traced (see note_oom).
  void* allocate(std::size_t bytes, stream_ref stream, std::string_view tag, bool final_try = true) {
    if (bytes == 0) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    if (!pending_.empty()) process_completed_frees();
    prepare_books();
    std::string kept_tag = tracing_ ? std::string(tag) : std::string();
    const std::size_t rounded = round_size(bytes);
    const bool small = is_small(rounded);
    const auto s = reinterpret_cast<std::uintptr_t>(stream.native);

    block* b = find_free_block(small, s, rounded);
    if (b == nullptr) b = obtain_new_memory(small, s, rounded, bytes, final_try);
    // The last step that may fail (its node is allocated) comes first: if the host refuses it, b
    // is still a free block in its set and nothing else has changed.
    enter_live(b);
    b = take_block(b, rounded);  // splits as needed, with the spares prepare_books made ready
    b->tag = std::move(kept_tag);
    hand_out(b, bytes);
    if (tracing_) trace(trace_action::alloc, s, b->addr, b->size, bytes, b->tag);
    return reinterpret_cast<void*>(b->addr);
  }

  // A request near SIZE_MAX (a negative size cast, say) would wrap to a tiny size in rounding and
  // be handed a block that is already live: out of memory at once, before any rounding. Smaller
  // requests beyond the device take the ordinary path, whose report shows the allocator's state.
  void refuse_impossible(std::size_t bytes, stream_ref stream) {
    if (bytes <= (SIZE_MAX >> 2)) return;
    const auto& props = device_.properties();
    std::lock_guard<std::mutex> lock(mutex_);
    // As the ordinary path does: the trace shows every out-of-memory error the stats count. No
    // rounding: the size is beyond it.
    count_oom(reinterpret_cast<std::uintptr_t>(stream.native), bytes, bytes);
    throw out_of_memory("terrace: out of memory on device '" + props.name + "' " +
                        std::to_string(props.device_index) + ": tried to allocate " +
                        std::to_string(bytes) + " bytes, more than the device's capacity (" +
                        format_bytes(props.capacity) + ")");
  }

  // Everything a call's changes to the books may need, made ready before its first change, so
  // that a host out of memory (std::bad_alloc) finds nothing half done: the spare blocks that
  // splits take and the nodes that set insertions take (node_stash). Three of each cover the
  // most one allocation uses: a new expandable range's head, its mapped hole's unmapped rest and
  // the request's split remainder. @throws std::bad_alloc, having changed nothing.
  void prepare_books() {
    while (spare_blocks_.size() < 3) spare_blocks_.push_back(new block());
    free_nodes_.ensure(3);
    unmapped_nodes_.ensure(3);
  }

  // b's entry in the live table: the one insertion of an allocation that allocates, so it is
  // made before any other change. @throws std::bad_alloc, having changed nothing.
  void enter_live(block* b) { live_.emplace(b->addr, b); }

  // b, out of every free set and entered in the live table, becomes a live allocation of
  // `requested` bytes, and is counted.
  void hand_out(block* b, std::size_t requested) noexcept {
    b->allocated = true;
    b->requested = requested;
    if (b->size >= config_.max_split_size) stats_.oversize_allocations.increase(1);
    for (int i : {0, pool_index(b->seg->small_pool)}) {
      stats_.allocation[i].increase(1);
      stats_.allocated_bytes[i].increase(static_cast<std::int64_t>(b->size));
      stats_.requested_bytes[i].increase(static_cast<std::int64_t>(requested));
      stats_.active[i].increase(1);
      stats_.active_bytes[i].increase(static_cast<std::int64_t>(b->size));
    }
  }

  // The segment whose range holds addr, or nullptr.
  segment* segment_containing(std::uintptr_t addr) const {
    auto it = segments_.upper_bound(addr);
    if (it == segments_.begin()) return nullptr;
    segment* seg = std::prev(it)->second;
    return addr < seg->addr + seg->size ? seg : nullptr;
  }

  // Best fit on the request's stream. Oversize blocks (>= max_split_size) of plain segments serve
  // only oversize requests, and only when not much larger, so that huge blocks are not whittled
  // away by small ones. Expandable segments ignore max_split_size (see should_split): refusing one
  // of their free blocks would map fresh pages while mapped free memory sits idle, and could even
  // fail the allocation, since grow_expandable leaves a mapped free block that fits to this search.
  block* find_free_block(bool small, std::uintptr_t stream, std::size_t rounded) {
    free_set& pool = pool_of(small);
    block key;
    key.stream = stream;
    key.size = rounded;
    key.addr = 0;
    auto it = pool.lower_bound(&key);
    if (it == pool.end() || (*it)->stream != stream) return nullptr;
    block* b = *it;
    const std::size_t max_split = config_.max_split_size;
    if (max_split != SIZE_MAX && !b->seg->expandable) {
      if (rounded < max_split && b->size >= max_split) return nullptr;
      if (rounded >= max_split && b->size >= rounded + config_.large_segment_size) return nullptr;
    }
    return b;
  }

  // A miss: new memory from the device; on failure release the cache and retry once; then OOM.
  block* obtain_new_memory(bool small, std::uintptr_t stream, std::size_t rounded,
                           std::size_t requested, bool final_try) {
    maybe_collect_garbage(rounded);
    prepare_books();  // what the collection's unmapping used
    if (block* b = try_new_memory(small, stream, rounded)) return b;
    ++stats_.num_alloc_retries;
    release_cached_memory();
    prepare_books();
    // Waiting for the pending frees may have made a block that fits reusable.
    if (block* b = find_free_block(small, stream, rounded)) return b;
    address_space_refusal_.clear();  // the report tells why the retry failed, not the first try
    if (block* b = try_new_memory(small, stream, rounded)) return b;
    if (final_try) count_oom(stream, rounded, requested);
    throw out_of_memory(oom_report(requested, rounded, stream));
  }

  void count_oom(std::uintptr_t stream, std::size_t rounded, std::size_t requested) {
    ++stats_.num_ooms;
    if (tracing_) trace(trace_action::oom, stream, 0, rounded, requested, {});
  }

  /// An out-of-memory of allocate(..., final_try = false) that reaches the caller after all.
  void note_oom(std::size_t bytes, stream_ref stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    count_oom(reinterpret_cast<std::uintptr_t>(stream.native), round_size(bytes), bytes);
  }

  // nullptr when the device (or the memory fraction) refuses; device_error propagates.
  block* try_new_memory(bool small, std::uintptr_t stream, std::size_t rounded) {
    if (config_.expandable_segments) return grow_expandable(small, stream, rounded);
    const std::size_t size = segment_size_for(rounded);
    if (!fraction_allows(size)) return nullptr;
    void* p = nullptr;
    try {
      p = device_.reserve(size);
    } catch (const out_of_memory&) {
      return nullptr;
    }
    segment* seg = nullptr;
    try {
      seg = new_segment(reinterpret_cast<std::uintptr_t>(p), size, stream, small, false);
    } catch (...) {
      device_.release(p, size);  // memory that never entered the books goes back
      throw;
    }
    count_reserved(seg, static_cast<std::int64_t>(size));
    ++stats_.num_device_alloc;
    if (tracing_) trace(trace_action::segment_alloc, stream, seg->addr, size, 0, {});
    insert_free(seg->head);
    return seg->head;
  }

  // Puts a free mapped block into its pool, counting it as inactive split if it is a piece.
  void insert_free(block* b) noexcept {
    if (b->is_split()) count_inactive_split(b, +1);
    free_nodes_.insert(pool_of(b->seg->small_pool), b);
  }

  // A segment in segments_, or (std::bad_alloc) nothing changed.
  segment* new_segment(std::uintptr_t addr, std::size_t size, std::uintptr_t stream, bool small,
                       bool expandable) {
    auto seg = std::make_unique<segment>();
    seg->addr = addr;
    seg->size = size;
    seg->stream = stream;
    seg->small_pool = small;
    seg->expandable = expandable;
    block* head = new_block();
    head->addr = addr;
    head->size = size;
    head->stream = stream;
    head->seg = seg.get();
    seg->head = head;
    try {
      segments_.emplace(addr, seg.get());
    } catch (...) {
      delete_block(head);
      throw;
    }
    segment* raw = seg.release();
    const int p = pool_index(small);
    if (is_oversize(*raw)) stats_.oversize_segments.increase(1);
    stats_.segment[0].increase(1);
    stats_.segment[p].increase(1);
    return raw;
  }

  // REQUIRES: b is free, mapped and in its pool's set. Takes exactly `rounded` bytes of it,
  // splitting off the rest as a free block.
  block* take_block(block* b, std::size_t rounded) {
    TERRACE_EXPECTS(b->size >= rounded, "caching allocator: a block smaller than its request");
    free_set& pool = pool_of(b->seg->small_pool);
    free_nodes_.erase(pool, b);
    if (b->is_split()) count_inactive_split(b, -1);
    if (b->size > rounded && should_split(b, rounded)) {
      block* rest = new_block();
      rest->addr = b->addr + rounded;
      rest->size = b->size - rounded;
      rest->stream = b->stream;
      rest->seg = b->seg;
      rest->mapped = true;
      rest->prev = b;
      rest->next = b->next;
      if (b->next) b->next->prev = rest;
      b->next = rest;
      b->size = rounded;
      count_inactive_split(rest, +1);
      free_nodes_.insert(pool, rest);
    }
    return b;
  }

  // ---------------------------------------------------------------- free and stream events

  void deallocate(void* p) {
    if (p == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    auto it = live_.find(addr);
    if (it == live_.end()) throw logic_error(describe_bad_pointer(addr, "free"));
    block* b = it->second;
    // Room first, for the events coming back, the pending entry and the free set's node: a host
    // out of memory then fails the free before anything has changed.
    free_nodes_.ensure(1);
    if (!b->used_streams.empty()) {
      reserve_room(event_pool_, b->used_streams.size());
      reserve_room(pending_, 1);
    }
    // Events next: only if the device can neither record them nor be waited for does the free
    // fail, and then the block stays live and nothing has changed.
    std::vector<event_ref> events;
    if (!b->used_streams.empty()) {
      events = detail::mark_stream_uses(
          device_, b->used_streams, [&] { return acquire_event(); },
          [&](event_ref e) { event_pool_.push_back(e); });
      if (events.empty()) b->used_streams.clear();  // waited for: nothing left to mark
    }
    live_.erase(it);
    b->allocated = false;
    if (b->size >= config_.max_split_size) stats_.oversize_allocations.decrease(1);
    const bool small = b->seg->small_pool;
    const int pi = pool_index(small);
    for (int i : {0, pi}) {
      stats_.allocation[i].decrease(1);
      stats_.allocated_bytes[i].decrease(static_cast<std::int64_t>(b->size));
      stats_.requested_bytes[i].decrease(static_cast<std::int64_t>(b->requested));
    }
    if (tracing_) trace(trace_action::free_requested, b->stream, b->addr, b->size, b->requested, b->tag);
    b->requested = 0;
    if (!events.empty()) {
      // Work queued on those streams may still use the block: it becomes reusable only once the
      // event recorded on each of them above has completed.
      pending_free pf{b, std::move(events)};
      b->pending_events = static_cast<int>(pf.events.size());
      b->used_streams.clear();
      pending_.push_back(std::move(pf));
      return;
    }
    complete_free(b);
  }

  void record_stream(void* p, stream_ref stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    auto it = live_.find(addr);
    if (it == live_.end()) throw logic_error(describe_bad_pointer(addr, "record_stream"));
    block* b = it->second;
    const auto s = reinterpret_cast<std::uintptr_t>(stream.native);
    if (s == b->stream) return;
    if (std::find(b->used_streams.begin(), b->used_streams.end(), s) == b->used_streams.end()) {
      b->used_streams.push_back(s);
    }
  }

  // The block is reusable: merge it with free neighbours and put it back in its pool.
  void complete_free(block* b) {
    const bool small = b->seg->small_pool;
    const int pi = pool_index(small);
    for (int i : {0, pi}) {
      stats_.active[i].decrease(1);
      stats_.active_bytes[i].decrease(static_cast<std::int64_t>(b->size));
    }
    if (tracing_) trace(trace_action::free_completed, b->stream, b->addr, b->size, 0, b->tag);
    b->tag.clear();
    b->pending_events = 0;
    insert_free(merge_free_neighbours(b));
  }

  // REQUIRES: b is free and not in the free set. Absorbs free neighbours of the same mapped state.
  // Unmapped blocks are never in a free set (find_free_block must not return address space without
  // memory), so erasing them is a no-op.
  block* merge_free_neighbours(block* b) {
    free_set& pool = pool_of(b->seg->small_pool);
    if (block* n = b->next; n != nullptr && n->is_free() && n->mapped == b->mapped) {
      free_nodes_.erase(pool, n);
      if (!n->mapped) unmapped_nodes_.erase(b->seg->unmapped, n);
      if (n->mapped && n->is_split()) count_inactive_split(n, -1);
      b->size += n->size;
      b->next = n->next;
      if (n->next) n->next->prev = b;
      delete_block(n);
    }
    if (block* pv = b->prev; pv != nullptr && pv->is_free() && pv->mapped == b->mapped) {
      free_nodes_.erase(pool, pv);
      if (!b->mapped) unmapped_nodes_.erase(b->seg->unmapped, b);
      if (pv->mapped && pv->is_split()) count_inactive_split(pv, -1);
      pv->size += b->size;
      pv->next = b->next;
      if (b->next) b->next->prev = pv;
      delete_block(b);
      b = pv;
    }
    return b;
  }

  // Moves blocks whose events have all completed back to their pools. Never blocks.
  void process_completed_frees() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      bool done = true;
      for (event_ref e : it->events) {
        if (!device_.query(e)) {
          done = false;
          break;
        }
      }
      if (!done) {
        ++it;
        continue;
      }
      reserve_room(event_pool_, it->events.size());
      free_nodes_.ensure(1);
      for (event_ref e : it->events) event_pool_.push_back(e);
      complete_free(it->b);
      it = pending_.erase(it);
    }
  }

  // Blocks until every pending free has completed.
  // If a synchronisation throws, the frees completed so far are gone from the list and the rest
  // stay pending, whole.
  void wait_for_pending_frees() {
    std::size_t done = 0;
    try {
      for (; done < pending_.size(); ++done) {
        pending_free& pf = pending_[done];
        reserve_room(event_pool_, pf.events.size());
        free_nodes_.ensure(1);
        for (event_ref e : pf.events) device_.synchronize(e);
        for (event_ref e : pf.events) event_pool_.push_back(e);
        complete_free(pf.b);
      }
    } catch (...) {
      pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(done));
      throw;
    }
    pending_.clear();
  }

  event_ref acquire_event() {
    if (!event_pool_.empty()) {
      event_ref e = event_pool_.back();
      event_pool_.pop_back();
      return e;
    }
    return device_.create_event();
  }

  // ---------------------------------------------------------------- expandable segments

  // The expandable segments of (stream, pool): virtual ranges as large as the device, whose pages
  // are mapped as the pool grows. Returns an unmapped free block that can hold `rounded`, possibly
  // extending a mapped free block just before it; nullptr if the device is exhausted. Usually one
  // range per (stream, pool); another is reserved when live blocks scattered through the ranges
  // leave no hole large enough, though the device has room (as PyTorch's expandable segments do),
  // and a range whose pages are all unmapped goes back at the next empty_cache.
  block* grow_expandable(bool small, std::uintptr_t stream, std::size_t rounded) {
    // A request larger than the device can never be mapped: out of memory, with its report,
    // rather than the backend's failure to reserve so large a range.
    if (rounded > allowed_bytes()) return nullptr;
    std::vector<segment*>& ranges = expandable_[expandable_key{stream, small}];
    for (segment* seg : ranges) {
      bool device_full = false;
      if (block* b = map_hole(seg, rounded, device_full)) return b;
      if (device_full) return nullptr;
    }
    // No hole anywhere: a new range, unless the device could not map the request's pages anyway
    // (the range would stay behind, reserved and empty, until the next empty_cache).
    if (!fraction_allows(round_up(rounded, granularity_))) return nullptr;
    // Whole pages, rounded down where rounding up would wrap past SIZE_MAX (to a range of 0 bytes);
    // `rounded` is within the capacity (checked above), so it still fits.
    const std::size_t want = std::max(device_.properties().capacity, rounded);
    const std::size_t range = want > SIZE_MAX - granularity_ ? round_down(want, granularity_)
                                                             : round_up(want, granularity_);
    reserve_room(ranges, 1);
    void* p = nullptr;
    try {
      p = device_.reserve_address_range(range);
    } catch (const out_of_memory& e) {
      // Address space, not memory, ran out (ranges as large as the device, one per stream and
      // pool): the caller's retry after releasing the cache frees the ranges left empty, and
      // the out-of-memory report says which of the two ran out.
      address_space_refusal_ = e.what();
      return nullptr;
    }
    segment* seg = nullptr;
    try {
      seg = new_segment(reinterpret_cast<std::uintptr_t>(p), range, stream, small, true);
    } catch (...) {
      device_.release_address_range(p, range);
      throw;
    }
    seg->head->mapped = false;  // address space only: kept out of the free set
    unmapped_nodes_.insert(seg->unmapped, seg->head);
    ranges.push_back(seg);
    bool device_full = false;
    return map_hole(seg, rounded, device_full);
  }

  // An unmapped hole of `seg` large enough (with the mapped free block before it), the lowest
  // first, mapped and returned as a free block; nullptr if none, with device_full set when one
  // fits but the device (or the memory fraction) refuses its pages.
  block* map_hole(segment* seg, std::size_t rounded, bool& device_full) {
    for (block* b : seg->unmapped) {
      const std::size_t have = (b->prev && b->prev->is_free() && b->prev->mapped) ? b->prev->size : 0;
      if (b->size + have < rounded) continue;
      const std::size_t need = round_up(rounded - std::min(have, rounded), granularity_);
      if (need == 0) continue;  // the mapped free neighbour alone fits: find_free_block missed it
      if (!fraction_allows(need)) {
        device_full = true;
        return nullptr;
      }
      try {
        b = map_for(b, rounded);
      } catch (const out_of_memory&) {
        device_full = true;
        return nullptr;
      }
      insert_free(b);
      return b;
    }
    return nullptr;
  }

  // REQUIRES: b unmapped and free. Maps just enough pages at b's start so that (its mapped free
  // predecessor + the new pages) holds `rounded`, and returns the resulting mapped free block, which
  // is in no set and not counted as inactive split. If the device refuses, nothing has changed.
  block* map_for(block* b, std::size_t rounded) {
    block* pv = (b->prev && b->prev->is_free() && b->prev->mapped) ? b->prev : nullptr;
    const std::size_t have = pv ? pv->size : 0;
    const std::size_t need = round_up(rounded - std::min(have, rounded), granularity_);
    device_.map(reinterpret_cast<void*>(b->addr), need);
    segment* seg = b->seg;
    seg->mapped_bytes += need;
    count_reserved(seg, static_cast<std::int64_t>(need));
    ++stats_.num_device_alloc;
    if (tracing_) trace(trace_action::segment_map, seg->stream, b->addr, need, 0, {});
    if (need < b->size) {
      block* rest = new_block();
      rest->addr = b->addr + need;
      rest->size = b->size - need;
      rest->stream = b->stream;
      rest->seg = seg;
      rest->mapped = false;
      rest->prev = b;
      rest->next = b->next;
      if (b->next) b->next->prev = rest;
      b->next = rest;
      b->size = need;
      unmapped_nodes_.insert(seg->unmapped, rest);
    }
    unmapped_nodes_.erase(seg->unmapped, b);
    b->mapped = true;
    // The new pages join the mapped free predecessor, and, when they fill a hole exactly, the
    // mapped free block after the hole as well.
    return merge_free_neighbours(b);
  }

  // Unmaps every whole page inside free mapped blocks of expandable segments. The split shapes of
  // many blocks change at once, so the inactive_split families are recounted afterwards rather than
  // tracked move by move (this is empty_cache / the OOM path, not a hot path).
  void unmap_free_pages() {
    try {
      for (auto& [key, ranges] : expandable_) {
        for (segment* seg : ranges) unmap_free_pages(seg);
      }
    } catch (...) {
      fix_inactive_split_counts();  // the blocks done so far moved
      throw;
    }
    fix_inactive_split_counts();
  }

  void unmap_free_pages(segment* seg) {
    free_set& pool = pool_of(seg->small_pool);
    for (block* b = seg->head; b != nullptr; b = b->next) {
      if (!b->mapped || !b->is_free()) continue;
      const std::uintptr_t lo = round_up(b->addr, granularity_);
      const std::uintptr_t hi = round_down(b->addr + b->size, granularity_);
      if (hi <= lo) continue;
      prepare_books();  // the splits below and their insertions; may throw before any change
      free_nodes_.erase(pool, b);
      block* mid = b;  // carve [lo, hi) out of b as a block of its own
      if (lo > b->addr) {
        mid = split_off(b, lo - b->addr);
        free_nodes_.insert(pool, b);
      }
      if (hi < mid->addr + mid->size) free_nodes_.insert(pool, split_off(mid, hi - mid->addr));
      device_.unmap(reinterpret_cast<void*>(mid->addr), mid->size);
      seg->mapped_bytes -= mid->size;
      count_reserved(seg, -static_cast<std::int64_t>(mid->size));
      ++stats_.num_device_free;
      if (tracing_) trace(trace_action::segment_unmap, seg->stream, mid->addr, mid->size, 0, {});
      mid->mapped = false;
      unmapped_nodes_.insert(seg->unmapped, mid);
      b = merge_free_neighbours(mid);
    }
  }

  // Splits b at `offset`; returns the new upper part (same state as b, not in any set).
  block* split_off(block* b, std::size_t offset) {
    block* up = new_block();
    up->addr = b->addr + offset;
    up->size = b->size - offset;
    up->stream = b->stream;
    up->seg = b->seg;
    up->mapped = b->mapped;
    up->prev = b;
    up->next = b->next;
    if (b->next) b->next->prev = up;
    b->next = up;
    b->size = offset;
    return up;
  }

  // ---------------------------------------------------------------- releasing cached memory

  // The OOM path and empty_cache(): wait for pending frees, return every fully free plain segment,
  // and unmap free pages of expandable segments.
  void release_cached_memory() {
    wait_for_pending_frees();
    // A free block may still be read by work queued on its own stream (stream-ordered reuse needs
    // no event for that); before memory goes back to the device, all such work must be done. This
    // is what cudaFree's implicit synchronisation gives PyTorch.
    device_.synchronize_device();
    ++stats_.num_sync_all_streams;
    unmap_free_pages();
    for (auto it = segments_.begin(); it != segments_.end();) {
      segment* seg = it->second;
      ++it;
      if (seg->head->is_free() && seg->head->next == nullptr) give_back_segment(seg, false);
    }
  }

  // Below the garbage-collection threshold nothing happens; above it, whole free segments go back
  // to the device before new memory is asked for, so that a long job does not hoard its peak.
  void maybe_collect_garbage(std::size_t rounded) {
    const double threshold = config_.garbage_collection_threshold;
    if (threshold <= 0.0) return;
    const auto limit = static_cast<std::size_t>(threshold * static_cast<double>(allowed_bytes()));
    if (reserved_total() + rounded <= limit) return;
    // The synchronisation is paid only when something will go back (PyTorch's collection frees
    // segments, whose cudaFree synchronises; it never synchronises for nothing). Above the
    // threshold with nothing cached, every miss would otherwise stall the whole device.
    const auto wholly_free = [](const segment* seg) {
      return !seg->expandable && seg->head->is_free() && seg->head->next == nullptr;
    };
    const bool any = config_.expandable_segments
                         ? has_unmappable_free_pages()
                         : std::any_of(segments_.begin(), segments_.end(),
                                       [&](const auto& kv) { return wholly_free(kv.second); });
    if (!any) return;
    device_.synchronize_device();  // as in release_cached_memory
    ++stats_.num_sync_all_streams;
    if (config_.expandable_segments) {
      // What an expandable segment caches is its free mapped pages.
      unmap_free_pages();
      return;
    }
    for (auto it = segments_.begin(); it != segments_.end() && reserved_total() + rounded > limit;) {
      segment* seg = it->second;
      ++it;
      if (wholly_free(seg)) give_back_segment(seg, false);
    }
  }

  // Whether unmap_free_pages() would unmap anything: a free mapped block covering a whole page.
  bool has_unmappable_free_pages() const {
    for (const auto& [key, ranges] : expandable_) {
      for (const segment* seg : ranges) {
        for (const block* b = seg->head; b != nullptr; b = b->next) {
          if (b->mapped && b->is_free() &&
              round_down(b->addr + b->size, granularity_) > round_up(b->addr, granularity_)) {
            return true;
          }
        }
      }
    }
    return false;
  }

  void give_back_segment(segment* seg, bool even_if_used) {
    free_set& pool = pool_of(seg->small_pool);
    if (seg->expandable) {
      // Unmap maximal mapped runs: they start and end on page boundaries, single blocks need not.
      for (block* b = seg->head; b != nullptr;) {
        if (!b->mapped) {
          b = b->next;
          continue;
        }
        if (!even_if_used) return;  // only whole-range teardown releases a mapped range
        const std::uintptr_t from = b->addr;
        std::size_t run = 0;
        for (; b != nullptr && b->mapped; b = b->next) run += b->size;
        device_.unmap(reinterpret_cast<void*>(from), run);
        ++stats_.num_device_free;
      }
      // Address space, not memory: counted no more than its reservation was (PyTorch counts
      // maps and unmaps, not ranges, in num_device_alloc and num_device_free).
      device_.release_address_range(reinterpret_cast<void*>(seg->addr), seg->size);
      auto ranges = expandable_.find(expandable_key{seg->stream, seg->small_pool});
      std::erase(ranges->second, seg);
      if (ranges->second.empty()) expandable_.erase(ranges);
    } else {
      device_.release(reinterpret_cast<void*>(seg->addr), seg->size);
      ++stats_.num_device_free;
      if (tracing_) trace(trace_action::segment_free, seg->stream, seg->addr, seg->size, 0, {});
    }
    count_reserved(seg, -static_cast<std::int64_t>(seg->reserved()));
    const int p = pool_index(seg->small_pool);
    if (is_oversize(*seg)) stats_.oversize_segments.decrease(1);
    stats_.segment[0].decrease(1);
    stats_.segment[p].decrease(1);
    for (block* b = seg->head; b != nullptr;) {
      block* n = b->next;
      free_nodes_.erase(pool, b);
      if (b->allocated) live_.erase(b->addr);
      delete_block(b);
      b = n;
    }
    segments_.erase(seg->addr);
    delete seg;
  }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    release_cached_memory();
  }

  // The planned policy's arena reuses the holes that the learning iterations left between long-lived
  // blocks: every free, mapped block of a plain segment becomes an allocation the front
  // owns (counted like any other, so the invariants hold), and goes back through deallocate().
  // Small-pool holes too: with small tensors, long-lived blocks fill the 2 MiB small segments.
  // Called right after empty_cache(), so no block is pending.
  std::vector<fallback_hole> claim_free_blocks() {
    std::lock_guard<std::mutex> lock(mutex_);
    // Two passes, so that a host out of memory claims nothing: first everything that allocates
    // (the list, the holes, the live entries), then the changes, which cannot fail.
    std::vector<block*> claimed;
    for (const auto& [addr, seg] : segments_) {
      if (seg->expandable) continue;
      for (block* b = seg->head; b != nullptr; b = b->next) {
        if (b->is_free() && b->mapped) claimed.push_back(b);
      }
    }
    std::vector<fallback_hole> holes;
    holes.reserve(claimed.size());
    std::size_t entered = 0;
    try {
      for (; entered < claimed.size(); ++entered) enter_live(claimed[entered]);
    } catch (...) {
      for (std::size_t i = 0; i < entered; ++i) live_.erase(claimed[i]->addr);
      throw;
    }
    for (block* b : claimed) {
      take_block(b, b->size);  // out of the free set, uncounted as inactive split; no split
      hand_out(b, b->size);
      holes.push_back({b->addr, b->size, b->stream, b->seg->small_pool});
    }
    return holes;
  }

  // The planned policy's arena, given to this allocator when a deviating iteration uninstalls the
  // plan (instead of back to the device): that iteration is then served from the arena's memory
  // rather than from new segments reserved beside it. A plain segment of `stream` from here on,
  // given back to the device whole (empty_cache, the OOM path) like any other.
  void adopt_segment(void* p, std::size_t size, std::uintptr_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    prepare_books();
    segment* seg = new_segment(reinterpret_cast<std::uintptr_t>(p), size, stream, false, false);
    count_reserved(seg, static_cast<std::int64_t>(size));
    // No segment_alloc: the arena's reservation is in the trace already (the planned policy
    // records it); its segment_free, when this allocator gives it back, closes it.
    insert_free(seg->head);
  }

  // The planned policy gives a claimed hole back while blocks it served from the hole's tail are
  // still live (the plan is uninstalled, or replaced): each such block becomes an ordinary
  // allocation of this allocator, carved at its address out of the free block the hole merged
  // into, so that its free comes here and its space is never handed out meanwhile.
  // REQUIRES: [addr, addr + size) lies in one free, mapped block of a plain segment.
  void adopt_range(std::uintptr_t addr, std::size_t size, std::size_t requested,
                   const std::vector<std::uintptr_t>& used_streams) {
    std::lock_guard<std::mutex> lock(mutex_);
    segment* seg = segment_containing(addr);
    TERRACE_EXPECTS(seg != nullptr, "adopt_range: address outside every segment");
    block* b = seg->head;
    while (b != nullptr && b->addr + b->size <= addr) b = b->next;
    TERRACE_EXPECTS(b != nullptr && !seg->expandable && b->is_free() && b->mapped &&
                        addr + size <= b->addr + b->size,
                    "adopt_range: the range is not inside one free block");
    // What allocates comes before any change: the spares, the streams' copy, the live entry
    // (keyed by the address, which the carving below does not move).
    prepare_books();
    std::vector<std::uintptr_t> other_streams;
    for (std::uintptr_t other : used_streams) {
      if (other != b->stream) other_streams.push_back(other);
    }
    const auto entry = live_.emplace(addr, nullptr).first;
    free_nodes_.erase(pool_of(seg->small_pool), b);
    if (b->is_split()) count_inactive_split(b, -1);
    if (addr > b->addr) {
      block* up = split_off(b, addr - b->addr);
      insert_free(b);
      b = up;
    }
    if (b->size > size) insert_free(split_off(b, size));
    b->used_streams = std::move(other_streams);
    entry->second = b;
    hand_out(b, requested);
  }

  // ---------------------------------------------------------------- out-of-memory report

  // The largest cached block on `stream` in the pool of `small`: all the request could have used.
  std::size_t largest_free_block_on(std::uintptr_t stream, bool small) {
    const free_set& pool = pool_of(small);
    block key;
    key.stream = stream;
    key.size = SIZE_MAX;
    key.addr = UINTPTR_MAX;
    auto it = pool.upper_bound(&key);
    if (it == pool.begin() || (*std::prev(it))->stream != stream) return 0;
    return (*std::prev(it))->size;
  }

  std::string oom_report(std::size_t requested, std::size_t rounded, std::uintptr_t stream) {
    const allocator_stats s = stats_locked();
    // A larger free block may survive the retry on another stream or in the other pool, which
    // this request may not use: the report says what it could use, or it reads as a contradiction.
    const std::size_t usable = largest_free_block_on(stream, is_small(rounded));
    std::ostringstream out;
    const auto& props = device_.properties();
    out << "terrace: out of memory on device '" << props.name << "' " << props.device_index
        << ": tried to allocate " << format_bytes(requested) << " (rounded to "
        << format_bytes(rounded) << ") on stream " << format_addr(stream) << ".\n"
        << "  device capacity " << format_bytes(props.capacity) << ", allowed by memory_fraction "
        << format_bytes(allowed_bytes()) << ", held by the device backend "
        << format_bytes(device_.used_bytes()) << ";\n"
        << "  reserved " << format_bytes(static_cast<std::size_t>(s.reserved_bytes[0].current))
        << ", allocated " << format_bytes(static_cast<std::size_t>(s.allocated_bytes[0].current))
        << ", reserved but unused " << format_bytes(static_cast<std::size_t>(s.cached_free_bytes))
        << ", largest free block " << format_bytes(static_cast<std::size_t>(s.largest_free_block))
        << "\n  (" << (usable > 0 ? format_bytes(usable) : std::string("none"))
        << " on the request's stream and pool, the only ones it may use)"
        << ";\n  fragmentation " << s.fragmentation << " (1 - active/reserved), external "
        << s.external_fragmentation << " (1 - largest free/unused)." << "\n";
    if (outside_reserved_ > 0) {
      out << "  the planned policy's arena holds " << format_bytes(outside_reserved_)
          << " beside the reserved segments; memory_fraction caps them together.\n";
    }
    if (!address_space_refusal_.empty()) {
      out << "  address space, not memory, ran out: every stream and pool of expandable segments\n"
          << "  holds a range as large as the device (" << address_space_refusal_ << ").\n";
    }
    std::vector<const block*> top;
    top.reserve(live_.size());
    for (const auto& [addr, b] : live_) top.push_back(b);
    const std::size_t n = std::min<std::size_t>(top.size(), 10);
    std::partial_sort(top.begin(), top.begin() + static_cast<std::ptrdiff_t>(n), top.end(),
                      [](const block* a, const block* b) { return a->size > b->size; });
    out << "  largest live allocations (" << live_.size() << " live):";
    for (std::size_t i = 0; i < n; ++i) {
      out << "\n    " << format_bytes(top[i]->size) << " at " << format_addr(top[i]->addr)
          << " stream " << format_addr(top[i]->stream);
      if (!top[i]->tag.empty()) out << " tag '" << top[i]->tag << "'";
    }
    if (n == 0) out << " none";
    return out.str();
  }

  std::string describe_bad_pointer(std::uintptr_t addr, const char* op) const {
    if (const segment* seg = segment_containing(addr)) {
      // The block holding addr, not only one starting there: a freed block merges into a free
      // neighbour below it, and a second free of it then lands inside that neighbour. Only the
      // inside of a live block is an interior pointer; inside free memory nothing is allocated.
      const block* b = seg->head;
      while (b->next != nullptr && b->addr + b->size <= addr) b = b->next;
      if (!b->allocated) {
        const char* state = !b->mapped ? "unmapped" : b->pending_events ? "pending free" : "free";
        const std::string where = b->addr == addr ? "its block of " + format_bytes(b->size)
                                                  : "it lies in a block of " + format_bytes(b->size) +
                                                        " at " + format_addr(b->addr) + " that";
        return std::string("terrace: ") + op + " of " + format_addr(addr) +
               ", which is not allocated (double free? " + where + " is " + state + ")";
      }
      return std::string("terrace: ") + op + " of " + format_addr(addr) +
             ", which points inside a segment of this allocator but not at the start of an "
             "allocation (it is " + std::to_string(addr - b->addr) +
             " bytes into the live block at " + format_addr(b->addr) + ")";
    }
    return std::string("terrace: ") + op + " of " + format_addr(addr) +
           ", a pointer this allocator never handed out (foreign pointer)";
  }

  // ---------------------------------------------------------------- stats and accounting

  std::size_t reserved_total() const noexcept {
    return static_cast<std::size_t>(stats_.reserved_bytes[0].current);
  }

  // What the memory fraction caps: the segments and the planned policy's arena beside them.
  std::size_t capped_total() const noexcept { return reserved_total() + outside_reserved_; }

  void count_reserved(const segment* seg, std::int64_t delta) {
    const int p = pool_index(seg->small_pool);
    for (int i : {0, p}) {
      if (delta >= 0) {
        stats_.reserved_bytes[i].increase(delta);
      } else {
        stats_.reserved_bytes[i].decrease(-delta);
      }
    }
  }

  // Blocks of expandable segments are left out, as PyTorch leaves them out: their free pages can
  // always be unmapped, and the free block beside the unmapped rest of a range is all its free
  // memory, not a piece split off (counting it left inactive_split above 0 with nothing live).
  void count_inactive_split(const block* b, int sign) {
    if (b->seg->expandable) return;
    const int p = pool_index(b->seg->small_pool);
    for (int i : {0, p}) {
      if (sign > 0) {
        stats_.inactive_split[i].increase(1);
        stats_.inactive_split_bytes[i].increase(static_cast<std::int64_t>(b->size));
      } else {
        stats_.inactive_split[i].decrease(1);
        stats_.inactive_split_bytes[i].decrease(static_cast<std::int64_t>(b->size));
      }
    }
  }

  // After the unmap pass the split shapes of many blocks changed at once; recount the two
  // inactive_split families instead of tracking each move. (empty_cache is not a hot path.)
  void fix_inactive_split_counts() {
    std::int64_t count[3] = {0, 0, 0};
    std::int64_t bytes[3] = {0, 0, 0};
    for (const auto& [addr, seg] : segments_) {
      if (seg->expandable) continue;  // as in count_inactive_split
      const int p = pool_index(seg->small_pool);
      for (const block* b = seg->head; b != nullptr; b = b->next) {
        if (b->mapped && b->is_free() && b->is_split()) {
          for (int i : {0, p}) {
            ++count[i];
            bytes[i] += static_cast<std::int64_t>(b->size);
          }
        }
      }
    }
    for (int i = 0; i < 3; ++i) {
      adjust(stats_.inactive_split[i], count[i]);
      adjust(stats_.inactive_split_bytes[i], bytes[i]);
    }
  }

  static void adjust(stat& s, std::int64_t target) {
    if (target > s.current) s.increase(target - s.current);
    if (target < s.current) s.decrease(s.current - target);
  }

  allocator_stats stats_locked() const {
    allocator_stats s = stats_;
    std::int64_t largest = 0;
    for (const free_set* pool : {&small_free_, &large_free_}) {
      for (const block* b : *pool) {
        if (b->mapped) largest = std::max<std::int64_t>(largest, static_cast<std::int64_t>(b->size));
      }
    }
    s.largest_free_block = largest;
    s.cached_free_bytes = s.reserved_bytes[0].current - s.active_bytes[0].current;
    s.external_fragmentation =
        s.cached_free_bytes > 0 ? 1.0 - static_cast<double>(largest) /
                                            static_cast<double>(s.cached_free_bytes)
                                : 0.0;
    const auto& rb = s.reserved_bytes[0];
    const auto& ab = s.active_bytes[0];
    s.fragmentation = rb.current > 0 ? 1.0 - static_cast<double>(ab.current) /
                                                 static_cast<double>(rb.current)
                                     : 0.0;
    s.peak_fragmentation =
        rb.peak > 0 ? 1.0 - static_cast<double>(ab.peak) / static_cast<double>(rb.peak) : 0.0;
    return s;
  }

  allocator_stats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_locked();
  }

  // While a plan is installed, the fallback serves only requests outside it: occasional ones,
  // which a 20 MiB segment per 2 MiB request would turn into cached memory beside the arena for
  // the rest of the run. Large segments are then cut to the request (rounded to large_round). So
  // they stay through a deviating iteration, which the arena's memory (adopted as a segment)
  // serves first: what does not fit there is the iteration's excess, not a cache to keep.
  void set_exact_large_segments(bool exact) {
    std::lock_guard<std::mutex> lock(mutex_);
    exact_large_segments_ = exact;
  }

  // The three current totals the planned policy combines with its arena; cheap, for every call.
  fallback_totals totals() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {stats_.reserved_bytes[0].current, stats_.allocated_bytes[0].current,
            stats_.requested_bytes[0].current,    stats_.allocation[0].current,
            stats_.allocation[1].current,         stats_.allocated_bytes[1].current,
            stats_.requested_bytes[1].current};
  }

  void reset_peak_stats() {
    std::lock_guard<std::mutex> lock(mutex_);
#define TERRACE_RESET_PEAK(field, name) \
  for (stat & s : stats_.field) s.reset_peak();
    TERRACE_POOL_STATS(TERRACE_RESET_PEAK)
#undef TERRACE_RESET_PEAK
#define TERRACE_RESET_SINGLE_PEAK(field, name) stats_.field.reset_peak();
    TERRACE_SINGLE_STATS(TERRACE_RESET_SINGLE_PEAK)
#undef TERRACE_RESET_SINGLE_PEAK
  }

  void reset_accumulated_stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_at_reset_ = stats_;  // check_invariants: current == then's current + allocated - freed
#define TERRACE_RESET_ACC(field, name) \
  for (stat & s : stats_.field) s.reset_accumulated();
    TERRACE_POOL_STATS(TERRACE_RESET_ACC)
#undef TERRACE_RESET_ACC
#define TERRACE_RESET_SINGLE_ACC(field, name) stats_.field.reset_accumulated();
    TERRACE_SINGLE_STATS(TERRACE_RESET_SINGLE_ACC)
#undef TERRACE_RESET_SINGLE_ACC
#define TERRACE_RESET_COUNTER(field, name) stats_.field = 0;
    TERRACE_EVENT_COUNTERS(TERRACE_RESET_COUNTER)
#undef TERRACE_RESET_COUNTER
  }

  void set_memory_fraction(double fraction) {
    TERRACE_EXPECTS(fraction >= 0.0 && fraction <= 1.0, "memory fraction must be in [0, 1]");
    std::lock_guard<std::mutex> lock(mutex_);
    memory_fraction_ = fraction;
  }

  // The planned policy's arena is reserved by its front, beside the segments: `bytes` resident
  // count against the memory fraction as the segments do.
  void set_outside_reserved(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    outside_reserved_ = bytes;
  }
  // How many bytes the memory fraction in force allows, segments and arena together.
  std::size_t fraction_allowed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return allowed_bytes();
  }
  // How many bytes more the memory fraction allows, segments and arena together.
  std::size_t fraction_room() const {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::size_t allowed = allowed_bytes();
    return capped_total() >= allowed ? 0 : allowed - capped_total();
  }

  // ---------------------------------------------------------------- trace and snapshot

  void trace(trace_action a, std::uintptr_t stream, std::uintptr_t addr, std::size_t size,
             std::size_t requested, std::string_view tag) noexcept {
    // The trace is a record, not the allocator's state: an event the host has no memory for is
    // counted as lost (snapshot().trace_events_lost) rather than failing a call whose changes
    // are already made.
    try {
      record_trace_event(a, stream, addr, size, requested, tag);
    } catch (const std::bad_alloc&) {
      ++trace_events_lost_;
    }
  }

  // Nanoseconds since the allocator was made: the clock of every trace event.
  std::uint64_t now_ns() const {
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_)
            .count());
  }

  void record_trace_event(trace_action a, std::uintptr_t stream, std::uintptr_t addr,
                          std::size_t size, std::size_t requested, std::string_view tag) {
    trace_event e;
    e.action = a;
    e.time_ns = now_ns();
    e.stream = stream;
    e.addr = addr;
    e.size = size;
    e.requested = requested;
    e.tag.assign(tag.data(), tag.size());
    const std::size_t cap = std::max<std::size_t>(config_.trace_max_events, 1);
    if (trace_.size() < cap) {
      trace_.push_back(std::move(e));
    } else {
      trace_[trace_head_] = std::move(e);  // a ring: the oldest event gives way
      trace_head_ = (trace_head_ + 1) % cap;
      ++trace_events_dropped_;  // said in the snapshot, so that a wrapped trace is told apart
    }
  }

  // The planned policy's arena blocks never pass through this allocator, but belong in its trace:
  // a saved trace or a snapshot's device_traces must show every allocation the program made.
  // Callers check tracing() first, so that the planned hot path takes no lock while it is off.
  bool tracing() const noexcept { return tracing_.load(std::memory_order_relaxed); }
  void trace_arena_block(trace_action a, stream_ref stream, const void* p, std::size_t size,
                         std::size_t requested, std::string_view tag) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (tracing_) {
      trace(a, reinterpret_cast<std::uintptr_t>(stream.native), reinterpret_cast<std::uintptr_t>(p),
            size, requested, tag);
    }
  }

  void trace_iteration_mark(trace_action a) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (tracing_) trace(a, 0, 0, 0, 0, {});
  }

  void set_tracing(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    tracing_ = on;
  }

  memory_snapshot snapshot() {
    std::lock_guard<std::mutex> lock(mutex_);
    memory_snapshot snap;
    snap.device = device_.properties().device_index;
    for (const auto& [addr, seg] : segments_) {
      snapshot_segment out;
      out.addr = seg->addr;
      out.total_size = seg->expandable ? seg->mapped_bytes : seg->size;
      out.stream = seg->stream;
      out.is_small_pool = seg->small_pool;
      out.is_expandable = seg->expandable;
      for (const block* b = seg->head; b != nullptr; b = b->next) {
        snapshot_block sb;
        sb.addr = b->addr;
        sb.size = b->size;
        sb.requested = b->requested;
        sb.tag = b->tag;
        if (!b->mapped) {
          sb.state = "unmapped";
        } else if (b->allocated) {
          sb.state = "active_allocated";
          out.allocated_size += b->size;
          out.active_size += b->size;
          out.requested_size += b->requested;
        } else if (b->pending_events > 0) {
          sb.state = "active_pending_free";
          out.active_size += b->size;
        } else {
          sb.state = "inactive";
        }
        out.blocks.push_back(std::move(sb));
      }
      snap.segments.push_back(std::move(out));
    }
    snap.trace.reserve(trace_.size());
    for (std::size_t i = 0; i < trace_.size(); ++i) {
      snap.trace.push_back(trace_[(trace_head_ + i) % trace_.size()]);
    }
    if (tracing_) {
      // Not recorded in the ring (a snapshot changes nothing), but stamped like the events in it,
      // with the active bytes as PyTorch's SNAPSHOT entry carries them.
      trace_event e;
      e.action = trace_action::snapshot;
      e.time_ns = now_ns();
      for (const snapshot_segment& seg : snap.segments) e.size += seg.active_size;
      snap.trace.push_back(e);
    }
    snap.trace_events_lost = trace_events_lost_;
    snap.trace_events_dropped = trace_events_dropped_;
    return snap;
  }

  // ---------------------------------------------------------------- invariants

  void check_invariants() const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto fail = [](const std::string& what) { throw logic_error("terrace invariant: " + what); };
    std::int64_t oversize_allocs = 0, oversize_segs = 0;
    std::int64_t alloc_n[3] = {}, alloc_b[3] = {}, req_b[3] = {}, active_n[3] = {},
                 active_b[3] = {}, split_n[3] = {}, split_b[3] = {}, reserved[3] = {}, segs[3] = {};
    std::uintptr_t prev_end = 0;
    std::size_t free_in_sets = 0, live_blocks = 0, pending_blocks = 0;
    for (const auto& [addr, seg] : segments_) {
      if (seg->addr < prev_end) fail("segments overlap at " + format_addr(seg->addr));
      prev_end = seg->addr + seg->size;
      const int p = pool_index(seg->small_pool);
      std::uintptr_t at = seg->addr;
      std::size_t mapped = 0;
      std::size_t unmapped_blocks = 0;
      const block* last = nullptr;
      for (const block* b = seg->head; b != nullptr; b = b->next) {
        if (b->seg != seg) fail("block " + format_addr(b->addr) + " names the wrong segment");
        if (b->prev != last) fail("broken prev link at " + format_addr(b->addr));
        if (b->addr != at) fail("blocks do not tile segment " + format_addr(seg->addr));
        if (b->size == 0) fail("empty block at " + format_addr(b->addr));
        if (b->stream != seg->stream) fail("block stream differs from its segment's");
        at += b->size;
        if (b->mapped) mapped += b->size;
        const free_set& pool = seg->small_pool ? small_free_ : large_free_;
        const bool in_set = pool.count(const_cast<block*>(b)) != 0;
        if (b->allocated) {
          ++live_blocks;
          auto it = live_.find(b->addr);
          if (it == live_.end() || it->second != b) fail("allocated block missing from live map");
          if (in_set) fail("allocated block " + format_addr(b->addr) + " is in a free set");
          if (b->pending_events) fail("allocated block with pending events");
          if (!b->mapped) fail("allocated block is unmapped");
          if (b->size >= config_.max_split_size) ++oversize_allocs;
          for (int i : {0, p}) {
            ++alloc_n[i];
            alloc_b[i] += static_cast<std::int64_t>(b->size);
            req_b[i] += static_cast<std::int64_t>(b->requested);
            ++active_n[i];
            active_b[i] += static_cast<std::int64_t>(b->size);
          }
        } else if (b->pending_events > 0) {
          ++pending_blocks;
          if (in_set) fail("block with pending events is in a free set (handed out too early)");
          for (int i : {0, p}) {
            ++active_n[i];
            active_b[i] += static_cast<std::int64_t>(b->size);
          }
        } else if (!b->mapped) {
          ++unmapped_blocks;
          if (in_set) fail("unmapped block " + format_addr(b->addr) + " is in a free set");
          if (seg->unmapped.count(const_cast<block*>(b)) == 0) {
            fail("unmapped block " + format_addr(b->addr) + " is missing from its segment's holes");
          }
          if (b->next && b->next->is_free() && !b->next->mapped) {
            fail("adjacent unmapped blocks not merged at " + format_addr(b->addr));
          }
        } else {
          if (!in_set) fail("free block " + format_addr(b->addr) + " is not in its free set");
          ++free_in_sets;
          if (b->next && b->next->is_free() && b->next->mapped == b->mapped) {
            fail("adjacent free blocks not merged at " + format_addr(b->addr));
          }
          if (b->mapped && b->is_split() && !seg->expandable) {
            for (int i : {0, p}) {
              ++split_n[i];
              split_b[i] += static_cast<std::int64_t>(b->size);
            }
          }
        }
        last = b;
      }
      if (at != seg->addr + seg->size) fail("blocks do not cover segment " + format_addr(seg->addr));
      if (seg->expandable && mapped != seg->mapped_bytes) fail("expandable mapped bytes disagree");
      if (unmapped_blocks != seg->unmapped.size()) fail("a segment's holes name a block it lacks");
      if (!seg->expandable && mapped != seg->size) fail("plain segment with unmapped block");
      for (int i : {0, p}) {
        reserved[i] += static_cast<std::int64_t>(seg->reserved());
        ++segs[i];
      }
      if (is_oversize(*seg)) ++oversize_segs;
    }
    if (free_in_sets != small_free_.size() + large_free_.size()) {
      fail("a free set holds a block that is not free");
    }
    if (live_blocks != live_.size()) fail("live map holds blocks that are not allocated");
    for (const auto& [s, at_reset, want, name] :
         {std::tuple{&stats_.oversize_allocations, &stats_at_reset_.oversize_allocations, oversize_allocs,
                     "oversize_allocations"},
          std::tuple{&stats_.oversize_segments, &stats_at_reset_.oversize_segments, oversize_segs,
                     "oversize_segments"}}) {
      if (s->current != want) {
        fail(std::string(name) + ".current is " + std::to_string(s->current) + ", recount gives " +
             std::to_string(want));
      }
      if (s->current != at_reset->current + s->allocated - s->freed || s->peak < s->current) {
        fail(std::string(name) + " disagrees with its own allocated, freed or peak");
      }
    }
    if (pending_blocks != pending_.size()) fail("pending list disagrees with block states");
    for (int i = 0; i < 3; ++i) {
      const std::string pool = stat_pool_names[i];
      auto check = [&](const stat& s, const stat& at_reset, std::int64_t want, const char* name) {
        if (s.current != want) {
          fail(std::string(name) + "." + pool + ".current is " + std::to_string(s.current) +
               ", recount gives " + std::to_string(want));
        }
        if (s.current != at_reset.current + s.allocated - s.freed) {
          fail(std::string(name) + " current != current at the last reset + allocated - freed");
        }
        if (s.peak < s.current) fail(std::string(name) + " peak below current");
      };
#define TERRACE_CHECK_STAT(field, want) \
  check(stats_.field[i], stats_at_reset_.field[i], want[i], #field)
      TERRACE_CHECK_STAT(allocation, alloc_n);
      TERRACE_CHECK_STAT(allocated_bytes, alloc_b);
      TERRACE_CHECK_STAT(requested_bytes, req_b);
      TERRACE_CHECK_STAT(active, active_n);
      TERRACE_CHECK_STAT(active_bytes, active_b);
      TERRACE_CHECK_STAT(inactive_split, split_n);
      TERRACE_CHECK_STAT(inactive_split_bytes, split_b);
      TERRACE_CHECK_STAT(reserved_bytes, reserved);
      TERRACE_CHECK_STAT(segment, segs);
#undef TERRACE_CHECK_STAT
    }
    // allocated + pending + cached free (mapped) bytes account for every reserved byte.
    std::int64_t free_mapped = 0;
    for (const free_set* pool : {&small_free_, &large_free_}) {
      for (const block* b : *pool) {
        if (b->mapped) free_mapped += static_cast<std::int64_t>(b->size);
      }
    }
    if (active_b[0] + free_mapped != reserved[0]) {
      fail("active + cached free bytes (" + std::to_string(active_b[0] + free_mapped) +
           ") != reserved bytes (" + std::to_string(reserved[0]) + ")");
    }
  }

  const allocator_config& config() const noexcept { return config_; }
  device_backend& device() noexcept { return device_; }

 private:
  struct pending_free {
    block* b;
    std::vector<event_ref> events;
  };
  struct expandable_key {
    std::uintptr_t stream;
    bool small;
    bool operator<(const expandable_key& o) const noexcept {
      return stream != o.stream ? stream < o.stream : small < o.small;
    }
  };

  block* new_block() {
    if (!spare_blocks_.empty()) {
      block* b = spare_blocks_.back();
      spare_blocks_.pop_back();
      return b;
    }
    return new block();
  }

  void delete_block(block* b) {
    // Blocks are recycled: splits and merges on the hot path then cost no heap allocation.
    b->prev = b->next = nullptr;
    b->seg = nullptr;
    b->allocated = false;
    b->mapped = true;
    b->pending_events = 0;
    b->requested = 0;
    b->used_streams.clear();
    b->tag.clear();
    if (spare_blocks_.size() < kSpareBlocksKept) {
      spare_blocks_.push_back(b);
    } else {
      delete b;
    }
  }

 private:
  device_backend& device_;
  allocator_config config_;
  std::chrono::steady_clock::time_point start_;
  mutable std::mutex mutex_;
  double memory_fraction_ = 1.0;
  std::size_t outside_reserved_ = 0;  // set_outside_reserved
  std::size_t granularity_ = kMinBlockSize;
  std::atomic<bool> tracing_{false};  // written under mutex_; read without it by tracing()
  bool exact_large_segments_ = false;  // set_exact_large_segments

  free_set small_free_;
  free_set large_free_;
  std::unordered_map<std::uintptr_t, block*> live_;
  std::map<std::uintptr_t, segment*> segments_;
  std::map<expandable_key, std::vector<segment*>> expandable_;
  std::string address_space_refusal_;  // the backend's words, when a miss found no address space
  std::vector<pending_free> pending_;
  std::vector<event_ref> event_pool_;
  static constexpr std::size_t kSpareBlocksKept = 4096;
  std::vector<block*> spare_blocks_;
  node_stash<free_set> free_nodes_;                            // for small_free_ and large_free_
  node_stash<std::set<block*, address_order>> unmapped_nodes_;  // for segment::unmapped
  std::size_t trace_events_lost_ = 0;
  std::size_t trace_events_dropped_ = 0;  // overwritten by the ring
  allocator_stats stats_;
  allocator_stats stats_at_reset_;  // stats_ at the last reset_accumulated_stats (check_invariants)
  std::vector<trace_event> trace_;
  std::size_t trace_head_ = 0;
};

}  // namespace detail

// ---------------------------------------------------------------- the public face

caching_allocator::caching_allocator(device_backend& device, allocator_config config)
    : impl_(std::make_unique<detail::allocator_impl>(device, config)) {
  // The planner sits in front of the caching policy only when asked for: otherwise every call
  // below costs one null test.
  const bool planned = config.policy == alloc_policy::planned;
  if (planned || config.plan_counterfactual) {
    plan_ = std::make_unique<detail::plan_front>(device, config, planned);
    plan_->set_release_fallback_cache([impl = impl_.get()] {
      impl->empty_cache();
      return impl->totals();
    });
    plan_->set_fallback_holes([impl = impl_.get()] { return impl->claim_free_blocks(); },
                              [impl = impl_.get()](void* p) { impl->deallocate(p); },
                              [impl = impl_.get()] { return impl->totals(); });
    plan_->set_fallback_segment([impl = impl_.get()](void* p, std::size_t size, std::uintptr_t stream) {
      impl->adopt_segment(p, size, stream);
    });
    plan_->set_segment_trace(
        [impl = impl_.get()](trace_action a, const void* p, std::size_t size, std::uintptr_t stream) {
          // The arena's own memory, as its blocks: reservation, pages mapped and unmapped, release.
          if (impl->tracing()) {
            impl->trace_arena_block(a, stream_ref{reinterpret_cast<void*>(stream)}, p, size, 0, {});
          }
        });
    plan_->set_fallback_adopt([impl = impl_.get()](std::uintptr_t addr, std::size_t size,
                                                   std::size_t requested,
                                                   const std::vector<std::uintptr_t>& streams) {
      impl->adopt_range(addr, size, requested, streams);
    });
    plan_->set_fallback_sizing(
        [impl = impl_.get()](bool exact) { impl->set_exact_large_segments(exact); });
    plan_->set_fallback_budget([impl = impl_.get()] { return impl->fraction_room(); },
                               [impl = impl_.get()] { return impl->fraction_allowed(); },
                               [impl = impl_.get()](std::size_t bytes) {
                                 impl->set_outside_reserved(bytes);
                               });
  }
}
caching_allocator::~caching_allocator() = default;

void* caching_allocator::allocate(std::size_t bytes, stream_ref stream, std::string_view tag) {
  impl_->refuse_impossible(bytes, stream);
  if (!plan_ || bytes == 0) return impl_->allocate(bytes, stream, tag);
  std::lock_guard<std::mutex> lock(plan_->mutex());
  void* p = nullptr;
  try {
    // Inside the try: a request try_allocate recorded and then failed on (a device error, a
    // host out of memory) is taken back out of the recording, as one the fallback refuses.
    if (void* q = plan_->try_allocate(bytes, stream, tag)) {
      if (impl_->tracing()) {
        impl_->trace_arena_block(trace_action::alloc, stream, q, plan_->block_size(q), bytes, tag);
      }
      return q;
    }
    try {
      p = impl_->allocate(bytes, stream, tag, /*final_try=*/false);
    } catch (const out_of_memory&) {
      // The plan's arena may hold the memory this request needs: correctness, and never running
      // out where the caching allocator alone would not, come before the plan. Only a failure
      // the caller sees counts as an OOM (num_ooms, the trace's oom event): the retries below
      // count their own; the rethrow counts here.
      if (plan_->release_under_pressure()) {
        p = impl_->allocate(bytes, stream, tag);
      } else if (void* q = plan_->lend_under_pressure(bytes, stream)) {
        if (impl_->tracing()) {
          impl_->trace_arena_block(trace_action::alloc, stream, q, plan_->block_size(q), bytes, tag);
        }
        plan_->note_totals(impl_->totals());
        return q;
      } else if (plan_->unmap_under_pressure()) {
        p = impl_->allocate(bytes, stream, tag);
      } else {
        impl_->note_oom(bytes, stream);
        throw;
      }
    }
  } catch (...) {
    plan_->forget_refused_request();
    throw;
  }
  try {
    plan_->on_fallback_alloc(p, bytes, stream);
  } catch (...) {
    // The front could not track the block (a host out of memory): it goes back, and the
    // request fails as a whole.
    impl_->deallocate(p);
    plan_->forget_refused_request();
    throw;
  }
  plan_->note_totals(impl_->totals());
  return p;
}
void caching_allocator::deallocate(void* p, stream_ref) {
  if (!plan_ || p == nullptr) return impl_->deallocate(p);
  std::lock_guard<std::mutex> lock(plan_->mutex());
  detail::arena_free freed;
  if (plan_->on_free(p, &freed)) {
    if (impl_->tracing()) {
      const stream_ref owner{reinterpret_cast<void*>(freed.stream)};
      impl_->trace_arena_block(trace_action::free_requested, owner, p, freed.size, freed.requested, {});
      impl_->trace_arena_block(trace_action::free_completed, owner, p, freed.size, 0, {});
    }
    return;
  }
  impl_->deallocate(p);
  plan_->note_totals(impl_->totals());
}
void caching_allocator::record_stream(void* p, stream_ref stream) {
  // An empty tensor's data pointer: no block, so nothing waits for the stream.
  if (p == nullptr) return;
  if (plan_) {
    std::lock_guard<std::mutex> lock(plan_->mutex());
    if (plan_->record_stream(p, stream)) return;
  }
  impl_->record_stream(p, stream);
}
void caching_allocator::empty_cache() {
  if (plan_) {
    std::lock_guard<std::mutex> lock(plan_->mutex());
    plan_->release_cached_arena();
    impl_->empty_cache();
    plan_->note_totals(impl_->totals());
    return;
  }
  impl_->empty_cache();
}
void caching_allocator::set_memory_fraction(double fraction) { impl_->set_memory_fraction(fraction); }
allocator_stats caching_allocator::stats() const {
  if (!plan_) return impl_->stats();
  std::lock_guard<std::mutex> lock(plan_->mutex());
  allocator_stats s = impl_->stats();
  plan_->merge_into(s);
  return s;
}
void caching_allocator::reset_peak_stats() {
  if (!plan_) return impl_->reset_peak_stats();
  std::lock_guard<std::mutex> lock(plan_->mutex());
  impl_->reset_peak_stats();
  plan_->reset_peaks(impl_->totals());
}
void caching_allocator::reset_accumulated_stats() {
  if (!plan_) return impl_->reset_accumulated_stats();
  std::lock_guard<std::mutex> lock(plan_->mutex());
  impl_->reset_accumulated_stats();
  plan_->reset_accumulated();
}
void caching_allocator::record_trace(bool on) { impl_->set_tracing(on); }
memory_snapshot caching_allocator::snapshot() const {
  if (!plan_) return impl_->snapshot();
  std::lock_guard<std::mutex> lock(plan_->mutex());
  memory_snapshot snap = impl_->snapshot();
  plan_->add_to_snapshot(snap);
  return snap;
}
void caching_allocator::check_invariants() const {
  if (!plan_) return impl_->check_invariants();
  std::lock_guard<std::mutex> lock(plan_->mutex());
  impl_->check_invariants();
  plan_->check_invariants();
}
const allocator_config& caching_allocator::config() const noexcept { return impl_->config(); }
void caching_allocator::begin_iteration() {
  impl_->trace_iteration_mark(trace_action::iteration_begin);
  if (!plan_) return;
  std::lock_guard<std::mutex> lock(plan_->mutex());
  plan_->begin_iteration();
}
void caching_allocator::end_iteration() {
  impl_->trace_iteration_mark(trace_action::iteration_end);
  if (!plan_) return;
  std::lock_guard<std::mutex> lock(plan_->mutex());
  plan_->end_iteration();
}
planner_stats caching_allocator::plan_stats() const {
  if (!plan_) return {};
  std::lock_guard<std::mutex> lock(plan_->mutex());
  return plan_->stats();
}
device_backend& caching_allocator::device() noexcept { return impl_->device(); }

}  // namespace terrace
