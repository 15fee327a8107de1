// SPDX-License-Identifier: Apache-2.0
// The host and device tiers (include/terrace/tier_manager.hpp): residency books, Belady eviction
// over the recorded schedule, and prefetch on a copy stream.
//
// Ordering argument, since nothing here blocks the host on a copy:
//   - every device block is allocated on the copy stream, so a block freed by an eviction and
//     reused for the next copy up is ordered behind the eviction's copy down on that stream;
//   - a compute stream that uses a block is registered with record_stream, so the allocator does
//     not hand the block out again before that stream's work (at free time) is done;
//   - the allocator hands a block freed on the copy stream out again at once, as stream-ordered
//     allocation does (cudaMallocAsync): safe on the copy stream, not on another one. So a block
//     given back while a copy on it may still be queued (a flush's copy down, the copy up of a
//     prefetch evicted before it landed) leaves a fence: its address range and an event recorded
//     right after its last copy. A caller's stream that gets a block without waiting for a copy up
//     into it (access::write, a tensor with no data yet, or one acquired again later) first waits
//     for the fences overlapping the block -- only those, not the whole copy stream, so prefetches
//     queued since stay hidden behind compute. A copy up needs no fence: it is queued on the copy
//     stream after them, and the caller waits for it;
//   - a copy down of a tensor written on a compute stream first waits for the event recorded at
//     release on that stream;
//   - a compute stream waits for the event of the copy up before using the block;
//   - a compute stream that acquires a tensor to change it waits for the event of a copy down
//     still in flight (a flush), so the copy reads the block before the kernels change it.
#include "terrace/tier_manager.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "terrace/error.hpp"
#include "tiers/backends.hpp"

namespace terrace {
namespace {

constexpr std::size_t kNever = std::numeric_limits<std::size_t>::max();
constexpr std::size_t kNoPos = kNever;
// How many of the last acquires a resync compares with the schedule before a match (at most the
// schedule's length).
constexpr std::size_t kResyncHistory = 16;

}  // namespace

struct tier_manager::impl {
  struct tensor {
    std::string name;
    std::size_t bytes = 0;
    void* host = nullptr;
    bool host_written = false;  // the pinned home copy holds the data (initial, copied down, read)
    bool nvme_current = false;  // the NVMe store holds the current data
    bool nvme_reading = false;  // a get into `host` is in flight (nvme_io)
    io_handle nvme_io;
    // Evicted ahead of need: a put of `host` is in flight (leave_io); the buffer is freed when it
    // lands, unless the tensor is used first (stay_home).
    bool leaving = false;
    io_handle leave_io;
    void* dev = nullptr;        // device block, or nullptr
    bool dev_newer = false;     // the device copy was written after the home copy
    bool prefetched = false;    // brought up ahead of use and not acquired since
    int pins = 0;
    event_ref up, down;         // created lazily
    bool up_pending = false, down_pending = false;
    // Per stream that released the tensor: an event recorded at its latest release. A copy down
    // waits for all of them: a tensor acquired on two streams at once (pins nest) may have been
    // written on one and released last on the other.
    std::vector<std::pair<std::uintptr_t, event_ref>> done;
    // Recorded on the copy stream after each copy into or out of the current block: when the block
    // is given back, the fence (see the file comment). Separate from `up`/`down`, which keep
    // serving host-side waits on the home buffer after the block is gone.
    event_ref last_copy;
    std::uint64_t last_copy_seq = 0;  // when last_copy was recorded, in copy-stream order
    std::uint64_t counted_in_walk = 0;  // prefetch(): the walk that counted its write's block
    bool block_copied = false;  // a copy touched the current block (last_copy is meaningful)
    std::vector<std::size_t> uses;   // positions in the schedule, ascending
    std::vector<std::size_t> reads;  // those of them that need the data (not access::write)
    std::uint64_t last_use = 0;     // tick of the last acquire, for LRU without a schedule
  };

  device_backend& device;
  caching_allocator& memory;
  pinned_host_pool& host;
  tensor_store* nvme;
  tier_manager_options options;
  bool default_window = false;  // prefetch_window was 0: a tensor larger than it may go alone
  stream_ref copy;

  mutable std::mutex mutex;
  std::vector<tensor> tensors;
  std::vector<tensor_id> resident;  // tensors with a device block
  std::size_t device_bytes = 0;
  std::size_t host_bytes = 0;  // bytes of home copies in pinned memory
  std::size_t leaving_bytes = 0;  // of those, on their way to NVMe (evicted ahead, not landed)
  std::vector<tensor_id> schedule;
  std::vector<bool> overwrites;  // per schedule position: acquired with access::write
  std::vector<tensor_id> recording;
  std::vector<bool> recording_overwrites;
  bool is_recording = false;
  bool schedule_given = false;
  std::size_t pos = 0;
  // A resync that wrapped into the next iteration, held until the next acquire confirms it:
  // one stray acquire near the end must not move `pos` back to the start.
  std::size_t wrapped_pos = kNoPos;
  std::deque<tensor_id> recent;  // the last acquires (kResyncHistory), oldest first
  std::uint64_t tick = 0;
  tier_stats counters;

  // Device blocks given back while a copy on the copy stream may still use them, in the order
  // their events were recorded on the copy stream (hence the order they complete in). That is not
  // the order the blocks are given back in: a tensor whose last copy came earlier may be evicted
  // later, so each fence goes in by its sequence number.
  struct fence {
    std::uintptr_t begin, end;  // the bytes the copies touched: [dev, dev + bytes)
    event_ref last_copy;        // completes once no copy uses them any more
    std::uint64_t seq = 0;      // the copy's place in copy-stream order
  };
  std::deque<fence> fences;
  std::uint64_t copy_seq = 0;  // copies noted so far (note_block_copy)
  std::uint64_t prefetch_walks = 0;  // prefetch() calls so far
  std::vector<event_ref> spare_events;  // events of completed fences, for reuse

  impl(device_backend& d, caching_allocator& m, pinned_host_pool& h, tier_manager_options o,
       tensor_store* store)
      : device(d), memory(m), host(h), nvme(store), options(o) {
    TERRACE_EXPECTS(options.host_budget == 0 || nvme != nullptr,
                    "tier manager: a host budget needs an NVMe store to put the rest in");
    const std::size_t pinned = host.options().capacity;
    TERRACE_EXPECTS(pinned == 0 || options.host_budget <= pinned,
                    "tier manager host budget " + detail::describe_bytes(options.host_budget) +
                        " exceeds the pinned pool's capacity (" + detail::describe_bytes(pinned) + ")");
    const std::size_t capacity = device.properties().capacity;
    if (options.device_budget == 0) options.device_budget = capacity;
    TERRACE_EXPECTS(options.device_budget <= capacity,
                    "tier manager device budget " + detail::describe_bytes(options.device_budget) +
                        " exceeds the capacity of device '" + device.properties().name + "' (" +
                        detail::describe_bytes(capacity) + ")");
    default_window = options.prefetch_window == 0;
    if (default_window) options.prefetch_window = options.device_budget / 4;
    copy = device.create_stream();
  }

