// SPDX-License-Identifier: Apache-2.0
// Trace replay: the address map from recorded to replayed pointers, streams made on demand, and the
// accounting of everything a window into a running job can contain.
#include "tools/replay.hpp"

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <algorithm>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "terrace/caching_allocator.hpp"
#include "terrace/config.hpp"
#include "terrace/device.hpp"
#include "terrace/error.hpp"
#include "tools/trace_input.hpp"

namespace terrace::tools {

namespace {

std::string hex(std::uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, v);
  return buf;
}

// Streams are destroyed only after the allocator, which may still hold events recorded on them:
// this owner is declared before the allocator so that it outlives it on every exit path.
class stream_table {
 public:
  explicit stream_table(device_backend& device) : device_(device) {}
  stream_table(const stream_table&) = delete;
  stream_table& operator=(const stream_table&) = delete;
  ~stream_table() {
    for (auto& [id, s] : streams_) {
      if (s.native != nullptr) device_.destroy_stream(s);
    }
  }

  // Trace stream 0 is the default stream on every backend; others get a stream of their own.
  // Consecutive events mostly name the same stream: the last one is remembered.
  stream_ref get(std::uintptr_t id) {
    if (id == last_id_ && !streams_.empty()) return last_;
    auto it = streams_.find(id);
    if (it == streams_.end()) {
      it = streams_.emplace(id, id == 0 ? stream_ref{} : device_.create_stream()).first;
    }
    last_id_ = id;
    last_ = it->second;
    return last_;
  }

  std::size_t size() const noexcept { return streams_.size(); }

 private:
  device_backend& device_;
  std::unordered_map<std::uintptr_t, stream_ref> streams_;
  std::uintptr_t last_id_ = 0;
  stream_ref last_{};
};

// What the replay holds for one recorded allocation (one slot per alloc event, and one per
// pre-existing block).
struct slot {
  void* ptr = nullptr;
  std::size_t event = 0;  // index of the alloc event, for error messages; SIZE_MAX: pre-existing
  std::size_t bytes = 0;
  // Its allocation failed with out_of_memory: its free is expected, and counted as what the block
  // was (a failed alloc of the trace, or a pre-existing block that could not be placed).
  bool failed = false;
};

constexpr std::uint32_t no_slot = UINT32_MAX;

// Each trace stream becomes a backend stream, a worker thread on sim: a trace naming more is
// refused before any is made, rather than starting thousands of threads. Real programs use a few.
constexpr std::size_t kMaxStreams = 1024;

// A live block's size as the allocator sees it (rounded to its 512 B minimum).
std::int64_t rounded_live_bytes(std::size_t bytes) {
  return static_cast<std::int64_t>((bytes + 511) / 512 * 512);
}

// The trace's addresses resolved once, before the timed loop: each alloc event gets a fresh
// slot, each free_requested event the slot of the allocation it frees (or no_slot: a free of a
// block that was never allocated in the window and is not accounted for). Resolving here rather
// than in the loop keeps one hash lookup per event out of the figure that measures the
// allocator, and finds an inconsistent trace before anything is replayed.
struct resolved_trace {
  std::vector<std::uint32_t> slot_of_event;  // per event; no_slot for the other actions
  std::vector<slot> slots;
  std::vector<std::size_t> preexisting;      // indices of free events whose block is pre-existing
  // The first event that contradicts the trace: an alloc of an address still held (`earlier` is
  // the alloc that holds it) or a second free of an address (`earlier` is the first free).
  std::size_t inconsistent_event = SIZE_MAX;
  std::size_t inconsistent_earlier = 0;
};

resolved_trace resolve(const std::vector<trace_event>& events, bool account_preexisting) {
  resolved_trace t;
  t.slot_of_event.assign(events.size(), no_slot);
  std::unordered_map<std::uintptr_t, std::uint32_t> open;  // address -> slot of its live alloc
  // Address -> the free event that freed it, until it is allocated again. A second free of it is a
  // double free: the trace is inconsistent, as with an alloc of a live address. (Taking it for a
  // block from before the window made a phantom block that counted in every peak.)
  std::unordered_map<std::uintptr_t, std::size_t> freed;
  std::unordered_set<std::uintptr_t> streams;
  std::uintptr_t last_stream = 0;  // consecutive events mostly name the same stream
  open.reserve(1024);
  auto inconsistent = [&](std::size_t event, std::size_t earlier) {
    t.inconsistent_event = event;
    t.inconsistent_earlier = earlier;
  };
  for (std::size_t i = 0; i < events.size(); ++i) {
    const trace_event& e = events[i];
    if ((e.action == trace_action::alloc || e.action == trace_action::free_requested) &&
        (e.stream != last_stream || streams.empty())) {
      last_stream = e.stream;
      if (streams.insert(e.stream).second && streams.size() > kMaxStreams) {
        throw logic_error("trace event " + std::to_string(i) + ": stream " + hex(e.stream) +
                          " is the trace's stream number " + std::to_string(streams.size()) +
                          "; the replay makes a backend stream for each (a worker thread on sim) "
                          "and takes at most " + std::to_string(kMaxStreams));
      }
    }
    if (e.action == trace_action::alloc) {
      const auto s = static_cast<std::uint32_t>(t.slots.size());
      const auto [it, inserted] = open.emplace(e.addr, s);
      if (!inserted) {
        inconsistent(i, t.slots[it->second].event);
        break;
      }
      t.slots.push_back({nullptr, i, 0, false});
      t.slot_of_event[i] = s;
      freed.erase(e.addr);
    } else if (e.action == trace_action::free_requested) {
      if (auto it = open.find(e.addr); it != open.end()) {
        t.slot_of_event[i] = it->second;
        open.erase(it);
        freed[e.addr] = i;
      } else if (auto f = freed.find(e.addr); f != freed.end()) {
        inconsistent(i, f->second);
        break;
      } else {
        // A block from before the window: accounted when its size is known and wanted, skipped
        // otherwise; either way its address is now freed, and a second free of it is refused.
        if (account_preexisting && (e.requested != 0 || e.size != 0)) {
          t.slot_of_event[i] = static_cast<std::uint32_t>(t.slots.size());
          t.slots.push_back({nullptr, SIZE_MAX, 0, false});
          t.preexisting.push_back(i);
        }
        freed[e.addr] = i;
      }
    }
  }
  if (t.slots.size() >= no_slot) {
    throw logic_error("trace has " + std::to_string(t.slots.size()) +
                      " allocations: more than the replay can index");
  }
  return t;
}

// The peaks of one window of the replay (from one timeline sample, or the start of the steady
// state, to the next), in the allocator's own figures: the blocks handed out and the bytes
// reserved, as the whole trace's peak_allocated_bytes and peak_reserved_bytes. Each window ends
// by reading the stats and resetting their peaks, so that the replay's loop counts nothing per
// event; the whole trace's peaks are kept here across the resets.
class window_peaks {
 public:
  explicit window_peaks(caching_allocator& alloc) : alloc_(alloc) {}

