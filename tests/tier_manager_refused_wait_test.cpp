// SPDX-License-Identifier: Apache-2.0
// An acquire whose stream wait the device refuses (cudaStreamWaitEvent failing) leaves nothing
// that passes for the tensor's data. A write acquire takes a block and puts none of its tensor's
// data there (the caller was to fill it); the stream is then ordered after the copies still using
// that memory (a fence). When that wait is refused the acquire fails, and the block must go with
// it: kept as the device copy, the next acquire for reading would hand out what the block's
// previous owner left there.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "refusing_device.hpp"
#include "terrace/caching_allocator.hpp"
#include "terrace/device.hpp"
#include "terrace/error.hpp"
#include "terrace/pinned_pool.hpp"
#include "terrace/sim_device.hpp"
#include "terrace/tier_manager.hpp"

namespace terrace {
namespace {

constexpr std::size_t MiB = 1024 * 1024;
constexpr std::size_t kBytes = 2 * MiB;
constexpr double kSlowBandwidth = 100e6;  // 2 MiB: ~21 ms per copy, so a copy stays queued

std::vector<unsigned char> filled(int value) {
  return std::vector<unsigned char>(kBytes, static_cast<unsigned char>(value));
}

struct slow_refusing_rig {
  testing::refusing_device dev{make_device("sim", [] {
    device_options o;
    o.capacity = 64 * MiB;
    o.copy_bandwidth = kSlowBandwidth;
    return o;
  }())};
  caching_allocator memory{dev};
  pinned_host_pool host{dev, [] {
    pinned_pool_options po;
    po.region_size = 16 * MiB;
    return po;
  }()};
  stream_ref compute = dev.create_stream();
  ~slow_refusing_rig() {
    dev.synchronize_device();
    dev.destroy_stream(compute);
  }

  // A "kernel" on the compute stream overwrites tensor `id` with `value`.
  void write_on_device(tier_manager& tm, tensor_id id, int value) {
    void* d = tm.acquire(id, compute, access::write);
    enqueue_host_function(dev.inner(), compute, [d, value] { std::memset(d, value, kBytes); });
    tm.release(id, compute);
  }

  // What a kernel reading tensor `id` on the compute stream sees.
  std::vector<unsigned char> seen_by_kernel(tier_manager& tm, tensor_id id) {
    auto* p = static_cast<unsigned char*>(tm.acquire(id, compute, access::read));
    std::vector<unsigned char> seen(kBytes);
    enqueue_host_function(dev.inner(), compute, [p, &seen] { std::memcpy(seen.data(), p, kBytes); });
    tm.release(id, compute);
    dev.synchronize_device();
    return seen;
  }
};

TEST(TierManagerRefusedWait, AWriteAcquireWhoseFenceWaitIsRefusedLeavesNoBlockStandingForTheData) {
  slow_refusing_rig r;
  {
    tier_manager tm(r.dev, r.memory, r.host, {});
    const tensor_id slow = tm.add("slow", kBytes, filled(1).data());
    const tensor_id old_owner = tm.add("old", kBytes, filled(2).data());
    const tensor_id c = tm.add("c", kBytes, filled(3).data());

    r.write_on_device(tm, slow, 0x5a);
    r.write_on_device(tm, old_owner, 0x77);
    tm.flush(slow);  // holds the copy stream: old's copy down waits its turn behind it
    r.dev.synchronize(r.compute);  // the block's compute work is done: reusable once given back
    tm.offload(old_owner);         // its block goes back fenced by the queued copy down

    r.dev.refuse_waits = 1;  // the write acquire's wait for that fence
    EXPECT_THROW(tm.acquire(c, r.compute, access::write), device_error);
    ASSERT_EQ(r.dev.refuse_waits, 0) << "the test does not test: no wait was refused";
    tm.check_invariants();
    EXPECT_THROW(tm.release(c, r.compute), logic_error) << "c was left pinned";
    EXPECT_FALSE(tm.on_device(c)) << "the failed write acquire's empty block stayed as c's device copy";
    EXPECT_TRUE(r.seen_by_kernel(tm, c) == filled(3)) << "c reads what the block's last owner left there";
    EXPECT_TRUE(r.seen_by_kernel(tm, old_owner) == filled(0x77));
    tm.check_invariants();
  }
}

}  // namespace
}  // namespace terrace
