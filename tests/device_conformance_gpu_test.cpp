// SPDX-License-Identifier: Apache-2.0
// The device conformance suite over the "cuda" and "cuda-vmm" backends, plus what only a real GPU
// can show: memory handed out is writable from a kernel, events follow kernels, stream-ordered
// reuse through the caching allocator does not race, and the CUDA error paths say what failed.
//
// Every case skips (GTEST_SKIP in SetUp) when cuda_device_available() is false, so this program
// compiles, runs and reports skips on a machine without a GPU. CUDA failures in the tests
// themselves throw with the call and cudaGetErrorString, which GoogleTest prints.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/fill.hpp"
#include "terrace/caching_allocator.hpp"
#include "terrace/device.hpp"
#include "terrace/error.hpp"
#include "tests/device_conformance.hpp"
#include "tiers/cuda_common.hpp"

namespace {

struct cuda_maker {
  static std::unique_ptr<terrace::device_backend> make() { return terrace::make_device("cuda"); }
  static bool available() { return terrace::cuda_device_available(); }
};

struct cuda_vmm_maker {
  static std::unique_ptr<terrace::device_backend> make() {
    return terrace::make_device("cuda-vmm");
  }
  static bool available() { return terrace::cuda_device_available(); }
};

}  // namespace

namespace terrace::conformance {
INSTANTIATE_TYPED_TEST_SUITE_P(Cuda, DeviceConformance, ::testing::Types<cuda_maker>);
INSTANTIATE_TYPED_TEST_SUITE_P(CudaVmm, DeviceConformance, ::testing::Types<cuda_vmm_maker>);
}  // namespace terrace::conformance

namespace terrace {
namespace {

using conformance::contains;
using conformance::MiB;

constexpr std::uint64_t gate_timeout_ns = 30'000'000'000ull;  // a failed test must not hang the GPU

void cuda_ok(cudaError_t error, const std::string& call) {
  if (error != cudaSuccess) {
    throw std::runtime_error(call + " failed: " + cudaGetErrorName(error) + " (" +
                             cudaGetErrorString(error) + ")");
  }
}

cudaStream_t native(stream_ref s) { return static_cast<cudaStream_t>(s.native); }

void* at(void* p, std::size_t bytes) { return static_cast<char*>(p) + bytes; }

bool overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

// Holds every kernel queued after it on a stream until open(): work behind it is pending for
// certain, however fast the GPU, rather than by a race against the clock.
class host_gate {
 public:
  host_gate() {
    void* p = nullptr;
    cuda_ok(cudaHostAlloc(&p, sizeof *flag_, cudaHostAllocMapped), "cudaHostAlloc(gate flag)");
    flag_ = static_cast<volatile std::uint32_t*>(p);
    *flag_ = 0;
  }
  ~host_gate() {
    open();
    (void)cudaDeviceSynchronize();
    (void)cudaFreeHost(const_cast<std::uint32_t*>(flag_));
  }
  host_gate(const host_gate&) = delete;
  host_gate& operator=(const host_gate&) = delete;

  void hold(stream_ref s) {
    cuda_ok(kernels::wait_for_host_flag(flag_, gate_timeout_ns, native(s)), "wait_for_host_flag");
  }
  void open() { *flag_ = 1; }

