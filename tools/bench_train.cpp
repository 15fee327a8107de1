// SPDX-License-Identifier: Apache-2.0
// bench_train: the offload engine under `terrace train`, measured two ways (docs/offload.md).
//
// 1. Overlap on the sim device. The demo model is trained for a few steps at each of a falling
//    series of copy bandwidths; for each it prints the median step, the host's exposed wait on
//    transfers (the model's wait on its stream plus the optimizer's wait for gradients to come
//    home) as a fraction of the step and of forward+backward, and the share of the modelled copy
//    time (bytes / bandwidth) hidden behind compute. The peer, measured in the same run, is the
//    resident configuration (every param and gradient fits on the device).
//
// 2. The delayed parameter update (offload_engine_options::delayed_update): the same training,
//    ordinary and delayed, alternated --rounds times at 8 GB/s; it prints each run's median step
//    and optimizer time and the median ratio of delayed to ordinary step time (its peer).
//
// 3. The largest model for given budgets. For a device budget D, pinned host memory H and a disk
//    (store) of N bytes, it searches the most residual blocks of the given width that construct
//    and train two steps without error, and compares the parameter count with the capacity bound
//    (D + H + N) / 18 B per parameter (bf16 param, fp32 grad, fp32 master, m, v).
//
//   bench_train [--steps 6] [--layers 16] [--width 1024] [--bandwidths 64,16,8,4,2,1,0.5,0.25]
//               [--device-mib 28] [--host-mib 256] [--disk-mib 4096] [--delayed-steps 20]
//               [--rounds 3] [--skip-overlap] [--skip-delayed] [--skip-capacity] [--dir DIR]
//   DIR (created when missing) is left as it was: the stores go in DIR/bench_train.<pid>.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "terrace/error.hpp"
#include "tools/bench_scratch.hpp"
#include "tools/bench_stats.hpp"
#include "tools/train.hpp"

