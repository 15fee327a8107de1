// SPDX-License-Identifier: Apache-2.0
// Internal to tiers/: the books of the host-side backends' virtual memory (sim and null). Which
// address ranges are reserved and which parts of them are mapped, so that misuse is refused with a
// message instead of corrupting memory (sim) or silently miscounting (null): an unaligned map, a
// map outside every range, a double map, an unmap of unmapped pages, releasing a range that still
// has pages mapped.
//
// Mapped space is kept as coalesced [begin, end) intervals rather than a bitmap per range, because
// the null device reserves ranges as large as its 1 TiB capacity: the books grow with the number
// of mapped runs, not with the size of the address space.
//
// unmap() is noexcept in the device contract, yet unmapping the middle of a run splits it in two,
// and the upper part needs a node: a host out of memory there would be fatal. So map(), which may
// throw, makes ready every node that unmaps could need before the next map: a run of L granules
// can be cut into at most ceil(L/2) runs (every other granule unmapped), and an unmap never
// raises that sum (a run cut into a head h and a tail t with h + t < L has ceil(h/2) + ceil(t/2)
// <= ceil(L/2)). The books hold that many nodes, in runs or spare, so unmap only moves nodes
// between the map and the spares. The price is at most one spare node per two mapped granules.
//
// REQUIRES: the owner serializes every call (the backends hold one mutex around it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <map>
#include <string>
#include <utility>

#include "terrace/error.hpp"
#include "tiers/backends.hpp"
#include "tiers/interval_nodes.hpp"

namespace terrace::detail {

class vmm_book {
 public:
  vmm_book(std::string backend, std::size_t granularity)
      : backend_(std::move(backend)), granularity_(granularity) {}

  std::size_t granularity() const noexcept { return granularity_; }
  const std::map<std::uintptr_t, std::size_t>& ranges() const noexcept { return ranges_; }

  /// @throws logic_error unless `bytes` is a positive multiple of the granularity.
  void check_range_size(std::size_t bytes) const {
    if (bytes == 0 || bytes % granularity_ != 0) {
      throw logic_error("terrace: reserve_address_range on device '" + backend_ + "': " +
                        describe_bytes(bytes) + " is not a multiple of the map granularity " +
                        describe_bytes(granularity_));
    }
  }

  void add_range(std::uintptr_t base, std::size_t bytes) { ranges_.emplace(base, bytes); }

  /// Empty when [base, base+bytes) is exactly a reserved range with nothing mapped; else why not.
  std::string why_not_releasable(std::uintptr_t base, std::size_t bytes) const {
    const auto it = ranges_.find(base);
    if (it == ranges_.end()) {
      return "release_address_range(" + hex_address(base) + "): not a reserved address range";
    }
    if (it->second != bytes) {
      return "release_address_range(" + hex_address(base) + ", " + std::to_string(bytes) +
             "): the range was reserved with " + std::to_string(it->second) + " bytes";
    }
    const auto m = first_mapped_overlap(base, base + bytes);
    if (m != mapped_.end()) {
      return "release_address_range(" + hex_address(base) + "): pages [" + hex_address(m->first) +
             ", " + hex_address(m->second) + ") are still mapped";
    }
    return {};
  }

  void erase_range(std::uintptr_t base) { ranges_.erase(base); }

  /// @throws logic_error unless [p, p+bytes) is aligned, inside one reserved range and unmapped.
  void check_map(std::uintptr_t p, std::size_t bytes) const {
    if (std::string why = why_not_in_a_range("map", p, bytes); !why.empty()) {
      throw logic_error("terrace: device '" + backend_ + "': " + why);
    }
    const auto m = first_mapped_overlap(p, p + bytes);
    if (m != mapped_.end()) {
      throw logic_error("terrace: device '" + backend_ + "': map(" + hex_address(p) + ", " +
                        std::to_string(bytes) + ") overlaps pages [" + hex_address(m->first) + ", " +
                        hex_address(m->second) + ") that are already mapped");
    }
  }

  /// REQUIRES: check_map(p, bytes) passed. Joins the run with its mapped neighbours.
  /// @throws std::bad_alloc, having changed nothing: the nodes that this run and later unmaps can
  /// need are made ready first; runs are then extended in place or moved by their node, and a run
  /// that touches neither neighbour takes a spare.
  void mark_mapped(std::uintptr_t p, std::size_t bytes) {
    const std::uintptr_t end = p + bytes;
    const auto next = mapped_.lower_bound(end);
    const bool joins_next = next != mapped_.end() && next->first == end;
    const auto prev = next == mapped_.begin() ? mapped_.end() : std::prev(next);
    const bool joins_prev = prev != mapped_.end() && prev->second == p;
    const std::uintptr_t run_begin = joins_prev ? prev->first : p;
    const std::uintptr_t run_end = joins_next ? next->second : end;
    const std::size_t needed = nodes_needed_ + most_runs_after_unmaps(run_begin, run_end) -
                               (joins_prev ? most_runs_after_unmaps(prev->first, prev->second) : 0) -
                               (joins_next ? most_runs_after_unmaps(next->first, next->second) : 0);
    nodes_.hold(mapped_, needed);  // the only allocation; may throw
    nodes_needed_ = needed;
    if (joins_prev) {
      prev->second = joins_next ? next->second : end;
      // The joined run's node stays spare: `needed` counts it for an unmap that cuts the run in
      // two again (erasing it left that unmap, which cannot allocate, without a node).
      if (joins_next) nodes_.keep(mapped_, next);
    } else if (joins_next) {
      auto node = mapped_.extract(next);
      node.key() = p;
      mapped_.insert(std::move(node));
    } else {
      nodes_.insert(mapped_, p, end);
    }
    mapped_bytes_ += bytes;
  }