  ~impl() {
    try {
      device.synchronize_device();
    } catch (...) {
      // A failed stream already reported; memory is returned regardless.
    }
    for (tensor& t : tensors) {
      if (t.nvme_reading) {
        try {
          t.nvme_io.wait();
        } catch (...) {
          // The buffer is freed below either way; the error belonged to a read nobody waits for.
        }
      }
      if (t.leaving) {
        try {
          t.leave_io.wait();  // the put reads the buffer freed below
        } catch (...) {
        }
      }
      // The device is idle (synchronized above): no fence is needed for these blocks.
      if (t.dev != nullptr) memory.deallocate(t.dev, copy);
      if (t.host != nullptr) host.deallocate(t.host);
      for (event_ref e : {t.up, t.down, t.last_copy}) {
        if (e.native != nullptr) device.destroy_event(e);
      }
      for (auto& [stream, e] : t.done) device.destroy_event(e);
    }
    for (const fence& f : fences) device.destroy_event(f.last_copy);
    for (event_ref e : spare_events) device.destroy_event(e);
    device.destroy_stream(copy);
  }

  tensor& at(tensor_id id, const char* call) {
    if (id >= tensors.size()) {
      throw logic_error(std::string("terrace: tier manager: ") + call + " of unknown tensor id " +
                        std::to_string(id));
    }
    return tensors[id];
  }

  event_ref& ensure(event_ref& e) {
    if (e.native == nullptr) {
      if (spare_events.empty()) {
        e = device.create_event();
      } else {
        e = spare_events.back();
        spare_events.pop_back();
      }
    }
    return e;
  }

  // ------------------------------------------------------------------ fences on reused blocks

  // After a copy into or out of t's block has been queued on the copy stream.
  void note_block_copy(tensor& t) {
    device.record(ensure(t.last_copy), copy);
    t.last_copy_seq = ++copy_seq;
    t.block_copied = true;
  }

  // t's block is about to go back to the allocator: fence it if a copy on it may still be queued.
  // The event moves into the fence (t gets another one for its next block), so later copies of t
  // never move the point the fence stands for.
  void fence_block(tensor& t) {
    prune_fences();  // keeps the list short between acquires too
    if (t.block_copied && !device.query(t.last_copy)) {
      const auto begin = reinterpret_cast<std::uintptr_t>(t.dev);
      const fence f{begin, begin + t.bytes, t.last_copy, t.last_copy_seq};
      fences.insert(std::upper_bound(fences.begin(), fences.end(), f,
                                     [](const fence& a, const fence& b) { return a.seq < b.seq; }),
                    f);
      t.last_copy = event_ref{};
    }
    t.block_copied = false;
  }

  // Drops the fences whose copies are done. Never blocks: the copy stream completes in order, so
  // the completed ones are a prefix of the list.
  void prune_fences() {
    while (!fences.empty() && device.query(fences.front().last_copy)) {
      spare_events.push_back(fences.front().last_copy);
      fences.pop_front();
    }
  }

  // Orders `stream` after every copy still using memory of t's block: a wait on the newest fence
  // (by copy order) that overlaps it; the copy stream is in order, so that covers the older ones
  // too. The host does not block.
  void order_after_fences(const tensor& t, stream_ref stream) {
    prune_fences();
    const auto begin = reinterpret_cast<std::uintptr_t>(t.dev);
    const std::uintptr_t end = begin + t.bytes;
    for (auto it = fences.rbegin(); it != fences.rend(); ++it) {
      if (it->begin < end && begin < it->end) {
        device.wait(stream, it->last_copy);
        ++counters.fence_waits;
        return;
      }
    }
  }

  // ------------------------------------------------------------------ schedule

  void build_uses() {
    overwrites.resize(schedule.size(), false);  // a given schedule says nothing: all reads
    for (tensor& t : tensors) {
      t.uses.clear();
      t.reads.clear();
    }
    for (std::size_t i = 0; i < schedule.size(); ++i) {
      tensors[schedule[i]].uses.push_back(i);
      if (!overwrites[i]) tensors[schedule[i]].reads.push_back(i);
    }
    set_pos(0);
  }

  void set_pos(std::size_t p) {
    pos = p;
    wrapped_pos = kNoPos;
  }

  // Where this acquire stands in the schedule: in step, a little ahead (the iteration skipped
  // something), or off it (served on demand, counted).
  void follow_schedule(tensor_id id, access mode) {
    if (is_recording) {
      recording.push_back(id);
      recording_overwrites.push_back(mode == access::write);
    }
    if (schedule.empty()) return;
    step_schedule(id);
    recent.push_back(id);
    if (recent.size() > kResyncHistory) recent.pop_front();
  }

  // Whether the schedule's entries before position k are the last acquires (as many as
  // kResyncHistory, or the schedule's length, compares).
  bool follows_recent(std::size_t k) const {
    const std::size_t n = schedule.size();
    const std::size_t count = std::min(kResyncHistory, n);
    if (recent.size() < count) return false;
    for (std::size_t j = 1; j <= count; ++j) {
      if (schedule[(k + n - j) % n] != recent[recent.size() - j]) return false;  // j <= n
    }
    return true;
  }

  void step_schedule(tensor_id id) {
    if (pos >= schedule.size()) set_pos(0);  // the next iteration began without begin_iteration
    if (schedule[pos] == id) {
      set_pos(pos + 1);
      return;
    }
    if (wrapped_pos < schedule.size() && schedule[wrapped_pos] == id) {
      set_pos(wrapped_pos + 1);  // the wrap is confirmed: the next iteration has begun
      return;
    }
    ++counters.schedule_misses;
    // The search runs on past the schedule's end into the next iteration's start: an iteration
    // that skipped its last accesses (and began without begin_iteration) would otherwise leave
    // `pos` behind, and every later acquire a miss until the skipped tensors came up again.
    // A match found past the end is only a candidate until the next acquire follows it.
    // The nearest match wins, unless a farther one is preceded in the schedule by the last
    // acquires: with a tensor used several times, the nearest could put `pos` into the same
    // wrong phase at every miss, so that one deviation made every later iteration miss (without
    // begin_iteration), and prefetch walk from the wrong place, for good.
    // Saturated: a distance of SIZE_MAX (search it all) must not overflow to nothing.
    const std::size_t distance = std::min(options.resync_distance, schedule.size() - 1);
    wrapped_pos = kNoPos;
    std::size_t found = kNoPos;
    for (std::size_t d = 1; d <= distance; ++d) {
      const std::size_t k = (pos + d) % schedule.size();
      if (schedule[k] != id) continue;
      if (found == kNoPos) found = d;
      if (follows_recent(k)) {
        found = d;
        break;
      }
    }
    if (found == kNoPos) return;
    const std::size_t k = (pos + found) % schedule.size();
    if (pos + found < schedule.size()) set_pos(k + 1);
    else wrapped_pos = k + 1;  // k < pos: within the schedule
  }

  // Accesses until the first of `uses` (positions, ascending), counted from the next expected
  // one; kNever if there is none.
  std::size_t next_of(const std::vector<std::size_t>& uses) const {
    if (uses.empty()) return kNever;
    const std::size_t p = pos >= schedule.size() ? 0 : pos;
    const auto it = std::lower_bound(uses.begin(), uses.end(), p);
    if (it != uses.end()) return *it - p;
    return uses.front() + schedule.size() - p;
  }
  // Accesses until `t` is used again (the host tier: its home copy is wanted then).
  std::size_t next_use(const tensor& t) const { return next_of(t.uses); }
  // Accesses until a use that needs `t`'s device data. A use that overwrites it (access::write)
  // needs none: dropping the device copy before then costs no copy up, just like dropping one that
  // is never used again. (The engine's gradients: every use is a write, so among them the least
  // recently used goes first, whose copy down is the most likely to be done, so that a write can
  // take its block without a fence wait; counting writes as uses would pick the gradient flushed
  // last, still copying down.)
  std::size_t next_read(const tensor& t) const { return next_of(t.reads); }