  struct peaks {
    std::int64_t requested = 0, allocated = 0, reserved = 0;
  };
  // The peak requested, allocated and reserved bytes since the window before; the next starts
  // from now.
  peaks close() {
    const allocator_stats s = alloc_.stats();
    keep_peaks_of(s);
    alloc_.reset_peak_stats();
    const auto all = static_cast<int>(stat_pool::all);
    return {s.requested_bytes[all].peak, s.allocated_bytes[all].peak, s.reserved_bytes[all].peak};
  }

  // `now` (the allocator's stats) with each peak the whole replay's, not its last window's.
  allocator_stats whole_replay(allocator_stats now) {
    keep_peaks_of(now);
#define TERRACE_WHOLE_PEAK(field, name) \
  for (std::size_t p = 0; p < now.field.size(); ++p) now.field[p].peak = kept_.field[p].peak;
    TERRACE_POOL_STATS(TERRACE_WHOLE_PEAK)
#undef TERRACE_WHOLE_PEAK
    const auto all = static_cast<int>(stat_pool::all);
    now.peak_fragmentation =
        unused_fraction(now.active_bytes[all].peak, now.reserved_bytes[all].peak);
    return now;
  }

 private:
  void keep_peaks_of(const allocator_stats& s) {
#define TERRACE_KEEP_PEAK(field, name)                   \
  for (std::size_t p = 0; p < s.field.size(); ++p) {     \
    kept_.field[p].peak = std::max(kept_.field[p].peak, s.field[p].peak); \
  }
    TERRACE_POOL_STATS(TERRACE_KEEP_PEAK)
#undef TERRACE_KEEP_PEAK
  }

  caching_allocator& alloc_;
  allocator_stats kept_{};
};

}  // namespace