 private:
  volatile std::uint32_t* flag_ = nullptr;
};

// ------------------------------------------------------------------------ the GPU fixture

template <class Maker>
class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Maker::available()) GTEST_SKIP() << "no CUDA device on this machine";
    dev_ = Maker::make();
    baseline_ = dev_->used_bytes();
    counter_ = dev_->reserve(sizeof(unsigned long long));
    stream_ = dev_->create_stream();
  }

  void TearDown() override {
    if (!dev_) return;
    dev_->synchronize_device();
    dev_->destroy_stream(stream_);
    dev_->release(counter_, sizeof(unsigned long long));
    EXPECT_EQ(dev_->used_bytes(), baseline_) << "the test leaked device memory";
  }

  device_backend& dev() { return *dev_; }

  void fill(void* p, std::size_t bytes, std::uint32_t seed, stream_ref s) {
    cuda_ok(kernels::fill_pattern(p, bytes, seed, native(s)), "fill_pattern");
  }

  // Queues a check of [p, p+bytes) against `seed` on `s`, waits for it, returns the mismatches.
  unsigned long long mismatches(const void* p, std::size_t bytes, std::uint32_t seed,
                                stream_ref s) {
    auto* counter = static_cast<unsigned long long*>(counter_);
    unsigned long long host = ~0ull;
    cuda_ok(cudaMemsetAsync(counter, 0, sizeof *counter, native(s)), "cudaMemsetAsync(counter)");
    cuda_ok(kernels::count_pattern_mismatches(p, bytes, seed, counter, native(s)),
            "count_pattern_mismatches");
    dev().copy_async(&host, counter, sizeof host, copy_kind::device_to_host, s);
    dev().synchronize(s);
    return host;
  }

  std::unique_ptr<device_backend> dev_;
  std::size_t baseline_ = 0;
  void* counter_ = nullptr;
  stream_ref stream_;
};

using cuda_makers = ::testing::Types<cuda_maker, cuda_vmm_maker>;
TYPED_TEST_SUITE(CudaBackendTest, cuda_makers);

