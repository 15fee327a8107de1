// SPDX-License-Identifier: Apache-2.0
// The device backend conformance suite: what every backend behind include/terrace/device.hpp must
// do, written once and instantiated per backend (rmm's cccl_mr_ref_test_basic.hpp pattern).
//
// A backend is named by a "maker" type, so that a typo is a compile error rather than a backend
// silently left untested:
//
//   struct cuda_maker {
//     static std::unique_ptr<terrace::device_backend> make() { return terrace::make_device("cuda"); }
//     static bool available() { return terrace::cuda_device_available(); }
//   };
//   namespace terrace::conformance {
//   INSTANTIATE_TYPED_TEST_SUITE_P(Cuda, DeviceConformance, ::testing::Types<cuda_maker>);
//   }
//
// INSTANTIATE_TYPED_TEST_SUITE_P pastes the suite's name into identifiers, so it must appear inside
// namespace terrace::conformance, unqualified. When available() is false every case skips,
// saying so: a machine without a GPU runs the CUDA instantiations as skips, never as passes.
//
// What the suite assumes of every backend, beyond device.hpp's comments:
//   - used_bytes() counts exactly the bytes passed to reserve() and map() (2 MiB multiples here);
//   - an out_of_memory's what() names the backend (properties().name);
//   - map/unmap work at any granule offset inside a reserved range, one granule at a time or many.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "terrace/device.hpp"
#include "terrace/error.hpp"

namespace terrace::conformance {

inline constexpr std::size_t KiB = 1024;
inline constexpr std::size_t MiB = 1024 * KiB;

inline ::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

// A buffer whose bytes depend on their index and on `seed`, so that a shifted, truncated or stale
// copy does not compare equal.
inline std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131 + seed * 7 + (i >> 12)) & 0xFF);
  return v;
}

inline void* offset(void* p, std::size_t bytes) { return static_cast<char*>(p) + bytes; }

template <class Maker>
class DeviceConformance : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Maker::available()) GTEST_SKIP() << "this backend is not available on this machine";
    dev_ = Maker::make();
    ASSERT_NE(dev_, nullptr);
    baseline_ = dev_->used_bytes();
  }

  void TearDown() override {
    if (dev_) {
      dev_->synchronize_device();
      EXPECT_EQ(dev_->used_bytes(), baseline_) << "the test leaked device memory";
    }
  }

  device_backend& dev() { return *dev_; }
  const device_properties& props() { return dev_->properties(); }
  bool touches() { return props().touches_memory; }

  std::unique_ptr<device_backend> dev_;
  std::size_t baseline_ = 0;
};

TYPED_TEST_SUITE_P(DeviceConformance);

// ---------------------------------------------------------------- segments

TYPED_TEST_P(DeviceConformance, ReserveReleaseRoundTripIsAlignedAndDisjoint) {
  auto& dev = this->dev();
  const std::size_t alignment = this->props().alignment;
  ASSERT_GE(alignment, 512u);
  const std::size_t sizes[] = {1, 511, 512, 4096, 1 * MiB + 1, 3 * MiB};
  std::vector<std::pair<std::uintptr_t, std::size_t>> got;
  for (std::size_t n : sizes) {
    void* p = dev.reserve(n);
    ASSERT_NE(p, nullptr) << n << " bytes";
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % alignment, 0u) << n << " bytes at " << p;
    got.emplace_back(reinterpret_cast<std::uintptr_t>(p), n);
  }
  std::vector<std::pair<std::uintptr_t, std::size_t>> sorted = got;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 0; i + 1 < sorted.size(); ++i) {
    EXPECT_LE(sorted[i].first + sorted[i].second, sorted[i + 1].first) << "segments overlap";
  }
  for (const auto& [p, n] : got) dev.release(reinterpret_cast<void*>(p), n);
  EXPECT_EQ(dev.used_bytes(), this->baseline_);
  // The memory is reusable afterwards.
  void* again = dev.reserve(3 * MiB);
  dev.release(again, 3 * MiB);
}

