// SPDX-License-Identifier: Apache-2.0
#include "tiers/extent_allocator.hpp"

#include <cstdint>
#include <iterator>
#include <string>

#include "terrace/error.hpp"

namespace terrace::detail {

extent_allocator::extent_allocator(std::uint64_t capacity, std::uint64_t unit)
    : capacity_(capacity), unit_(unit), free_(0) {
  TERRACE_EXPECTS(unit > 0 && capacity % unit == 0, "extent capacity must be whole units");
  if (capacity > 0) insert_hole(0, capacity);
}

std::uint64_t extent_allocator::extent_size(std::uint64_t bytes) const {
  if (bytes == 0) return unit_;
  // Saturates instead of wrapping: a request near 2^64 must find no hole, not a zero-byte extent.
  if (bytes > UINT64_MAX - (unit_ - 1)) return UINT64_MAX;
  return (bytes + unit_ - 1) / unit_ * unit_;
}

void extent_allocator::insert_hole(std::uint64_t offset, std::uint64_t size) {
  const auto it = by_offset_.emplace(offset, size).first;
  try {
    by_size_.emplace(size, offset);
  } catch (...) {
    by_offset_.erase(it);
    throw;
  }
  free_ += size;
}

void extent_allocator::erase_hole(hole_iterator it) noexcept {
  by_size_.erase({it->second, it->first});
  free_ -= it->second;
  by_offset_.erase(it);
}

void extent_allocator::move_hole(hole_iterator it, std::uint64_t offset, std::uint64_t size) noexcept {
  auto by_size = by_size_.extract({it->second, it->first});
  by_size.value() = {size, offset};
  by_size_.insert(std::move(by_size));
  free_ = free_ - it->second + size;
  if (it->first == offset) {
    it->second = size;
    return;
  }
  auto by_offset = by_offset_.extract(it);
  by_offset.key() = offset;
  by_offset.mapped() = size;
  by_offset_.insert(std::move(by_offset));
}

std::optional<std::uint64_t> extent_allocator::allocate(std::uint64_t bytes) {
  const std::uint64_t size = extent_size(bytes);
  auto fit = by_size_.lower_bound({size, 0});
  if (fit == by_size_.end()) return std::nullopt;
  const auto [hole_size, offset] = *fit;
  const auto hole = by_offset_.find(offset);
  if (hole_size > size) {
    move_hole(hole, offset + size, hole_size - size);
  } else {
    erase_hole(hole);
  }
  return offset;
}

void extent_allocator::release(std::uint64_t offset, std::uint64_t bytes) {
  const std::uint64_t size = extent_size(bytes);
  // A double or foreign release would otherwise put free space in the books twice, and the next
  // allocations would hand the same bytes (on disk: the same blocks) to two tensors.
  if (offset % unit_ != 0 || offset > capacity_ || size > capacity_ - offset) {
    throw logic_error("terrace: extent release [" + std::to_string(offset) + ", +" +
                      std::to_string(size) + ") is not inside the store's " +
                      std::to_string(capacity_) + " bytes");
  }
  if (const auto hole = hole_overlapping(offset, size); hole != by_offset_.end()) {
    throw logic_error("terrace: extent release [" + std::to_string(offset) + ", +" +
                      std::to_string(size) + ") overlaps the free hole [" +
                      std::to_string(hole->first) + ", +" + std::to_string(hole->second) +
                      "): released twice?");
  }
  // Coalesced with the holes on either side; a neighbouring hole's nodes carry the result.
  const auto next = by_offset_.lower_bound(offset);
  const bool joins_next = next != by_offset_.end() && next->first == offset + size;
  const auto prev = next == by_offset_.begin() ? by_offset_.end() : std::prev(next);
  const bool joins_prev = prev != by_offset_.end() && prev->first + prev->second == offset;
  if (joins_prev) {
    const std::uint64_t end = joins_next ? next->first + next->second : offset + size;
    if (joins_next) erase_hole(next);
    move_hole(prev, prev->first, end - prev->first);
  } else if (joins_next) {
    move_hole(next, offset, next->first + next->second - offset);
  } else {
    insert_hole(offset, size);
  }
}

std::map<std::uint64_t, std::uint64_t>::const_iterator extent_allocator::hole_overlapping(
    std::uint64_t offset, std::uint64_t size) const {
  auto next = by_offset_.lower_bound(offset);
  if (next != by_offset_.end() && next->first < offset + size) return next;
  if (next != by_offset_.begin()) {
    const auto prev = std::prev(next);
    if (prev->first + prev->second > offset) return prev;
  }
  return by_offset_.end();
}

bool extent_allocator::reserve(std::uint64_t offset, std::uint64_t bytes) {
  const std::uint64_t size = extent_size(bytes);
  if (offset % unit_ != 0 || offset > capacity_ || size > capacity_ - offset) return false;
  auto it = by_offset_.upper_bound(offset);
  if (it == by_offset_.begin()) return false;
  --it;
  const auto [hole, hole_size] = *it;
  if (offset + size > hole + hole_size) return false;
  const bool keeps_head = offset > hole;
  const bool keeps_tail = hole + hole_size > offset + size;
  // Only a reserve in the middle of the hole needs a second one: the tail, made first.
  if (keeps_head && keeps_tail) insert_hole(offset + size, hole + hole_size - offset - size);
  if (keeps_head) {
    move_hole(it, hole, offset - hole);
  } else if (keeps_tail) {
    move_hole(it, offset + size, hole + hole_size - offset - size);
  } else {
    erase_hole(it);
  }
  return true;
}

std::uint64_t extent_allocator::largest_hole() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

bool extent_allocator::consistent() const {
  if (by_offset_.size() != by_size_.size()) return false;
  std::uint64_t total = 0, end = 0;
  bool first = true;
  for (const auto& [off, size] : by_offset_) {
    if (size == 0 || off % unit_ || size % unit_ || off + size > capacity_) return false;
    if (!first && off <= end) return false;  // overlapping or adjacent (not coalesced)
    if (!by_size_.count({size, off})) return false;
    end = off + size;
    first = false;
    total += size;
  }
  return total == free_;
}

}  // namespace terrace::detail
