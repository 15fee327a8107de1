// SPDX-License-Identifier: Apache-2.0
// bench_nvme: the tensor store's put/get throughput against fio and, where installed, DeepSpeed's
// aio handle, on the same file, with the same total bytes, block size and queue depth, in one run
// (the machines are noisy: only ratios taken side by side mean anything). Prints tables of medians.
//
//   bench_nvme [--dir DIR] [--total-mib 1024] [--runs 5] [--qd 16] [--block-kib 1024]
//              [--sizes-mib 1,16,256] [--no-fio] [--no-deepspeed]
//   Environment: TERRACE_DEEPSPEED_PYTHONPATH, a PYTHONPATH under which deepspeed imports.
//   DIR (created when missing) is left as it was: the benchmark works in DIR/bench_nvme.<pid>.
//
// terrace: put every tensor (all in flight at once, the engine keeps --qd blocks in the ring),
// wait for all; then get them all back, CRC-verified. fio: --ioengine=io_uring --direct=1
// --rw=write then read over one file of the same total size. DeepSpeed: tools/bench_nvme_deepspeed.py
// through /usr/bin/python3 (as bench_adam runs its Python half): aio_handle(block, qd) async_pwrite
// of every tensor at the offset the store gives it, one wait(), then async_pread (O_DIRECT, libaio).
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "terrace/error.hpp"
#include "terrace/tensor_store.hpp"
#include "tools/bench_scratch.hpp"
#include "tools/bench_stats.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
constexpr std::uint64_t MiB = 1 << 20;

using terrace::tools::median;

std::string run_command(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  ::pclose(p);
  return out;
}

// fio's bandwidth in MB/s (10^6), or -1 when fio is missing or failed.
double fio_mbps(const std::filesystem::path& file, const char* rw, std::uint64_t total, std::size_t block,
                unsigned qd) {
  const std::string cmd = "fio --name=terrace-bench --filename=" + file.string() + " --size=" + std::to_string(total) +
                          " --bs=" + std::to_string(block) + " --iodepth=" + std::to_string(qd) +
                          " --ioengine=io_uring --direct=1 --rw=" + rw + " --output-format=json 2>/dev/null";
  const std::string out = run_command(cmd);
  const auto start = out.find('{');
  if (start == std::string::npos) return -1;
  try {
    auto j = nlohmann::json::parse(out.substr(start));
    const double bw = j["jobs"][0][std::string(rw) == "write" ? "write" : "read"]["bw_bytes"].get<double>();
    return bw / 1e6;
  } catch (const std::exception&) {
    return -1;
  }
}

