// SPDX-License-Identifier: Apache-2.0
// bench_tiers: how much of the copy time the tier manager hides behind compute.
//
// A model of `layers` weight tensors is streamed through a device budget that holds `budget`
// of them, on the simulated device whose copy engine moves `bandwidth` bytes/s. Each layer's
// "kernel" is a host function that holds the compute stream for `compute_ms`. One step acquires
// every layer in order, queues its kernel, releases it, and waits for the stream at the end.
// It prints, medians over the steps after the first:
//   - the step with every tensor resident (no copies), measured in the same run: the compute as
//     this machine really runs it;
//   - the step time against the measured limit max(resident step, copy time): perfect overlap;
//   - the fraction of the copy time hidden behind compute: 1 - (step - resident step) / copies;
//   - the same with no schedule (LRU, every copy on demand), for the peer.
//
//   bench_tiers [--layers 16] [--budget 4] [--window 0] [--mib 8] [--bandwidth-gbs 2] [--compute-ms 5] [--steps 7]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <thread>
#include <vector>

#include "terrace/caching_allocator.hpp"
#include "terrace/device.hpp"
#include "terrace/pinned_pool.hpp"
#include "terrace/sim_device.hpp"
#include "terrace/tier_manager.hpp"
#include "tools/bench_stats.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using terrace::tools::median;

struct result {
  double step_s = 0;
  terrace::tier_stats stats;
};

result run(bool with_schedule, int layers, int budget, int window, std::size_t bytes,
           double bandwidth, double compute_ms, int steps) {
  terrace::device_options o;
  // Room beyond the budget: blocks evicted while the compute stream still reads them are only
  // reusable once it is done, and the host runs ahead of the stream.
  o.capacity = static_cast<std::size_t>(budget + 8) * bytes + (64u << 20);
  o.copy_bandwidth = bandwidth;
  auto dev = terrace::make_device("sim", o);
  terrace::caching_allocator memory(*dev);
  terrace::pinned_host_pool host(*dev);
  terrace::tier_manager_options to;
  to.device_budget = static_cast<std::size_t>(budget) * bytes;
  to.prefetch_window = static_cast<std::size_t>(window) * bytes;  // 0: the manager's default
  auto tm = std::make_unique<terrace::tier_manager>(*dev, memory, host, to);
  const terrace::stream_ref compute = dev->create_stream();
  std::vector<unsigned char> init(bytes, 1);
  std::vector<terrace::tensor_id> ids;
  for (int i = 0; i < layers; ++i) ids.push_back(tm->add("layer" + std::to_string(i), bytes, init.data()));
  if (with_schedule) tm->set_schedule(ids);

  const auto kernel = std::chrono::duration<double, std::milli>(compute_ms);
  std::vector<double> times;
  for (int s = 0; s < steps; ++s) {
    const auto t0 = clock_type::now();
    for (auto id : ids) {
      tm->acquire(id, compute);
      terrace::enqueue_host_function(*dev, compute, [kernel] { std::this_thread::sleep_for(kernel); });
      tm->release(id, compute);
    }
    dev->synchronize(compute);
    if (s > 0) times.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
  }
  result r;
  r.step_s = median(times);
  r.stats = tm->stats();
  tm.reset();
  dev->destroy_stream(compute);
  return r;
}

// The resident peer, then both policies against it.
void table(int layers, int budget, int window, std::size_t bytes, double bandwidth, double compute_ms,
           int steps, double copies_s) {
  // The peer measured in the same run: every tensor resident after the first step, so the step
  // is the compute as this machine really runs it (sleep overshoot, queueing) with no copies.
  const result resident = run(true, layers, layers, 0, bytes, bandwidth, compute_ms, steps);
  const double real_limit_s = std::max(resident.step_s, copies_s);
  std::printf("all resident (no copies): %.1f ms per step; measured limit max(that, copies) = %.1f ms\n\n",
              resident.step_s * 1e3, real_limit_s * 1e3);
  std::printf("| policy | step ms | measured limit / step | copy time hidden | prefetch hits | demand fetches |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (bool sched : {true, false}) {
    const result r = run(sched, layers, budget, window, bytes, bandwidth, compute_ms, steps);
    const double hidden = 1.0 - std::max(0.0, r.step_s - resident.step_s) / copies_s;
    std::printf("| %s | %.1f | %.2f | %.2f | %lld | %lld |\n",
                sched ? "schedule + prefetch" : "on demand (LRU)", r.step_s * 1e3,
                real_limit_s / r.step_s, hidden, static_cast<long long>(r.stats.prefetch_hits),
                static_cast<long long>(r.stats.demand_fetches));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"terrace tier manager benchmark: copy time hidden behind compute (sim device)"};
  int layers = 16, budget = 4, window = 0, steps = 7;
  double mib = 8, bandwidth_gbs = 2, compute_ms = 5;
  app.add_option("--layers", layers, "weight tensors streamed per step")->check(CLI::PositiveNumber);
  app.add_option("--budget", budget, "device budget, in tensors")->check(CLI::Range(2, 1 << 20));
  app.add_option("--window", window, "prefetch window, in tensors (0: the manager's default)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--mib", mib, "MiB per tensor")->check(CLI::PositiveNumber);
  app.add_option("--bandwidth-gbs", bandwidth_gbs, "sim copy engine, GB/s")->check(CLI::PositiveNumber);
  app.add_option("--compute-ms", compute_ms, "compute per layer, ms")->check(CLI::NonNegativeNumber);
  app.add_option("--steps", steps, "steps (the first is not counted)")->check(CLI::Range(2, 1000));
  CLI11_PARSE(app, argc, argv);

  const auto bytes = static_cast<std::size_t>(mib * (1 << 20));
  if (bytes == 0) {
    std::fprintf(stderr, "bench_tiers: --mib %g is less than a byte per tensor\n", mib);
    return 2;
  }
  const double bandwidth = bandwidth_gbs * 1e9;
  const double compute_s = layers * compute_ms / 1e3;
  const double copies_s = layers * static_cast<double>(bytes) / bandwidth;
  const double limit_s = std::max(compute_s, copies_s);
  std::printf("bench_tiers: %d layers x %.1f MiB, device budget %d tensors, copy engine %.1f GB/s, "
              "%.1f ms compute per layer, median of %d steps\n",
              layers, mib, budget, bandwidth_gbs, compute_ms, steps - 1);
  std::printf("nominal: compute %.1f ms, copies %.1f ms per step, max %.1f ms\n", compute_s * 1e3,
              copies_s * 1e3, limit_s * 1e3);
  if (budget >= layers) {
    std::printf("note: the budget holds all %d layers: after the first step nothing is copied, and "
                "\"copy time hidden\" compares with copies that are not made\n", layers);
  }
  try {
    table(layers, budget, window, bytes, bandwidth, compute_ms, steps, copies_s);
  } catch (const std::exception& e) {  // the device or the host out of memory, for a size asked
    std::fprintf(stderr, "bench_tiers: %s\n", e.what());
    return 1;
  }
  return 0;
}
