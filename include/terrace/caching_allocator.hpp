// SPDX-License-Identifier: Apache-2.0
/// @file caching_allocator.hpp
/// @brief The stream-ordered caching allocator: pure policy over a device_backend's address ranges.
///
/// Semantics follow PyTorch's CUDACachingAllocator, which training frameworks already assume:
///   - sizes round up to 512 bytes (optionally to power-of-two divisions);
///   - requests up to `small_size` come from a small pool of small segments, others from a large pool;
///   - best fit over the cached free blocks of the request's stream, splitting the remainder, merging
///     neighbours on free;
///   - a block freed on its stream is reusable on that stream at once; a block that record_stream()
///     marked as used by other streams is reusable only after events recorded on those streams at
///     free time have completed;
///   - on a miss, new memory comes from the backend; if that fails, the allocator releases its cached
///     free segments and retries, and only then throws out_of_memory with a full report.
/// With `expandable_segments`, each (stream, pool) pair owns one address range on a VMM backend whose
/// pages are mapped as it grows and unmapped by empty_cache().
///
/// All methods are thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "terrace/config.hpp"
#include "terrace/device.hpp"
#include "terrace/planner.hpp"
#include "terrace/stats.hpp"
#include "terrace/trace.hpp"

namespace terrace {

namespace detail {
class allocator_impl;
class plan_front;
}

class caching_allocator {
 public:
  /// @brief An allocator over `device`, which must outlive it.
  /// @throws terrace::logic_error when the config is inconsistent (e.g. expandable_segments on a
  /// backend without VMM, a memory_fraction outside (0,1]).
  explicit caching_allocator(device_backend& device, allocator_config config = {});
  /// Releases every cached segment. Blocks still allocated are leaked to the device, not freed.
  ~caching_allocator();
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;

  /// @brief A block of at least `bytes` usable in stream order on `stream`. `bytes == 0` returns
  /// nullptr. `tag` is kept in the trace when recording is on.
  /// @throws terrace::out_of_memory (after the release-and-retry path) with the full report;
  ///         terrace::device_error when the backend fails for another reason.
  void* allocate(std::size_t bytes, stream_ref stream = {}, std::string_view tag = {});

  /// @brief Returns a block. nullptr is ignored. `stream` is informational (the block belongs to the
  /// stream it was allocated on, as in PyTorch).
  /// @throws terrace::logic_error for a pointer this allocator did not hand out or already freed;
  /// terrace::device_error when record_stream() named other streams and the device can neither
  /// record an event on them nor be synchronized. Nothing is changed then (the block stays live).
  void deallocate(void* p, stream_ref stream = {});

  /// @brief Marks `p` as used on `stream` too: its reuse waits for the work queued there until free.
  /// nullptr (what allocate(0) returns) is ignored, as deallocate and PyTorch ignore it.
  /// @throws terrace::logic_error for any other pointer that is not a live allocation.
  void record_stream(void* p, stream_ref stream);

  /// @brief Returns every cached, fully free segment (and free expandable pages) to the device.
  /// Waits for pending frees first.
  /// @throws terrace::device_error
  void empty_cache();

  /// @brief Caps reserved memory at `fraction` of the device capacity (PyTorch's
  /// set_per_process_memory_fraction: 0 lets no new memory be reserved; what is cached stays
  /// usable). The config key `memory_fraction` must be above 0.
  /// @throws terrace::logic_error unless 0 <= fraction <= 1.
  void set_memory_fraction(double fraction);

  allocator_stats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();

  /// @brief Turns trace recording on or off (off by default unless config.record_trace).
  void record_trace(bool on);
  /// @brief The segments and blocks now, plus the recorded trace.
  memory_snapshot snapshot() const;

  /// @brief Checks every internal invariant: blocks tile their segments without overlap, free +
  /// allocated bytes account for every reserved byte, the stats equal a recount, no free block has
  /// pending events. @throws terrace::logic_error describing the first violation.
  void check_invariants() const;

  const allocator_config& config() const noexcept;
  device_backend& device() noexcept;

  // ------------------------------------------------ lifetime-aware planning (policy `planned`)
  /// @brief Marks the start of a training iteration. Optional: without it the planner finds the
  /// repeating iteration itself; once called, only these marks delimit iterations. Recorded in
  /// the trace (iteration_begin) when tracing is on, so that a replay marks the same iterations;
  /// otherwise a no-op unless the policy is `planned` or plan_counterfactual is on. Never throws
  /// except device_error.
  void begin_iteration();
  /// @brief Marks the end of a training iteration (see begin_iteration). An iteration is planned
  /// when it equals one of the last four (each stream made the same requests and frees in the
  /// same order, however the streams interleaved), or when two of them made the same requests in
  /// other orders: the plan then allows for each order seen. @throws terrace::device_error if
  /// reserving the arena fails otherwise than OOM.
  void end_iteration();
  /// @brief What the planner did (enabled = false when it is off).
  planner_stats plan_stats() const;

 private:
  std::unique_ptr<detail::allocator_impl> impl_;
  // Declared after impl_: destroyed first, so its arena goes back before the cached segments.
  std::unique_ptr<detail::plan_front> plan_;
};

}  // namespace terrace
