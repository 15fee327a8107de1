// SPDX-License-Identifier: Apache-2.0
// bench_offload_adam: the offloaded optimizer's step with all state on NVMe against its two
// bounds, measured in the same run (the machines are noisy: only figures taken side by side mean
// anything). Prints medians of --reps.
//
//   bench_offload_adam [--params 64M] [--groups 16] [--chunk-elements 4194304] [--depth 3]
//                      [--threads 0] [--reps 5] [--dir DIR] [--qd 16] [--block-kib 1024]
//   DIR (created when missing) is left as it was: the store goes in DIR/bench_offload_adam.<pid>.
//
//   compute   adam_optimizer::step over the same parameters in memory (one call, all groups);
//   io        the store moving the same bytes as the step, chunk by chunk through the same number
//             of rotating buffers: read chunk i+1 while writing chunk i-1, no arithmetic (and,
//             for reference, all reads alone and all writes alone);
//   offload   offload_adam::step, every group on NVMe.
// efficiency = offload / max(io, compute): 1.0 when the pipeline hides the smaller of the two
// completely behind the larger.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "terrace/adam.hpp"
#include "terrace/device.hpp"
#include "terrace/error.hpp"
#include "terrace/offload_adam.hpp"
#include "terrace/pinned_pool.hpp"
#include "terrace/tensor_store.hpp"
#include "tools/bench_scratch.hpp"
#include "tools/bench_stats.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
constexpr std::size_t MiB = std::size_t{1} << 20;

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

using terrace::tools::median;

// A positive whole number with an optional K, M or G suffix (powers of 2). Anything else ("1.5M",
// "-5", "64MB", a count that overflows) is refused: std::stoull read "1.5M" as 1 Mi and "-5" as
// 2^64 - 5.
std::size_t parse_count(const std::string& option, const std::string& s) {
  std::size_t multiplier = 1;
  std::string digits = s;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'K': case 'k': multiplier = 1024; break;
      case 'M': case 'm': multiplier = MiB; break;
      case 'G': case 'g': multiplier = MiB * 1024; break;
      default: break;
    }
    if (multiplier != 1) digits.pop_back();
  }
  std::size_t value = 0;
  const char* const end = digits.data() + digits.size();
  const auto [at, ec] = std::from_chars(digits.data(), end, value);
  if (digits.empty() || ec != std::errc() || at != end || value == 0 ||
      value > std::numeric_limits<std::size_t>::max() / multiplier) {
    throw std::invalid_argument(option + " '" + s + "': expected a positive whole number, optionally with K, M or G");
  }
  return value * multiplier;
}