TYPED_TEST_P(DeviceConformance, ReserveOfZeroBytesIsALogicError) {
  EXPECT_THROW(this->dev().reserve(0), logic_error);
  EXPECT_EQ(this->dev().used_bytes(), this->baseline_);
}

TYPED_TEST_P(DeviceConformance, ReserveBeyondCapacityThrowsOutOfMemoryNamingTheBackend) {
  auto& dev = this->dev();
  const std::size_t too_much = this->props().capacity + 64 * MiB;
  try {
    void* p = dev.reserve(too_much);
    dev.release(p, too_much);
    FAIL() << "reserve beyond the capacity of " << this->props().capacity << " bytes succeeded";
  } catch (const out_of_memory& e) {
    EXPECT_TRUE(contains(e.what(), this->props().name));
  }
  EXPECT_EQ(dev.used_bytes(), this->baseline_);
  // A refusal leaves the device usable.
  void* p = dev.reserve(2 * MiB);
  ASSERT_NE(p, nullptr);
  dev.release(p, 2 * MiB);
}

TYPED_TEST_P(DeviceConformance, InjectedOutOfMemoryFailsTheNextReservesThenClears) {
  auto& dev = this->dev();
  dev.inject_out_of_memory(2);
  for (int i = 0; i < 2; ++i) {
    try {
      void* p = dev.reserve(4096);
      dev.release(p, 4096);
      FAIL() << "injected out of memory #" << i << " did not fire";
    } catch (const out_of_memory& e) {
      EXPECT_TRUE(contains(e.what(), this->props().name));
      EXPECT_TRUE(contains(e.what(), "4096"));
    }
  }
  EXPECT_EQ(dev.used_bytes(), this->baseline_);
  void* p = dev.reserve(4096);
  ASSERT_NE(p, nullptr);
  dev.release(p, 4096);
}

TYPED_TEST_P(DeviceConformance, InjectedDeviceErrorFailsTheNextReserveThenClears) {
  auto& dev = this->dev();
  dev.inject_device_error(1);
  try {
    void* p = dev.reserve(4096);
    dev.release(p, 4096);
    FAIL() << "injected device error did not fire";
  } catch (const device_error& e) {
    EXPECT_TRUE(contains(e.what(), this->props().name));
  }
  EXPECT_EQ(dev.used_bytes(), this->baseline_);
  void* p = dev.reserve(4096);
  ASSERT_NE(p, nullptr);
  dev.release(p, 4096);
}

TYPED_TEST_P(DeviceConformance, UsedBytesCountsReservesAndMaps) {
  auto& dev = this->dev();
  const std::size_t base = this->baseline_;
  void* a = dev.reserve(2 * MiB);
  EXPECT_EQ(dev.used_bytes(), base + 2 * MiB);
  void* b = dev.reserve(4 * MiB);
  EXPECT_EQ(dev.used_bytes(), base + 6 * MiB);
  dev.release(a, 2 * MiB);
  EXPECT_EQ(dev.used_bytes(), base + 4 * MiB);
  if (this->props().supports_vmm) {
    const std::size_t g = this->props().map_granularity;
    void* r = dev.reserve_address_range(4 * g);
    EXPECT_EQ(dev.used_bytes(), base + 4 * MiB) << "address space alone costs no memory";
    dev.map(r, 2 * g);
    EXPECT_EQ(dev.used_bytes(), base + 4 * MiB + 2 * g);
    dev.unmap(r, g);
    EXPECT_EQ(dev.used_bytes(), base + 4 * MiB + g);
    dev.unmap(offset(r, g), g);
    dev.release_address_range(r, 4 * g);
  }
  dev.release(b, 4 * MiB);
  EXPECT_EQ(dev.used_bytes(), base);
}

