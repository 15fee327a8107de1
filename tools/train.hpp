// SPDX-License-Identifier: Apache-2.0
/// @file train.hpp
/// @brief `terrace train`: the char-level demo model trained through the offload engine, with its
/// state across device, pinned host memory and NVMe. The engine under the command line, kept free
/// of argument parsing so that tests and bench_train call it directly.
///
///   train.cpp         the driver: device, engine, steps, checkpoints, progress, summary
///   train_model.cpp   the char model as a layered_model, the corpus and its batches
///   train_report.cpp  the memory report from the device allocator's recorded trace
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/char_model.hpp"
#include "terrace/config.hpp"
#include "terrace/planner.hpp"
#include "terrace/offload_engine.hpp"

namespace terrace::tools {

/// @brief The allocator keys that train_options::alloc_conf refuses: the tool sets them itself, so
/// given there they would be ignored (the device comes from --device, --device-memory and
/// --bandwidth) or overwritten (record_trace).
inline const std::vector<alloc_conf_reserved_key> kTrainReservedAllocKeys = {
    {"device", "use --device"},
    {"device_capacity", "use --device-memory"},
    {"copy_bandwidth", "use --bandwidth"},
    {"record_trace", "use --save-trace (the memory report records the trace too, unless --no-report)"}};

/// @brief A configuration that cannot train (budgets, a missing corpus, a directory that holds a
/// checkpoint on a fresh run): raised before the first step. The command line exits 2 on it.
class train_setup_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct train_options {
  // ---- the model and the data
  model::char_model_config model{};  ///< width, layers, batch, ... (cpu_threads for OpenBLAS)
  std::string corpus = "/usr/share/common-licenses/GPL-3";
  std::uint64_t seed = 1;
  int steps = 250;
  double lr = 3e-4;
  double clip = 1.0;  ///< global gradient norm clip; 0: none
  /// The optimizer of step t runs beside the forward of t+1 (offload_engine_options), after
  /// `delayed_update_after` undelayed steps.
  bool delayed_update = false;
  std::int64_t delayed_update_after = 10;

  // ---- the device
  std::string device = "sim";          ///< sim (default) or cuda
  /// sim: the device's capacity. The default makes the demo's state (297 MiB) 10.6x the device.
  std::size_t device_memory = 28u << 20;
  double copy_bandwidth = 8e9;         ///< sim: host<->device bytes/s
  std::size_t device_budget = 0;       ///< what the engine may use (0: all of the device)
  /// TERRACE_ALLOC_CONF-style keys over the engine's device allocator settings
  /// (offload_engine_options::default_device_allocator), e.g. "policy:planned"; not those of
  /// kTrainReservedAllocKeys.
  std::string alloc_conf;

  // ---- host and NVMe
  std::size_t host_budget = 0;         ///< pinned home copies of params + grads (0: all)
  std::size_t optimizer_host_budget = 64u << 20;  ///< master + m + v in host memory; rest on NVMe
  std::size_t pinned_limit = 0;        ///< most pinned bytes (0: no limit of terrace's own)
  std::size_t chunk_elements = std::size_t{1} << 19;  ///< optimizer pipeline chunk
  unsigned optimizer_threads = 0;      ///< CPU Adam threads (0: all cores)
  std::filesystem::path dir;           ///< the store's directory (see default_dir)
  bool dir_is_default = true;          ///< a fresh run may replace a store there
  bool fresh = false;                  ///< discard a store in `dir` (given dir) and start over
  bool resume = false;                 ///< continue from the last checkpoint in `dir`
  std::uint64_t store_capacity = 0;    ///< 0: what the configuration needs
  int checkpoint_every = 50;           ///< steps; 0: only at the end
  /// No checkpoints at all: the store then needs room for the state once, not twice (the
  /// capacity benchmark). A run without checkpoints cannot be resumed.
  bool checkpoints = true;
  /// Budgets so large that nothing is offloaded: the device holds every param and gradient, the
  /// optimizer state stays in host memory (the peer run; NVMe only for checkpoints).
  bool resident = false;

