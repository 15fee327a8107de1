// SPDX-License-Identifier: Apache-2.0
// The benchmarks' median (tools/bench_stats.hpp): an even count takes the mean of the middle two.
#include <gtest/gtest.h>

#include "tools/bench_stats.hpp"

namespace {

using terrace::tools::median;

TEST(BenchMedian, OddCountIsTheMiddleValue) {
  EXPECT_DOUBLE_EQ(median({3.0}), 3.0);
  EXPECT_DOUBLE_EQ(median({9.0, 1.0, 5.0}), 5.0);
}

TEST(BenchMedian, EvenCountIsTheMeanOfTheMiddleTwo) {
  EXPECT_DOUBLE_EQ(median({1.0, 2.0}), 1.5);
  EXPECT_DOUBLE_EQ(median({4.0, 1.0, 3.0, 10.0}), 3.5);
}

TEST(BenchMedian, EmptyIsZero) { EXPECT_DOUBLE_EQ(median({}), 0.0); }

}  // namespace