  // ------------------------------------------------------------------ room on the device

  // The unpinned resident tensor used farthest in the future (least recently used among those
  // never used again), other than `keep` and `also_keep`; only one used later than `later_than`
  // when that is set.
  tensor_id victim(tensor_id keep, std::size_t later_than,
                   tensor_id also_keep = static_cast<tensor_id>(-1)) const {
    tensor_id best = static_cast<tensor_id>(-1);
    std::size_t best_next = 0;
    std::uint64_t best_last = 0;
    for (tensor_id id : resident) {
      const tensor& t = tensors[id];
      if (id == keep || id == also_keep || t.pins > 0) continue;
      const std::size_t next = next_read(t);
      if (later_than != kNever && next <= later_than) continue;
      if (best == static_cast<tensor_id>(-1) || next > best_next ||
          (next == best_next && t.last_use < best_last)) {
        best = id;
        best_next = next;
        best_last = t.last_use;
      }
    }
    return best;
  }

  // Evicts until `bytes` more fit the budget. With `later_than` set (prefetch), only tensors
  // needed after that are evicted, and false says it could not make room.
  bool make_room(std::size_t bytes, tensor_id keep, std::size_t later_than) {
    while (device_bytes + bytes > options.device_budget) {
      const tensor_id v = victim(keep, later_than);
      if (v == static_cast<tensor_id>(-1)) return false;
      evict(v);
    }
    return true;
  }

  // A device block for `t`, evicting more if the device itself (fragmentation, other users) is
  // fuller than the budget says. nullptr, with nothing changed, if that is impossible and `soft`.
  void* device_block(tensor_id id, std::size_t later_than, bool soft) {
    tensor& t = tensors[id];
    for (;;) {
      try {
        return memory.allocate(t.bytes, copy, t.name);
      } catch (const out_of_memory&) {
        const tensor_id v = victim(id, later_than);
        if (v == static_cast<tensor_id>(-1)) {
          if (soft) return nullptr;
          throw;
        }
        evict(v);
      }
    }
  }

  void copy_down(tensor& t) {
    for (auto& [stream, e] : t.done) device.wait(copy, e);
    device.copy_async(t.host, t.dev, t.bytes, copy_kind::device_to_host, copy);
    try {
      device.record(ensure(t.down), copy);
      note_block_copy(t);
    } catch (...) {
      // The copy is queued but no event tells when it is done: nothing would wait for it before
      // the home buffer is written (host_data(access::write)) or the block handed on. Once the
      // copy stream is idle it is a finished copy down; if even that fails, it stays unfinished
      // (dev_newer), as a copy never queued.
      bool idle = false;
      try {
        device.synchronize(copy);
        idle = true;
      } catch (...) {
      }
      if (idle) mark_copied_down(t);
      throw;
    }
    t.down_pending = true;
    mark_copied_down(t);
  }

  // The home copy gets (or, down_pending, is getting) the device copy's data.
  void mark_copied_down(tensor& t) {
    t.host_written = true;
    t.nvme_current = false;
    t.dev_newer = false;
    counters.device_to_host_bytes += static_cast<std::int64_t>(t.bytes);
    ++counters.device_to_host_copies;
  }

  void drop_device_copy(tensor_id id) {
    tensor& t = tensors[id];
    fence_block(t);  // the next owner of the memory may be handed it on another stream
    memory.deallocate(t.dev, copy);
    t.dev = nullptr;
    t.up_pending = false;
    t.prefetched = false;
    resident.erase(std::find(resident.begin(), resident.end(), id));
    device_bytes -= t.bytes;
    counters.device_bytes = static_cast<std::int64_t>(device_bytes);
  }

  void evict(tensor_id id) {
    tensor& t = tensors[id];
    if (t.dev_newer) copy_down(t);  // the home copy must hold the data before the block goes
    drop_device_copy(id);
    ++counters.evictions;
  }

  // Gives `t` a device block and queues its copy up (unless it is about to be overwritten).
  // A copy the device refuses gives the block back and throws: kept, the block would pass for
  // the tensor's data at its next acquire.
  void bring_up(tensor_id id, void* block, bool needs_data) {
    tensor& t = tensors[id];
    const bool copies = needs_data && t.host_written;
    if (copies) {
      bool queued = false;
      try {
        // A copy down still in flight on the copy stream is ahead of this one: same stream.
        device.copy_async(block, t.host, t.bytes, copy_kind::host_to_device, copy);
        queued = true;
        device.record(ensure(t.up), copy);
        // Here too: without the block's event the tensor would be left on the device with its
        // copy queued and nothing pending, and its next acquire would not wait for the data.
        note_block_copy(t);
      } catch (...) {
        if (queued) {
          try {
            device.synchronize(copy);  // no event fences the block: the copy must be done
          } catch (...) {
          }
        }
        memory.deallocate(block, copy);
        throw;
      }
    }
    t.dev = block;
    resident.push_back(id);
    device_bytes += t.bytes;
    counters.device_bytes = static_cast<std::int64_t>(device_bytes);
    counters.device_bytes_peak = std::max(counters.device_bytes_peak, counters.device_bytes);
    if (copies) {
      t.up_pending = true;
      counters.host_to_device_bytes += static_cast<std::int64_t>(t.bytes);
      ++counters.host_to_device_copies;
    }
  }

  // Bytes of prefetches still copying up (a demand fetch is not counted: the window bounds how far
  // prefetch runs ahead, not the traffic the caller asked for).
  std::size_t prefetch_bytes_in_flight() {
    std::size_t sum = 0;
    for (tensor_id id : resident) {
      tensor& t = tensors[id];
      if (t.up_pending && device.query(t.up)) t.up_pending = false;
      if (t.up_pending && t.prefetched) sum += t.bytes;
    }
    return sum;
  }

  // How many schedule positions from `pos` on prefetch may look at: the whole cycle, or (without
  // prefetch_across_iterations) only what is left of this iteration.
  std::size_t prefetch_horizon() const {
    const std::size_t n = schedule.size();
    if (options.prefetch_across_iterations) return n;
    return pos >= n ? 0 : n - pos;
  }

