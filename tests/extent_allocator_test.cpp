// SPDX-License-Identifier: Apache-2.0
// The tensor store's free-space policy: best fit, coalescing, hole reuse, reserve (index rebuild)
// and a randomized run against a shadow bitmap.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "terrace/error.hpp"
#include "tiers/extent_allocator.hpp"

namespace terrace::detail {
namespace {

constexpr std::uint64_t U = 4096;

TEST(ExtentAllocator, RoundsToUnitsAndFills) {
  extent_allocator a(16 * U, U);
  EXPECT_EQ(a.extent_size(0), U);
  EXPECT_EQ(a.extent_size(1), U);
  EXPECT_EQ(a.extent_size(U + 1), 2 * U);
  auto x = a.allocate(10 * U - 5);
  ASSERT_TRUE(x);
  EXPECT_EQ(*x, 0u);
  EXPECT_EQ(a.free_bytes(), 6 * U);
  EXPECT_FALSE(a.allocate(7 * U));  // does not fit: nothing changes
  EXPECT_EQ(a.free_bytes(), 6 * U);
  EXPECT_TRUE(a.consistent());
}

TEST(ExtentAllocator, BestFitReusesHolesAndCoalesces) {
  extent_allocator a(100 * U, U);
  std::vector<std::uint64_t> off;
  for (int i = 0; i < 10; ++i) off.push_back(*a.allocate(10 * U));
  a.release(off[2], 10 * U);
  a.release(off[6], 10 * U);
  a.release(off[7], 10 * U);  // joins off[6]: a 20-unit hole
  EXPECT_EQ(a.holes(), 2u);
  EXPECT_EQ(*a.allocate(8 * U), off[2]);    // best fit: the 10-unit hole, not the 20
  EXPECT_EQ(*a.allocate(15 * U), off[6]);   // the 20-unit hole
  a.release(off[2], 8 * U);
  a.release(off[6], 15 * U);
  for (int i : {0, 1, 3, 4, 5, 8, 9}) a.release(off[i], 10 * U);
  EXPECT_EQ(a.holes(), 1u);
  EXPECT_EQ(a.largest_hole(), 100 * U);
  EXPECT_TRUE(a.consistent());
}

TEST(ExtentAllocator, ReserveRebuildsFromAnIndex) {
  extent_allocator a(10 * U, U);
  EXPECT_TRUE(a.reserve(2 * U, 3 * U));
  EXPECT_FALSE(a.reserve(4 * U, U));       // overlaps
  EXPECT_FALSE(a.reserve(9 * U, 2 * U));   // past the end
  EXPECT_FALSE(a.reserve(U + 1, U));       // unaligned
  EXPECT_EQ(a.free_bytes(), 7 * U);
  EXPECT_EQ(*a.allocate(2 * U), 0u);
  EXPECT_TRUE(a.consistent());
}

TEST(ExtentAllocator, ARequestNear2To64FindsNoHoleInsteadOfWrapping) {
  extent_allocator a(16 * U, U);
  EXPECT_EQ(a.extent_size(UINT64_MAX - 100), UINT64_MAX);
  EXPECT_FALSE(a.allocate(UINT64_MAX - 100));
  EXPECT_FALSE(a.reserve(0, UINT64_MAX));
  EXPECT_EQ(a.free_bytes(), 16 * U);
  EXPECT_TRUE(a.consistent());
}

TEST(ExtentAllocator, DoubleAndForeignReleasesAreRefusedAndChangeNothing) {
  extent_allocator a(16 * U, U);
  const std::uint64_t x = *a.allocate(2 * U);
  const std::uint64_t y = *a.allocate(2 * U);
  a.release(x, 2 * U);
  EXPECT_THROW(a.release(x, 2 * U), logic_error);     // twice: the hole is already there
  EXPECT_THROW(a.release(y, 3 * U), logic_error);     // a size that runs into free space
  EXPECT_THROW(a.release(15 * U, 2 * U), logic_error);  // past the end
  EXPECT_THROW(a.release(y + 1, U), logic_error);     // unaligned
  EXPECT_EQ(a.free_bytes(), 14 * U);
  EXPECT_TRUE(a.consistent());
  a.release(y, 2 * U);
  EXPECT_EQ(a.free_bytes(), 16 * U);
  EXPECT_EQ(a.holes(), 1u);
}

TEST(ExtentAllocator, RandomizedAgainstShadow) {
  constexpr std::uint64_t units = 512;
  extent_allocator a(units * U, U);
  std::vector<bool> used(units, false);
  std::map<std::uint64_t, std::uint64_t> live;
  std::mt19937_64 rng(42);
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const std::uint64_t n = 1 + rng() % 20;
      auto off = a.allocate(n * U - rng() % U);
      if (!off) continue;
      for (std::uint64_t u = *off / U; u < *off / U + n; ++u) {
        ASSERT_FALSE(used[u]) << "double allocation at unit " << u;
        used[u] = true;
      }
      live[*off] = n * U;
    } else {
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      for (std::uint64_t u = it->first / U; u < (it->first + it->second) / U; ++u) used[u] = false;
      a.release(it->first, it->second);
      live.erase(it);
    }
    if (step % 500 == 0) {
      ASSERT_TRUE(a.consistent());
    }
  }
  std::uint64_t free_units = 0;
  for (bool u : used) free_units += !u;
  EXPECT_EQ(a.free_bytes(), free_units * U);
}

}  // namespace
}  // namespace terrace::detail
