// SPDX-License-Identifier: Apache-2.0
// The tensor store under several threads: puts, gets and erases on private ids while another
// thread checkpoints, with many requests in flight; every byte checked. Runs under TSan.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "scratch_dir.hpp"
#include "terrace/error.hpp"
#include "terrace/tensor_store.hpp"

namespace terrace {
namespace {

std::vector<unsigned char> fill(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(TensorStoreConcurrent, ThreadsAndCheckpointsStress) {
  testing::scratch_dir dir("concurrent");
  tensor_store_options o;
  o.capacity = 96 << 20;
  o.block_size = 64 << 10;
  o.queue_depth = 16;
  o.files = 2;
  auto owner = std::make_unique<tensor_store>(tensor_store::create(dir.path(), o));
  tensor_store& store = *owner;
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::thread checkpointer([&] {
    while (!stop.load()) {
      store.checkpoint();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < 4; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::map<std::string, std::vector<unsigned char>> live;
      for (int step = 0; step < 150; ++step) {
        const std::string id = "w" + std::to_string(t) + "." + std::to_string(rng() % 8);
        const unsigned op = rng() % 4;
        if (op <= 1 || !live.count(id)) {
          // Several puts in flight from one thread before waiting.
          std::vector<std::vector<unsigned char>> data;
          std::vector<io_handle> hs;
          std::vector<std::string> ids;
          for (int k = 0; k < 3; ++k) {
            ids.push_back("w" + std::to_string(t) + "." + std::to_string(rng() % 8));
            data.push_back(fill(rng() % (300 << 10) + 1, rng()));
          }
          for (int k = 0; k < 3; ++k) hs.push_back(store.put(ids[k], data[k].data(), data[k].size()));
          for (auto& h : hs) h.wait();
          for (int k = 0; k < 3; ++k) live[ids[k]] = data[k];
        } else if (op == 2) {
          auto& want = live[id];
          std::vector<unsigned char> got(want.size());
          store.get(id, got.data(), got.size()).wait();
          if (got != want) failures.fetch_add(1);
        } else {
          store.erase(id);
          live.erase(id);
        }
      }
      for (auto& [id, want] : live) {
        std::vector<unsigned char> got(want.size());
        store.get(id, got.data(), got.size()).wait();
        if (got != want) failures.fetch_add(1);
      }
    });
  }
  for (auto& w : workers) w.join();
  stop = true;
  checkpointer.join();
  EXPECT_EQ(failures.load(), 0);
  const auto final_generation = store.checkpoint();
  const auto ids = store.ids();
  owner.reset();
  auto reopened = tensor_store::open(dir.path(), o);
  EXPECT_EQ(reopened.generation(), final_generation);
  EXPECT_EQ(reopened.ids(), ids);
}

// Found in review: a put that replaced a committed tensor while a checkpoint waited for the puts
// issued before it dropped the old version at once, and the snapshot skipped the new one, still
// in flight: the commit held neither, and a crash after it lost the tensor, which had never been
// absent. The checkpoint now takes the version the put replaced. Timing decides whether a round
// hits that window (the replacing put must still be in flight when the wait ends): the big put
// before each checkpoint makes it likely, and the test fails if no round hit it.
TEST(TensorStoreConcurrent, APutDuringACheckpointNeverLeavesTheTensorOutOfIt) {
  testing::scratch_dir dir("ckpt-window");
  tensor_store_options o;
  o.capacity = 512 << 20;
  o.block_size = 1 << 20;
  constexpr std::size_t kBig = 64 << 20;
  const std::vector<unsigned char> big(kBig, 0xb1);
  auto store = std::make_unique<tensor_store>(tensor_store::create(dir.path(), o));
  int old_kept = 0;
  for (int round = 0; round < 20 && old_kept < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const std::vector<unsigned char> x_old(kBig, static_cast<unsigned char>(2 * round));
    const std::vector<unsigned char> x_new(kBig, static_cast<unsigned char>(2 * round + 1));
    store->put("x", x_old.data(), x_old.size()).wait();
    store->checkpoint();
    io_handle big_put = store->put("big", big.data(), big.size());  // the checkpoint waits for it
    std::thread checkpointer([&] { store->checkpoint(); });
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    io_handle x_put = store->put("x", x_new.data(), x_new.size());
    checkpointer.join();
    x_put.wait();
    big_put.wait();
    // What a crash right after that checkpoint would leave.
    store.reset();
    store = std::make_unique<tensor_store>(tensor_store::open(dir.path(), o));
    ASSERT_TRUE(store->contains("x")) << "the committed tensor was lost";
    std::vector<unsigned char> got(kBig);
    store->get("x", got.data(), got.size()).wait();
    if (got == x_old) {
      ++old_kept;
    } else {
      ASSERT_TRUE(got == x_new) << "neither version";
    }
  }
  EXPECT_GE(old_kept, 1) << "no replacing put was in flight at a snapshot: the test does not test";
}

}  // namespace
}  // namespace terrace
