// SPDX-License-Identifier: Apache-2.0
// Trace replay: the address map from recorded to replayed pointers, streams made on demand, and the
// accounting of everything a window into a running job can contain.
#include "tools/replay.hpp"

#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
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
  std::size_t event = 0;  // index of the alloc event, for error messages
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

  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < events.size(); ++i) {
    const trace_event& e = events[i];
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
        void* p = alloc.allocate(bytes, streams.get(e.stream));
        live.emplace(e.addr, live_block{p, i});
      } catch (const out_of_memory&) {
        ++r.ooms;
        failed.insert(e.addr);
      }
    } else if (e.action == trace_action::free_requested) {
      if (auto it = live.find(e.addr); it != live.end()) {
        alloc.deallocate(it->second.ptr, streams.get(e.stream));
        live.erase(it);
        ++r.frees;
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