namespace {

namespace fs = std::filesystem;
using terrace::tools::train_options;
using terrace::tools::train_result;
using terrace::tools::median;

struct overlap_row {
  double step = 0, fb = 0, exposed = 0, transfer = 0, optimizer = 0;
};

// Medians over the steps after the first two (the first records the schedule, the second is the
// first to prefetch from it).
overlap_row measure(const train_options& base, double bandwidth, bool resident) {
  train_options o = base;
  o.copy_bandwidth = bandwidth;
  o.resident = resident;
  const train_result r = terrace::tools::run_train(o);
  std::vector<double> step, fb, exposed, transfer, optimizer;
  for (std::size_t i = 2; i < r.steps.size(); ++i) {
    step.push_back(r.steps[i].seconds);
    fb.push_back(r.steps[i].forward_backward_seconds);
    exposed.push_back(r.steps[i].exposed_transfer_seconds);
    transfer.push_back(r.steps[i].transfer_seconds);
    optimizer.push_back(r.steps[i].optimizer_seconds);
  }
  return {median(step), median(fb), median(exposed), median(transfer), median(optimizer)};
}

void overlap(const train_options& base, const std::vector<double>& bandwidths) {
  std::printf("== overlap: %d blocks x %d, batch %d, device %zu MiB, %d steps per point "
              "(medians over steps 3..)\n",
              base.model.layers, base.model.width, base.model.batch, base.device_memory >> 20,
              base.steps);
  const overlap_row peer = measure(base, 0.0, true);
  std::printf("resident peer (no copy bandwidth limit): step %.0f ms, forward+backward %.0f ms, "
              "exposed %.1f ms\n\n",
              peer.step * 1e3, peer.fb * 1e3, peer.exposed * 1e3);
  std::printf("%10s %9s %9s %9s %9s %9s %10s %8s\n", "bandwidth", "step ms", "fwd+bwd", "exposed",
              "exp/step", "exp/f+b", "copy ms", "hidden");
  for (double bw : bandwidths) {
    const overlap_row r = measure(base, bw * 1e9, false);
    const double hidden = r.transfer > 0 ? std::clamp(1 - r.exposed / r.transfer, 0.0, 1.0) : NAN;
    std::printf("%7.2f GB/s %9.0f %9.0f %9.1f %8.1f%% %8.1f%% %10.1f %7.1f%%\n", bw,
                r.step * 1e3, r.fb * 1e3, r.exposed * 1e3, 100 * r.exposed / r.step,
                100 * r.exposed / r.fb, r.transfer * 1e3, 100 * hidden);
    std::fflush(stdout);
  }
  std::printf("\n");
}

// ------------------------------------------------------------------------------- delayed update

void delayed(const train_options& base, int steps, int rounds) {
  train_options o = base;
  o.steps = steps;
  std::printf("== delayed parameter update: %d blocks x %d, batch %d, device %zu MiB, 8 GB/s, "
              "%d steps per run (medians over steps 3..), %d rounds\n",
              o.model.layers, o.model.width, o.model.batch, o.device_memory >> 20, steps, rounds);
  std::printf("%6s %13s %13s %15s %15s %9s\n", "round", "ordinary ms", "delayed ms",
              "ord. optim. ms", "del. optim. ms", "ratio");
  std::vector<double> ratios;
  for (int r = 1; r <= rounds; ++r) {
    o.delayed_update = false;
    const overlap_row a = measure(o, 8e9, false);
    o.delayed_update = true;
    o.delayed_update_after = 0;  // every step timed is a delayed one
    const overlap_row b = measure(o, 8e9, false);
    ratios.push_back(b.step / a.step);
    std::printf("%6d %13.0f %13.0f %15.0f %15.0f %9.2f\n", r, a.step * 1e3, b.step * 1e3,
                a.optimizer * 1e3, b.optimizer * 1e3, ratios.back());
    std::fflush(stdout);
  }
  std::printf("median step time, delayed / ordinary: %.2f\n\n", median(ratios));
}

// ------------------------------------------------------------------------------- capacity

struct budgets {
  std::size_t device, host, disk;
};

// The split of the host budget: the tier manager's pinned home copies get the device's tensors
// plus four layers (the optimizer steps a few at a time when the rest is on NVMe, and reads from
// NVMe in flight hold their buffers), the engine's and the optimizer's staging buffers theirs, an
// eighth goes to the pinned pool's 64 MiB regions not tiling exactly, and the optimizer state
// gets what is left. No checkpoints (the store then holds the state once). Batch 8: the model keeps every block's activations (no activation
// checkpointing), which at batch 64 would fill the device before the state fills the disk.
train_options capacity_options(const train_options& base, const budgets& b, int layers) {
  train_options o = base;
  o.model.layers = layers;
  o.model.batch = 8;
  o.steps = 2;
  o.checkpoints = false;
  o.write_report = false;
  o.device_memory = b.device;
  o.pinned_limit = b.host;
  o.store_capacity = b.disk;
  const std::size_t width = static_cast<std::size_t>(o.model.width);
  const std::size_t layer_bytes = width * (width + 1) * 6;
  const std::size_t activations = terrace::tools::char_model_activation_bytes(o.model);
  const std::size_t tensors = b.device > activations ? b.device - activations : 0;
  o.host_budget = tensors + 4 * layer_bytes;
  const std::size_t engine_staging = std::size_t{1} << 22;  // elements (offload_engine.cpp)
  const std::size_t staging = engine_staging * 6 + 3 * o.chunk_elements * 12;
  const std::size_t reserve = o.host_budget + staging + b.host / 8;
  o.optimizer_host_budget = b.host > reserve ? b.host - reserve : 0;
  return o;
}

bool trains(const train_options& o, std::string& why) {
  try {
    (void)terrace::tools::run_train(o);
    return true;
  } catch (const std::exception& e) {
    why = e.what();
    return false;
  }
}

void capacity(const train_options& base, const budgets& b) {
  const double per_layer =
      static_cast<double>(base.model.width) * (base.model.width + 1);
  const double bound = static_cast<double>(b.device + b.host + b.disk) / 18.0;
  std::printf("== capacity: device %zu MiB, pinned host %zu MiB, disk %zu MiB; width %d\n",
              b.device >> 20, b.host >> 20, b.disk >> 20, base.model.width);
  std::printf("capacity bound (device + host + disk) / 18 B = %.2f M parameters\n", bound / 1e6);
  int lo = 1, hi = static_cast<int>(bound / per_layer) + 2;
  std::string why;
  if (!trains(capacity_options(base, b, lo), why)) {
    std::printf("not even one block trains: %s\n", why.c_str());
    return;
  }
  // Invariant: lo trains, hi does not (hi is above the bound: it cannot).
  std::string last_failure;
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    std::string w;
    const bool ok = trains(capacity_options(base, b, mid), w);
    std::printf("  %4d blocks: %s\n", mid, ok ? "trains" : ("fails: " + w.substr(0, 160)).c_str());
    std::fflush(stdout);
    if (ok) {
      lo = mid;
    } else {
      hi = mid;
      last_failure = w;
    }
  }
  terrace::model::char_model_config c = base.model;
  c.layers = lo;
  const double params = static_cast<double>(terrace::model::parameter_count(c));
  std::printf("largest: %d blocks = %.2f M parameters = %.3f of the bound\n", lo, params / 1e6,
              params / bound);
  std::printf("one more block fails with: %s\n\n", last_failure.c_str());
}

