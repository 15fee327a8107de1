// SPDX-License-Identifier: Apache-2.0
// The caching allocator when the host runs out of memory in the middle of a call. Its books (free
// sets, the live table, pending frees, the trace) are standard containers, so any call may meet a
// std::bad_alloc between two updates. This executable replaces the global operator new with one
// that fails the N-th allocation made on the test thread, and runs one scripted workload once for
// every N until a run meets no failure. After each injected failure the allocator must be exactly
// as it was before the call that failed (no block lost, none handed out twice, the stats equal a
// recount), and the rest of the workload must run to an empty device.
//
// Every policy: caching, expandable segments, and planned (marked iterations, and iterations its
// detector finds), whose plan is made, installed and replayed in the workload.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <new>
#include <random>
#include <thread>
#include <vector>

#include "terrace/caching_allocator.hpp"
#include "terrace/error.hpp"
#include "terrace/sim_device.hpp"
#include "failing_operator_new.hpp"

namespace terrace {
namespace {

using testing::allocations_until_failure;
using testing::injected;

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

// Arms the failure for the scope of one allocator call.
class armed {
 public:
  explicit armed(long& budget) : budget_(budget) { allocations_until_failure = budget_; }
  ~armed() {
    budget_ = allocations_until_failure;  // what is left carries over to the next call
    allocations_until_failure = -1;
  }
  armed(const armed&) = delete;
  armed& operator=(const armed&) = delete;

 private:
  long& budget_;
};

// What a failed call must leave as it was. Not the active counts: a call that waits (the OOM
// path, empty_cache) completes pending frees before it fails, which loses nothing.
struct counts {
  std::int64_t allocations = 0;
  std::int64_t allocated_bytes = 0;
  std::int64_t requested_bytes = 0;
};

counts counts_of(const caching_allocator& a) {
  const allocator_stats s = a.stats();
  return {s.allocation[0].current, s.allocated_bytes[0].current, s.requested_bytes[0].current};
}

// The sim device, except that the host waiting for the device (a stream, an event, all of it)
// first calls `on_host_wait`. Its noexcept calls (release, unmap, destroy_stream, ...) are injected
// into like every other: the sim device makes what they need ready beforehand
// (tests/tiers_host_oom_test.cpp). Work gated until the test opens it would otherwise never finish
// when the allocator waits for it (the OOM path, empty_cache, a free whose event could not be
// recorded): the gate opens then, as a kernel would finish.
class waited_device final : public device_backend {
 public:
  waited_device(std::unique_ptr<device_backend> inner, std::function<void()> on_host_wait)
      : inner_(std::move(inner)), on_host_wait_(std::move(on_host_wait)) {
    properties_ = inner_->properties();
  }
  device_backend& inner() { return *inner_; }

 private:
  void* do_reserve(std::size_t bytes) override { return inner_->reserve(bytes); }
  void do_release(void* p, std::size_t bytes) noexcept override {
    inner_->release(p, bytes);
  }
  void* do_reserve_address_range(std::size_t bytes) override {
    return inner_->reserve_address_range(bytes);
  }
  void do_release_address_range(void* p, std::size_t bytes) noexcept override {
    inner_->release_address_range(p, bytes);
  }
  void do_map(void* p, std::size_t bytes) override { inner_->map(p, bytes); }
  void do_unmap(void* p, std::size_t bytes) noexcept override { inner_->unmap(p, bytes); }
  std::size_t do_used_bytes() const noexcept override { return inner_->used_bytes(); }
  stream_ref do_create_stream() override { return inner_->create_stream(); }
  void do_destroy_stream(stream_ref s) noexcept override {
    inner_->destroy_stream(s);
  }
  void do_synchronize_stream(stream_ref s) override {
    on_host_wait_();
    inner_->synchronize(s);
  }
  void do_synchronize_device() override {
    on_host_wait_();
    inner_->synchronize_device();
  }
  event_ref do_create_event() override { return inner_->create_event(); }
  void do_destroy_event(event_ref e) noexcept override {
    inner_->destroy_event(e);
  }
  void do_record(event_ref e, stream_ref s) override { inner_->record(e, s); }
  bool do_query(event_ref e) override { return inner_->query(e); }
  void do_wait(stream_ref s, event_ref e) override { inner_->wait(s, e); }
  void do_synchronize_event(event_ref e) override {
    on_host_wait_();
    inner_->synchronize(e);
  }
  void do_copy_async(void* dst, const void* src, std::size_t bytes, copy_kind kind,
                     stream_ref s) override {
    inner_->copy_async(dst, src, bytes, kind, s);
  }

