// SPDX-License-Identifier: Apache-2.0
// bench_adam: the CPU Adam step against the memory-bandwidth bound, measured in the same run.
//
// For each precision configuration and thread count it times (median of --reps) the optimizer
// step and a probe that moves the same bytes with the same access pattern: it reads the same
// streams and writes the same ones back in place (or write-only, like the param copy), split over
// the same threads, with almost no arithmetic. The probe's time is the bound; the achieved
// fraction is probe time / step time. Then, where installed, torch.optim.AdamW and
// DeepSpeedCPUAdam (tools/bench_adam_torch.py through /usr/bin/python3) with ratios.
//
//   bench_adam [--params N] [--threads 1,2] [--reps R] [--no-python]
//   Environment: TERRACE_DEEPSPEED_PYTHONPATH, a PYTHONPATH under which deepspeed imports.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "optimizer/thread_pool.hpp"
#include "terrace/adam.hpp"
#include "tools/bench_python.hpp"
#include "tools/bench_stats.hpp"

namespace {

using terrace::dtype;
using clock_type = std::chrono::steady_clock;

struct config {
  const char* name;
  dtype grad;
  dtype state;
  bool copy;
  dtype copy_type;
  bool check;  // loss scale + inf/NaN check (a read-only scan of the grads first)
  bool lion = false;  // Lion instead of AdamW: one moment (no v stream)
};

const config configs[] = {
    {"fp32", dtype::f32, dtype::f32, false, dtype::bf16, false},
    {"fp32 + bf16 copy", dtype::f32, dtype::f32, true, dtype::bf16, false},
    {"bf16 grad + bf16 copy", dtype::bf16, dtype::f32, true, dtype::bf16, false},
    {"fp16 grad + fp16 copy", dtype::f16, dtype::f32, true, dtype::f16, false},
    {"bf16 grad, bf16 m/v, bf16 copy", dtype::bf16, dtype::bf16, true, dtype::bf16, false},
    {"mixed: bf16 grad, unscale+check, bf16 copy", dtype::bf16, dtype::f32, true, dtype::bf16, true},
    {"lion fp32", dtype::f32, dtype::f32, false, dtype::bf16, false, true},
    {"lion: bf16 grad, unscale+check, bf16 copy", dtype::bf16, dtype::f32, true, dtype::bf16, true, true},
};

// ------------------------------------------------------------------------------------ the probe

enum class access { read, update, write };
struct stream {
  void* data;
  std::size_t width;  // bytes per element
  access how;
};

// The probe's loop: for every element, the same loads and stores as the step (param, m and v
// read and written back in place, the grad read, the copy written), with an integer add in place
// of the arithmetic. Compiled twice: for AVX-512 (the loop is then as wide as the step's) and for
// the baseline, chosen at run time, in separate namespaces so the two never merge at link time.
// Each loop runs with and without a software prefetch of every stream 1024 elements ahead (what
// the step does with bf16 moments, adam_body.hpp): without it a core may keep too few misses in
// flight to reach the memory's bandwidth, and the step, which prefetches, then beat its probe
// (1.15-1.41x at 1 and 2 threads on 2026-11-25). The bound is the faster of the two.
#define TERRACE_PROBE_BODY                                                                      \
  constexpr std::size_t kAhead = 1024, kChunk = 64;                                            \
  template <class T>                                                                           \
  void prefetch_chunk(const T* base, std::size_t j, std::size_t end, int write) {              \
    if (base == nullptr || j >= end) return;                                                   \
    const char* at = reinterpret_cast<const char*>(base + j);                                  \
    const std::size_t bytes = std::min(kChunk, end - j) * sizeof(T);                           \
    for (std::size_t o = 0; o < bytes; o += 64) {                                              \
      if (write) __builtin_prefetch(at + o, 1); else __builtin_prefetch(at + o, 0);            \
    }                                                                                          \
  }                                                                                            \
  template <class G, class S, class C, bool Copy, bool HasV, bool Prefetch>                    \
  std::uint64_t fused(const std::vector<stream>& st, std::size_t begin, std::size_t end) {     \
    auto* __restrict p = static_cast<std::uint32_t*>(st[0].data);                              \
    auto* __restrict m = static_cast<S*>(st[1].data);                                          \
    auto* __restrict v = static_cast<S*>(st[2].data);                                          \
    const auto* __restrict g = static_cast<const G*>(st[3].data);                              \
    auto* __restrict c = Copy ? static_cast<C*>(st[4].data) : nullptr;                         \
    G sink = 0;                                                                                \
    const auto element = [&](std::size_t i) __attribute__((always_inline)) {                  \
      p[i] += 1;                                                                               \
      m[i] = static_cast<S>(m[i] + 1);                                                         \
      if constexpr (HasV) v[i] = static_cast<S>(v[i] + 1);                                     \
      sink ^= g[i];                                                                            \
      if constexpr (Copy) c[i] = static_cast<C>(p[i]);                                         \
    };                                                                                         \
    std::size_t i = begin;                                                                     \
    if constexpr (Prefetch) {                                                                  \
      for (; i + kAhead + kChunk <= end; i += kChunk) {                                        \
        const std::size_t j = i + kAhead;                                                      \
        prefetch_chunk(p, j, end, 1);                                                          \
        prefetch_chunk(m, j, end, 1);                                                          \
        if constexpr (HasV) prefetch_chunk(v, j, end, 1);                                      \
        prefetch_chunk(g, j, end, 0);                                                          \
        if constexpr (Copy) prefetch_chunk(c, j, end, 1);                                      \
        for (std::size_t k = 0; k < kChunk; ++k) element(i + k);                               \
      }                                                                                        \
    }                                                                                          \
    for (; i < end; ++i) element(i);                                                           \
    return sink;                                                                               \
  }                                                                                            \
  /* Lion's streams have no v (st[2].data null). */                                            \
  template <class G, class S, class C, bool Copy, bool Prefetch>                               \
  std::uint64_t fused_v(const std::vector<stream>& st, std::size_t begin, std::size_t end) {   \
    return st[2].data != nullptr ? fused<G, S, C, Copy, true, Prefetch>(st, begin, end)        \
                                 : fused<G, S, C, Copy, false, Prefetch>(st, begin, end);      \
  }                                                                                            \
  template <class G, bool Prefetch>                                                            \
  std::uint64_t read_only(const std::vector<stream>& st, std::size_t begin, std::size_t end) { \
    const auto* __restrict g = static_cast<const G*>(st[0].data);                              \
    G sink = 0;                                                                                \
    std::size_t i = begin;                                                                     \
    if constexpr (Prefetch) {                                                                  \
      for (; i + kAhead + kChunk <= end; i += kChunk) {                                        \
        prefetch_chunk(g, i + kAhead, end, 0);                                                 \
        for (std::size_t k = 0; k < kChunk; ++k) sink ^= g[i + k];                             \
      }                                                                                        \
    }                                                                                          \
    for (; i < end; ++i) sink ^= g[i];                                                         \
    return sink;                                                                               \
  }                                                                                            \
  template <bool Prefetch>                                                                     \
  std::uint64_t run_t(const std::vector<stream>& st, std::size_t b, std::size_t e) {           \
    using u16 = std::uint16_t;                                                                 \
    using u32 = std::uint32_t;                                                                 \
    if (st.size() == 1) {                                                                      \
      return st[0].width == 2 ? read_only<u16, Prefetch>(st, b, e) : read_only<u32, Prefetch>(st, b, e); \
    }                                                                                          \
    const bool copy = st.size() == 5;                                                          \
    const int key = (st[3].width == 2) * 4 + (st[1].width == 2) * 2 + copy;                    \
    switch (key) {                                                                             \
      case 0: return fused_v<u32, u32, u16, false, Prefetch>(st, b, e);                        \
      case 1: return fused_v<u32, u32, u16, true, Prefetch>(st, b, e);                         \
      case 2: return fused_v<u32, u16, u16, false, Prefetch>(st, b, e);                        \
      case 3: return fused_v<u32, u16, u16, true, Prefetch>(st, b, e);                         \
      case 4: return fused_v<u16, u32, u16, false, Prefetch>(st, b, e);                        \
      case 5: return fused_v<u16, u32, u16, true, Prefetch>(st, b, e);                         \
      case 6: return fused_v<u16, u16, u16, false, Prefetch>(st, b, e);                        \
      default: return fused_v<u16, u16, u16, true, Prefetch>(st, b, e);                        \
    }                                                                                          \
  }                                                                                            \
  std::uint64_t run(const std::vector<stream>& st, std::size_t b, std::size_t e, bool prefetch) { \
    return prefetch ? run_t<true>(st, b, e) : run_t<false>(st, b, e);                          \
  }

namespace probe_portable {
TERRACE_PROBE_BODY
}  // namespace probe_portable
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2")
namespace probe_avx512 {
TERRACE_PROBE_BODY
}  // namespace probe_avx512
#pragma GCC pop_options

// REQUIRES: streams are {param f32, m, v (null data: Lion, none), grad[, copy]} (all copies
// 16-bit), or {grad} alone.
std::uint64_t probe_range(const std::vector<stream>& streams, std::size_t begin, std::size_t end,
                          bool prefetch) {
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl");
  return avx512 ? probe_avx512::run(streams, begin, end, prefetch)
                : probe_portable::run(streams, begin, end, prefetch);
}

std::uint64_t g_sink = 0;

void probe(terrace::detail::thread_pool& pool, unsigned threads, const std::vector<stream>& streams,
           std::size_t n, bool prefetch) {
  std::vector<std::uint64_t> sinks(pool.size());
  pool.run([&](unsigned k) {
    if (k >= threads) return;
    const std::size_t per = (n / threads + 63) / 64 * 64;
    const std::size_t b = std::min(n, per * k);
    const std::size_t e = k + 1 == threads ? n : std::min(n, per * (k + 1));
    sinks[k] = probe_range(streams, b, e, prefetch);
  });
  for (auto s : sinks) g_sink ^= s;
}

// ------------------------------------------------------------------------------------- helpers

struct aligned_free {
  void operator()(void* p) const noexcept { std::free(p); }
};
using buffer = std::unique_ptr<void, aligned_free>;

buffer allocate(std::size_t bytes, float value, dtype type) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) {
    std::fprintf(stderr, "bench_adam: out of memory (%zu bytes)\n", bytes);
    std::exit(1);
  }
  // Touch every page, with a value that keeps the arithmetic free of denormals.
  if (type == dtype::f32) {
    std::fill_n(static_cast<float*>(p), bytes / 4, value);
  } else {
    std::uint32_t bits;
    std::memcpy(&bits, &value, 4);
    std::fill_n(static_cast<std::uint16_t*>(p), bytes / 2, static_cast<std::uint16_t>(bits >> 16));
  }
  return buffer(p);
}

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

