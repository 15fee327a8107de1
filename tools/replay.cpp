// SPDX-License-Identifier: Apache-2.0
// Trace replay: the address map from recorded to replayed pointers, streams made on demand, and the
// accounting of everything a window into a running job can contain.
#include "tools/replay.hpp"

#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#include "terrace/caching_allocator.hpp"
#include "terrace/device.hpp"
#include "terrace/error.hpp"

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
  stream_ref get(std::uintptr_t id) {
    auto it = streams_.find(id);
    if (it != streams_.end()) return it->second;
    const stream_ref s = id == 0 ? stream_ref{} : device_.create_stream();
    streams_.emplace(id, s);
    return s;
  }

  std::size_t size() const noexcept { return streams_.size(); }

 private:
  device_backend& device_;
  std::unordered_map<std::uintptr_t, stream_ref> streams_;
};

struct live_block {
  void* ptr = nullptr;
  std::size_t event = 0;  // index of the alloc event, for error messages; SIZE_MAX: pre-existing
  std::size_t bytes = 0;
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

  std::unordered_map<std::uintptr_t, live_block> live;
  // Addresses whose replayed allocation failed: their frees are expected, not pre-existing.
  std::unordered_set<std::uintptr_t> failed;
  live.reserve(1024);
  r.policy = std::string(to_string(options.config.policy));

  // A free of an address not live in the window held memory since before it: allocate it first,
  // with the size its free gives, so that the peak counts it.
  if (options.account_preexisting) {
    std::unordered_set<std::uintptr_t> seen_live;
    for (const trace_event& e : events) {
      if (e.action == trace_action::alloc) {
        seen_live.insert(e.addr);
      } else if (e.action == trace_action::free_requested && seen_live.erase(e.addr) == 0 &&
                 live.count(e.addr) == 0) {
        const std::size_t bytes = e.requested != 0 ? e.requested : e.size;
        if (bytes == 0) continue;
        try {
          void* p = alloc.allocate(bytes, streams.get(e.stream), "pre-existing");
          live.emplace(e.addr, live_block{p, SIZE_MAX, bytes});
          ++r.preexisting_allocs;
        } catch (const out_of_memory&) {
          ++r.ooms;
          failed.insert(e.addr);
        }
      }
    }
  }
  std::int64_t live_bytes = 0;
  for (const auto& [addr, b] : live) live_bytes += static_cast<std::int64_t>((b.bytes + 511) / 512 * 512);
  std::int64_t peak_live = live_bytes;
  const std::size_t stride =
      options.timeline_points > 0 ? std::max<std::size_t>(1, events.size() / options.timeline_points) : 0;
  auto sample = [&](std::size_t i) {
    r.timeline.push_back({i, live_bytes, static_cast<std::int64_t>(device->used_bytes())});
  };
  if (stride != 0) sample(0);

