// SPDX-License-Identifier: Apache-2.0
// The caching allocator's bookkeeping records: segments (address ranges from the device) and the
// blocks that tile them. Internal to allocator/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace terrace::detail {

struct segment;

// One contiguous piece of a segment. Blocks of a segment are linked in address order and tile it
// exactly. A block is in exactly one of four states:
//   allocated              -- handed to the user (in allocator_impl::live_)
//   pending                -- freed, but waiting on events of streams that record_stream() named
//   free, mapped           -- in its pool's free set, reusable
//   free, unmapped         -- expandable segments only: address space with no memory behind it
struct block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;   // the caller's size while allocated, else 0
  std::uintptr_t stream = 0;   // the stream the segment (and so the block) belongs to
  segment* seg = nullptr;
  block* prev = nullptr;
  block* next = nullptr;
  bool allocated = false;
  bool mapped = true;
  int pending_events = 0;
  std::vector<std::uintptr_t> used_streams;  // record_stream() streams other than `stream`
  std::string tag;

  bool is_free() const noexcept { return !allocated && pending_events == 0; }
  bool is_split() const noexcept { return prev != nullptr || next != nullptr; }
};

// Free-set order: by stream, then size, then address, so that lower_bound({stream, size}) is the
// best fit on that stream, and ties go to the lowest address (which keeps the heap compact).
struct block_order {
  bool operator()(const block* a, const block* b) const noexcept {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->addr < b->addr;
  }
};

using free_set = std::set<block*, block_order>;

struct address_order {
  bool operator()(const block* a, const block* b) const noexcept { return a->addr < b->addr; }
};

// An address range obtained from the device: a plain segment (reserve/release) or, with
// expandable segments, a reserved virtual range whose pages are mapped on demand.
struct segment {
  std::uintptr_t addr = 0;
  std::size_t size = 0;          // the whole range
  std::size_t mapped_bytes = 0;  // expandable only: bytes with memory behind them
  std::uintptr_t stream = 0;
  bool small_pool = false;
  bool expandable = false;
  block* head = nullptr;
  // Expandable only: its unmapped blocks, by address. Growth searches these, not every block of
  // the segment: a long-running job tiles the range with tens of thousands of blocks and only a
  // handful of holes.
  std::set<block*, address_order> unmapped;

  // Bytes this segment holds on the device: what counts as reserved.
  std::size_t reserved() const noexcept { return expandable ? mapped_bytes : size; }
};

}  // namespace terrace::detail