  // Copies the next tensors of the schedule up, in order of use, while the window and the budget
  // allow it without evicting anything needed before them. That includes the blocks the writes
  // before a prefetched tensor's use will take (a tensor to be overwritten gets a block at its
  // acquire, with no copy up): without them, a prefetch into the room a gradient's write is about
  // to take is evicted by that write before its use, and copied up again. (Reads of tensors not
  // prefetched yet are not counted: they are prefetched in turn, or wait on NVMe, whose host-side
  // room is another budget.)
  void prefetch() {
    if (schedule.empty()) return;
    std::size_t in_flight = prefetch_bytes_in_flight();
    const std::size_t n = schedule.size();
    const std::size_t start = pos >= n ? 0 : pos;
    const std::size_t horizon = prefetch_horizon();
    std::size_t taken_before = 0;  // blocks the writes before position k will take
    const std::uint64_t walk = ++prefetch_walks;
    const auto needs_block_first = [&](tensor& t) {
      if (t.counted_in_walk == walk) return;  // written twice ahead: one block
      t.counted_in_walk = walk;
      taken_before += t.bytes;
    };
    for (std::size_t k = 0; k < horizon; ++k) {
      const tensor_id id = schedule[(start + k) % n];
      tensor& t = tensors[id];
      if (t.dev != nullptr) continue;
      if (overwrites[(start + k) % n]) {  // its data is not wanted there: no copy up
        needs_block_first(t);
        continue;
      }
      if (t.nvme_reading) {
        if (!t.nvme_io.ready()) continue;  // still on its way from NVMe: a later call takes it
        if (!finish_read_ahead(t)) continue;
      }
      if (t.host == nullptr || !t.host_written) continue;  // on NVMe only, or never written
      // Under the default window (a quarter of the budget) one prefetch of any size may be in
      // flight, so that a model of a few large layers is still brought up ahead of use.
      if (in_flight + t.bytes > options.prefetch_window && (in_flight > 0 || !default_window)) return;
      if (t.bytes + taken_before > options.device_budget) return;
      // Room as make_room makes it, but a victim whose next use before t's is a write (a gradient
      // flushed but kept) takes a block again there, evicting what is needed farthest then: t,
      // when everything else is needed sooner, which made this copy up a waste. It goes only if
      // another victim is left for that write (and then counts as a write for the positions
      // after this one).
      std::vector<tensor_id> rewritten;
      while (device_bytes + t.bytes + taken_before > options.device_budget) {
        const tensor_id v = victim(id, k);
        if (v == static_cast<tensor_id>(-1)) return;
        if (next_use(tensors[v]) <= k) {
          if (victim(id, k, v) == static_cast<tensor_id>(-1)) return;
          rewritten.push_back(v);
        }
        evict(v);
      }
      void* block = device_block(id, k, /*soft=*/true);
      if (block == nullptr) return;
      for (tensor_id v : rewritten) needs_block_first(tensors[v]);
      // Wanted soon after all (evicted ahead, not landed yet): it stays home. Only here, once it
      // is brought up: before the window's checks, a walk that stopped there waited for the put
      // and undid the eviction for nothing.
      stay_home(t);
      bring_up(id, block, true);
      t.prefetched = true;
      ++counters.prefetches;
      in_flight += t.bytes;
    }
  }

  // ------------------------------------------------------------------ the host tier over NVMe

  bool host_limited() const { return nvme != nullptr && options.host_budget != 0; }

  // The home copy used farthest in the future that can move to NVMe now: not on the device (its
  // copies there would need it), not being read from NVMe, not `chosen` already.
  tensor_id host_victim(tensor_id keep, std::size_t later_than, const std::vector<tensor_id>& chosen,
                        bool copies_done_only) const {
    tensor_id best = static_cast<tensor_id>(-1);
    std::size_t best_next = 0;
    std::uint64_t best_last = 0;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const tensor& t = tensors[i];
      if (i == keep || t.host == nullptr || t.dev != nullptr || t.nvme_reading || t.leaving) continue;
      if (std::find(chosen.begin(), chosen.end(), i) != chosen.end()) continue;
      if (copies_done_only && !copies_done(t)) continue;
      const std::size_t next = next_use(t);
      if (later_than != kNever && next <= later_than) continue;
      if (best == static_cast<tensor_id>(-1) || next > best_next ||
          (next == best_next && t.last_use < best_last)) {
        best = static_cast<tensor_id>(i);
        best_next = next;
        best_last = t.last_use;
      }
    }
    return best;
  }

  // Moves home copies to NVMe and frees their pinned buffers. The puts of one round are issued
  // together and then waited for together, so the engine runs them side by side; each buffer is
  // freed only once its own put landed (the caller needs the room at once, so the round itself
  // cannot return before that). A copy up or down may still touch a buffer: both are waited for
  // first. A put that fails leaves its tensor at home, unchanged; the others are settled and the
  // first error propagates.
  void evict_hosts(const std::vector<tensor_id>& victims) {
    struct write {
      tensor_id id;
      io_handle put;  // default: nothing to write (already on NVMe, or never written)
    };
    std::vector<write> writes;
    writes.reserve(victims.size());  // a put started is always kept, to be waited for below
    std::exception_ptr failure;
    for (tensor_id id : victims) {
      tensor& t = tensors[id];
      write w{id, {}};
      try {
        settle_copies(t);
        if (t.host_written && !t.nvme_current) w.put = nvme->put(t.name, t.host, t.bytes);
      } catch (...) {
        // The store is full, or a copy of this victim cannot be waited for: evict no more. The
        // puts already started still land below (an io_handle does not wait when destroyed, and
        // the put would go on reading a home buffer that is then written or reused).
        failure = std::current_exception();
        break;
      }
      writes.push_back(w);
    }
    for (write& w : writes) {
      tensor& t = tensors[w.id];
      try {
        w.put.wait();
      } catch (...) {
        ++counters.failed_puts;
        if (!failure) failure = std::current_exception();
        continue;
      }
      free_home(t, /*written=*/t.host_written && !t.nvme_current);
    }
    if (failure) std::rethrow_exception(failure);
  }

  // The home copy of `t` is on NVMe now (`written`: by a put just landed): its buffer goes back.
  void free_home(tensor& t, bool written) {
    if (written) {
      t.nvme_current = true;
      counters.nvme_write_bytes += static_cast<std::int64_t>(t.bytes);
    }
    give_back_home_buffer(t);
    t.host_written = false;
    ++counters.host_evictions;
  }

  // Whether t has a home buffer that holds none of its data, and no read is filling it: a write
  // acquire took it without reading the data in, or a read into it failed.
  static bool unfilled_home(const tensor& t) {
    return t.host != nullptr && !t.host_written && !t.nvme_reading;
  }

  // An unfilled home goes back when the acquire fails: whether it was taken by this acquire or
  // by a read ahead that failed before it, kept it would pass for the data.
  void give_back_unfilled_home(tensor& t) {
    if (unfilled_home(t)) give_back_home_buffer(t);
  }

  // The pinned buffer of `t` goes back to the pool and out of the host budget.
  void give_back_home_buffer(tensor& t) {
    host.deallocate(t.host);
    t.host = nullptr;
    host_bytes -= t.bytes;
    counters.host_bytes = static_cast<std::int64_t>(host_bytes);
  }

  // Whether no copy up or down touches t's home buffer any more (settle_copies would not wait).
  bool copies_done(const tensor& t) const {
    return (t.up.native == nullptr || device.query(t.up)) && (!t.down_pending || device.query(t.down));
  }

  // A copy up or down may still touch the home buffer of a tensor about to leave: both first.
  void settle_copies(tensor& t) {
    if (t.up.native != nullptr) device.synchronize(t.up);
    if (t.down_pending) {
      device.synchronize(t.down);
      t.down_pending = false;
    }
  }

  // ---- evicting ahead of need. prefetch_from_nvme makes room for the reads it starts by putting
  // home copies needed later to NVMe without waiting (the training thread would otherwise wait
  // for those puts inside acquire); their buffers are freed by a later call once the puts have
  // landed (land_leaving). A tensor used before that stays home (stay_home). A put that fails
  // leaves its tensor at home, as evict_hosts does; the error is not reported here (the call that
  // lands it did not ask for it, and may have acquired a tensor already): the next eviction of it
  // on the demand path puts it again and reports.

