// SPDX-License-Identifier: Apache-2.0
// Internal to tiers/: free-space policy of the tensor store over one logical byte range. Best fit
// (the smallest hole that fits, lowest offset among equals), holes coalesced on release. Pure policy:
// no I/O, no locking (the store holds its mutex around every call).
//
// A host out of memory never costs free space or the books' agreement: a hole that shrinks, moves
// or grows keeps its nodes (moved between positions, not freed and made again), so allocate() and a
// release() next to a hole allocate nothing, and the calls that do need a new hole (a release
// between two extents, a reserve in the middle of a hole) make it before they change anything.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace terrace::detail {

class extent_allocator {
 public:
  /// REQUIRES: capacity and unit > 0, capacity a multiple of unit.
  extent_allocator(std::uint64_t capacity, std::uint64_t unit);

  /// Bytes an extent for `bytes` occupies (rounded up to the unit; at least one unit).
  std::uint64_t extent_size(std::uint64_t bytes) const;
  /// The offset of a new extent of extent_size(bytes), or nullopt when no hole is large enough.
  /// Allocates no host memory.
  std::optional<std::uint64_t> allocate(std::uint64_t bytes);
  /// Returns an extent allocated or reserved, and not released since.
  /// @throws logic_error, changing nothing, for a range past the end or overlapping free space (a
  /// double or foreign release); std::bad_alloc, changing nothing, when the extent touches no hole
  /// and the host has no memory for a new one.
  void release(std::uint64_t offset, std::uint64_t bytes);
  /// Marks an extent used (rebuilding from an index). Returns false, changing nothing, when any of
  /// it is not free (overlap, or past the end). @throws std::bad_alloc, changing nothing.
  bool reserve(std::uint64_t offset, std::uint64_t bytes);

  std::uint64_t capacity() const { return capacity_; }
  std::uint64_t free_bytes() const { return free_; }
  std::uint64_t largest_hole() const;
  std::size_t holes() const { return by_offset_.size(); }
  /// Checks every invariant (sizes agree, no adjacent or overlapping holes); for tests.
  bool consistent() const;

 private:
  using hole_iterator = std::map<std::uint64_t, std::uint64_t>::iterator;
  /// A new hole. @throws std::bad_alloc, changing nothing.
  void insert_hole(std::uint64_t offset, std::uint64_t size);
  void erase_hole(hole_iterator it) noexcept;
  /// Makes hole `it` the hole [offset, offset + size), reusing its nodes. REQUIRES: no other hole
  /// overlaps or touches the new range.
  void move_hole(hole_iterator it, std::uint64_t offset, std::uint64_t size) noexcept;
  /// A hole sharing a byte with [offset, offset+size), or by_offset_.end().
  std::map<std::uint64_t, std::uint64_t>::const_iterator hole_overlapping(std::uint64_t offset,
                                                                          std::uint64_t size) const;

  std::uint64_t capacity_;
  std::uint64_t unit_;
  std::uint64_t free_;
  std::map<std::uint64_t, std::uint64_t> by_offset_;       // offset -> size
  std::set<std::pair<std::uint64_t, std::uint64_t>> by_size_;  // (size, offset)
};

}  // namespace terrace::detail
