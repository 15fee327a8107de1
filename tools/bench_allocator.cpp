// SPDX-License-Identifier: Apache-2.0
// bench_allocator: what a cached alloc+free pair costs in terrace's caching allocator, against the
// backend's raw reserve/release for the same sizes, measured side by side in one run.
//
// Every benchmark runs on one thread and on two (->Threads(2)), each thread on a stream of its own,
// sharing one allocator (so the two-thread figure includes the contention on its mutex). Counters:
//   ns_per_pair  wall nanoseconds per pair as one thread sees it (averaged over threads);
//   raw_ns       the backend's reserve+release for the same sizes, measured in this run;
//   vs_raw       ns_per_pair / raw_ns (terrace benchmarks only): below 1 means caching wins.
// With a GPU (and a CUDA build) the same mixes also run over the "cuda" backend and against
// cudaMalloc/cudaFree and cudaMallocAsync/cudaFreeAsync (bench_allocator_cuda.cpp).
//
// c_abi_free_malloc_with_live/N: one free + malloc of a 2 MiB block through the C ABI (what
// PyTorch's hooks call) while N such blocks are live, on the null device; vs_cpp divides it by
// the same pair through caching_allocator with N live. The C ABI's table of live pointers must
// not slow down as N grows.
//
// Run with --benchmark_repetitions=N --benchmark_report_aggregates_only=true and read the medians.
#include <benchmark/benchmark.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "terrace/caching_allocator.hpp"
#include "terrace/device.hpp"
#include "terrace/terrace.h"
#include "tools/bench_allocator_mixes.hpp"

#ifdef TERRACE_WITH_CUDA
namespace terrace::bench {
void register_cuda_runtime_benchmarks();  // bench_allocator_cuda.cpp
}
#endif