TYPED_TEST_P(DeviceConformance, ConcurrentReservesFromManyThreadsAreDisjoint) {
  auto& dev = this->dev();
  constexpr int kThreads = 4;
  constexpr int kPerThread = 64;
  std::mutex m;
  std::vector<std::pair<std::uintptr_t, std::size_t>> all;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(1234 + t);
      std::vector<std::pair<std::uintptr_t, std::size_t>> mine;
      for (int i = 0; i < kPerThread; ++i) {
        const std::size_t n = 512 * (1 + rng() % 512);
        mine.emplace_back(reinterpret_cast<std::uintptr_t>(dev.reserve(n)), n);
        if (i % 3 == 2) {  // churn: give one back
          dev.release(reinterpret_cast<void*>(mine.front().first), mine.front().second);
          mine.erase(mine.begin());
        }
      }
      std::lock_guard<std::mutex> lock(m);
      all.insert(all.end(), mine.begin(), mine.end());
    });
  }
  for (auto& t : threads) t.join();
  std::size_t total = 0;
  std::sort(all.begin(), all.end());
  for (std::size_t i = 0; i < all.size(); ++i) {
    total += all[i].second;
    if (i + 1 < all.size()) {
      EXPECT_LE(all[i].first + all[i].second, all[i + 1].first) << "segments overlap";
    }
  }
  EXPECT_EQ(dev.used_bytes(), this->baseline_ + total);
  for (const auto& [p, n] : all) dev.release(reinterpret_cast<void*>(p), n);
}

// ---------------------------------------------------------------- copies and streams

TYPED_TEST_P(DeviceConformance, DataRoundTripsHostToDeviceToDeviceToHost) {
  if (!this->touches()) GTEST_SKIP() << "this backend does not touch memory";
  auto& dev = this->dev();
  const std::size_t n = 1 * MiB + 37;  // odd: a copy that rounds or truncates shows
  const auto src = pattern(n, 1);
  std::vector<unsigned char> out(n, 0);
  void* a = dev.reserve(n);
  void* b = dev.reserve(n);
  for (stream_ref s : {stream_ref{}, dev.create_stream()}) {
    std::fill(out.begin(), out.end(), 0);
    dev.copy_async(a, src.data(), n, copy_kind::host_to_device, s);
    dev.copy_async(b, a, n, copy_kind::device_to_device, s);
    dev.copy_async(out.data(), b, n, copy_kind::device_to_host, s);
    dev.synchronize(s);
    EXPECT_EQ(out, src) << (s.native ? "created stream" : "default stream");
    if (s.native) dev.destroy_stream(s);
  }
  dev.release(a, n);
  dev.release(b, n);
}

TYPED_TEST_P(DeviceConformance, CopyOfZeroBytesIsANoOp) {
  auto& dev = this->dev();
  EXPECT_NO_THROW(dev.copy_async(nullptr, nullptr, 0, copy_kind::host_to_device, stream_ref{}));
  dev.synchronize(stream_ref{});
}

TYPED_TEST_P(DeviceConformance, CopiesOnOneStreamCompleteInOrder) {
  auto& dev = this->dev();
  const std::size_t n = 4 * MiB;
  const auto first = pattern(n, 2);
  const auto second = pattern(n, 3);
  std::vector<unsigned char> out(n, 0);
  void* d = dev.reserve(n);
  stream_ref s = dev.create_stream();
  event_ref e = dev.create_event();
  // Both copies write `d`; the read-back sees the later one only if they ran in queue order.
  dev.copy_async(d, first.data(), n, copy_kind::host_to_device, s);
  dev.copy_async(d, second.data(), n, copy_kind::host_to_device, s);
  dev.copy_async(out.data(), d, n, copy_kind::device_to_host, s);
  dev.record(e, s);
  dev.synchronize(e);
  EXPECT_TRUE(dev.query(e));
  if (this->touches()) {
    EXPECT_EQ(out, second);
  }
  // An event recorded after work is complete once the stream is synchronized.
  dev.copy_async(out.data(), d, n, copy_kind::device_to_host, s);
  dev.record(e, s);
  dev.synchronize(s);
  EXPECT_TRUE(dev.query(e));
  dev.destroy_event(e);
  dev.destroy_stream(s);
  dev.release(d, n);
}

