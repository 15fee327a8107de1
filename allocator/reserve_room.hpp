// SPDX-License-Identifier: Apache-2.0
// Room in a vector before a change that must not fail half-way: the caching allocator and the
// planned front reserve what their books will need, then make changes that cannot allocate.
// Internal to allocator/.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace terrace::detail {

/// Room for `more` elements beyond the size, grown geometrically (reserve alone grows to the
/// exact size asked, which would reallocate at every call). @throws std::bad_alloc, having
/// changed nothing.
template <class T>
void reserve_room(std::vector<T>& v, std::size_t more) {
  if (v.capacity() - v.size() >= more) return;
  v.reserve(std::max(v.size() + more, 2 * v.capacity()));
}

}  // namespace terrace::detail