TYPED_TEST(CudaBackendTest, PropertiesDescribeTheDevice) {
  const device_properties& p = this->dev().properties();
  int device = -1;
  cuda_ok(cudaGetDevice(&device), "cudaGetDevice");
  std::size_t free = 0;
  std::size_t total = 0;
  cuda_ok(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  EXPECT_EQ(p.capacity, total);
  EXPECT_EQ(p.device_index, 0);
  EXPECT_TRUE(p.touches_memory);
  EXPECT_EQ(p.alignment, 512u);
  if (p.name == "cuda-vmm") {
    EXPECT_TRUE(p.supports_vmm);
    EXPECT_GT(p.map_granularity, 0u);
    EXPECT_EQ(p.map_granularity % (2 * MiB), 0u) << p.map_granularity;
  } else {
    EXPECT_EQ(p.name, "cuda");
    EXPECT_FALSE(p.supports_vmm);
  }
}

TYPED_TEST(CudaBackendTest, ReservedMemoryIsWritableFromAKernel) {
  auto& dev = this->dev();
  const std::size_t n = 3 * MiB + 123;  // odd: the kernels' tails are covered too
  void* p = dev.reserve(n);
  this->fill(p, n, 7, this->stream_);
  EXPECT_EQ(this->mismatches(p, n, 7, this->stream_), 0u);
  // The checker is not blind: another seed differs almost everywhere.
  EXPECT_GT(this->mismatches(p, n, 8, this->stream_), n / 2);
  // The device's bytes are the ones the host-side formula predicts, at every offset.
  std::vector<std::uint8_t> host(n);
  dev.copy_async(host.data(), p, n, copy_kind::device_to_host, this->stream_);
  dev.synchronize(this->stream_);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += host[i] != kernels::pattern_byte(7, i);
  EXPECT_EQ(wrong, 0u);
  dev.release(p, n);
}

TYPED_TEST(CudaBackendTest, KernelsWorkOnTheLegacyDefaultStream) {
  auto& dev = this->dev();
  const std::size_t n = 1 * MiB;
  void* p = dev.reserve(n);
  this->fill(p, n, 11, stream_ref{});
  EXPECT_EQ(this->mismatches(p, n, 11, stream_ref{}), 0u);
  dev.release(p, n);
}

TYPED_TEST(CudaBackendTest, EventAfterAKernelIsPendingThenComplete) {
  auto& dev = this->dev();
  const std::size_t n = 8 * MiB;
  void* p = dev.reserve(n);
  event_ref done = dev.create_event();
  {
    host_gate gate;
    gate.hold(this->stream_);
    this->fill(p, n, 21, this->stream_);
    dev.record(done, this->stream_);
    // The fill cannot have run: the gate still holds the stream.
    EXPECT_FALSE(dev.query(done));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(dev.query(done)) << "the event completed while the kernel before it was held";
    gate.open();
    dev.synchronize(done);
    EXPECT_TRUE(dev.query(done));
  }
  EXPECT_EQ(this->mismatches(p, n, 21, this->stream_), 0u);
  dev.destroy_event(done);
  dev.release(p, n);
}

TYPED_TEST(CudaBackendTest, WaitOrdersAKernelOnOneStreamAfterAKernelOnAnother) {
  auto& dev = this->dev();
  const std::size_t n = 16 * MiB;
  void* p = dev.reserve(n);
  stream_ref producer = dev.create_stream();
  event_ref produced = dev.create_event();
  {
    host_gate gate;
    gate.hold(producer);
    this->fill(p, n, 31, producer);
    dev.record(produced, producer);
    dev.wait(this->stream_, produced);
    // Queued behind the held producer: if wait() were ignored this check would read the memory
    // before the fill and count mismatches. It runs only once the gate opens.
    auto* counter = static_cast<unsigned long long*>(this->counter_);
    cuda_ok(cudaMemsetAsync(counter, 0, sizeof *counter, native(this->stream_)), "cudaMemsetAsync");
    cuda_ok(kernels::count_pattern_mismatches(p, n, 31, counter, native(this->stream_)),
            "count_pattern_mismatches");
    event_ref checked = dev.create_event();
    dev.record(checked, this->stream_);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(dev.query(checked)) << "the waiting stream ran ahead of the event";
    gate.open();
    unsigned long long host = ~0ull;
    dev.copy_async(&host, counter, sizeof host, copy_kind::device_to_host, this->stream_);
    dev.synchronize(this->stream_);
    EXPECT_EQ(host, 0u);
    dev.destroy_event(checked);
  }
  dev.destroy_event(produced);
  dev.destroy_stream(producer);
  dev.release(p, n);
}

TYPED_TEST(CudaBackendTest, MappedMemoryIsWritableFromAKernelAndSurvivesPartialUnmap) {
  auto& dev = this->dev();
  if (!dev.properties().supports_vmm) GTEST_SKIP() << "this backend has no virtual memory";
  const std::size_t g = dev.properties().map_granularity;
  void* r = dev.reserve_address_range(4 * g);
  // Three granules in one map, then give back the first only: the others keep their contents,
  // which is what empty_cache() does to a partly free expandable segment.
  void* p = at(r, g);
  dev.map(p, 3 * g);
  this->fill(p, 3 * g, 41, this->stream_);
  EXPECT_EQ(this->mismatches(p, 3 * g, 41, this->stream_), 0u);
  dev.unmap(p, g);
  EXPECT_EQ(dev.used_bytes(), this->baseline_ + sizeof(unsigned long long) + 2 * g);
  // The pattern's offsets start at the range's start: check the tail as a whole against a copy.
  std::vector<std::uint8_t> host(2 * g);
  dev.copy_async(host.data(), at(p, g), 2 * g, copy_kind::device_to_host, this->stream_);
  dev.synchronize(this->stream_);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < 2 * g; ++i) wrong += host[i] != kernels::pattern_byte(41, g + i);
  EXPECT_EQ(wrong, 0u);
  // Map the hole and the granule before it again; a kernel writes across all four granules.
  dev.map(r, 2 * g);
  this->fill(r, 4 * g, 42, this->stream_);
  EXPECT_EQ(this->mismatches(r, 4 * g, 42, this->stream_), 0u);
  dev.synchronize(this->stream_);
  dev.unmap(r, 2 * g);             // both granules of the second map
  dev.unmap(at(r, 2 * g), 2 * g);  // the last two of the first
  dev.release_address_range(r, 4 * g);
}

// -------------------------------------------------------- the caching allocator on a real GPU