namespace {

using terrace::bench::size_mix;
using clock_type = std::chrono::steady_clock;

// One run's shared state, made by setup<> before the threads start and destroyed by teardown
// after they have all finished.
struct environment {
  std::unique_ptr<terrace::device_backend> device;
  std::unique_ptr<terrace::caching_allocator> allocator;
  double raw_ns = 0.0;  // written by thread 0 before the loop's start barrier, read after its end
};
std::unique_ptr<environment> g_env;

constexpr const char* kBackendNames[] = {"sim", "cuda"};

template <int Backend>
void setup(const benchmark::State&) {
  auto env = std::make_unique<environment>();
  env->device = terrace::make_device(kBackendNames[Backend]);
  env->allocator = std::make_unique<terrace::caching_allocator>(*env->device);
  g_env = std::move(env);
}

void teardown(const benchmark::State&) { g_env.reset(); }

double elapsed_ns(clock_type::time_point since) {
  return std::chrono::duration<double, std::nano>(clock_type::now() - since).count();
}

// The backend's own reserve+release for the same sizes, for at most ~50 ms: the yardstick for the
// vs_raw counter, measured in the same process and minutes apart at most from what it is compared to.
double measure_raw_ns(terrace::device_backend& device, const std::vector<std::size_t>& sizes) {
  constexpr std::size_t mask = terrace::bench::kMixLength - 1;
  const auto start = clock_type::now();
  std::size_t pairs = 0;
  while (pairs < 20000 && (pairs < 64 || elapsed_ns(start) < 50e6)) {
    const std::size_t bytes = sizes[pairs & mask];
    void* p = device.reserve(bytes);
    benchmark::DoNotOptimize(p);
    device.release(p, bytes);
    ++pairs;
  }
  return elapsed_ns(start) / static_cast<double>(pairs);
}

// ---------------------------------------------------------------- terrace: cached alloc + free

void bm_terrace_pair(benchmark::State& state, size_mix mix) {
  environment& env = *g_env;
  const std::vector<std::size_t> sizes = terrace::bench::mix_sizes(mix);
  constexpr std::size_t mask = terrace::bench::kMixLength - 1;
  if (state.thread_index() == 0) env.raw_ns = measure_raw_ns(*env.device, sizes);

  terrace::caching_allocator& alloc = *env.allocator;
  const terrace::stream_ref stream = env.device->create_stream();
  // Warm the cache: afterwards every size of the mix is a hit.
  for (std::size_t bytes : sizes) alloc.deallocate(alloc.allocate(bytes, stream), stream);

  std::size_t i = static_cast<std::size_t>(state.thread_index()) * 977;  // threads out of phase
  const auto start = clock_type::now();
  for (auto _ : state) {
    void* p = alloc.allocate(sizes[i & mask], stream);
    benchmark::DoNotOptimize(p);
    alloc.deallocate(p, stream);
    ++i;
  }
  const double ns = elapsed_ns(start) / static_cast<double>(state.iterations());
  env.device->synchronize(stream);
  env.device->destroy_stream(stream);

  state.SetItemsProcessed(state.iterations());
  state.counters["ns_per_pair"] = benchmark::Counter(ns, benchmark::Counter::kAvgThreads);
  state.counters["raw_ns"] = benchmark::Counter(env.raw_ns, benchmark::Counter::kAvgThreads);
  state.counters["vs_raw"] = benchmark::Counter(ns / env.raw_ns, benchmark::Counter::kAvgThreads);
}

// ------------------------------------------------------------- the backend: reserve + release

void bm_raw_pair(benchmark::State& state, size_mix mix) {
  environment& env = *g_env;
  const std::vector<std::size_t> sizes = terrace::bench::mix_sizes(mix);
  constexpr std::size_t mask = terrace::bench::kMixLength - 1;
  terrace::device_backend& device = *env.device;

  std::size_t i = static_cast<std::size_t>(state.thread_index()) * 977;
  const auto start = clock_type::now();
  for (auto _ : state) {
    const std::size_t bytes = sizes[i & mask];
    void* p = device.reserve(bytes);
    benchmark::DoNotOptimize(p);
    device.release(p, bytes);
    ++i;
  }
  const double ns = elapsed_ns(start) / static_cast<double>(state.iterations());
  state.SetItemsProcessed(state.iterations());
  state.counters["ns_per_pair"] = benchmark::Counter(ns, benchmark::Counter::kAvgThreads);
}

// ------------------------------------------- the C ABI's free + malloc with many blocks live

constexpr std::size_t kLiveBlock = 2u << 20;

void bm_c_abi_with_live(benchmark::State& state) {
  const auto live = static_cast<std::size_t>(state.range(0));
  // The C++ allocator over its own null device, as the yardstick, measured first.
  double cpp_ns = 0.0;
  {
    auto device = terrace::make_device("null");
    terrace::caching_allocator alloc(*device);
    std::vector<void*> blocks(live);
    for (void*& p : blocks) p = alloc.allocate(kLiveBlock);
    const std::size_t pairs = 4 * live;
    const auto start = clock_type::now();
    for (std::size_t i = 0; i < pairs; ++i) {
      void*& p = blocks[i % live];
      alloc.deallocate(p);
      p = alloc.allocate(kLiveBlock);
      benchmark::DoNotOptimize(p);
    }
    cpp_ns = elapsed_ns(start) / static_cast<double>(pairs);
    for (void* p : blocks) alloc.deallocate(p);
  }
  std::vector<void*> blocks(live);
  for (void*& p : blocks) p = terrace_malloc(kLiveBlock, 0, nullptr);
  std::size_t i = 0;
  const auto start = clock_type::now();
  for (auto _ : state) {
    void*& p = blocks[i++ % live];
    terrace_free(p, kLiveBlock, 0, nullptr);
    p = terrace_malloc(kLiveBlock, 0, nullptr);
    benchmark::DoNotOptimize(p);
  }
  const double ns = elapsed_ns(start) / static_cast<double>(state.iterations());
  for (void* p : blocks) terrace_free(p, kLiveBlock, 0, nullptr);
  terrace_empty_cache();
  state.SetItemsProcessed(state.iterations());
  state.counters["ns_per_pair"] = ns;
  state.counters["cpp_ns"] = cpp_ns;
  state.counters["vs_cpp"] = ns / cpp_ns;
}

void register_c_abi_benchmarks() {
  // The C ABI's device 0 on the null backend, which has room for 64 Ki blocks of 2 MiB.
  if (terrace_configure("device:null,device_capacity:1TiB") != 0) return;
  benchmark::RegisterBenchmark("c_abi_free_malloc_with_live", &bm_c_abi_with_live)
      ->Arg(1000)
      ->Arg(16000)
      ->Arg(64000)
      ->UseRealTime();
}

template <int Backend>
void register_backend_benchmarks() {
  const std::string backend = kBackendNames[Backend];
  for (int m = 0; m < static_cast<int>(size_mix::count); ++m) {
    const auto mix = static_cast<size_mix>(m);
    const std::string suffix = backend + "/" + terrace::bench::mix_name(mix);
    for (auto [name, fn] : {std::pair{"raw_reserve_release/", &bm_raw_pair},
                            std::pair{"terrace_alloc_free/", &bm_terrace_pair}}) {
      benchmark::RegisterBenchmark((name + suffix).c_str(), fn, mix)
          ->Setup(&setup<Backend>)
          ->Teardown(&teardown)
          ->Threads(1)
          ->Threads(2)
          ->UseRealTime();
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_backend_benchmarks<0>();
  register_c_abi_benchmarks();
  if (terrace::cuda_device_available()) {
    register_backend_benchmarks<1>();
#ifdef TERRACE_WITH_CUDA
    terrace::bench::register_cuda_runtime_benchmarks();
#endif
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
