// SPDX-License-Identifier: Apache-2.0
// The optimizer's thread pool (optimizer/thread_pool.hpp) on its own: every part runs exactly
// once for every size and part count, an exception thrown by a part reaches the caller (from the
// caller's part or a worker's) and leaves the pool usable, and a part that runs the same pool
// again gets its parts run instead of a deadlock. Labelled concurrent: tools/test.sh runs it
// under ThreadSanitizer.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <vector>

#include "optimizer/thread_pool.hpp"

namespace terrace::detail {
namespace {

TEST(ThreadPool, EveryPartRunsExactlyOnceForEverySizeAndPartCount) {
  for (unsigned threads : {1u, 2u, 3u, 5u}) {
    thread_pool pool(threads);
    ASSERT_EQ(pool.size(), threads);
    for (unsigned parts = 1; parts <= threads + 1; ++parts) {
      for (int round = 0; round < 20; ++round) {
        std::vector<std::atomic<int>> runs(threads);
        pool.run([&](unsigned i) { runs[i].fetch_add(1); }, parts);
        for (unsigned i = 0; i < threads; ++i) {
          // Parts >= `parts` may be called (they must then do nothing); parts below always are.
          if (i < parts) EXPECT_EQ(runs[i].load(), 1) << threads << " threads, part " << i;
          else EXPECT_LE(runs[i].load(), 1) << threads << " threads, part " << i;
        }
      }
    }
  }
}

TEST(ThreadPool, ZeroThreadsIsTheCallerAlone) {
  thread_pool pool(0);
  EXPECT_EQ(pool.size(), 1u);
  int runs = 0;
  pool.run([&](unsigned i) { runs += i == 0; });
  EXPECT_EQ(runs, 1);
}

TEST(ThreadPool, AnExceptionFromAWorkersPartReachesTheCaller) {
  thread_pool pool(3);
  std::atomic<int> runs{0};
  EXPECT_THROW(pool.run([&](unsigned i) {
                 runs.fetch_add(1);
                 if (i == 2) throw std::runtime_error("part 2");
               }),
               std::runtime_error);
  EXPECT_EQ(runs.load(), 3);  // the other parts still ran to the end before run() returned
  runs = 0;
  pool.run([&](unsigned) { runs.fetch_add(1); });  // and the pool still works
  EXPECT_EQ(runs.load(), 3);
}

TEST(ThreadPool, AnExceptionFromTheCallersPartWaitsForTheWorkers) {
  thread_pool pool(4);
  for (int round = 0; round < 50; ++round) {
    std::vector<int> done(4, 0);  // written by the workers: read only after run() returned
    try {
      pool.run([&](unsigned i) {
        if (i == 0) throw std::runtime_error("part 0");
        done[i] = 1;
      });
      ADD_FAILURE() << "no exception";
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "part 0");
    }
    EXPECT_EQ(done, (std::vector<int>{0, 1, 1, 1}));
  }
}

TEST(ThreadPool, ARunInsideAPartRunsItsPartsInsteadOfDeadlocking) {
  thread_pool pool(3);
  std::atomic<int> inner{0};
  pool.run([&](unsigned) { pool.run([&](unsigned) { inner.fetch_add(1); }); });
  EXPECT_EQ(inner.load(), 9);  // each of the 3 parts ran the 3 inner parts
}

}  // namespace
}  // namespace terrace::detail