TYPED_TEST_P(DeviceConformance, StreamWaitsForAnotherStreamsEvent) {
  auto& dev = this->dev();
  const std::size_t n = 32 * MiB;  // long enough that an ignored wait would read too early
  const auto src = pattern(n, 4);
  std::vector<unsigned char> out(n, 0);
  void* a = dev.reserve(n);
  void* b = dev.reserve(n);
  stream_ref producer = dev.create_stream();
  stream_ref consumer = dev.create_stream();
  event_ref produced = dev.create_event();
  dev.copy_async(a, src.data(), n, copy_kind::host_to_device, producer);
  dev.record(produced, producer);
  dev.wait(consumer, produced);
  dev.copy_async(b, a, n, copy_kind::device_to_device, consumer);
  dev.copy_async(out.data(), b, n, copy_kind::device_to_host, consumer);
  dev.synchronize(consumer);
  EXPECT_TRUE(dev.query(produced)) << "the consumer finished before the event it waited on";
  if (this->touches()) {
    EXPECT_EQ(out, src);
  }
  dev.destroy_event(produced);
  dev.destroy_stream(producer);
  dev.destroy_stream(consumer);
  dev.release(a, n);
  dev.release(b, n);
}

TYPED_TEST_P(DeviceConformance, NeverRecordedEventIsComplete) {
  auto& dev = this->dev();
  event_ref e = dev.create_event();
  EXPECT_TRUE(dev.query(e));
  dev.synchronize(e);  // returns at once
  stream_ref s = dev.create_stream();
  dev.wait(s, e);  // waits for nothing: later work still runs
  std::vector<unsigned char> in = pattern(4096, 5), out(4096, 0);
  void* d = dev.reserve(4096);
  dev.copy_async(d, in.data(), 4096, copy_kind::host_to_device, s);
  dev.copy_async(out.data(), d, 4096, copy_kind::device_to_host, s);
  dev.synchronize(s);
  if (this->touches()) {
    EXPECT_EQ(out, in);
  }
  dev.destroy_stream(s);
  dev.destroy_event(e);
  dev.release(d, 4096);
}

TYPED_TEST_P(DeviceConformance, StreamsAndEventsComeAndGo) {
  auto& dev = this->dev();
  std::vector<stream_ref> streams;
  std::vector<event_ref> events;
  for (int i = 0; i < 8; ++i) {
    streams.push_back(dev.create_stream());
    events.push_back(dev.create_event());
    EXPECT_NE(streams.back(), stream_ref{}) << "a created stream is not the default stream";
  }
  for (int i = 0; i < 8; ++i) {
    for (int j = i + 1; j < 8; ++j) {
      EXPECT_NE(streams[i], streams[j]);
      EXPECT_NE(events[i], events[j]);
    }
  }
  for (int i = 0; i < 8; ++i) dev.record(events[i], streams[i]);
  dev.synchronize_device();
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(dev.query(events[i]));
  for (int i = 0; i < 8; ++i) {
    dev.destroy_event(events[i]);
    dev.destroy_stream(streams[i]);
  }
}

// ---------------------------------------------------------------- virtual memory