  // ---- output
  std::FILE* progress = nullptr;       ///< the progress bar (stderr in the CLI); nullptr: none
  std::filesystem::path report;        ///< the memory report (empty: <dir>/memory-report.html)
  bool write_report = true;
  /// The device allocator's recorded trace, written as terrace JSON lines (trace.hpp) for
  /// `terrace compare` / `terrace replay` and the planner's tests. Empty: not written.
  std::filesystem::path save_trace;
  /// One line per step (flushed): step, loss as a C99 hex float (exact), loss, seconds, bytes up,
  /// down, NVMe read, NVMe written, exposed wait, transfer seconds. Empty: none. A fresh run
  /// starts it anew; a resumed one keeps the lines of the steps its checkpoint holds.
  std::filesystem::path log;
  /// Called after every step (after its checkpoint, if any, with `checkpointed` set).
  std::function<void(const offload_step_stats& step, bool checkpointed)> on_step;
};

struct train_result {
  std::vector<offload_step_stats> steps;  ///< this run's steps, in order
  std::int64_t first_step = 1;            ///< the step number of steps[0] (after a resume: > 1)
  std::size_t parameters = 0;
  std::size_t state_bytes = 0;            ///< 18 B per parameter (bf16, fp32 grad, master, m, v)
  std::size_t device_memory = 0;          ///< the device's capacity
  std::size_t tensor_device_budget = 0;   ///< the tier manager's share of it
  std::size_t pinned_bytes = 0;
  std::uint64_t store_capacity = 0;       ///< 0 without NVMe
  std::uint64_t store_used = 0;
  tier_stats tiers{};                     ///< the tier manager's counters at the end
  offload_adam_stats optimizer{};
  std::int64_t device_peak_reserved = 0;  ///< the device allocator's peak reserved bytes
  /// The steady state: from step steady_from_step on (after the first quarter of the run, when
  /// the planned policy has learnt its iteration), the device allocator's peak reserved and peak
  /// allocated bytes. steady_from_step = 0 when the run is too short to have one.
  std::int64_t steady_from_step = 0;
  std::int64_t steady_peak_reserved = 0;
  std::int64_t steady_peak_allocated = 0;
  planner_stats plan{};                   ///< the device allocator's planner (policy planned)
  std::filesystem::path dir;
  std::filesystem::path report;           ///< written (empty when not)
  std::filesystem::path trace;            ///< the saved device trace (empty when not)
  std::string report_summary;             ///< the report's plain-text summary
  /// Why the trace or the report could not be written after training (empty: both were, or none
  /// was asked for). The training itself and its checkpoint are done.
  std::string output_error;
  /// Said before the summary: a resume under another device or thread count than its checkpoint's.
  std::vector<std::string> notes;
};

/// @brief `<build dir>/train-state` for the running executable (its folder's parent when it lives
/// in <build>/tools), else $TMPDIR (or /tmp) /terrace-train.
std::filesystem::path default_dir();

/// @brief Removes the store in `dir` (dir/store: the tensor store's own files, then the folder)
/// and nothing else.
/// @throws train_setup_error when the folder cannot be read, holds a file the store did not
/// write (nothing is removed then), the store is open in another process, or a file cannot be
/// removed.
void remove_store(const std::filesystem::path& dir);

/// @brief Trains (or resumes) as `options` say. Progress goes to options.progress.
/// @throws train_setup_error for a configuration that cannot train, before any step; what the
///         engine throws during training otherwise.
train_result run_train(const train_options& options);

/// @brief The closing summary the command prints (stdout).
std::string format_train_summary(const train_options& options, const train_result& result);

// ---- train_model.cpp

/// @brief The bytes of a text corpus. @throws train_setup_error when it cannot be read or holds
/// fewer than context + 1 bytes.
std::vector<std::uint8_t> load_corpus(const std::string& path, int context);

/// @brief Batch number `index` of `config.batch` rows of context + 1 bytes taken from `corpus` at
/// offsets drawn from (seed, index): the same batch for the same index on every run, which is
/// what lets a resumed run continue where the checkpoint left off. @throws logic_error for a
/// corpus shorter than one row.
std::vector<std::uint8_t> sample_batch(const std::vector<std::uint8_t>& corpus,
                                       const model::char_model_config& config, std::uint64_t seed,
                                       std::uint64_t index);

/// @brief Device bytes the char model's activations and per-call scratch take at their peak, as
/// the engine's device allocator rounds them. Not a strict bound: a request may get a cached
/// block up to 64 KiB larger than it asked for (with recompute_blocks the peak measured 12-16 KiB
/// above this, width 1024-2048), which the engine's allocator slack (1 MiB + 1/32 of the budget)
/// absorbs.
std::size_t char_model_activation_bytes(const model::char_model_config& config);

/// @brief The char model as the engine's layered_model (init from `seed`).
std::unique_ptr<layered_model> make_char_layered_model(const model::char_model_config& config,
                                                       std::uint64_t seed, device_backend& device,
                                                       caching_allocator& activations,
                                                       stream_ref stream);

// ---- train_report.cpp

/// @brief Writes `contents` beside `path` (a new file, "<path>.tmp.<pid>.<n>") and renames it
/// over: a failed write leaves the old file whole, never half, and no other file is touched.
/// Returns why it could not (the temporary removed), or "" once written.
std::string replace_file(const std::filesystem::path& path, std::string_view contents);

/// @brief Writes the profiler's HTML report (tools/html_report.hpp) for the device allocator's
/// recorded trace: the trace replayed under caching, expandable and planned, the segments at the
/// peak and the largest holders. @returns the report's plain-text summary.
/// @throws std::runtime_error when the file cannot be written.
std::string write_memory_report(const memory_snapshot& recorded, const allocator_config& config,
                                const std::filesystem::path& path, const std::string& title);

}  // namespace terrace::tools
