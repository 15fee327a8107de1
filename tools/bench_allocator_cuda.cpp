// SPDX-License-Identifier: Apache-2.0
// bench_allocator's GPU baselines: cudaMalloc/cudaFree and cudaMallocAsync/cudaFreeAsync pairs for
// the same size mixes. Compiled only in CUDA builds and registered only when a GPU is present, so
// this is the one file of the benchmark that sees cuda_runtime_api.h.
#include <cuda_runtime_api.h>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>

#include "tools/bench_allocator_mixes.hpp"

namespace terrace::bench {

namespace {

using clock_type = std::chrono::steady_clock;

double elapsed_ns(clock_type::time_point since) {
  return std::chrono::duration<double, std::nano>(clock_type::now() - since).count();
}

bool check(benchmark::State& state, cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  state.SkipWithError((std::string(what) + ": " + cudaGetErrorString(err)).c_str());
  return false;
}

// The driver's own allocator, which synchronizes the device on every free: the cost terrace avoids.
void bm_cuda_malloc_pair(benchmark::State& state, size_mix mix) {
  const auto sizes = mix_sizes(mix);
  constexpr std::size_t mask = kMixLength - 1;
  std::size_t i = static_cast<std::size_t>(state.thread_index()) * 977;
  const auto start = clock_type::now();
  for (auto _ : state) {
    void* p = nullptr;
    if (!check(state, cudaMalloc(&p, sizes[i & mask]), "cudaMalloc")) break;
    benchmark::DoNotOptimize(p);
    if (!check(state, cudaFree(p), "cudaFree")) break;
    ++i;
  }
  const double ns = elapsed_ns(start) / static_cast<double>(std::max<std::int64_t>(state.iterations(), 1));
  state.SetItemsProcessed(state.iterations());
  state.counters["ns_per_pair"] = benchmark::Counter(ns, benchmark::Counter::kAvgThreads);
}

// The stream-ordered pool allocator, each thread on its own stream; the default pool keeps its
// memory (release threshold set to the maximum at registration), so pairs are pool hits as in terrace.
void bm_cuda_malloc_async_pair(benchmark::State& state, size_mix mix) {
  const auto sizes = mix_sizes(mix);
  constexpr std::size_t mask = kMixLength - 1;
  cudaStream_t stream = nullptr;
  if (!check(state, cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate")) {
    for (auto _ : state) {
    }
    return;
  }
  for (std::size_t bytes : sizes) {  // warm the pool
    void* p = nullptr;
    if (cudaMallocAsync(&p, bytes, stream) == cudaSuccess) cudaFreeAsync(p, stream);
  }
  cudaStreamSynchronize(stream);

  std::size_t i = static_cast<std::size_t>(state.thread_index()) * 977;
  const auto start = clock_type::now();
  for (auto _ : state) {
    void* p = nullptr;
    if (!check(state, cudaMallocAsync(&p, sizes[i & mask], stream), "cudaMallocAsync")) break;
    benchmark::DoNotOptimize(p);
    if (!check(state, cudaFreeAsync(p, stream), "cudaFreeAsync")) break;
    ++i;
  }
  const double ns = elapsed_ns(start) / static_cast<double>(std::max<std::int64_t>(state.iterations(), 1));
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  state.SetItemsProcessed(state.iterations());
  state.counters["ns_per_pair"] = benchmark::Counter(ns, benchmark::Counter::kAvgThreads);
}

}  // namespace

void register_cuda_runtime_benchmarks() {
  int device = 0;
  cudaMemPool_t pool = nullptr;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
    std::uint64_t keep_all = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all);
  }
  for (int m = 0; m < static_cast<int>(size_mix::count); ++m) {
    const auto mix = static_cast<size_mix>(m);
    const std::string suffix = std::string("cuda/") + mix_name(mix);
    benchmark::RegisterBenchmark(("cudaMalloc_cudaFree/" + suffix).c_str(), &bm_cuda_malloc_pair, mix)
        ->Threads(1)
        ->Threads(2)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("cudaMallocAsync_cudaFreeAsync/" + suffix).c_str(),
                                 &bm_cuda_malloc_async_pair, mix)
        ->Threads(1)
        ->Threads(2)
        ->UseRealTime();
  }
}

}  // namespace terrace::bench