  // Frees the buffers whose puts have landed (with `wait`, waits for all of them first).
  void land_leaving(bool wait) noexcept {
    if (leaving_bytes == 0) return;
    for (tensor& t : tensors) {
      if (!t.leaving || (!wait && !t.leave_io.ready())) continue;
      t.leaving = false;
      leaving_bytes -= t.bytes;
      try {
        t.leave_io.wait();
      } catch (...) {
        ++counters.failed_puts;
        continue;  // still at home, the only current copy
      }
      free_home(t, /*written=*/true);
    }
  }

  // `t` is needed: it stays home. Its put still has to land (the caller may write the buffer).
  void stay_home(tensor& t) noexcept {
    if (!t.leaving) return;
    t.leaving = false;
    leaving_bytes -= t.bytes;
    try {
      t.leave_io.wait();
      t.nvme_current = true;  // the put wrote the current data
      counters.nvme_write_bytes += static_cast<std::int64_t>(t.bytes);
    } catch (...) {
      ++counters.failed_puts;  // NVMe does not hold it; home does
    }
  }

  // Starts puts of home copies needed later than `later_than` (Belady) until `bytes` more will fit
  // the host budget once they land; clean ones (already on NVMe) are freed at once. False if not
  // enough can leave, or the store refuses a put.
  bool start_leaving(std::size_t bytes, tensor_id keep, std::size_t later_than) {
    // Home copies no copy still touches first: this runs inside acquire, which should not wait
    // for a copy (a gradient just offloaded is the farthest-needed home copy while its copy down
    // runs). Only if they are not enough, the others too, whose copies settle_copies waits for:
    // a read started ahead is worth that wait (its use would otherwise read on demand).
    auto [chosen, enough] =
        host_victims(bytes, keep, later_than, leaving_bytes, /*copies_done_only=*/true);
    if (!enough) std::tie(chosen, enough) = host_victims(bytes, keep, later_than, leaving_bytes);
    if (!enough) return false;
    for (tensor_id id : chosen) {
      tensor& t = tensors[id];
      settle_copies(t);
      if (!t.host_written || t.nvme_current) {
        free_home(t, /*written=*/false);
        continue;
      }
      try {
        t.leave_io = nvme->put(t.name, t.host, t.bytes);
      } catch (...) {
        return false;  // the store is full: the demand path will say so
      }
      t.leaving = true;
      leaving_bytes += t.bytes;
      ++counters.host_evictions_ahead;
    }
    return true;
  }

  // Evicts home copies (Belady) until `bytes` more fit the host budget; false if not enough can
  // leave (what could leave has left).
  bool make_host_room(std::size_t bytes, tensor_id keep, std::size_t later_than) {
    if (!host_limited()) return true;
    // Puts started ahead of need free room as they land: first those, then the rest of them.
    land_leaving(/*wait=*/false);
    if (host_bytes + bytes > options.host_budget) land_leaving(/*wait=*/true);
    auto victims = host_victims(bytes, keep, later_than, 0);
    if (!victims.second) {
      // Reads started ahead of use hold room that is never a victim while in flight; landed,
      // their copies are clean (NVMe holds them) and leave like any other, without a put.
      land_reads();
      victims = host_victims(bytes, keep, later_than, 0);
    }
    evict_hosts(victims.first);
    return host_bytes + bytes <= options.host_budget;
  }

  // Waits for every NVMe read in flight (finish_read_ahead).
  void land_reads() noexcept {
    for (tensor& t : tensors) {
      if (t.nvme_reading) finish_read_ahead(t);
    }
  }

  // Finishes a read that the call at hand did not ask for (started ahead of use); false if it
  // failed. The failed read has given its buffer back (finish_read) and its tensor is still on
  // NVMe: the error is left to the use that needs the tensor, which reads it again and reports
  // the error if it persists. Reported here, it would fail a call about another tensor (an
  // acquire, begin_iteration, a checkpoint) once per failed read, however healthy the store is
  // by then.
  bool finish_read_ahead(tensor& t) noexcept {
    try {
      finish_read(t);
      return true;
    } catch (...) {
      return false;
    }
  }

  // The home copies to move out (host_victim, in turn) so that `bytes` more fit the host budget
  // once they and the `going` bytes already on their way have left; and whether that is enough.
  std::pair<std::vector<tensor_id>, bool> host_victims(std::size_t bytes, tensor_id keep,
                                                       std::size_t later_than, std::size_t going,
                                                       bool copies_done_only = false) const {
    std::vector<tensor_id> chosen;
    while (host_bytes - going + bytes > options.host_budget) {
      const tensor_id v = host_victim(keep, later_than, chosen, copies_done_only);
      if (v == static_cast<tensor_id>(-1)) return {std::move(chosen), false};
      chosen.push_back(v);
      going += tensors[v].bytes;
    }
    return {std::move(chosen), true};
  }

  // A tensor whose home copy can never fit the host budget: refused before any home copy is
  // moved out for it (the search for room would push the whole host tier to NVMe, then fail).
  void refuse_larger_than_host_budget(const tensor& t) const {
    if (host_limited() && t.bytes > options.host_budget) {
      throw out_of_memory("terrace: tier manager: '" + t.name + "' (" +
                          detail::describe_bytes(t.bytes) + ") is larger than the host budget of " +
                          detail::describe_bytes(options.host_budget) +
                          ": its home copy can never be in pinned memory");
    }
  }

  // A home buffer for `id`, which needs one now (its data is wanted, or it is being added): room
  // in the host budget first; then, since the pinned pool can refuse although the budget has room
  // (its alignment rounding, the memlock limit, regions too fragmented for the size), home copies
  // move to NVMe one at a time (Belady) until the pool serves it. A home copy under a device copy
  // cannot leave, so when no other can, an unpinned device copy is evicted (Belady) and its home
  // leaves next, for the budget as for the pool; only the homes of acquired tensors make either
  // refusal final. (A host budget below the device budget fills with the homes of device copies.)
  void take_home_buffer_on_demand(tensor_id id) {
    tensor& t = tensors[id];
    refuse_larger_than_host_budget(t);
    while (!make_host_room(t.bytes, id, kNever)) {
      const tensor_id on_device = victim(id, kNever);
      if (on_device == static_cast<tensor_id>(-1)) {
        throw out_of_memory("terrace: tier manager: no room for '" + t.name + "' (" +
                            detail::describe_bytes(t.bytes) + ") in the host budget of " +
                            detail::describe_bytes(options.host_budget) +
                            ": every home copy there belongs to an acquired tensor");
      }
      evict(on_device);
    }
    for (bool landed = false;;) {
      try {
        take_host_buffer(t);
        return;
      } catch (const out_of_memory&) {
        if (!host_limited()) throw;  // without NVMe no home copy can leave
        if (!landed) {
          landed = true;  // buffers of puts and reads in flight first
          land_leaving(/*wait=*/true);
          land_reads();
          continue;
        }
        const tensor_id home = host_victim(id, kNever, {}, false);
        if (home != static_cast<tensor_id>(-1)) {
          evict_hosts({home});
          continue;
        }
        const tensor_id on_device = victim(id, kNever);
        if (on_device == static_cast<tensor_id>(-1)) throw;
        evict(on_device);
      }
    }
  }