TYPED_TEST(CudaBackendTest, SameStreamReuseIsImmediateAndOrdered) {
  allocator_config config;
  config.expandable_segments = this->dev().properties().supports_vmm;
  const std::size_t n = 4 * MiB;
  void* q = nullptr;
  {
    caching_allocator alloc(this->dev(), config);
    host_gate gate;
    gate.hold(this->stream_);
    void* p = alloc.allocate(n, this->stream_);
    this->fill(p, n, 51, this->stream_);
    alloc.deallocate(p, this->stream_);
    // The fill is still queued; reuse on the same stream is safe because stream order puts the
    // next user's work after it.
    q = alloc.allocate(n, this->stream_);
    EXPECT_EQ(q, p) << "a block freed on its own stream was not reused at once";
    this->fill(q, n, 52, this->stream_);
    gate.open();
    EXPECT_EQ(this->mismatches(q, n, 52, this->stream_), 0u);
    alloc.deallocate(q, this->stream_);
    alloc.check_invariants();
  }
}

TYPED_TEST(CudaBackendTest, CrossStreamUseDelaysReuseUntilTheOtherStreamIsDone) {
  auto& dev = this->dev();
  allocator_config config;
  config.expandable_segments = dev.properties().supports_vmm;
  const std::size_t n = 4 * MiB;
  stream_ref other = dev.create_stream();
  {
    caching_allocator alloc(dev, config);
    void* p = alloc.allocate(n, this->stream_);
    void* q = nullptr;
    {
      host_gate gate;
      gate.hold(other);
      this->fill(p, n, 61, other);  // held: still writing p when p is freed
      alloc.record_stream(p, other);
      alloc.deallocate(p, this->stream_);
      q = alloc.allocate(n, this->stream_);
      EXPECT_FALSE(overlap(p, n, q, n))
          << "a block still in use on another stream was handed out again";
      this->fill(q, n, 62, this->stream_);
      dev.synchronize(this->stream_);
      gate.open();
      dev.synchronize(other);
    }
    // The late writer on `other` did not touch q.
    EXPECT_EQ(this->mismatches(q, n, 62, this->stream_), 0u);
    // Now that `other` is done, p is free for the owning stream again.
    void* r = alloc.allocate(n, this->stream_);
    EXPECT_EQ(r, p) << "the block was not reused after the other stream's work completed";
    this->fill(r, n, 63, this->stream_);
    EXPECT_EQ(this->mismatches(r, n, 63, this->stream_), 0u);
    alloc.deallocate(r, this->stream_);
    alloc.deallocate(q, this->stream_);
    alloc.check_invariants();
  }
  dev.destroy_stream(other);
}

// ------------------------------------------------------------------------ CUDA error paths

class CudaErrorPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device on this machine";
  }
};

TEST_F(CudaErrorPathTest, AutoPicksCudaWhenAGpuIsPresent) {
  EXPECT_EQ(make_device("auto")->properties().name, "cuda");
}

TEST_F(CudaErrorPathTest, ABadDeviceIndexNamesCudaSetDeviceAndItsError) {
  for (const char* name : {"cuda", "cuda-vmm"}) {
    device_options options;
    options.device_index = 999;
    try {
      auto dev = make_device(name, options);
      FAIL() << name << " accepted device index 999";
    } catch (const device_error& e) {
      EXPECT_TRUE(contains(e.what(), "cudaSetDevice(999)")) << name;
      EXPECT_TRUE(contains(e.what(), cudaGetErrorString(cudaErrorInvalidDevice))) << name;
    }
  }
}

TEST_F(CudaErrorPathTest, AMissingDriverEntryPointIsADeviceErrorNamingTheSymbol) {
  try {
    (void)detail::cuda_driver_entry_point("cuTerraceNoSuchFunction", 12000);
    FAIL() << "a made-up driver symbol resolved";
  } catch (const device_error& e) {
    EXPECT_TRUE(contains(e.what(), "cuTerraceNoSuchFunction"));
  }
  // A real one resolves, so the failure above is about the name.
  EXPECT_NE(detail::cuda_driver_entry_point("cuMemCreate", 10020), nullptr);
}