// A word for /bin/sh: single-quoted, with embedded quotes escaped.
std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// tools/bench_nvme_deepspeed.py, run under /usr/bin/python3 with TERRACE_DEEPSPEED_PYTHONPATH as its
// PYTHONPATH. Returns its RESULT object, or null with `why` set (its UNAVAILABLE line, or how it
// failed with the last line it wrote to stderr).
nlohmann::json deepspeed_run(const std::string& args, const std::filesystem::path& err_file, std::string& why) {
  std::string env;
  if (const char* path = std::getenv("TERRACE_DEEPSPEED_PYTHONPATH")) env = "PYTHONPATH=" + shell_quote(path) + " ";
  const std::string cmd = env + "/usr/bin/python3 " + shell_quote(TERRACE_SOURCE_DIR "/tools/bench_nvme_deepspeed.py") +
                          " " + args + " 2>" + shell_quote(err_file.string());
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) {
    why = "could not run /usr/bin/python3";
    return nullptr;
  }
  nlohmann::json result;
  why.clear();
  char line[8192];
  while (std::fgets(line, sizeof line, p) != nullptr) {
    std::string l(line);
    while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.pop_back();
    if (l.rfind("RESULT ", 0) == 0) {
      try {
        result = nlohmann::json::parse(l.substr(7));
      } catch (const std::exception& e) {
        why = std::string("unparsable RESULT line: ") + e.what();
      }
    } else if (l.rfind("UNAVAILABLE ", 0) == 0) {
      why = l.substr(12);
    }
  }
  const int status = ::pclose(p);
  if (!result.is_null() && why.empty()) return result;
  if (why.empty()) {
    std::string last, l;
    std::ifstream err(err_file);
    while (std::getline(err, l))
      if (!l.empty()) last = l;
    why = "bench_nvme_deepspeed.py gave no result (" +
          (WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                             : "killed by signal " + std::to_string(WIFSIGNALED(status) ? WTERMSIG(status) : 0)) +
          (last.empty() ? std::string(")") : "): " + last);
  }
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"terrace NVMe tier benchmark: tensor store vs fio and DeepSpeed's aio handle"};
  std::string dir = "bench-nvme-scratch";
  std::uint64_t total_mib = 1024;
  int runs = 5;
  unsigned qd = terrace::tensor_store_options{}.queue_depth;
  std::size_t block_kib = terrace::tensor_store_options{}.block_size >> 10;
  std::vector<std::uint64_t> sizes_mib = {1, 16, 256};
  bool no_fio = false;
  bool no_deepspeed = false;
  app.add_option("--dir", dir, "where to make the scratch folder (removed at the end; must not be tmpfs)");
  app.add_option("--total-mib", total_mib, "bytes moved per configuration and direction")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--runs", runs, "repetitions (medians are printed)")->check(CLI::Range(1, 1000));
  app.add_option("--qd", qd, "queue depth (terrace and fio)")->check(CLI::Range(1, 4096));
  app.add_option("--block-kib", block_kib, "block size (terrace and fio)")->check(CLI::Range(4, 256 << 10));
  app.add_option("--sizes-mib", sizes_mib, "tensor sizes, each at most --total-mib")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 20));
  app.add_flag("--no-fio", no_fio, "skip fio");
  app.add_flag("--no-deepspeed", no_deepspeed, "skip DeepSpeed's aio handle");
  CLI11_PARSE(app, argc, argv);
  // A configuration moves total / size tensors: a size above the total would move none and
  // print a row of zeros that reads as a measurement.
  for (const std::uint64_t s : sizes_mib) {
    if (s > total_mib) {
      std::fprintf(stderr, "bench_nvme: a %llu MiB tensor does not fit in --total-mib %llu\n",
                   static_cast<unsigned long long>(s), static_cast<unsigned long long>(total_mib));
      return 2;
    }
  }

  int status = 0;
  try {
    // Declared first: removed once the store has closed its files.
    const terrace::tools::bench_scratch scratch(dir, "bench_nvme");
    const std::filesystem::path& base = scratch.path();
    const std::filesystem::path store_dir = base / "store";
    std::filesystem::create_directory(store_dir);
    const std::uint64_t total = total_mib * MiB;
    const std::size_t block = block_kib << 10;

    terrace::tensor_store_options opt;
    opt.capacity = total + 64 * MiB;
    opt.queue_depth = qd;
    opt.block_size = block;
    auto store = terrace::tensor_store::create(store_dir, opt);
    std::printf("bench_nvme: %s, %llu MiB per configuration, %d runs, dir %s\n", store.describe().c_str(),
                static_cast<unsigned long long>(total_mib), runs, base.c_str());
    if (!store.direct()) std::printf("warning: no O_DIRECT on this file system: numbers measure the page cache\n");
    if (terrace::tools::on_tmpfs(base)) std::printf("warning: %s is on tmpfs: numbers measure memory, not a drive\n", base.c_str());

    const auto buffer = [total] {
      std::unique_ptr<unsigned char, decltype(&std::free)> p(
          static_cast<unsigned char*>(std::aligned_alloc(4096, total)), &std::free);
      if (!p) throw std::runtime_error("cannot allocate two buffers of --total-mib each");
      return p;
    };
    const auto src_buffer = buffer(), dst_buffer = buffer();
    unsigned char* const src = src_buffer.get();
    unsigned char* const dst = dst_buffer.get();
    for (std::uint64_t i = 0; i < total; i += 8) {
      const std::uint64_t v = i * 0x9E3779B97F4A7C15ull;
      std::memcpy(src + i, &v, 8);
    }
    std::memset(dst, 0, total);

    struct row {
      std::uint64_t size_mib;
      std::vector<double> put, get, fio_w, fio_r, ds_w, ds_r;
    };
    std::vector<row> rows;
    for (auto s : sizes_mib) rows.push_back({s, {}, {}, {}, {}, {}, {}});

    auto pass = [&](row& r, bool record) {
      const std::uint64_t size = r.size_mib * MiB;
      const std::uint64_t n = total / size;
      std::vector<terrace::io_handle> hs;
      auto t0 = clock_type::now();
      for (std::uint64_t i = 0; i < n; ++i) hs.push_back(store.put("t" + std::to_string(i), src + i * size, size));
      for (auto& h : hs) h.wait();
      auto t1 = clock_type::now();
      hs.clear();
      for (std::uint64_t i = 0; i < n; ++i) hs.push_back(store.get("t" + std::to_string(i), dst + i * size, size));
      for (auto& h : hs) h.wait();
      auto t2 = clock_type::now();
      if (std::memcmp(src, dst, n * size) != 0) {
        throw std::runtime_error("data mismatch for " + std::to_string(r.size_mib) + " MiB tensors");
      }
      for (std::uint64_t i = 0; i < n; ++i) store.erase("t" + std::to_string(i));
      if (record) {
        const double bytes = static_cast<double>(n * size) / 1e6;
        r.put.push_back(bytes / std::chrono::duration<double>(t1 - t0).count());
        r.get.push_back(bytes / std::chrono::duration<double>(t2 - t1).count());
      }
    };

    // Warm-up: the first write into a preallocated file also converts its extents; fio's first run
    // lays its file out. Neither is counted.
    pass(rows.front(), false);
    // fio runs on the store's own swap file (every tensor is erased after each pass, so nothing
    // there is live): a virtual disk's host-side cache makes the same bytes read at very different
    // speeds depending on the file and on what was written last (measured 2026-11-22: fio read
    // 1.2 GB/s on a file of its own against 3.0-3.3 GB/s on the swap file just written). Same file,
    // same write-then-read order: the ratio compares the engines, not the cache states.
    const auto fio_file = store_dir / "swap.0";
    // fio missing or failing (no io_uring, no O_DIRECT) leaves its columns out, said once, rather
    // than a row of -1 and ratios of 0 that read as measurements.
    std::string fio_why = "skipped (--no-fio)";
    if (!no_fio && fio_mbps(fio_file, "write", total, block, qd) < 0) {
      no_fio = true;
      fio_why = "fio is not installed or failed (fio --ioengine=io_uring --direct=1 on " + fio_file.string() + ")";
    }
    // DeepSpeed's aio handle works on the same swap file too, each tensor at the offset the store's
    // allocator gives it (the extents are laid out from offset 0, in put order, and freed after
    // every pass). Its op is checked (and, the first time, compiled) once, before the runs.
    const auto ds_err = base / "deepspeed.stderr";
    std::string ds_why;
    bool deepspeed = false;
    if (no_deepspeed) {
      ds_why = "skipped (--no-deepspeed)";
    } else {
      std::printf("DeepSpeed aio: checking (its first use compiles DeepSpeed's async_io op: minutes)\n");
      std::fflush(stdout);
      deepspeed = !deepspeed_run("--check", ds_err, ds_why).is_null();
    }
    auto deepspeed_pass = [&](row& r) {
      const std::string args = "--file " + shell_quote(fio_file.string()) + " --total-bytes " + std::to_string(total) +
                               " --tensor-bytes " + std::to_string(r.size_mib * MiB) + " --block-bytes " +
                               std::to_string(block) + " --qd " + std::to_string(qd) + " --reps 1";
      const nlohmann::json j = deepspeed_run(args, ds_err, ds_why);
      if (j.is_null()) {  // reported once, after the tables
        deepspeed = false;
        for (auto& x : rows) x.ds_w.clear(), x.ds_r.clear();
        return;
      }
      r.ds_w.push_back(j["write_mbps"].get<double>());
      r.ds_r.push_back(j["read_mbps"].get<double>());
    };
    // Each terrace pass is paired with a fio pass and a DeepSpeed pass next to it, and the ratios
    // are taken per run: the neighbours' load drifts over seconds, so adjacent measurements share
    // most of it. Which of the three goes first rotates from run to run (terrace, fio, DeepSpeed;
    // then fio, DeepSpeed, terrace; ...): on a disk with a host cache, following another engine's
    // read or write of the same bytes is not neutral, so no engine keeps one place.
    for (int run = 0; run < runs; ++run) {
      for (auto& r : rows) {
        for (int k = 0; k < 3; ++k) {
          switch ((run + k) % 3) {
            case 0:
              pass(r, true);
              break;
            case 1:
              if (!no_fio) {
                r.fio_w.push_back(fio_mbps(fio_file, "write", total, block, qd));
                r.fio_r.push_back(fio_mbps(fio_file, "read", total, block, qd));
              }
              break;
            default:
              if (deepspeed) deepspeed_pass(r);
          }
        }
      }
    }
    std::printf("\nmedians over %d runs (order rotated each run); ratios are medians of the per-run ratios\n", runs);
    if (no_fio) std::printf("fio: not measured: %s\n", fio_why.c_str());
    std::printf("| tensor | terrace put MB/s | fio write MB/s | put/fio | terrace get MB/s | fio read MB/s | get/fio |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
    // A figure over the runs where it was measured (a failed fio run gives -1), or "-" for none.
    const auto cell = [](const std::vector<double>& v, const char* format) {
      std::vector<double> ok;
      for (const double x : v)
        if (x > 0) ok.push_back(x);
      char text[64];
      std::snprintf(text, sizeof text, format, median(ok));
      return ok.empty() ? std::string("-") : std::string(text);
    };
    for (auto& r : rows) {
      std::vector<double> pr, gr;
      for (std::size_t i = 0; i < r.fio_w.size(); ++i) {
        if (r.fio_w[i] > 0) pr.push_back(r.put[i] / r.fio_w[i]);
        if (r.fio_r[i] > 0) gr.push_back(r.get[i] / r.fio_r[i]);
      }
      std::printf("| %llu MiB | %.0f | %s | %s | %.0f | %s | %s |\n", static_cast<unsigned long long>(r.size_mib),
                  median(r.put), cell(r.fio_w, "%.0f").c_str(), cell(pr, "%.2f").c_str(), median(r.get),
                  cell(r.fio_r, "%.0f").c_str(), cell(gr, "%.2f").c_str());
    }
    // fio's figures only where it ran: a 0 there would read as a measurement.
    std::printf("\nper-run MB/s, terrace put/get%s:\n", no_fio ? "" : " | fio write/read");
    for (auto& r : rows) {
      std::printf("  %4llu MiB:", static_cast<unsigned long long>(r.size_mib));
      for (std::size_t i = 0; i < r.put.size(); ++i) {
        std::printf("  %.0f/%.0f", r.put[i], r.get[i]);
        if (i < r.fio_w.size()) std::printf(" | %.0f/%.0f", r.fio_w[i], r.fio_r[i]);
      }
      std::printf("\n");
    }
    if (deepspeed) {
      std::printf("\nDeepSpeed aio_handle(block=%zu KiB, qd=%u, single_submit=0, overlap_events=1, threads=1), "
                  "O_DIRECT, same file\n",
                  block_kib, qd);
      std::printf("| tensor | terrace put MB/s | DeepSpeed write MB/s | put/DeepSpeed | terrace get MB/s | "
                  "DeepSpeed read MB/s | get/DeepSpeed |\n");
      std::printf("|---|---|---|---|---|---|---|\n");
      for (auto& r : rows) {
        std::vector<double> pr, gr;
        for (std::size_t i = 0; i < r.ds_w.size(); ++i) {
          if (r.ds_w[i] > 0) pr.push_back(r.put[i] / r.ds_w[i]);
          if (r.ds_r[i] > 0) gr.push_back(r.get[i] / r.ds_r[i]);
        }
        std::printf("| %llu MiB | %.0f | %.0f | %.2f | %.0f | %.0f | %.2f |\n",
                    static_cast<unsigned long long>(r.size_mib), median(r.put), median(r.ds_w), median(pr), median(r.get),
                    median(r.ds_r), median(gr));
      }
      std::printf("\nper-run MB/s, DeepSpeed write/read:\n");
      for (auto& r : rows) {
        std::printf("  %4llu MiB:", static_cast<unsigned long long>(r.size_mib));
        for (std::size_t i = 0; i < r.ds_w.size(); ++i) std::printf("  %.0f/%.0f", r.ds_w[i], r.ds_r[i]);
        std::printf("\n");
      }
    } else {
      std::printf("DeepSpeed aio: not measured: %s\n", ds_why.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_nvme: %s\n", e.what());
    status = 1;
  }
  return status;
}