  void take_host_buffer(tensor& t) {
    t.host = host.allocate(t.bytes);
    host_bytes += t.bytes;
    counters.host_bytes = static_cast<std::int64_t>(host_bytes);
    counters.host_bytes_peak = std::max(counters.host_bytes_peak, counters.host_bytes);
  }

  // Finishes an NVMe read of `t` (blocking); on failure the buffer is given back and the error,
  // which names the tensor, propagates.
  void finish_read(tensor& t) {
    try {
      t.nvme_io.wait();
    } catch (...) {
      t.nvme_reading = false;
      give_back_home_buffer(t);
      throw;
    }
    t.nvme_reading = false;
    t.host_written = true;
  }

  // Makes the home copy of `id` present in pinned memory (a device copy must always have one to
  // come home to), reading it from NVMe when it lives there and `need_data`; blocks until the data
  // is in.
  void ensure_home(tensor_id id, bool need_data = true) {
    tensor& t = tensors[id];
    stay_home(t);
    if (t.nvme_reading && !need_data) {
      // A read ahead is writing into the buffer the caller will overwrite: it must land first,
      // but its data is not wanted, so its failure is not the caller's (finish_read gave the
      // buffer back; one is taken anew below).
      try {
        finish_read(t);
      } catch (const io_error&) {
      }
    }
    if (t.host == nullptr) take_home_buffer_on_demand(id);
    // A buffer that holds none of the data (just taken, or left by a write acquire that failed)
    // is filled from NVMe when the data is wanted.
    if (need_data && t.nvme_current && unfilled_home(t)) {
      t.nvme_io = nvme->get(t.name, t.host, t.bytes);
      t.nvme_reading = true;
      counters.nvme_read_bytes += static_cast<std::int64_t>(t.bytes);
    }
    if (t.nvme_reading) {
      if (!t.nvme_io.ready()) ++counters.nvme_waits;
      finish_read(t);
    }
  }

  // Starts reading the home copies of the next tensors of the schedule back from NVMe, without
  // pushing out any home copy needed before them. Never blocks.
  void prefetch_from_nvme() {
    if (!host_limited() || schedule.empty()) return;
    land_leaving(/*wait=*/false);
    const std::size_t n = schedule.size();
    const std::size_t start = pos >= n ? 0 : pos;
    const std::size_t horizon = prefetch_horizon();
    for (std::size_t k = 0; k < horizon; ++k) {
      if (overwrites[(start + k) % n]) continue;  // overwritten there: its data is not wanted
      const tensor_id id = schedule[(start + k) % n];
      tensor& t = tensors[id];
      if (t.host != nullptr || !t.nvme_current) continue;
      if (host_bytes + t.bytes > options.host_budget) {
        // No room yet: start moving home copies needed later out, without waiting for them; this
        // read starts at a later call, once they have landed.
        start_leaving(t.bytes, id, k);
        return;
      }
      // A read ahead is never worth failing the call at hand: a pool that refuses the buffer (it
      // can although the budget has room) or a store that refuses the read ends reading ahead;
      // the tensor's own use asks again and reports.
      try {
        take_host_buffer(t);
      } catch (const out_of_memory&) {
        // Room in the budget but not in the pool: home copies needed later leave as they would
        // for the budget (forced past it by the bytes the pool lacks), and a later call reads.
        start_leaving(options.host_budget - host_bytes + t.bytes, id, k);
        return;
      }
      try {
        t.nvme_io = nvme->get(t.name, t.host, t.bytes);
      } catch (...) {
        give_back_home_buffer(t);
        return;
      }
      t.nvme_reading = true;
      counters.nvme_read_bytes += static_cast<std::int64_t>(t.bytes);
      ++counters.nvme_prefetches;
    }
  }

  // ------------------------------------------------------------------ the calls

  void* acquire(tensor_id id, stream_ref stream, access mode) {
    std::lock_guard lock(mutex);
    tensor& t = at(id, "acquire");
    follow_schedule(id, mode);
    t.last_use = ++tick;
    bool empty_block = false;  // this acquire gave t a block and put none of its data there
    if (t.dev != nullptr) {
      if (t.prefetched) ++counters.prefetch_hits;
    } else {
      if (t.bytes > options.device_budget) {
        // Not a matter of what is acquired: releasing everything would not help.
        throw out_of_memory("terrace: tier manager: '" + t.name + "' (" +
                            detail::describe_bytes(t.bytes) + ") is larger than the device budget of " +
                            detail::describe_bytes(options.device_budget) +
                            ": it can never be on the device");
      }
      if (!make_room(t.bytes, id, kNever)) {
        throw out_of_memory("terrace: tier manager: no room for '" + t.name + "' (" +
                            detail::describe_bytes(t.bytes) + ") in the device budget of " +
                            detail::describe_bytes(options.device_budget) + ": " +
                            detail::describe_bytes(device_bytes) + " are held by " +
                            std::to_string(pinned_count()) + " acquired tensors");
      }
      ensure_home(id, mode != access::write);
      void* block = nullptr;
      try {
        block = device_block(id, kNever, /*soft=*/false);
      } catch (...) {
        // A write acquire takes a home buffer without reading the data in (it will be
        // overwritten); failing here, that empty buffer must not stand for the tensor's data.
        give_back_unfilled_home(t);
        throw;
      }
      bring_up(id, block, mode != access::write);
      if (t.up_pending) ++counters.demand_fetches;
      empty_block = !t.up_pending;
    }
    t.prefetched = false;
    try {
      order_stream(t, stream, mode);
    } catch (...) {
      // A refused wait: the block this acquire took for the caller to fill must not stay as the
      // device copy (the next acquire would hand out what its last owner left there).
      if (empty_block) drop_empty_block(id);
      throw;
    }
    ++t.pins;
    const bool was_newer = t.dev_newer;
    if (mode != access::read) t.dev_newer = true;
    try {
      prefetch();
      prefetch_from_nvme();
    } catch (...) {
      // A failure in another tensor's prefetch (a device error, say; not a failed read ahead:
      // finish_read_ahead) fails this acquire, which then must leave nothing pinned: the caller
      // gets no pointer and will not release it.
      --t.pins;
      t.dev_newer = was_newer;
      if (empty_block) drop_empty_block(id);
      throw;
    }
    return t.dev;
  }

  // Orders `stream` after the copies that t's block needs done before the caller's work: its copy
  // up, the copies that used its memory before it became t's, and for a caller that changes it, a
  // copy down still reading it. The host does not block.
  void order_stream(tensor& t, stream_ref stream, access mode) {
    bool after_copy_up = false;
    if (t.up_pending) {
      if (device.query(t.up)) {
        t.up_pending = false;
      } else {
        device.wait(stream, t.up);
        after_copy_up = true;
      }
    }
    // Without a copy up to wait for (access::write, no data yet, or a tensor already on the device
    // whose copy up, if any, is done), the caller's stream is not ordered after the copies that
    // used this memory before it became t's. A pending copy up is itself queued after them.
    if (!after_copy_up && stream.native != copy.native) order_after_fences(t, stream);
    if (mode != access::read && t.down_pending) {
      if (device.query(t.down)) {
        t.down_pending = false;
      } else {
        device.wait(stream, t.down);  // a flush still reading the block the caller will change
      }
    }
    if (stream.native != copy.native) memory.record_stream(t.dev, stream);
  }

