// SPDX-License-Identifier: Apache-2.0
// Spare nodes for the caching allocator's node-based books (its free sets). An insertion into a
// std::set allocates; if the host is out of memory half-way through a split or a merge, the
// block being moved would belong to no set and be lost. Each call therefore makes its nodes
// ready before its first change (ensure, which may throw and then has changed nothing), and the
// changes themselves move nodes between the sets and the stash without allocating. Nodes that
// leave a set are kept for the next insertion, which also spares the hot path a malloc and a
// free per split or merge. Internal to allocator/.
#pragma once

#include <cassert>
#include <cstddef>
#include <utility>
#include <vector>

namespace terrace::detail {

template <class Set>
class node_stash {
 public:
  using node_type = typename Set::node_type;

  node_stash() { spares_.reserve(kKept); }

  /// Makes `n` (at most kKept) spare nodes ready. @throws std::bad_alloc, having changed no set.
  void ensure(std::size_t n) {
    while (spares_.size() < n) {
      // An empty set inserts without comparing, so a null value is safe whatever the order.
      scratch_.emplace();
      spares_.push_back(scratch_.extract(scratch_.begin()));
    }
  }

  /// Inserts `value` into `set` with a spare node. REQUIRES: ensure() made one ready.
  void insert(Set& set, typename Set::value_type value) noexcept {
    assert(!spares_.empty() && "node_stash: insert without a spare node");
    node_type node = std::move(spares_.back());
    spares_.pop_back();
    node.value() = value;
    set.insert(std::move(node));
  }

  /// Removes `value` from `set` if it is there, keeping its node.
  void erase(Set& set, const typename Set::value_type& value) noexcept {
    node_type node = set.extract(value);
    if (!node.empty() && spares_.size() < kKept) spares_.push_back(std::move(node));
  }

 private:
  static constexpr std::size_t kKept = 16;  // the capacity reserved: push_back never reallocates
  std::vector<node_type> spares_;
  Set scratch_;
};

}  // namespace terrace::detail