using terrace::tools::median;

// Runs tools/bench_adam_torch.py: the median seconds per step (negative, with a note, when not
// measured), and, where libterrace.so is built, the ratio paired step by step with terrace's.
terrace::tools::python_figures python_step(const std::string& impl, std::size_t n, unsigned threads,
                                           int reps, std::string& note) {
  std::string env;
  if (impl != "torch") {
    if (const char* path = std::getenv("TERRACE_DEEPSPEED_PYTHONPATH")) env = "PYTHONPATH=" + std::string(path) + " ";
  }
  std::string paired;
  if (std::filesystem::exists(TERRACE_C_LIBRARY)) paired = " --terrace-library " TERRACE_C_LIBRARY;
  return terrace::tools::python_run(
      env + "/usr/bin/python3 " TERRACE_SOURCE_DIR "/tools/bench_adam_torch.py --impl " + impl +
          " --params " + std::to_string(n) + " --threads " + std::to_string(threads) +
          " --reps " + std::to_string(reps) + paired + " 2>/dev/null",
      note);
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t n = 100'000'000;
  std::vector<unsigned> thread_counts{1, 2};
  int reps = 7;
  bool python = true;
  CLI::App app{"bench_adam: the CPU Adam step against the memory-bandwidth bound, torch and DeepSpeed"};
  app.add_option("--params", n, "parameters (rounded down to a multiple of 64)")
      ->check(CLI::Range(std::size_t{64}, std::size_t{1} << 34));
  app.add_option("--threads", thread_counts, "thread counts, comma-separated")
      ->delimiter(',')
      ->check(CLI::Range(1u, 1024u));
  app.add_option("--reps", reps, "repetitions (medians are printed)")->check(CLI::Range(1, 1000));
  app.add_flag("!--no-python", python, "skip torch and DeepSpeed");
  CLI11_PARSE(app, argc, argv);
  n = n / 64 * 64;

  // One set of buffers, as large as the widest configuration needs.
  buffer param = allocate(n * 4, 0.1f, dtype::f32);
  buffer m = allocate(n * 4, 0.0f, dtype::f32);
  buffer v = allocate(n * 4, 0.0f, dtype::f32);
  buffer grad = allocate(n * 4, 0.01f, dtype::f32);
  buffer copy = allocate(n * 4, 0.0f, dtype::f32);

  std::printf("bench_adam: %zu parameters, median of %d runs, kernels %s\n", n, reps,
              std::string(terrace::to_string(terrace::best_simd_isa())).c_str());
  // "pf": the prefetching probe was the faster (see the probe). "fraction": of this configuration's
  // own probe. "of best": of the fastest probe at that thread count. A probe is one way to move
  // the bytes, not the fastest possible: where the step beats its own probe (bf16 moments: the
  // probe's mixed 16/32-bit loop reaches less of the bandwidth than the step does), the best probe
  // of any configuration is the tighter bound, and with it no fraction exceeds 1 by more than noise.
  std::printf("%-44s %3s %6s %10s %10s %10s %3s %8s %7s\n", "configuration", "thr", "B/par", "Gparam/s", "step GB/s",
              "probe GB/s", "", "fraction", "of best");
  std::map<std::pair<std::string, unsigned>, double> step_seconds;
  for (unsigned threads : thread_counts) {
    terrace::adam_options o;
    o.threads = threads;
    o.weight_decay = 0.01;
    terrace::detail::thread_pool pool(threads);
    struct row {
      const config* c;
      std::size_t bytes;
      double step_gbs, probe_gbs;
      bool prefetch_faster;
    };
    std::vector<row> rows;
    for (const config& c : configs) {
      o.state_dtype = c.state;
      o.mode = c.lion ? terrace::adam_mode::lion : terrace::adam_mode::adamw;
      terrace::adam_optimizer adam(o);
      void* const v_or_none = c.lion ? nullptr : v.get();
      const terrace::adam_tensor t{static_cast<float*>(param.get()), m.get(), v_or_none, grad.get(),
                                   c.copy ? copy.get() : nullptr, n};
      terrace::adam_step_options so;
      so.grad_dtype = c.grad;
      so.copy_dtype = c.copy_type;
      if (c.check) {
        so.grad_scale = 1024.0f;
        so.check_finite = true;
      }
      // The bytes the step must move, and the probe streams that move them the same way.
      const std::size_t gw = terrace::size_of(c.grad), sw = terrace::size_of(c.state),
                        cw = terrace::size_of(c.copy_type);
      std::vector<stream> streams{{param.get(), 4, access::update},
                                  {m.get(), sw, access::update},
                                  {v_or_none, sw, access::update},
                                  {grad.get(), gw, access::read}};
      if (c.copy) streams.push_back({copy.get(), cw, access::write});
      const std::vector<stream> scan{{grad.get(), gw, access::read}};
      const std::size_t bytes = 4 * 2 + sw * (c.lion ? 2 : 4) + gw + (c.copy ? cw : 0) + (c.check ? gw : 0);

      auto step_once = [&] {
        if (!adam.step(std::span<const terrace::adam_tensor>(&t, 1), so)) std::abort();
      };
      auto probe_once = [&](bool prefetch) {
        if (c.check) probe(pool, threads, scan, n, prefetch);
        probe(pool, threads, streams, n, prefetch);
      };
      step_once();  // warm-up (and moments away from zero)
      probe_once(false);
      probe_once(true);
      std::vector<double> ts, tp[2];
      for (int r = 0; r < reps; ++r) {  // interleaved, so that drifting neighbours hit all alike
        for (const bool prefetch : {false, true}) {
          const auto t0 = clock_type::now();
          probe_once(prefetch);
          tp[prefetch].push_back(seconds_since(t0));
        }
        const auto t0 = clock_type::now();
        step_once();
        ts.push_back(seconds_since(t0));
      }
      const double s = median(ts), p = std::min(median(tp[0]), median(tp[1]));
      const bool prefetch_faster = median(tp[1]) < median(tp[0]);
      step_seconds[{c.name, threads}] = s;
      rows.push_back({&c, bytes, bytes * n / s / 1e9, bytes * n / p / 1e9, prefetch_faster});
    }
    double best = 0;
    for (const row& r : rows) best = std::max(best, r.probe_gbs);
    for (const row& r : rows) {
      std::printf("%-44s %3u %6zu %10.3f %10.2f %10.2f %3s %8.2f %7.2f\n", r.c->name, threads, r.bytes,
                  r.step_gbs / r.bytes, r.step_gbs, r.probe_gbs, r.prefetch_faster ? "pf" : "",
                  r.step_gbs / r.probe_gbs, r.step_gbs / best);
    }
    std::fflush(stdout);
  }

  if (python) {
    std::printf("\ncomparisons (same data size; ratio = their step time / ours):\n");
    struct other {
      const char* impl;
      const char* ours;
    };
    for (unsigned threads : thread_counts) {
      for (const other& x : {other{"torch", "fp32"}, other{"deepspeed", "fp32"},
                             other{"deepspeed-mixed", "mixed: bf16 grad, unscale+check, bf16 copy"}}) {
        std::string note;
        const auto r = python_step(x.impl, n, threads, std::max(3, reps / 2), note);
        const double s = r.seconds;
        const double ours = step_seconds[{x.ours, threads}];
        if (s < 0) {
          std::printf("  %-16s %u thr: not measured: %s\n", x.impl, threads, note.c_str());
        } else {
          std::printf("  %-16s %u thr: %8.3f Gparam/s; terrace '%s' is %.2fx faster", x.impl, threads,
                      n / s / 1e9, x.ours, s / ours);
          // The ratio that the host's drifting bandwidth does not skew (bench_adam_torch.py).
          if (r.paired > 0) {
            std::printf("; paired step by step: %.2fx (%.2f-%.2f)", r.paired, r.paired_lowest,
                        r.paired_highest);
          }
          std::printf("\n");
        }
        std::fflush(stdout);
      }
    }
  }
  return g_sink == 42 ? 1 : 0;  // keeps the probe's reads alive
}