TEST_F(CudaErrorPathTest, AMapGranularityThatIsNotWholeDriverPagesIsALogicError) {
  device_options options;
  options.map_granularity = 3 * MiB;
  try {
    auto dev = make_device("cuda-vmm", options);
    FAIL() << "cuda-vmm accepted a 3 MiB map granularity";
  } catch (const logic_error& e) {
    EXPECT_TRUE(contains(e.what(), "multiple of the driver's minimum"));
  }
  options.map_granularity = 64 * MiB;
  auto dev = make_device("cuda-vmm", options);
  EXPECT_EQ(dev->properties().map_granularity, 64 * MiB);
}

// cuMemAddressReserve takes only a power-of-two alignment; a page of three driver pages is still
// accepted, and its ranges still start on page boundaries (the allocator and the book count pages
// from there), map, hold data and go back.
TEST_F(CudaErrorPathTest, APageThatIsNotAPowerOfTwoGivesPageAlignedRanges) {
  const std::size_t minimum = make_device("cuda-vmm")->properties().map_granularity;
  device_options options;
  options.map_granularity = 3 * minimum;
  auto dev = make_device("cuda-vmm", options);
  const std::size_t g = dev->properties().map_granularity;
  ASSERT_EQ(g, 3 * minimum);
  std::vector<void*> ranges;
  for (int i = 0; i < 4; ++i) {
    void* r = dev->reserve_address_range(2 * g);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(r) % g, 0u) << r;
    ranges.push_back(r);
  }
  dev->map(ranges[1], 2 * g);
  cuda_ok(cudaMemset(ranges[1], 0x5a, 2 * g), "cudaMemset");
  unsigned char last = 0;
  cuda_ok(cudaMemcpy(&last, static_cast<unsigned char*>(ranges[1]) + 2 * g - 1, 1, cudaMemcpyDeviceToHost),
          "cudaMemcpy");
  EXPECT_EQ(last, 0x5a);
  dev->unmap(ranges[1], 2 * g);
  for (void* r : ranges) dev->release_address_range(r, 2 * g);
  EXPECT_EQ(dev->used_bytes(), 0u);
}

TEST_F(CudaErrorPathTest, MappingMoreThanTheDeviceHoldsIsOutOfMemoryAndUndone) {
  // Large pages, so that running the device out of memory takes few driver calls.
  device_options options;
  options.map_granularity = 1024 * MiB;
  auto dev = make_device("cuda-vmm", options);
  const std::size_t g = dev->properties().map_granularity;
  const std::size_t bytes = (dev->properties().capacity / g + 2) * g;
  void* r = dev->reserve_address_range(bytes);
  try {
    dev->map(r, bytes);
    dev->unmap(r, bytes);
    ADD_FAILURE() << "mapping " << bytes << " bytes on a device of " << dev->properties().capacity
                  << " succeeded";
  } catch (const out_of_memory& e) {
    EXPECT_TRUE(contains(e.what(), "cuda-vmm"));
    EXPECT_TRUE(contains(e.what(), "given back"));
    EXPECT_TRUE(contains(e.what(), "free of"));
  }
  EXPECT_EQ(dev->used_bytes(), 0u);
  dev->map(r, g);  // every page of the failed map was given back
  dev->unmap(r, g);
  dev->release_address_range(r, bytes);
}

TEST_F(CudaErrorPathTest, MapOutsideARangeOrTwiceIsALogicError) {
  auto dev = make_device("cuda-vmm");
  const std::size_t g = dev->properties().map_granularity;
  void* r = dev->reserve_address_range(2 * g);
  EXPECT_THROW(dev->map(at(r, 2 * g), g), logic_error);  // just past the end
  EXPECT_THROW(dev->map(at(r, 512), g), logic_error);    // not on a granule
  dev->map(r, g);
  EXPECT_THROW(dev->map(r, 2 * g), logic_error);  // overlaps the mapped granule
  EXPECT_EQ(dev->used_bytes(), g);
  dev->unmap(r, g);
  dev->release_address_range(r, 2 * g);
  EXPECT_THROW(dev->reserve_address_range(g + 1), logic_error);
}

