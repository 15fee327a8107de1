// SPDX-License-Identifier: Apache-2.0
// host_data(id, access::write) of a tensor whose home copy is on NVMe takes a pinned buffer for
// the caller to fill, then waits for the copies that may still touch the tensor's home. When the
// device refuses that wait the call fails, and the buffer must not stay: it holds none of the
// tensor's data, which is on NVMe, yet it holds room in the host budget and passes for a home
// copy (check_invariants names it).
#include <gtest/gtest.h>

#include <vector>

#include "refusing_device.hpp"
#include "scratch_dir.hpp"
#include "terrace/caching_allocator.hpp"
#include "terrace/device.hpp"
#include "terrace/error.hpp"
#include "terrace/pinned_pool.hpp"
#include "terrace/sim_device.hpp"
#include "terrace/tensor_store.hpp"
#include "terrace/tier_manager.hpp"

namespace terrace {
namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;
constexpr std::size_t kBytes = 256 * KiB;

std::vector<unsigned char> filled(int value) {
  return std::vector<unsigned char>(kBytes, static_cast<unsigned char>(value));
}

TEST(TierManagerRefusedOverwrite, ARefusedWaitLeavesNoEmptyHomeBufferForATensorOnNvme) {
  testing::scratch_dir dir("tm-refused-overwrite");
  tensor_store_options so;
  so.capacity = 16 * MiB;
  so.block_size = 64 * KiB;
  auto store = tensor_store::create(dir.path(), so);
  testing::refusing_device dev{make_device("sim", device_options{})};
  caching_allocator memory{dev};
  pinned_host_pool host{dev, pinned_pool_options{}};
  const stream_ref compute = dev.create_stream();
  {
    tier_manager_options to;
    to.device_budget = kBytes;    // one tensor on the device
    to.host_budget = 2 * kBytes;  // two home copies in pinned memory, the rest on NVMe
    tier_manager tm(dev, memory, host, to, &store);
    const tensor_id a = tm.add("a", kBytes, filled(1).data());
    const tensor_id w = tm.add("w", kBytes);
    tm.acquire(a, compute);  // a's copy up: a has an event for copies touching its home
    tm.release(a, compute);
    tm.acquire(w, compute, access::write);  // evicts a from the device
    tm.release(w, compute);
    dev.synchronize(compute);
    tm.add("c", kBytes, filled(3).data());  // a's home goes to NVMe
    ASSERT_FALSE(tm.on_host(a)) << "the scenario needs a's home copy on NVMe";

    dev.refuse_event_syncs = 1;  // the wait for copies touching a's home
    EXPECT_THROW(tm.host_data(a, access::write), device_error);
    ASSERT_EQ(dev.refuse_event_syncs, 0) << "the test does not test: nothing was refused";
    EXPECT_NO_THROW(tm.check_invariants());
    EXPECT_FALSE(tm.on_host(a)) << "a failed overwrite left a's home buffer empty, a's data on NVMe";
    std::vector<unsigned char> seen(kBytes);
    tm.read_home(a, seen.data());
    EXPECT_TRUE(seen == filled(1));
  }
  dev.synchronize_device();
  dev.destroy_stream(compute);
}

}  // namespace
}  // namespace terrace