// The store moving one step's bytes without the arithmetic: `chunks` tensors of `bytes` each,
// through `depth` buffers; mode 0 reads and writes as the pipeline does, 1 only reads, 2 only
// writes. Returns seconds.
double raw_io(terrace::tensor_store& store, const std::vector<std::string>& ids, const std::vector<std::size_t>& sizes,
              std::vector<void*>& buffers, int mode) {
  const std::size_t n = ids.size();
  const std::size_t depth = buffers.size();
  std::vector<terrace::io_handle> reads(depth), writes(depth);
  const auto start = clock_type::now();
  if (mode == 1) {
    for (std::size_t i = 0; i < n; ++i) {
      reads[i % depth].wait();
      reads[i % depth] = store.get(ids[i], buffers[i % depth], sizes[i]);
    }
    for (auto& h : reads) h.wait();
  } else if (mode == 2) {
    for (std::size_t i = 0; i < n; ++i) {
      writes[i % depth].wait();
      writes[i % depth] = store.put(ids[i], buffers[i % depth], sizes[i]);
    }
    for (auto& h : writes) h.wait();
  } else {
    for (std::size_t i = 0; i < std::min(n, depth - 2); ++i) reads[i] = store.get(ids[i], buffers[i], sizes[i]);
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t ahead = i + depth - 2;
      if (ahead < n) {
        writes[ahead % depth].wait();
        reads[ahead % depth] = store.get(ids[ahead], buffers[ahead % depth], sizes[ahead]);
      }
      reads[i % depth].wait();
      writes[i % depth] = store.put(ids[i], buffers[i % depth], sizes[i]);
    }
    for (auto& h : writes) h.wait();
  }
  return seconds_since(start);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_offload_adam: offloaded CPU Adam over NVMe against its compute and I/O bounds"};
  std::string params_text = "64M";
  std::size_t groups = 16;
  std::size_t chunk_elements = std::size_t{1} << 22;
  unsigned depth = 3;
  unsigned threads = 0;
  int reps = 5;
  std::string dir = "bench-offload-adam-scratch";
  unsigned qd = 16;
  std::size_t block_kib = 1024;
  app.add_option("--params", params_text, "parameters in all (suffix K, M, G: powers of 2)");
  app.add_option("--groups", groups, "parameter groups (equal sizes)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--chunk-elements", chunk_elements, "elements per pipeline chunk (a multiple of 64)");
  app.add_option("--depth", depth, "staging buffers of the pipeline (read, step, write: >= 3)")
      ->check(CLI::Range(3, 64));
  app.add_option("--threads", threads, "optimizer threads (0: all cores)")->check(CLI::Range(0u, 1024u));
  app.add_option("--reps", reps, "repetitions (medians are printed)")->check(CLI::Range(1, 1000));
  app.add_option("--dir", dir, "where to make the scratch folder (removed at the end; must not be tmpfs)");
  app.add_option("--qd", qd, "store queue depth")->check(CLI::Range(1, 4096));
  app.add_option("--block-kib", block_kib, "store block size")->check(CLI::Range(4, 256 << 10));
  CLI11_PARSE(app, argc, argv);
  // Said before the in-memory step runs (seconds at the default sizes), not after it by the
  // offloaded optimizer and the store.
  if (chunk_elements == 0 || chunk_elements % 64 != 0) {
    std::fprintf(stderr, "bench_offload_adam: --chunk-elements %zu: expected a positive multiple of 64\n",
                 chunk_elements);
    return 2;
  }
  if (block_kib % 4 != 0) {
    std::fprintf(stderr, "bench_offload_adam: --block-kib %zu: expected a multiple of 4 (O_DIRECT)\n", block_kib);
    return 2;
  }

  int status = 0;
  try {
    const std::size_t params = parse_count("--params", params_text);
    if (params < groups) {
      throw std::invalid_argument("--params " + params_text + " is fewer than one per group (--groups " +
                                  std::to_string(groups) + ")");
    }
    const std::size_t per_group = params / groups;
    const std::size_t state_bytes = per_group * groups * 12;
    std::printf("bench_offload_adam: %zu params in %zu groups, f32 grads and state (%.0f MiB of state), "
                "chunks of %zu elements, depth %u, %d reps\n",
                per_group * groups, groups, static_cast<double>(state_bytes) / MiB, chunk_elements, depth, reps);

    terrace::adam_options ao;
    ao.threads = threads;

    // ---- compute: the in-memory step
    std::vector<std::vector<float>> master(groups, std::vector<float>(per_group, 0.1f));
    std::vector<std::vector<float>> m(groups, std::vector<float>(per_group, 0.0f));
    std::vector<std::vector<float>> v(groups, std::vector<float>(per_group, 0.0f));
    std::vector<std::vector<float>> grad(groups, std::vector<float>(per_group));
    for (std::size_t g = 0; g < groups; ++g)
      for (std::size_t i = 0; i < per_group; ++i) grad[g][i] = 1e-3f * static_cast<float>((i * 7 + g) % 101) - 0.05f;
    terrace::adam_optimizer adam(ao);
    std::vector<terrace::adam_tensor> tensors;
    for (std::size_t g = 0; g < groups; ++g)
      tensors.push_back({master[g].data(), m[g].data(), v[g].data(), grad[g].data(), nullptr, per_group});
    adam.step(tensors);  // warm: pages touched, threads up
    std::vector<double> compute;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = clock_type::now();
      adam.step(tensors);
      compute.push_back(seconds_since(t0));
    }
    std::printf("  threads %u, isa %s\n", adam.options().threads, std::string(terrace::to_string(adam.options().isa)).c_str());
    m.clear();
    v.clear();

    // ---- the store and the offloaded optimizer (declared first: removed after the store closes)
    const terrace::tools::bench_scratch scratch(dir, "bench_offload_adam");
    const std::filesystem::path& base = scratch.path();
    terrace::tensor_store_options so;
    so.capacity = state_bytes + state_bytes / 8 + 256 * MiB;  // the state, room to replace chunks
    so.queue_depth = qd;
    so.block_size = block_kib * 1024;
    auto store = terrace::tensor_store::create(base, so);
    std::printf("  store: %s, dir %s\n", store.describe().c_str(), base.c_str());
    if (terrace::tools::on_tmpfs(base)) std::printf("  warning: %s is on tmpfs: io measures memory, not a drive\n", base.c_str());

    auto device = terrace::make_device("sim", {});
    terrace::pinned_pool_options po;
    po.region_size = 64 * MiB;
    terrace::pinned_host_pool pool(*device, po);
    terrace::offload_adam_options oo;
    oo.adam = ao;
    oo.chunk_elements = chunk_elements;
    oo.pipeline_depth = depth;
    terrace::offload_adam opt(oo, pool, &store);
    std::vector<terrace::offload_group_step> list;
    for (std::size_t g = 0; g < groups; ++g) {
      const terrace::group_id id = opt.add("layer" + std::to_string(g), per_group, master[g].data());
      list.push_back({id, grad[g].data(), nullptr});
    }
    master.clear();
    opt.step(list);  // warm
    std::vector<double> offload, wait;
    for (int r = 0; r < reps; ++r) {
      const terrace::offload_adam_stats before = opt.stats();
      opt.step(list);
      const terrace::offload_adam_stats after = opt.stats();
      offload.push_back(after.step_seconds - before.step_seconds);
      wait.push_back(after.io_wait_seconds - before.io_wait_seconds);
    }

    // ---- io: the same chunks through the same number of buffers, without the arithmetic
    std::vector<std::string> ids;
    std::vector<std::size_t> sizes;
    for (std::size_t g = 0; g < groups; ++g) {
      for (std::size_t b = 0, k = 0; b < per_group; b += chunk_elements, ++k) {
        ids.push_back("layer" + std::to_string(g) + "#" + std::to_string(k));
        sizes.push_back(std::min(chunk_elements, per_group - b) * 12);
      }
    }
    std::vector<void*> buffers(depth);
    for (auto& b : buffers) b = pool.allocate(*std::max_element(sizes.begin(), sizes.end()));
    std::vector<double> io, reads, writes;
    for (int r = 0; r < reps; ++r) {
      io.push_back(raw_io(store, ids, sizes, buffers, 0));
      reads.push_back(raw_io(store, ids, sizes, buffers, 1));
      // Writes put back what the reads brought (a chunk's own bytes would do as well).
      writes.push_back(raw_io(store, ids, sizes, buffers, 2));
    }
    for (auto& b : buffers) pool.deallocate(b);

    const double gib = static_cast<double>(state_bytes) / (1 << 30);
    const double c = median(compute), o = median(offload), i = median(io);
    std::printf("\n  %-46s %9s %12s\n", ("median of " + std::to_string(reps)).c_str(), "ms", "GiB/s");
    std::printf("  %-46s %9.1f %12s\n", "compute: adam_optimizer::step in memory", c * 1e3, "");
    std::printf("  %-46s %9.1f %12.2f\n", "io: read+write of every chunk, pipelined", i * 1e3, 2 * gib / i);
    std::printf("  %-46s %9.1f %12.2f\n", "   reads alone", median(reads) * 1e3, gib / median(reads));
    std::printf("  %-46s %9.1f %12.2f\n", "   writes alone", median(writes) * 1e3, gib / median(writes));
    std::printf("  %-46s %9.1f %12s\n", "offload_adam::step, all state on NVMe", o * 1e3, "");
    std::printf("  %-46s %9.1f %12s\n", "   of which waiting for I/O", median(wait) * 1e3, "");
    std::printf("\n  efficiency = offload / max(io, compute) = %.2f   (1.00: perfect overlap)\n", o / std::max(i, c));
    std::printf("  offload / compute = %.2f, offload / io = %.2f\n", o / c, o / i);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_offload_adam: %s\n", e.what());
    status = 1;
  }
  return status;
}