  const bool planned = options.config.policy == alloc_policy::planned;
  std::size_t steady_from = options.steady_from_event;
  if (steady_from == SIZE_MAX && !planned) steady_from = 0;
  bool steady = steady_from == 0;
  std::int64_t steady_live = 0, steady_reserved = 0;
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < events.size(); ++i) {
    if (!steady) {
      if (steady_from == SIZE_MAX ? (i % 64 == 0 && alloc.plan_stats().iterations > 0)
                                  : i >= steady_from) {
        steady = true;
        r.steady_from_event = i;
      }
    }
    if (steady) {
      steady_live = std::max(steady_live, live_bytes);
      steady_reserved =
          std::max(steady_reserved, static_cast<std::int64_t>(device->used_bytes()));
    }
    if (i == options.stop_after_event) {
      r.snapshot_at_stop = alloc.snapshot();
      break;
    }
    const trace_event& e = events[i];
    if (stride != 0 && i % stride == 0 && i != 0) sample(i);
    if (e.action == trace_action::alloc) {
      if (auto it = live.find(e.addr); it != live.end()) {
        throw logic_error("trace event " + std::to_string(i) + ": alloc of " + hex(e.addr) +
                          ", which the alloc at event " + std::to_string(it->second.event) +
                          " still holds (no free_requested in between): the trace is inconsistent");
      }
      if (failed.count(e.addr) != 0) {
        throw logic_error("trace event " + std::to_string(i) + ": alloc of " + hex(e.addr) +
                          ", which an earlier alloc still holds (no free_requested in between): "
                          "the trace is inconsistent");
      }
      const std::size_t bytes = e.requested != 0 ? e.requested : e.size;
      ++r.allocs;
      ++r.events_replayed;
      try {
        void* p = alloc.allocate(bytes, streams.get(e.stream), e.tag);
        live.emplace(e.addr, live_block{p, i, bytes});
        if (p != nullptr) live_bytes += static_cast<std::int64_t>((bytes + 511) / 512 * 512);
        if (live_bytes > peak_live) {
          peak_live = live_bytes;
          r.peak_live_event = i;
        }
      } catch (const out_of_memory&) {
        ++r.ooms;
        failed.insert(e.addr);
      }
    } else if (e.action == trace_action::free_requested) {
      if (auto it = live.find(e.addr); it != live.end()) {
        alloc.deallocate(it->second.ptr, streams.get(e.stream));
        if (it->second.ptr != nullptr) {
          live_bytes -= static_cast<std::int64_t>((it->second.bytes + 511) / 512 * 512);
        }
        if (it->second.event == SIZE_MAX) {
          ++r.preexisting_frees;
        } else {
          ++r.frees;
        }
        live.erase(it);
        ++r.events_replayed;
      } else if (failed.erase(e.addr) != 0) {
        ++r.failed_alloc_frees;
        ++r.events_replayed;
      } else {
        ++r.preexisting_frees;
      }
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
  if (stride != 0) sample(events.empty() ? 0 : events.size() - 1);
  if (steady) {
    steady_live = std::max(steady_live, live_bytes);
    steady_reserved = std::max(steady_reserved, static_cast<std::int64_t>(device->used_bytes()));
  } else {
    r.steady_from_event = events.size();
  }
  r.steady_peak_live_bytes = steady_live;
  r.steady_peak_reserved_bytes = steady_reserved;
  r.steady_fragmentation =
      steady_reserved > 0
          ? 1.0 - static_cast<double>(steady_live) / static_cast<double>(steady_reserved)
          : 0.0;
  if (options.check_invariants_every != 0) alloc.check_invariants();

  r.seconds = std::chrono::duration<double>(stop - start).count();
  r.events_per_second = r.seconds > 0.0 ? static_cast<double>(r.events_replayed) / r.seconds : 0.0;
  r.streams = streams.size();
  r.live_at_end = live.size();
  r.stats = alloc.stats();
  const auto all = static_cast<int>(stat_pool::all);
  r.peak_requested_bytes = r.stats.requested_bytes[all].peak;
  r.peak_allocated_bytes = r.stats.allocated_bytes[all].peak;
  r.peak_reserved_bytes = r.stats.reserved_bytes[all].peak;
  r.fragmentation = r.peak_reserved_bytes > 0
                        ? 1.0 - static_cast<double>(r.peak_allocated_bytes) /
                                    static_cast<double>(r.peak_reserved_bytes)
                        : 0.0;
  r.device_allocs = r.stats.num_device_alloc;
  r.plan = alloc.plan_stats();
  if (!steady) {  // no steady state was reached: the steady figures are the whole trace's
    r.steady_peak_live_bytes = r.peak_allocated_bytes;
    r.steady_peak_reserved_bytes = r.peak_reserved_bytes;
    r.steady_fragmentation = r.fragmentation;
  }
  return r;
}

std::vector<trace_event> load_trace(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    throw logic_error("cannot open trace '" + path + "': " + std::strerror(errno));
  }
  try {
    return read_trace_jsonl(in);
  } catch (const logic_error& e) {
    throw logic_error(path + ": " + e.what());
  }
}

}  // namespace terrace::tools
