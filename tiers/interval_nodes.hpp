// SPDX-License-Identifier: Apache-2.0
// Internal to tiers/: spare nodes for a map of [begin, end) intervals whose noexcept calls must
// split or insert intervals (the sim and null devices' mapped runs in vmm_book.hpp, the null
// device's free address space). A call that may throw makes the nodes ready (hold); the noexcept
// ones then only move nodes between the map and the spares, never allocating.
// REQUIRES: the owner serializes every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace terrace::detail {

class interval_nodes {
 public:
  using interval_map = std::map<std::uintptr_t, std::uintptr_t>;  // begin -> end

  /// Makes `map` and the spares hold at least `n` nodes together, with room among the spares for
  /// every one of them. @throws std::bad_alloc; the nodes made before it stay spare, which changes
  /// no interval.
  void hold(const interval_map& map, std::size_t n) {
    if (map.size() + spares_.size() >= n) return;
    spares_.reserve(n);
    while (map.size() + spares_.size() < n) {
      scratch_.emplace(0, 0);  // an empty map inserts without comparing
      spares_.push_back(scratch_.extract(scratch_.begin()));
    }
  }

  /// Inserts [begin, end) into `map` with a spare node. REQUIRES: hold() counted it.
  void insert(interval_map& map, std::uintptr_t begin, std::uintptr_t end) noexcept {
    interval_map::node_type node = std::move(spares_.back());
    spares_.pop_back();
    node.key() = begin;
    node.mapped() = end;
    map.insert(std::move(node));
  }

  /// Takes `it` out of `map`, keeping its node spare (within the room hold() made).
  void keep(interval_map& map, interval_map::iterator it) noexcept {
    spares_.push_back(map.extract(it));
  }

  /// Gives spare nodes back to the host until `map` and the spares hold `n` (freeing never fails).
  void trim(const interval_map& map, std::size_t n) noexcept {
    while (!spares_.empty() && map.size() + spares_.size() > n) spares_.pop_back();
  }

 private:
  std::vector<interval_map::node_type> spares_;  // capacity >= every node held
  interval_map scratch_;                         // always empty: where hold() makes nodes
};

}  // namespace terrace::detail
