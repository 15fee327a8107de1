// SPDX-License-Identifier: Apache-2.0
// A deterministic randomized stress test of the caching allocator over the simulated device.
//
// Several threads allocate, free and record_stream over several streams. Every use of a block is a
// host function queued on a stream, the way a kernel would be, so the simulated device really runs
// them concurrently. Two properties are checked:
//   - on the books: check_invariants() after every step (no overlap, blocks tile segments, stats
//     equal a recount, allocated + cached free == reserved, no pending block in a free set);
//   - on the data: each allocation stamps its block with its own byte on its stream; every queued use
//     (on the owning stream and on record_stream'd streams) verifies the stamp later. If the allocator
//     handed a block out while another stream's work on it was still queued, the new owner's stamp
//     would land under the old owner's check and be counted as corruption.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "terrace/caching_allocator.hpp"
#include "terrace/error.hpp"
#include "terrace/sim_device.hpp"

namespace terrace {
namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

struct live_block {
  unsigned char* p;
  std::size_t n;
  unsigned char stamp;
  stream_ref stream;
};

struct stress_params {
  int threads;
  int steps;
  bool expandable;
};

class AllocatorStress : public ::testing::TestWithParam<stress_params> {};

TEST_P(AllocatorStress, InvariantsAndDataHoldUnderConcurrentStreams) {
  const stress_params params = GetParam();
  device_options o;
  o.capacity = 192 * MiB;  // small enough that the OOM and release paths run too
  o.map_granularity = 2 * MiB;
  auto dev = make_device("sim", o);
  allocator_config cfg;
  cfg.expandable_segments = params.expandable;
  cfg.record_trace = true;
  cfg.trace_max_events = 1 << 12;
  caching_allocator alloc(*dev, cfg);

  constexpr int kStreams = 4;
  std::vector<stream_ref> streams;
  streams.push_back(stream_ref{});  // the default stream takes part too
  for (int i = 1; i < kStreams; ++i) streams.push_back(dev->create_stream());

  std::atomic<long> corrupt{0};
  std::atomic<long> ooms{0};
  std::atomic<long> checks{0};

  auto verify_later = [&](stream_ref s, const live_block& b) {
    enqueue_host_function(*dev, s, [&corrupt, &checks, b] {
      // Linger a little so that an early reuse would overlap with this check.
      std::this_thread::sleep_for(std::chrono::microseconds(b.stamp % 50));
      for (std::size_t i = 0; i < b.n; i += 61) {
        if (b.p[i] != b.stamp) {
          ++corrupt;
          break;
        }
      }
      if (b.p[b.n - 1] != b.stamp) ++corrupt;
      ++checks;
    });
  };

  auto worker = [&](int id) {
    std::mt19937_64 rng(0x7e77ace + static_cast<unsigned>(id));
    std::vector<live_block> mine;
    event_ref ev = dev->create_event();
    for (int step = 0; step < params.steps; ++step) {
      const unsigned op = rng() % 100;
      if (op < 50 || mine.empty()) {
        // Allocate: mostly small, sometimes large.
        const std::size_t n = (rng() % 4 == 0) ? (1 * MiB + rng() % (6 * MiB)) : (1 + rng() % (256 * KiB));
        const stream_ref s = streams[rng() % kStreams];
        void* p = nullptr;
        try {
          p = alloc.allocate(n, s, "stress");
        } catch (const out_of_memory&) {
          ++ooms;
          continue;
        }
        live_block b{static_cast<unsigned char*>(p), n, static_cast<unsigned char>(1 + rng() % 254), s};
        enqueue_host_function(*dev, s, [b] { std::memset(b.p, b.stamp, b.n); });
        verify_later(s, b);
        mine.push_back(b);
      } else if (op < 85) {
        // Free a random block on its stream, after one last queued use.
        const std::size_t i = rng() % mine.size();
        const live_block b = mine[i];
        mine[i] = mine.back();
        mine.pop_back();
        verify_later(b.stream, b);
        alloc.deallocate(b.p, b.stream);
      } else {
        // Use a block on another stream: order after its stamp, then record_stream.
        const live_block& b = mine[rng() % mine.size()];
        const stream_ref other = streams[rng() % kStreams];
        if (other == b.stream) continue;
        dev->record(ev, b.stream);
        dev->wait(other, ev);
        verify_later(other, b);
        alloc.record_stream(b.p, other);
      }
      alloc.check_invariants();
    }
    for (const live_block& b : mine) alloc.deallocate(b.p, b.stream);
    dev->synchronize_device();
    dev->destroy_event(ev);
  };

  std::vector<std::thread> pool;
  for (int t = 0; t < params.threads; ++t) pool.emplace_back(worker, t);
  for (auto& t : pool) t.join();
  dev->synchronize_device();

  EXPECT_EQ(corrupt.load(), 0) << "a block was reused while another stream still used it";
  EXPECT_GT(checks.load(), params.threads * params.steps / 2);
  alloc.check_invariants();
  const allocator_stats s = alloc.stats();
  EXPECT_EQ(s.allocation[0].current, 0);
  EXPECT_EQ(s.allocated_bytes[0].current, 0);
  EXPECT_EQ(s.allocation[0].allocated, s.allocation[0].freed);
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved_bytes[0].current, 0);
  EXPECT_EQ(dev->used_bytes(), 0u);
  alloc.check_invariants();
  std::printf("stress: %d threads x %d steps, %ld OOMs, %ld stream-ordered checks, %lld retries\n",
              params.threads, params.steps, ooms.load(), checks.load(),
              static_cast<long long>(s.num_alloc_retries));
  for (std::size_t i = 1; i < streams.size(); ++i) dev->destroy_stream(streams[i]);
}

INSTANTIATE_TEST_SUITE_P(Sim, AllocatorStress,
                         ::testing::Values(stress_params{1, 3000, false},
                                           stress_params{4, 1500, false},
                                           stress_params{4, 1500, true}),
                         [](const auto& info) {
                           return std::to_string(info.param.threads) + "threads" +
                                  (info.param.expandable ? "Expandable" : "Caching");
                         });

}  // namespace
}  // namespace terrace
