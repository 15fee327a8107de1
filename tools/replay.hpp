// SPDX-License-Identifier: Apache-2.0
/// @file replay.hpp
/// @brief Replays a recorded allocation trace through a caching_allocator over a chosen backend.
///
/// The replay is the engine under the `terrace` command line (`replay` today; `report` and
/// `compare` later run the same function under several configurations). It is kept free of
/// argument parsing and output formatting so that tests and other subcommands can call it directly.
///
/// Semantics:
///   - `alloc` events allocate `requested` bytes (or `size` when a trace carries no requested size)
///     on the stream the event names; `free_requested` events free the pointer that replayed the
///     event's address. Every other action (free_completed, segment_*, oom, snapshot) describes what
///     the recording allocator did, not what the program asked for, and is skipped.
///   - A trace is a window into a running job: a free of an address that was not allocated inside
///     the window is counted in `preexisting_frees` and skipped.
///   - Trace streams map to backend streams created on first use; stream 0 is the default stream.
///   - An allocation that fails with out_of_memory is counted in `ooms`; the replay goes on and the
///     matching free is skipped (counted in `failed_alloc_frees`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "terrace/config.hpp"
#include "terrace/stats.hpp"
#include "terrace/trace.hpp"

namespace terrace::tools {

struct replay_options {
  /// Backend name for make_device: "null" (addresses only; any trace fits), "sim", "cuda", ...
  std::string device = "null";
  /// The allocator's policy. device_capacity and copy_bandwidth configure the backend; the
  /// `device` field is ignored (the backend is `device` above).
  allocator_config config{};
  /// Calls caching_allocator::check_invariants() after every this many replayed events and at the
  /// end; 0 = never. Slow: for tests and for debugging a policy.
  std::size_t check_invariants_every = 0;
};

struct replay_result {
  std::string device;                    ///< the backend's properties().name
  std::size_t events_total = 0;          ///< events in the trace, of every action
  std::size_t events_replayed = 0;       ///< alloc + free_requested events acted on
  std::size_t allocs = 0;                ///< alloc events replayed (including those that OOMed)
  std::size_t frees = 0;                 ///< free_requested events that freed a replayed block
  std::size_t preexisting_frees = 0;     ///< frees of addresses allocated before the window
  std::size_t failed_alloc_frees = 0;    ///< frees of allocations that had failed with OOM
  std::size_t skipped_events = 0;        ///< events of the other actions
  std::size_t streams = 0;               ///< distinct trace streams seen on alloc/free events
  std::size_t live_at_end = 0;           ///< replayed blocks never freed inside the window
  std::int64_t peak_requested_bytes = 0; ///< peak of the live callers' sizes
  std::int64_t peak_allocated_bytes = 0; ///< peak of the live blocks' rounded sizes
  std::int64_t peak_reserved_bytes = 0;  ///< peak of the memory held from the device
  /// 1 - peak allocated / peak reserved (GMLake's figure); 0 when nothing was reserved.
  double fragmentation = 0.0;
  std::int64_t device_allocs = 0;        ///< segments or pages obtained from the backend
  std::size_t ooms = 0;                  ///< allocations that failed with out_of_memory
  double seconds = 0.0;                  ///< wall time of the replay loop alone
  double events_per_second = 0.0;        ///< events_replayed / seconds
  allocator_stats stats{};               ///< the allocator's stats after the last event
};

/// @brief Replays `events` (oldest first) through a fresh caching_allocator over a fresh backend.
/// @throws terrace::logic_error for an inconsistent trace (an alloc of an address that is still
/// live in the trace), naming the event's index; or for an invalid config / unknown backend.
/// @throws terrace::device_error when the backend fails for a reason other than out of memory.
replay_result replay(const std::vector<trace_event>& events, const replay_options& options = {});

/// @brief Reads a JSON-lines trace from `path`.
/// @throws terrace::logic_error naming the file when it cannot be opened, and the file and line
/// for a malformed line.
std::vector<trace_event> load_trace(const std::string& path);

}  // namespace terrace::tools
