// SPDX-License-Identifier: Apache-2.0
/// @file trace.hpp
/// @brief Allocation traces and memory snapshots, in the vocabulary of PyTorch's memory snapshots.
///
/// A trace is a sequence of events (alloc, free_requested, free_completed, segment_alloc, ...),
/// written as JSON lines, one object per event. tools/terrace_to_torch_snapshot.py turns a trace plus a
/// snapshot into the pickle that pytorch.org/memory_viz opens.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace terrace {

enum class trace_action : std::uint8_t {
  alloc,           ///< a block was handed to the user
  free_requested,  ///< the user freed it; it may still wait on stream events
  free_completed,  ///< the block is reusable
  segment_alloc,   ///< a segment was reserved from the device
  segment_free,    ///< a segment was returned to the device
  segment_map,     ///< pages of an expandable segment were mapped
  segment_unmap,   ///< pages of an expandable segment were unmapped
  oom,             ///< a request failed; `size` is what was asked, `addr` is 0
  snapshot,        ///< a snapshot was taken at this point
  /// The caller's begin_iteration() / end_iteration() (terrace's own; not in PyTorch's
  /// vocabulary). A replay makes the same calls, so that a trace of a marked training loop is
  /// planned as it was live, and not only from the repetitions found in its allocations.
  iteration_begin,
  iteration_end,
};

/// @brief The action's name as PyTorch spells it ("alloc", "free_requested", ...).
std::string_view to_string(trace_action a) noexcept;
/// @brief The inverse of to_string; nullopt for an unknown name.
std::optional<trace_action> parse_trace_action(std::string_view name) noexcept;

struct trace_event {
  trace_action action = trace_action::alloc;
  std::uint64_t time_ns = 0;     ///< steady-clock nanoseconds since the allocator was created
  std::uintptr_t stream = 0;     ///< the stream handle's value (0 = default stream)
  std::uintptr_t addr = 0;
  std::uint64_t size = 0;        ///< rounded block size; for oom, the request
  std::uint64_t requested = 0;   ///< the caller's size (alloc/free events)
  std::string tag;               ///< the caller's optional tag
};

/// @brief Writes one JSON object per line: {"action","time_ns","stream","addr","size","requested","tag"}.
void write_trace_jsonl(std::ostream& out, const std::vector<trace_event>& events);
/// @brief Reads what write_trace_jsonl wrote.
/// @throws terrace::logic_error naming the line for malformed JSON, an unknown action or a missing field.
std::vector<trace_event> read_trace_jsonl(std::istream& in);

/// @brief One block of a segment, as in PyTorch's snapshot `blocks` list.
struct snapshot_block {
  std::uintptr_t addr = 0;
  std::uint64_t size = 0;
  std::uint64_t requested = 0;
  /// "active_allocated", "active_pending_free" or "inactive"; "unmapped" for expandable pages
  /// that hold no memory.
  std::string state;
  std::string tag;
};

/// @brief One segment, as in PyTorch's snapshot `segments` list.
struct snapshot_segment {
  std::uintptr_t addr = 0;
  std::uint64_t total_size = 0;
  std::uint64_t allocated_size = 0;
  std::uint64_t active_size = 0;
  std::uint64_t requested_size = 0;
  std::uintptr_t stream = 0;
  bool is_small_pool = false;
  bool is_expandable = false;
  std::vector<snapshot_block> blocks;
};

struct memory_snapshot {
  int device = 0;
  std::vector<snapshot_segment> segments;
  std::vector<trace_event> trace;  ///< the recorded trace, oldest first (empty when recording is off)
  /// Events the host had no memory to record (the calls themselves succeeded): the trace has
  /// gaps. Events the ring dropped as the oldest are not counted here.
  std::size_t trace_events_lost = 0;
  /// Events the ring (trace_max_events) dropped as the oldest to make room: the trace starts
  /// after them, so a replay of it misses the blocks allocated before.
  std::size_t trace_events_dropped = 0;
};

/// @brief Writes the snapshot as one JSON document:
/// {"device", "segments": [...], "device_traces": [[...]]} with PyTorch's field names.
void write_snapshot_json(std::ostream& out, const memory_snapshot& s);

}  // namespace terrace