  /// Empty when [p, p+bytes) is aligned, inside one reserved range and wholly mapped; else why not.
  std::string why_not_unmappable(std::uintptr_t p, std::size_t bytes) const {
    if (std::string why = why_not_in_a_range("unmap", p, bytes); !why.empty()) return why;
    auto it = mapped_.upper_bound(p);
    if (it == mapped_.begin() || std::prev(it)->second < p + bytes) {
      return "unmap(" + hex_address(p) + ", " + std::to_string(bytes) +
             "): some of these pages are not mapped";
    }
    return {};
  }

  /// REQUIRES: why_not_unmappable(p, bytes) is empty. Allocates nothing: a hole in the middle
  /// of a run takes a spare node for its upper part (mark_mapped made it ready).
  void mark_unmapped(std::uintptr_t p, std::size_t bytes) noexcept {
    const auto it = std::prev(mapped_.upper_bound(p));
    const std::uintptr_t begin = it->first;
    const std::uintptr_t end = it->second;
    const bool keeps_head = begin < p;
    const bool keeps_tail = p + bytes < end;
    nodes_needed_ = nodes_needed_ - most_runs_after_unmaps(begin, end) +
                    (keeps_head ? most_runs_after_unmaps(begin, p) : 0) +
                    (keeps_tail ? most_runs_after_unmaps(p + bytes, end) : 0);
    if (keeps_tail && keeps_head) {
      it->second = p;
      nodes_.insert(mapped_, p + bytes, end);
    } else if (keeps_tail) {
      auto node = mapped_.extract(it);
      node.key() = p + bytes;
      mapped_.insert(std::move(node));
    } else if (keeps_head) {
      it->second = p;
    } else {
      nodes_.keep(mapped_, it);
    }
    // Nodes beyond what later unmaps can need go back to the host (freeing never fails).
    nodes_.trim(mapped_, nodes_needed_);
    mapped_bytes_ -= bytes;
  }

  std::size_t mapped_bytes() const noexcept { return mapped_bytes_; }

  /// Whether every byte of [p, p+bytes) is mapped (for bounds checks of copies).
  bool is_mapped(std::uintptr_t p, std::size_t bytes) const {
    auto it = mapped_.upper_bound(p);
    return it != mapped_.begin() && std::prev(it)->second >= p + bytes;
  }

  /// Every mapped [begin, end) run; for a backend's destructor, which cleans up after leaks.
  const std::map<std::uintptr_t, std::uintptr_t>& mapped_runs() const noexcept { return mapped_; }

 private:
  std::string why_not_in_a_range(const char* op, std::uintptr_t p, std::size_t bytes) const {
    // Spelled out only for a refusal: a check that passes allocates nothing, so that unmap
    // (noexcept) cannot meet a host out of memory here.
    const auto call = [&] {
      return std::string(op) + "(" + hex_address(p) + ", " + std::to_string(bytes) + ")";
    };
    if (bytes == 0 || p % granularity_ != 0 || bytes % granularity_ != 0) {
      return call() + ": address and size must be multiples of the map granularity " +
             describe_bytes(granularity_);
    }
    auto it = ranges_.upper_bound(p);
    if (it == ranges_.begin()) return call() + ": not inside a reserved address range";
    --it;
    const std::uintptr_t base = it->first;
    const std::size_t size = it->second;
    if (p - base >= size) return call() + ": not inside a reserved address range";
    if (bytes > size - (p - base)) {
      return call() + ": runs past the end of the reserved range [" + hex_address(base) + ", " +
             hex_address(base + size) + ")";
    }
    return {};
  }

  // The first mapped run that intersects [begin, end), or end().
  std::map<std::uintptr_t, std::uintptr_t>::const_iterator first_mapped_overlap(
      std::uintptr_t begin, std::uintptr_t end) const {
    auto it = mapped_.upper_bound(begin);
    if (it != mapped_.begin() && std::prev(it)->second > begin) return std::prev(it);
    if (it != mapped_.end() && it->first < end) return it;
    return mapped_.end();
  }

  using run_map = interval_nodes::interval_map;

  // How many runs unmaps alone can cut [begin, end) into: every other granule left mapped.
  std::size_t most_runs_after_unmaps(std::uintptr_t begin, std::uintptr_t end) const noexcept {
    return ((end - begin) / granularity_ + 1) / 2;
  }

  std::string backend_;
  std::size_t granularity_;
  std::map<std::uintptr_t, std::size_t> ranges_;  // base -> bytes
  run_map mapped_;                                // begin -> end, coalesced
  std::size_t mapped_bytes_ = 0;
  // Sum over runs of most_runs_after_unmaps: the nodes that unmaps before the next map can need.
  std::size_t nodes_needed_ = 0;
  interval_nodes nodes_;  // nodes_needed_ of them, in mapped_ or spare
};

}  // namespace terrace::detail