// Misuse of the noexcept calls cannot throw; it aborts with a message instead of freeing the wrong
// memory. Death tests re-run this program, so the child has a CUDA context of its own.
class CudaContractDeathTest : public CudaErrorPathTest {
 protected:
  void SetUp() override {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    CudaErrorPathTest::SetUp();
  }
};

TEST_F(CudaContractDeathTest, UnmappingAPageThatIsNotMappedAborts) {
  EXPECT_DEATH(
      {
        auto dev = make_device("cuda-vmm");
        const std::size_t g = dev->properties().map_granularity;
        void* r = dev->reserve_address_range(2 * g);
        dev->map(r, g);
        dev->unmap(r, 2 * g);
      },
      "cuda-vmm.*not mapped");
}

TEST_F(CudaContractDeathTest, ReleasingWithTheWrongSizeAborts) {
  EXPECT_DEATH(
      {
        auto dev = make_device("cuda");
        void* p = dev->reserve(4096);
        dev->release(p, 8192);
      },
      "'cuda'.*reserved with 4096 bytes");
}

// Found in review: restore_cuda_caller called cudaSetDevice before putting a caller's own context
// back, and cudaSetDevice binds and initialises the device's primary context, hundreds of MiB
// on a GPU the caller reaches only through a context of its own. Run in a fresh process (the
// death test's re-run of this program), so that the primary context is known to be inactive.
class CudaFreshProcessTest : public CudaErrorPathTest {
 protected:
  void SetUp() override {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    CudaErrorPathTest::SetUp();
  }
};

[[noreturn]] void exit_because(int code, const char* why) {
  std::fprintf(stderr, "%s\n", why);
  std::exit(code);
}

TEST_F(CudaFreshProcessTest, PuttingBackACallersOwnContextLeavesThePrimaryContextAlone) {
  EXPECT_EXIT(
      {
        const auto device_get = reinterpret_cast<PFN_cuDeviceGet_v2000>(
            detail::cuda_driver_entry_point("cuDeviceGet", 2000));
        const auto primary_state = reinterpret_cast<PFN_cuDevicePrimaryCtxGetState_v7000>(
            detail::cuda_driver_entry_point("cuDevicePrimaryCtxGetState", 7000));
        const auto ctx_create = reinterpret_cast<PFN_cuCtxCreate_v3020>(
            detail::cuda_driver_entry_point("cuCtxCreate", 3020));
        const auto ctx_get = reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(
            detail::cuda_driver_entry_point("cuCtxGetCurrent", 4000));
        const auto ctx_set = reinterpret_cast<PFN_cuCtxSetCurrent_v4000>(
            detail::cuda_driver_entry_point("cuCtxSetCurrent", 4000));
        CUdevice device = 0;
        if (device_get(&device, 0) != CUDA_SUCCESS) exit_because(2, "cuDeviceGet failed");
        unsigned flags = 0;
        int active = -1;
        if (primary_state(device, &flags, &active) != CUDA_SUCCESS || active != 0) {
          exit_because(2, "the primary context was active before the test");
        }
        CUcontext own = nullptr;
        if (ctx_create(&own, 0, device) != CUDA_SUCCESS) exit_because(2, "cuCtxCreate failed");
        (void)ctx_set(nullptr);  // as if terrace had switched this thread elsewhere
        detail::restore_cuda_caller(detail::cuda_caller{0, own});
        CUcontext now = nullptr;
        if (ctx_get(&now) != CUDA_SUCCESS || now != own) exit_because(1, "the caller's context is not current");
        if (primary_state(device, &flags, &active) != CUDA_SUCCESS || active != 0) {
          exit_because(1, "restoring the caller made the device's primary context");
        }
        int runtime_device = -1;
        if (cudaGetDevice(&runtime_device) != cudaSuccess || runtime_device != 0) {
          exit_because(1, "the runtime does not see the caller's device");
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace terrace