replay_result replay(const std::vector<trace_event>& events, const replay_options& options) {
  device_options dev_opts;
  dev_opts.capacity = options.config.device_capacity;
  dev_opts.copy_bandwidth = options.config.copy_bandwidth;
  std::unique_ptr<device_backend> device = make_device(options.device, dev_opts);

  replay_result r;
  r.device = device->properties().name;
  r.events_total = events.size();

  stream_table streams(*device);
  caching_allocator alloc(*device, options.config);

  r.policy = std::string(to_string(options.config.policy));
  resolved_trace t = resolve(events, options.account_preexisting);

  // A free of an address not live in the window held memory since before it: allocate it first,
  // with the size its free gives, so that the peak counts it.
  std::int64_t live_bytes = 0;
  std::size_t held = 0;  // slots allocated and not yet freed
  for (std::size_t i : t.preexisting) {
    const trace_event& e = events[i];
    slot& b = t.slots[t.slot_of_event[i]];
    b.bytes = e.requested != 0 ? e.requested : e.size;
    try {
      b.ptr = alloc.allocate(b.bytes, streams.get(e.stream), "pre-existing");
      live_bytes += rounded_live_bytes(b.bytes);
      ++r.preexisting_allocs;
      ++held;
    } catch (const out_of_memory&) {
      // Not one of the trace's requests: `ooms` and `failed_alloc_frees` count only those.
      ++r.preexisting_unplaced;
      r.unplaced_events.push_back(i);
      b.failed = true;
    }
  }
  std::int64_t peak_live = live_bytes;
  const std::size_t stride =
      options.timeline_points > 0 ? std::max<std::size_t>(1, events.size() / options.timeline_points) : 0;

  const bool planned = options.config.policy == alloc_policy::planned;
  std::size_t steady_from = options.steady_from_event;
  if (steady_from == SIZE_MAX && !planned) steady_from = 0;
  bool steady = steady_from == 0;
  // Each sample, and the steady state's figures, are the peaks of the windows since: the state at
  // every stride-th event alone would miss a peak between two samples, and the report's chart
  // would then disagree with the peak its summary gives. Both count the blocks handed out, as
  // the whole trace's figures do (live_bytes, rounded requests, would give one state two figures).
  window_peaks windows(alloc);
  std::int64_t steady_requested = 0, steady_live = 0, steady_reserved = 0;
  auto close_window = [&] {
    const window_peaks::peaks p = windows.close();
    if (steady) {
      steady_requested = std::max(steady_requested, p.requested);
      steady_live = std::max(steady_live, p.allocated);
      steady_reserved = std::max(steady_reserved, p.reserved);
    }
    return p;
  };
  auto sample = [&](std::size_t i) {
    const window_peaks::peaks p = close_window();
    r.timeline.push_back({i, p.allocated, p.reserved});
  };
  if (stride != 0) sample(0);
  const std::size_t end = std::min(events.size(), t.inconsistent_event);
  bool stopped = false;
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < end; ++i) {
    if (!steady) {
      // plan_stats() takes the planner's lock and copies its figures, hence not every event; but
      // also just past every begin mark, where a marked iteration starts under a plan, or the
      // window would begin up to 63 events (on short iterations, iterations) into the first.
      const bool may_start_planned =
          i % 64 == 0 || events[i - 1].action == trace_action::iteration_begin;
      if (steady_from == SIZE_MAX ? (may_start_planned && alloc.plan_stats().iterations > 0)
                                  : i >= steady_from) {
        close_window();  // what came before is not the steady state's
        steady = true;
        r.steady_from_event = i;
      }
    }
    if (i == options.stop_after_event) {
      r.snapshot_at_stop = alloc.snapshot();
      stopped = true;
      break;
    }
    const trace_event& e = events[i];
    if (stride != 0 && i % stride == 0 && i != 0) sample(i);
    if (e.action == trace_action::alloc) {
      slot& b = t.slots[t.slot_of_event[i]];
      b.bytes = e.requested != 0 ? e.requested : e.size;
      ++r.allocs;
      ++r.events_replayed;
      try {
        b.ptr = alloc.allocate(b.bytes, streams.get(e.stream), e.tag);
        ++held;
        if (b.ptr != nullptr) live_bytes += rounded_live_bytes(b.bytes);
        if (live_bytes > peak_live) {
          peak_live = live_bytes;
          r.peak_live_after_events = i + 1;
        }
      } catch (const out_of_memory&) {
        ++r.ooms;
        r.unplaced_events.push_back(i);
        b.failed = true;
      }
    } else if (e.action == trace_action::free_requested) {
      const std::uint32_t s = t.slot_of_event[i];
      if (s == no_slot) {
        ++r.preexisting_frees;
        ++r.preexisting_skipped;
        continue;
      }
      slot& b = t.slots[s];
      ++r.events_replayed;
      if (b.failed) {
        ++(b.event == SIZE_MAX ? r.preexisting_frees : r.failed_alloc_frees);
      } else {
        alloc.deallocate(b.ptr, streams.get(e.stream));
        if (b.ptr != nullptr) live_bytes -= rounded_live_bytes(b.bytes);
        ++(b.event == SIZE_MAX ? r.preexisting_frees : r.frees);
        b.ptr = nullptr;
        --held;
      }
    } else if (e.action == trace_action::iteration_begin || e.action == trace_action::iteration_end) {
      // The recorded loop's marks: the planner sees the iterations it saw live.
      ++r.iteration_marks;
      if (e.action == trace_action::iteration_begin) {
        alloc.begin_iteration();
      } else {
        alloc.end_iteration();
      }
      continue;
    } else {
      ++r.skipped_events;
      continue;
    }
    if (options.check_invariants_every != 0 &&
        r.events_replayed % options.check_invariants_every == 0) {
      alloc.check_invariants();
    }
  }
  const auto stop = std::chrono::steady_clock::now();
  if (!stopped && t.inconsistent_event != SIZE_MAX) {
    const trace_event& e = events[t.inconsistent_event];
    if (e.action == trace_action::alloc) {
      throw logic_error("trace event " + std::to_string(t.inconsistent_event) + ": alloc of " +
                        hex(e.addr) + ", which the alloc at event " +
                        std::to_string(t.inconsistent_earlier) +
                        " still holds (no free_requested in between): the trace is inconsistent");
    }
    throw logic_error("trace event " + std::to_string(t.inconsistent_event) +
                      ": free_requested of " + hex(e.addr) + ", which the free_requested at event " +
                      std::to_string(t.inconsistent_earlier) +
                      " already freed (no alloc in between): a double free, the trace is "
                      "inconsistent");
  }
  // A stop at or after the last event (the report's "just after the peak" when the peak is the
  // last event) is never met inside the loop: the snapshot is the end's.
  if (!stopped && options.stop_after_event != SIZE_MAX) {
    r.snapshot_at_stop = alloc.snapshot();
  }
  if (stride != 0) {
    sample(stopped ? options.stop_after_event : end);
  } else {
    close_window();
  }
  if (!steady) r.steady_from_event = events.size();
  r.steady_peak_requested_bytes = steady_requested;
  r.steady_peak_live_bytes = steady_live;
  r.steady_peak_reserved_bytes = steady_reserved;
  r.steady_fragmentation = unused_fraction(steady_live, steady_reserved);
  if (options.check_invariants_every != 0) alloc.check_invariants();

  r.seconds = std::chrono::duration<double>(stop - start).count();
  r.events_per_second = r.seconds > 0.0 ? static_cast<double>(r.events_replayed) / r.seconds : 0.0;
  r.streams = streams.size();
  r.live_at_end = held;
  r.stats = windows.whole_replay(alloc.stats());
  const auto all = static_cast<int>(stat_pool::all);
  r.peak_requested_bytes = r.stats.requested_bytes[all].peak;
  r.peak_allocated_bytes = r.stats.allocated_bytes[all].peak;
  r.peak_reserved_bytes = r.stats.reserved_bytes[all].peak;
  r.fragmentation = unused_fraction(r.peak_allocated_bytes, r.peak_reserved_bytes);
  r.device_allocs = r.stats.num_device_alloc;
  r.plan = alloc.plan_stats();
  // No steady state reached, or one from event 0 (the others' default): the window is the whole
  // trace, and its figures are the whole trace's.
  if (!steady || r.steady_from_event == 0) {
    r.steady_peak_requested_bytes = r.peak_requested_bytes;
    r.steady_peak_live_bytes = r.peak_allocated_bytes;
    r.steady_peak_reserved_bytes = r.peak_reserved_bytes;
    r.steady_fragmentation = r.fragmentation;
  }
  return r;
}

