// SPDX-License-Identifier: Apache-2.0
// What a refused free says. A block freed next to a free neighbour merges into it, so no block
// starts at its address any more: a second free of it must still read as a double free, not as
// an interior pointer, which sends the reader hunting for an offset that the code never applied.
#include <gtest/gtest.h>

#include <string>

#include "terrace/caching_allocator.hpp"
#include "terrace/error.hpp"
#include "terrace/sim_device.hpp"

namespace terrace {
namespace {

constexpr std::size_t kBlock = 4096;

std::string free_error(caching_allocator& a, void* p) {
  try {
    a.deallocate(p);
  } catch (const logic_error& e) {
    return e.what();
  }
  return "(accepted)";
}

bool contains(const std::string& haystack, const char* needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST(AllocatorDoubleFreeMessage, ASecondFreeOfABlockMergedIntoItsNeighbourIsADoubleFree) {
  auto dev = make_device("sim", {});
  caching_allocator a(*dev);
  void* lower = a.allocate(kBlock);
  void* upper = a.allocate(kBlock);
  void* keep = a.allocate(kBlock);  // keeps the segment split, so `upper` has a block to merge into
  ASSERT_EQ(static_cast<char*>(upper), static_cast<char*>(lower) + kBlock);
  a.deallocate(lower);
  a.deallocate(upper);  // merges into `lower`'s free block: no block starts at `upper` now

  const std::string said = free_error(a, upper);
  EXPECT_TRUE(contains(said, "double free")) << said;
  EXPECT_FALSE(contains(said, "not at the start of an allocation")) << said;
  a.check_invariants();
  a.deallocate(keep);
  a.check_invariants();
}

TEST(AllocatorDoubleFreeMessage, AnInteriorPointerOfALiveBlockIsNotCalledADoubleFree) {
  auto dev = make_device("sim", {});
  caching_allocator a(*dev);
  void* live = a.allocate(kBlock);
  const std::string said = free_error(a, static_cast<char*>(live) + 16);
  EXPECT_TRUE(contains(said, "not at the start of an allocation")) << said;
  EXPECT_FALSE(contains(said, "double free")) << said;
  EXPECT_EQ(a.stats().allocation[0].current, 1);  // refused: still live
  a.deallocate(live);
  a.check_invariants();
}

}  // namespace
}  // namespace terrace