TYPED_TEST_P(DeviceConformance, VirtualMemoryMapsWritesUnmapsAndRemaps) {
  if (!this->props().supports_vmm) GTEST_SKIP() << "this backend has no virtual memory";
  auto& dev = this->dev();
  const std::size_t g = this->props().map_granularity;
  ASSERT_GT(g, 0u);
  void* r = dev.reserve_address_range(4 * g);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(r) % g, 0u) << "ranges start on a granule";
  stream_ref s = dev.create_stream();
  const auto data = pattern(2 * g, 6);
  std::vector<unsigned char> out(2 * g, 0);

  // Two granules in one map, at a nonzero offset.
  void* p = offset(r, g);
  dev.map(p, 2 * g);
  EXPECT_EQ(dev.used_bytes(), this->baseline_ + 2 * g);
  dev.copy_async(p, data.data(), 2 * g, copy_kind::host_to_device, s);
  dev.copy_async(out.data(), p, 2 * g, copy_kind::device_to_host, s);
  dev.synchronize(s);
  if (this->touches()) {
    EXPECT_EQ(out, data);
  }
  dev.unmap(p, 2 * g);
  EXPECT_EQ(dev.used_bytes(), this->baseline_);

  // The same addresses again, one granule at a time, and the granule before them.
  dev.map(p, g);
  dev.map(offset(p, g), g);
  dev.map(r, g);
  EXPECT_EQ(dev.used_bytes(), this->baseline_ + 3 * g);
  std::fill(out.begin(), out.end(), 0);
  dev.copy_async(p, data.data(), 2 * g, copy_kind::host_to_device, s);
  dev.copy_async(out.data(), p, 2 * g, copy_kind::device_to_host, s);
  dev.copy_async(r, data.data(), g, copy_kind::host_to_device, s);
  dev.synchronize(s);
  if (this->touches()) {
    EXPECT_EQ(out, data);
  }
  dev.unmap(r, g);
  dev.unmap(p, g);
  dev.unmap(offset(p, g), g);
  EXPECT_EQ(dev.used_bytes(), this->baseline_);
  dev.destroy_stream(s);
  dev.release_address_range(r, 4 * g);
}

TYPED_TEST_P(DeviceConformance, InjectedFaultsFailMapThenClear) {
  if (!this->props().supports_vmm) GTEST_SKIP() << "this backend has no virtual memory";
  auto& dev = this->dev();
  const std::size_t g = this->props().map_granularity;
  void* r = dev.reserve_address_range(2 * g);
  dev.inject_out_of_memory(1);
  EXPECT_THROW(dev.map(r, g), out_of_memory);
  dev.inject_device_error(1);
  EXPECT_THROW(dev.map(r, g), device_error);
  EXPECT_EQ(dev.used_bytes(), this->baseline_);
  dev.map(r, g);  // nothing was left half-mapped
  EXPECT_EQ(dev.used_bytes(), this->baseline_ + g);
  dev.unmap(r, g);
  dev.release_address_range(r, 2 * g);
}

TYPED_TEST_P(DeviceConformance, VirtualMemoryCallsFailCleanlyWithoutSupport) {
  if (this->props().supports_vmm) GTEST_SKIP() << "this backend has virtual memory";
  auto& dev = this->dev();
  try {
    dev.reserve_address_range(2 * MiB);
    FAIL() << "reserve_address_range succeeded on a backend without virtual memory";
  } catch (const device_error& e) {
    EXPECT_TRUE(contains(e.what(), "does not support virtual memory"));
  }
  alignas(64) static unsigned char not_device_memory[64];
  EXPECT_THROW(dev.map(not_device_memory, 2 * MiB), device_error);
}

REGISTER_TYPED_TEST_SUITE_P(DeviceConformance, ReserveReleaseRoundTripIsAlignedAndDisjoint,
                            ReserveOfZeroBytesIsALogicError,
                            ReserveBeyondCapacityThrowsOutOfMemoryNamingTheBackend,
                            InjectedOutOfMemoryFailsTheNextReservesThenClears,
                            InjectedDeviceErrorFailsTheNextReserveThenClears,
                            UsedBytesCountsReservesAndMaps, ConcurrentReservesFromManyThreadsAreDisjoint,
                            DataRoundTripsHostToDeviceToDeviceToHost, CopyOfZeroBytesIsANoOp,
                            CopiesOnOneStreamCompleteInOrder, StreamWaitsForAnotherStreamsEvent,
                            NeverRecordedEventIsComplete, StreamsAndEventsComeAndGo,
                            VirtualMemoryMapsWritesUnmapsAndRemaps, InjectedFaultsFailMapThenClear,
                            VirtualMemoryCallsFailCleanlyWithoutSupport);

}  // namespace terrace::conformance
