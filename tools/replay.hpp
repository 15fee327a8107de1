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
///     the window is counted in `preexisting_frees`. With `account_preexisting` (the default) such
///     a block is allocated, with the size the free gives, before the first event and freed at its
///     free, so that the memory it held counts; otherwise the free is skipped. A pre-existing
///     block the device cannot hold is counted in `preexisting_unplaced` (not in `ooms`), and its
///     free in `preexisting_frees`.
///   - A trace that contradicts itself is refused: an alloc of an address still live, or a free
///     of an address already freed with no alloc in between (a double free, which would otherwise
///     pass for a pre-existing block and count in every peak).
///   - The policy is `config.policy`; event tags are passed to the allocator (the planner uses them).
///   - Trace streams map to backend streams created on first use; stream 0 is the default stream.
///     A trace naming more than 1024 streams is refused (each is a worker thread on sim).
///   - An alloc event that fails with out_of_memory is counted in `ooms`; the replay goes on and
///     the matching free is skipped (counted in `failed_alloc_frees`). `stats.num_ooms`, the
///     allocator's own figure, also counts the pre-existing blocks that could not be placed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <istream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "terrace/config.hpp"
#include "terrace/planner.hpp"
#include "terrace/stats.hpp"
#include "terrace/trace.hpp"

namespace terrace::tools {

struct replay_options {
  /// Backend name for make_device: "null" (addresses only; 1 TiB unless config.device_capacity says otherwise), "sim", "cuda", ...
  std::string device = "null";
  /// The allocator's policy. device_capacity and copy_bandwidth configure the backend; the
  /// `device` field is ignored (the backend is `device` above).
  allocator_config config{};
  /// Calls caching_allocator::check_invariants() after every this many replayed events and at the
  /// end; 0 = never. Slow: for tests and for debugging a policy.
  std::size_t check_invariants_every = 0;
  /// Allocate blocks freed but never allocated inside the window before the first event.
  bool account_preexisting = true;
  /// About this many (event, live, reserved) samples in replay_result::timeline; 0 = none.
  std::size_t timeline_points = 0;
  /// Stop after this many events (a snapshot of that moment is then in `snapshot_at_stop`; of the
  /// end when the trace has no more); SIZE_MAX = replay everything.
  std::size_t stop_after_event = SIZE_MAX;
  /// Where the steady state starts, for the steady_* figures. SIZE_MAX = for the planned policy,
  /// the first planned iteration's first event; for the others, the whole trace. Pass the planned
  /// run's steady_from_event to the others to compare the same window.
  std::size_t steady_from_event = SIZE_MAX;
};

/// @brief One sample of the replay's memory over time: the most at any event since the sample
/// before (so that no peak falls between two samples).
struct timeline_point {
  /// The trace's events before this one have been replayed: the sample covers the events since
  /// the sample before, up to index after_events - 1 (0: before the first event, the
  /// pre-existing blocks alone; the last sample: the trace's length, or where the replay stopped).
  std::size_t after_events = 0;
  std::int64_t live_bytes = 0;    ///< the blocks handed out, as peak_allocated_bytes counts them
  std::int64_t reserved_bytes = 0;///< what the allocator holds, as peak_reserved_bytes counts it
};

struct replay_result {
  std::string device;                    ///< the backend's properties().name
  std::size_t events_total = 0;          ///< events in the trace, of every action
  std::size_t events_replayed = 0;       ///< alloc + free_requested events acted on
  std::size_t allocs = 0;                ///< alloc events replayed (including those that OOMed)
  std::size_t frees = 0;                 ///< free_requested events that freed a replayed block
  std::size_t preexisting_frees = 0;     ///< frees of addresses allocated before the window
  std::size_t failed_alloc_frees = 0;    ///< frees of the trace's allocs that had failed with OOM
  std::size_t iteration_marks = 0;       ///< iteration_begin / iteration_end events, passed on
  std::size_t skipped_events = 0;        ///< events of the other actions
  /// Frees of blocks from before the window that the replay does not hold (no size to give them,
  /// or account_preexisting off): in preexisting_frees, not in events_replayed.
  std::size_t preexisting_skipped = 0;
  std::size_t streams = 0;               ///< distinct trace streams seen on alloc/free events
  std::size_t live_at_end = 0;           ///< replayed blocks never freed inside the window
  std::int64_t peak_requested_bytes = 0; ///< peak of the live callers' sizes
  std::int64_t peak_allocated_bytes = 0; ///< peak of the live blocks' rounded sizes
  std::int64_t peak_reserved_bytes = 0;  ///< peak of the memory held from the device
  /// 1 - peak allocated / peak reserved (GMLake's figure); 0 when nothing was reserved.
  double fragmentation = 0.0;
  std::int64_t device_allocs = 0;        ///< segments or pages obtained from the backend
  std::size_t ooms = 0;                  ///< alloc events that failed with out_of_memory
  double seconds = 0.0;                  ///< wall time of the replay loop alone
  double events_per_second = 0.0;        ///< events_replayed / seconds
  allocator_stats stats{};               ///< the allocator's stats after the last event
  std::size_t preexisting_allocs = 0;    ///< blocks allocated up front for pre-existing frees
  /// Pre-existing blocks whose up-front allocation failed with out_of_memory (the device is too
  /// small for what the job held before the window): in no peak, and not in `ooms`.
  std::size_t preexisting_unplaced = 0;
  /// The events whose block the replay never held: allocs that failed with out_of_memory, and
  /// the frees of the pre-existing blocks it could not place. Oldest first within each kind.
  std::vector<std::size_t> unplaced_events;
  std::string policy;                    ///< "caching", "expandable" or "planned"
  planner_stats plan{};                  ///< the planner's stats (enabled = false when off)
  std::vector<timeline_point> timeline;  ///< when options.timeline_points > 0
  /// Trace events replayed when the callers' live bytes (each rounded to 512 B) peaked, the
  /// first time: a moment that does not depend on the policy, unlike the peak of the blocks
  /// handed out (peak_allocated_bytes), which falls where each policy's rounding puts it. The
  /// peak is the state just after event peak_live_after_events - 1; 0 = before the first event,
  /// the pre-existing blocks alone (or nothing ever allocated). Pass it as stop_after_event to
  /// see that state.
  std::size_t peak_live_after_events = 0;
  /// From steady_from_event on: peak allocated bytes and peak reserved bytes (as
  /// peak_allocated_bytes and peak_reserved_bytes count them), and 1 - the first / the second. When there is none (steady_from_event ==
  /// events_total) or it is 0, the whole trace's peak_allocated_bytes, peak_reserved_bytes and
  /// fragmentation.
  std::size_t steady_from_event = 0;
  /// From steady_from_event on: the peak of the live callers' sizes, as peak_requested_bytes
  /// (the same under every policy: the strict denominator for what a policy wastes).
  std::int64_t steady_peak_requested_bytes = 0;
  std::int64_t steady_peak_live_bytes = 0;
  std::int64_t steady_peak_reserved_bytes = 0;
  double steady_fragmentation = 0.0;
  std::optional<memory_snapshot> snapshot_at_stop;  ///< when options.stop_after_event != SIZE_MAX
};

/// @brief Replays `events` (oldest first) through a fresh caching_allocator over a fresh backend.
/// @throws terrace::logic_error for an inconsistent trace (an alloc of an address that is still
/// live in the trace, or a second free of an address), naming the event's index and the earlier
/// event it contradicts; for more than 1024 streams; or for an invalid config / unknown backend.
/// @throws terrace::device_error when the backend fails for a reason other than out of memory.
replay_result replay(const std::vector<trace_event>& events, const replay_options& options = {});

/// 1 - used / reserved, or 0 when nothing is reserved: fragmentation with `used` the blocks
/// handed out, the strict figure with `used` the callers' bytes.
inline double unused_fraction(std::int64_t used, std::int64_t reserved) {
  return reserved > 0 ? 1.0 - static_cast<double>(used) / static_cast<double>(reserved) : 0.0;
}

/// @brief `events` replayed under each policy over `base` (its device and config; the policy, and
/// with it expandable segments, set as TERRACE_ALLOC_CONF's `policy:` key sets them), returned as
/// (name, result) in the order caching, expandable, planned. Planned runs first: its first planned
/// iteration marks the steady state, over which the other two are measured too, so that the
/// steady-state figures compare the same window (`terrace compare`, `terrace report`).
/// @throws as replay().
std::vector<std::pair<std::string, replay_result>> replay_policies(const std::vector<trace_event>& events,
                                                                   const replay_options& base);

/// @brief Reads a JSON-lines trace from `path` (`-`: standard input).
/// @throws terrace::logic_error naming the file when it cannot be opened or read, and the file and
/// line for a malformed line.
std::vector<trace_event> load_trace(const std::string& path);
/// @brief Reads a JSON-lines trace from `in`, already open on `path`.
/// @throws terrace::logic_error naming the file and the line for a malformed line.
std::vector<trace_event> read_trace_jsonl_of(std::istream& in, const std::string& path);

}  // namespace terrace::tools