  std::unique_ptr<device_backend> inner_;
  std::function<void()> on_host_wait_;
};

::testing::AssertionResult invariants_hold(const caching_allocator& a) {
  try {
    a.check_invariants();
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << e.what();
  }
}

bool operator==(const counts& x, const counts& y) {
  return x.allocations == y.allocations && x.allocated_bytes == y.allocated_bytes &&
         x.requested_bytes == y.requested_bytes;
}

struct run_result {
  bool failure_met = false;
  std::size_t trace_events_lost = 0;
};

// One run of the workload, failing the allocation numbered `fail_at` on this thread (counting
// only inside allocator calls).
run_result run_workload(long fail_at, bool expandable) {
  device_options o;
  o.capacity = 1024 * MiB;  // never full: a device OOM would wait for the gated side stream
  if (expandable) o.map_granularity = 2 * MiB;
  // Work queued on the side stream stays unfinished until its gate opens: blocks it used are
  // pending. Any host wait opens it; the test closes a new one after each call that did.
  std::deque<std::atomic<bool>> gates;
  const auto open_gate = [&gates] {
    if (!gates.empty()) gates.back() = true;
  };
  auto dev = std::make_unique<waited_device>(make_device("sim", o), open_gate);
  allocator_config cfg;
  cfg.expandable_segments = expandable;
  cfg.record_trace = true;
  cfg.trace_max_events = 64;  // small: the ring wraps, so both of its paths run
  caching_allocator a(*dev, cfg);
  stream_ref main_stream = dev->create_stream();
  stream_ref side = dev->create_stream();
  const auto close_gate = [&] {
    if (!gates.empty() && !gates.back().load()) return;  // still closed
    std::atomic<bool>& gate = gates.emplace_back(false);
    enqueue_host_function(dev->inner(), side, [&gate] {
      while (!gate.load()) std::this_thread::yield();
    });
  };
  close_gate();

  std::vector<void*> live;
  live.reserve(256);
  std::mt19937 rng(7);
  long budget = fail_at;
  run_result result;
  injected = false;
  const auto sizes = std::vector<std::size_t>{512, 3000, 64 * KiB, 900 * KiB, 1536 * KiB,
                                              3 * MiB, 5 * MiB + 100};
  for (int op = 0; op < 160; ++op) {
    const unsigned pick = rng() % 10;
    const counts before = counts_of(a);
    try {
      if (pick < 5 || live.empty()) {
        const std::size_t bytes = sizes[rng() % sizes.size()];
        void* p = nullptr;
        {
          armed guard(budget);
          // Longer than a short string's inline buffer: the tag's copies allocate too.
          p = a.allocate(bytes, main_stream, "transformer.layer.17.attention.output");
        }
        live.push_back(p);
      } else if (pick < 8) {
        const std::size_t i = rng() % live.size();
        if (pick == 7) a.record_stream(live[i], side);
        {
          armed guard(budget);
          a.deallocate(live[i], main_stream);
        }
        live[i] = live.back();
        live.pop_back();
      } else if (pick == 8) {
        armed guard(budget);
        a.empty_cache();
      } else {
        const std::size_t i = rng() % live.size();
        armed guard(budget);
        a.record_stream(live[i], side);
      }
    } catch (const std::bad_alloc&) {
      EXPECT_TRUE(injected) << "a bad_alloc that was not injected, op " << op;
      // The call failed as a whole: nothing it began may remain.
      EXPECT_TRUE(counts_of(a) == before) << "op " << op << " (fail_at " << fail_at
                                          << ") changed the allocator's counts and failed";
      EXPECT_TRUE(invariants_hold(a)) << "after op " << op << " (fail_at " << fail_at << ")";
    }
    close_gate();
    if (::testing::Test::HasFailure()) break;
  }
  a.check_invariants();
  result.trace_events_lost = a.snapshot().trace_events_lost;
  // The failure may also have been met where it is no error (the device reports a book entry it
  // has no memory for as out of memory, which the allocator's retry absorbs).
  result.failure_met = injected;
  dev->synchronize(side);
  for (void* p : live) a.deallocate(p, main_stream);  // a block lost or freed twice throws here
  a.empty_cache();
  a.check_invariants();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, 0) << "fail_at " << fail_at;
  EXPECT_EQ(a.stats().active[0].current, 0) << "fail_at " << fail_at;
  dev->destroy_stream(main_stream);
  dev->destroy_stream(side);
  return result;
}

// The planned policy: a training-like iteration repeated (with marks, or found by the detector),
// so that a plan is made, installed and replayed, failing the allocation numbered `fail_at` as
// run_workload does.
run_result run_planned_workload(long fail_at, bool marked) {
  device_options o;
  o.capacity = 1024 * MiB;
  auto dev = make_device("sim", o);
  allocator_config cfg;
  cfg.policy = alloc_policy::planned;
  cfg.plan_min_period = 16;  // the iteration below is 18 tokens (allocations and frees)
  cfg.record_trace = true;
  cfg.trace_max_events = 64;
  caching_allocator a(*dev, cfg);
  const auto sizes = std::vector<std::size_t>{3 * MiB, 512, 64 * KiB, 5 * MiB + 100, 3000,
                                              900 * KiB, 1536 * KiB, 2 * MiB};
  std::vector<void*> live;
  live.reserve(64);
  long budget = fail_at;
  run_result result;
  injected = false;
  const auto attempt = [&](auto&& call) {
    const counts before = counts_of(a);
    try {
      armed guard(budget);
      call();
    } catch (const std::bad_alloc&) {
      EXPECT_TRUE(injected) << "a bad_alloc that was not injected";
      EXPECT_TRUE(counts_of(a) == before) << "(fail_at " << fail_at << ") a failed call changed "
                                          << "the allocator's counts";
      EXPECT_TRUE(invariants_hold(a)) << "fail_at " << fail_at;
    }
  };
  const auto free_last = [&] {
    attempt([&] {
      a.deallocate(live.back());
      live.pop_back();  // only once freed: a failed free leaves the block live
    });
  };
  const int iterations = marked ? 8 : 24;
  for (int iteration = 0; iteration < iterations && !::testing::Test::HasFailure(); ++iteration) {
    if (marked) attempt([&] { a.begin_iteration(); });
    for (std::size_t bytes : sizes) {
      attempt([&] {
        void* p = a.allocate(bytes, {}, "activation.of.a.layer.in.the.model");
        live.push_back(p);
      });
    }
    // Activations freed in reverse, as backward does; then a workspace allocated and freed.
    while (live.size() > 2) free_last();
    attempt([&] {
      void* p = a.allocate(7 * MiB, {}, "workspace.of.the.optimizer.step");
      live.push_back(p);
    });
    while (!live.empty()) free_last();
    if (marked) attempt([&] { a.end_iteration(); });
  }
  EXPECT_TRUE(invariants_hold(a)) << "fail_at " << fail_at;
  result.trace_events_lost = a.snapshot().trace_events_lost;
  result.failure_met = injected;
  EXPECT_GT(a.plan_stats().iterations, 0) << "fail_at " << fail_at << ": no iteration ran under a plan";
  for (void* p : live) a.deallocate(p);
  a.empty_cache();
  EXPECT_TRUE(invariants_hold(a)) << "fail_at " << fail_at;
  EXPECT_EQ(a.stats().allocated_bytes[0].current, 0) << "fail_at " << fail_at;
  return result;
}

template <class Run>
void sweep(Run&& run) {
  long fail_at = 0;
  std::size_t runs_with_lost_events = 0;
  for (; fail_at < 100000; ++fail_at) {
    const run_result r = run(fail_at);
    if (::testing::Test::HasFailure()) {
      ADD_FAILURE() << "first failure with the allocation numbered " << fail_at << " refused";
      return;
    }
    if (!r.failure_met) break;
    runs_with_lost_events += r.trace_events_lost > 0 ? 1 : 0;
  }
  // The workload must have made allocations to fail, or the sweep tested nothing; some of them
  // are the trace's, whose loss is counted instead of failing the call.
  EXPECT_GT(fail_at, 20);
  EXPECT_GT(runs_with_lost_events, 0u);
}

TEST(AllocatorHostOom, EveryFailedAllocationInACallLeavesTheAllocatorAsItWas) {
  sweep([](long fail_at) { return run_workload(fail_at, false); });
}

TEST(AllocatorHostOom, EveryFailedAllocationInACallOnExpandableSegmentsLeavesItAsItWas) {
  sweep([](long fail_at) { return run_workload(fail_at, true); });
}

TEST(AllocatorHostOom, EveryFailedAllocationInACallOfThePlannedPolicyLeavesItAsItWas) {
  sweep([](long fail_at) { return run_planned_workload(fail_at, true); });
}

TEST(AllocatorHostOom, EveryFailedAllocationInThePlannedPolicysOwnDetectionLeavesItAsItWas) {
  sweep([](long fail_at) { return run_planned_workload(fail_at, false); });
}

}  // namespace
}  // namespace terrace