  // An acquire that gave `id` a block with none of its data (the caller was to fill it) failed:
  // the caller never will. Kept, the block would pass for the tensor's data, and so would a home
  // buffer taken without reading the data in.
  void drop_empty_block(tensor_id id) {
    drop_device_copy(id);
    give_back_unfilled_home(tensors[id]);
  }

  std::size_t pinned_count() const {
    std::size_t n = 0;
    for (tensor_id id : resident) n += tensors[id].pins > 0 ? 1 : 0;
    return n;
  }

  void release(tensor_id id, stream_ref stream) {
    std::lock_guard lock(mutex);
    tensor& t = at(id, "release");
    if (t.pins == 0) {
      throw logic_error("terrace: tier manager: release of '" + t.name + "', which is not acquired");
    }
    // The block must not be handed out again before the work queued on `stream` is done, as it
    // would be for a stream that released the tensor without having acquired it (a reader
    // ordered after the acquiring stream).
    if (stream.native != copy.native) memory.record_stream(t.dev, stream);
    // The copy down of an eviction must wait for the work that used the tensor on `stream`.
    const auto s = reinterpret_cast<std::uintptr_t>(stream.native);
    auto d = std::find_if(t.done.begin(), t.done.end(), [&](const auto& x) { return x.first == s; });
    if (d == t.done.end()) {
      // The event first, and room for it: an entry without one would be waited on.
      t.done.reserve(t.done.size() + 1);
      event_ref e{};
      t.done.emplace_back(s, ensure(e));
      d = std::prev(t.done.end());
    }
    device.record(d->second, stream);
    // Unpinned last: a release that throws (an event the device cannot record) leaves the tensor
    // acquired, never evictable with nothing to tell when `stream` is done with it.
    --t.pins;
  }

  void* host_data(tensor_id id, access mode) {
    std::lock_guard lock(mutex);
    return host_data_locked(id, mode);
  }

  void read_home(tensor_id id, void* out) {
    std::lock_guard lock(mutex);
    tensor& t = at(id, "read_home");
    TERRACE_EXPECTS(out != nullptr, "tier manager: read_home of '" + t.name + "' into a null buffer");
    if (t.pins == 0 && t.host == nullptr && !(t.dev != nullptr && t.dev_newer) && t.nvme_current) {
      // Only on NVMe: read it straight into `out`. A home buffer would need room in the host
      // budget, which the training thread's tensors may be holding (the caller runs beside it);
      // the lock keeps the stored copy from being replaced meanwhile.
      nvme->get(t.name, out, t.bytes).wait();
      counters.nvme_read_bytes += static_cast<std::int64_t>(t.bytes);
      return;
    }
    if (t.pins == 0 && !t.host_written && !t.nvme_current && !(t.dev != nullptr && t.dev_newer)) {
      // Never written (or not since a restart whose checkpoint lacks it): its contents are
      // undefined, and a home buffer taken only to copy them out could be refused for want of room
      // in the host budget, which the training thread's acquired tensors may hold. A home buffer
      // it has (taken by add) holds whatever the pool's last user left there.
      std::memset(out, 0, t.bytes);
      return;
    }
    std::memcpy(out, host_data_locked(id, access::read), t.bytes);
  }

  void* host_data_locked(tensor_id id, access mode) {
    tensor& t = at(id, "host_data");
    stay_home(t);
    if (t.pins > 0) {
      throw logic_error("terrace: tier manager: host_data of '" + t.name +
                        "' while it is acquired on the device (release it first)");
    }
    if (mode == access::write) return overwrite_home(id);
    if (t.dev == nullptr || !t.dev_newer) ensure_home(id);
    if (t.dev != nullptr && t.dev_newer) copy_down(t);
    // A copy up (perhaps a prefetch since evicted) may still be reading the home copy that the
    // caller is about to change.
    if (t.up.native != nullptr) device.synchronize(t.up);
    t.up_pending = false;
    if (t.down_pending) {
      device.synchronize(t.down);
      t.down_pending = false;
    }
    return t.host;
  }

  // host_data(id, access::write): a home buffer whose old contents nobody needs.
  void* overwrite_home(tensor_id id) {
    tensor& t = tensors[id];
    // A copy up still reading the buffer, or a copy down (a flush) still writing it, must be done
    // before the caller writes it. Waited for before a buffer is taken for a home copy on NVMe
    // (no copy touches that one): a wait that fails would otherwise leave it holding none of the
    // data, in the host budget, as if it were the home copy.
    if (t.up.native != nullptr) device.synchronize(t.up);
    t.up_pending = false;
    if (t.down_pending) {
      device.synchronize(t.down);
      t.down_pending = false;
    }
    ensure_home(id, /*need_data=*/false);
    if (t.dev != nullptr) drop_device_copy(id);
    t.host_written = true;
    t.nvme_current = false;
    t.dev_newer = false;
    return t.host;
  }

  // flush(), and with `drop` offload(): the device block goes back once the copy is queued.
  void flush(tensor_id id, bool drop) {
    std::lock_guard lock(mutex);
    const char* what = drop ? "offload" : "flush";
    tensor& t = at(id, what);
    if (t.pins > 0) {
      throw logic_error(std::string("terrace: tier manager: ") + what + " of '" + t.name +
                        "' while it is acquired on the device (release it first)");
    }
    if (t.dev == nullptr) return;
    // A tensor on the device always has its home buffer (host eviction skips them), and no NVMe
    // read into it is in flight (acquire finished it or never started one).
    if (t.dev_newer) copy_down(t);  // after t.done, the events recorded at release: never blocks
    if (drop) drop_device_copy(id);  // fenced: the block's next owner waits for the copy down
  }

  void host_modified(tensor_id id) {
    std::lock_guard lock(mutex);
    tensor& t = at(id, "host_modified");
    if (t.pins > 0) {
      throw logic_error("terrace: tier manager: host_modified of '" + t.name +
                        "' while it is acquired on the device");
    }
    if (t.host == nullptr) {
      throw logic_error("terrace: tier manager: host_modified of '" + t.name +
                        "', whose home copy is on NVMe (call host_data first)");
    }
    stay_home(t);
    t.host_written = true;
    t.nvme_current = false;
    t.dev_newer = false;
    if (t.dev != nullptr) drop_device_copy(id);
  }

  std::uint64_t checkpoint() {
    std::lock_guard lock(mutex);
    TERRACE_EXPECTS(nvme != nullptr, "tier manager: checkpoint without an NVMe store");
    // Refused before anything starts: a put issued for an earlier tensor would otherwise be left
    // reading its home buffer.
    for (const tensor& t : tensors) {
      if (t.pins > 0) {
        throw logic_error("terrace: tier manager: checkpoint while '" + t.name + "' is acquired");
      }
    }
    land_leaving(/*wait=*/true);
    std::vector<io_handle> writes;
    // Every put issued is waited for before this returns or throws: an io_handle does not wait
    // when destroyed, and a put left running would read a home buffer that a later copy down or
    // host_data(write) rewrites, or that another tensor gets once it is freed.
    std::exception_ptr failure;
    try {
      for (tensor& t : tensors) {
        if (t.dev != nullptr && t.dev_newer) copy_down(t);
        if (t.down_pending) {
          device.synchronize(t.down);
          t.down_pending = false;
        }
        if (t.nvme_reading) finish_read_ahead(t);  // NVMe holds it either way: nothing to put
        if (t.host != nullptr && t.host_written && !t.nvme_current) {
          writes.push_back(nvme->put(t.name, t.host, t.bytes));
          counters.nvme_write_bytes += static_cast<std::int64_t>(t.bytes);
        }
      }
    } catch (...) {
      failure = std::current_exception();
    }
    wait_all(writes, failure);
    if (failure) std::rethrow_exception(failure);
    for (tensor& t : tensors) {
      if (t.host != nullptr && t.host_written) t.nvme_current = true;
    }
    return nvme->checkpoint();
  }