std::vector<std::pair<std::string, replay_result>> replay_policies(const std::vector<trace_event>& events,
                                                                   const replay_options& base) {
  auto with_policy = [&](alloc_policy policy) {
    replay_options o = base;
    o.config = parse_alloc_conf("policy:" + std::string(to_string(policy)), base.config);
    return o;
  };
  replay_result planned = replay(events, with_policy(alloc_policy::planned));
  // No plan formed: no policy has a steady state, and each one's steady figures are its whole
  // trace's (a window from event 0 would measure live bytes where the others measure allocated).
  const std::size_t steady = std::min(planned.steady_from_event, events.size());
  std::vector<std::pair<std::string, replay_result>> runs;
  for (alloc_policy p : {alloc_policy::caching, alloc_policy::expandable}) {
    replay_options o = with_policy(p);
    o.steady_from_event = steady;
    runs.emplace_back(std::string(to_string(p)), replay(events, o));
  }
  runs.emplace_back("planned", std::move(planned));
  return runs;
}

std::vector<trace_event> load_trace(const std::string& path) {
  // Through trace_input, as every other format: `-` is standard input, and a read error (EIO, a
  // directory) is said as such rather than ending the trace early.
  trace_input input(path);
  return reading(path, [&] { return read_trace_jsonl_of(input.from_start(), path); });
}

std::vector<trace_event> read_trace_jsonl_of(std::istream& in, const std::string& path) {
  try {
    return read_trace_jsonl(in);
  } catch (const logic_error& e) {
    throw logic_error(path + ": " + std::string(message_without_origin(e)));
  }
}

}  // namespace terrace::tools