// Comma-separated positive numbers. Anything else is refused: std::stod read "8x" as 8, and a
// bandwidth of 0 (the sim's "no limit") or below would print a row for a bandwidth never modelled.
std::vector<double> parse_bandwidths(const std::string& text) {
  std::vector<double> out;
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const char* const begin = text.data() + at;
    const char* const end = text.data() + comma;
    double value = 0;
    const auto [stop, ec] = std::from_chars(begin, end, value);
    if (begin == end || ec != std::errc() || stop != end || !(value > 0) || !std::isfinite(value)) {
      throw std::invalid_argument("--bandwidths '" + text + "': expected positive GB/s figures, comma-separated");
    }
    out.push_back(value);
    at = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_train: overlap and capacity of the offload engine (terrace train)"};
  train_options base;
  base.steps = 6;
  base.checkpoint_every = 0;
  base.write_report = false;
  std::string bandwidths = "64,16,8,4,2,1,0.5,0.25";
  std::size_t device_mib = 28, host_mib = 256, disk_mib = 4096;
  bool skip_overlap = false, skip_capacity = false, skip_delayed = false;
  int delayed_steps = 20, rounds = 3;
  std::string dir;
  // Medians are taken over the steps after the first two: fewer than three would leave none.
  app.add_option("--steps", base.steps, "steps per overlap point")
      ->check(CLI::Range(3, 100000))
      ->capture_default_str();
  app.add_option("--layers", base.model.layers, "residual blocks (overlap)")->capture_default_str();
  app.add_option("--width", base.model.width, "hidden width")->capture_default_str();
  app.add_option("--bandwidths", bandwidths, "GB/s, comma-separated")->capture_default_str();
  // Up to 1 PiB: in bytes (<< 20) a larger figure would wrap to a small one unnoticed.
  const auto mib_range = CLI::Range(std::size_t{1}, std::size_t{1} << 30);
  app.add_option("--device-mib", device_mib, "device memory")->check(mib_range)->capture_default_str();
  app.add_option("--host-mib", host_mib, "pinned host memory (capacity)")
      ->check(mib_range)
      ->capture_default_str();
  app.add_option("--disk-mib", disk_mib, "NVMe store (capacity)")->check(mib_range)->capture_default_str();
  app.add_option("--dir", dir,
                 "where to make the scratch folder for the stores (default: <build>/bench-train-scratch; "
                 "removed at the end)");
  app.add_flag("--skip-overlap", skip_overlap);
  app.add_flag("--skip-capacity", skip_capacity);
  app.add_option("--delayed-steps", delayed_steps, "steps per run of the delayed-update comparison")
      ->check(CLI::Range(3, 100000))
      ->capture_default_str();
  app.add_option("--rounds", rounds, "ordinary/delayed pairs")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_flag("--skip-delayed", skip_delayed);
  CLI11_PARSE(app, argc, argv);
  base.device_memory = device_mib << 20;
  int status = 0;
  try {
    // Every run starts over in its folder, discarding the store it finds there: a folder of the
    // benchmark's own, never `terrace train`'s <build>/train-state, whose checkpoint it used to
    // discard. Removed at the end with the stores trained in it (up to --disk-mib of swap file).
    const terrace::tools::bench_scratch scratch(
        dir.empty() ? terrace::tools::default_dir().parent_path() / "bench-train-scratch" : fs::path(dir),
        "bench_train");
    base.dir = scratch.path();
    base.dir_is_default = true;
    if (!skip_overlap) overlap(base, parse_bandwidths(bandwidths));
    if (!skip_delayed) delayed(base, delayed_steps, rounds);
    if (!skip_capacity) capacity(base, {device_mib << 20, host_mib << 20, disk_mib << 20});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train: %s\n", e.what());
    status = 1;
  }
  return status;
}