  void check() const {
    std::lock_guard lock(mutex);
    const auto fail = [](const std::string& what) {
      throw logic_error("terrace: tier manager invariant: " + what);
    };
    std::size_t sum = 0;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const tensor& t = tensors[i];
      const bool listed = std::find(resident.begin(), resident.end(), i) != resident.end();
      if ((t.dev != nullptr) != listed) fail("'" + t.name + "' residency list disagrees");
      if (t.dev != nullptr) sum += t.bytes;
      if (t.pins < 0) fail("'" + t.name + "' has negative pins");
      if (t.pins > 0 && t.dev == nullptr) fail("'" + t.name + "' is pinned but not on the device");
      if (t.dev_newer && t.dev == nullptr) fail("'" + t.name + "' newer on a device it is not on");
    }
    if (sum != device_bytes) fail("device bytes do not recount");
    std::size_t home = 0, going = 0;
    for (const tensor& t : tensors) {
      home += t.host != nullptr ? t.bytes : 0;
      if (!t.leaving) continue;
      going += t.bytes;
      if (t.host == nullptr || t.dev != nullptr || t.nvme_reading) {
        fail("'" + t.name + "' is leaving for NVMe without a home copy, or with a device copy");
      }
    }
    if (home != host_bytes) fail("host bytes do not recount");
    if (going != leaving_bytes) fail("bytes leaving for NVMe do not recount");
    for (const tensor& t : tensors) {
      if (t.host == nullptr && t.dev == nullptr && !t.nvme_current && t.host_written) {
        fail("'" + t.name + "' has no copy anywhere");
      }
      if (unfilled_home(t) && t.nvme_current && t.dev == nullptr) {
        fail("'" + t.name + "' has a home buffer that holds none of its data, which is on NVMe");
      }
    }
    if (device_bytes > options.device_budget) fail("over the device budget");
  }
};

tier_manager::tier_manager(device_backend& device, caching_allocator& device_memory,
                           pinned_host_pool& host, tier_manager_options options,
                           tensor_store* nvme)
    : impl_(std::make_unique<impl>(device, device_memory, host, options, nvme)) {}

tier_manager::~tier_manager() = default;

tensor_id tier_manager::add(std::string name, std::size_t bytes, const void* initial) {
  TERRACE_EXPECTS(bytes > 0, "tier manager: tensor '" + name + "' of 0 bytes");
  // The name is its id in the store: refused here, not at its first eviction to NVMe.
  TERRACE_EXPECTS(name.size() <= tensor_store::max_id_bytes,
                  "tier manager: a tensor name of " + std::to_string(name.size()) + " bytes (at most " +
                      std::to_string(tensor_store::max_id_bytes) + ")");
  std::lock_guard lock(impl_->mutex);
  impl& m = *impl_;
  TERRACE_EXPECTS(m.tensors.size() < std::numeric_limits<tensor_id>::max(),
                  "tier manager: too many tensors");
  for (const impl::tensor& other : m.tensors) {
    TERRACE_EXPECTS(other.name != name, "tier manager: a tensor named '" + name + "' exists");
  }
  const auto id = static_cast<tensor_id>(m.tensors.size());
  m.tensors.emplace_back();
  impl::tensor& t = m.tensors.back();
  t.name = std::move(name);
  t.bytes = bytes;
  try {
    m.refuse_larger_than_host_budget(t);
    if (initial == nullptr && m.nvme != nullptr && m.nvme->size_of(t.name) == bytes) {
      t.nvme_current = true;  // resumed: its contents are on NVMe until first used
      return id;
    }
    m.take_home_buffer_on_demand(id);
  } catch (...) {
    m.tensors.pop_back();
    throw;
  }
  if (initial != nullptr) {
    std::memcpy(t.host, initial, bytes);
    t.host_written = true;
  }
  return id;
}

std::uint64_t tier_manager::checkpoint() { return impl_->checkpoint(); }

bool tier_manager::on_host(tensor_id id) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->at(id, "on_host").host != nullptr;
}

void* tier_manager::acquire(tensor_id id, stream_ref stream, access mode) {
  return impl_->acquire(id, stream, mode);
}
void tier_manager::release(tensor_id id, stream_ref stream) { impl_->release(id, stream); }
void* tier_manager::host_data(tensor_id id) { return impl_->host_data(id, access::update); }
void* tier_manager::host_data(tensor_id id, access mode) { return impl_->host_data(id, mode); }
void tier_manager::read_home(tensor_id id, void* out) { impl_->read_home(id, out); }
void tier_manager::flush(tensor_id id) { impl_->flush(id, /*drop=*/false); }
void tier_manager::offload(tensor_id id) { impl_->flush(id, /*drop=*/true); }
void tier_manager::host_modified(tensor_id id) { impl_->host_modified(id); }

void tier_manager::begin_iteration() {
  std::lock_guard lock(impl_->mutex);
  impl& m = *impl_;
  if (!m.schedule_given && m.schedule.empty()) {
    if (!m.is_recording) {
      m.is_recording = true;
      m.recording.clear();
      m.recording_overwrites.clear();
      return;
    }
    m.is_recording = false;
    m.schedule = std::move(m.recording);
    m.overwrites = std::move(m.recording_overwrites);
    m.recording.clear();
    m.recording_overwrites.clear();
    m.build_uses();
  } else {
    m.set_pos(0);
  }
  // The iteration's first tensors start coming up now, not at its first acquire (without
  // prefetch_across_iterations nothing else starts them before that acquire).
  m.prefetch();
  m.prefetch_from_nvme();
}

void tier_manager::abandon_iteration() {
  std::lock_guard lock(impl_->mutex);
  impl& m = *impl_;
  if (!m.is_recording) return;
  m.is_recording = false;
  m.recording.clear();
  m.recording_overwrites.clear();
}

void tier_manager::set_schedule(std::vector<tensor_id> order) {
  std::lock_guard lock(impl_->mutex);
  for (tensor_id id : order) (void)impl_->at(id, "set_schedule");
  impl_->schedule = std::move(order);
  impl_->overwrites.clear();  // no access modes given: every use counts as a read
  impl_->schedule_given = true;
  impl_->is_recording = false;
  impl_->build_uses();
}

std::vector<tensor_id> tier_manager::schedule() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->schedule;
}

bool tier_manager::on_device(tensor_id id) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->at(id, "on_device").dev != nullptr;
}

std::size_t tier_manager::size(tensor_id id) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->at(id, "size").bytes;
}

std::string tier_manager::name(tensor_id id) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->at(id, "name").name;
}

tier_stats tier_manager::stats() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->counters;
}

stream_ref tier_manager::copy_stream() const noexcept { return impl_->copy; }

void tier_manager::check_invariants() const { impl_->check(); }

}  // namespace terrace
