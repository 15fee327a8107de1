// SPDX-License-Identifier: Apache-2.0
// `terrace train`, the driver: makes the device and the offload engine from the options, runs the
// steps with checkpoints, draws the progress bar and writes the memory report.
#include "tools/train.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "terrace/config.hpp"
#include "terrace/error.hpp"
#include "tools/replay_format.hpp"

namespace terrace::tools {
namespace {

namespace fs = std::filesystem;

std::string bytes(std::int64_t b) { return format_bytes(b); }

// ------------------------------------------------------------------------------- the directory

// The engine keeps its store in <dir>/store (offload_engine_options::nvme_dir). A folder of that
// name is the store only when it holds the store's index: a user's own `store` folder must never
// be taken for one (--fresh would delete it).
bool holds_store(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / "store" / "index", ec);
}

// A file the tensor store writes in its folder: index, index.tmp, lock, creating, swap.N.
bool is_store_file(const std::string& name) {
  // The names of tiers/store_index.hpp and tensor_store.cpp; "creating" marks an interrupted create.
  if (name == "index" || name == "index.tmp" || name == "lock" || name == "creating") return true;
  // run_settings, below, and its temporaries (replace_file: "train-run.tmp.<pid>.<n>").
  if (name == "train-run" || name.rfind("train-run.tmp.", 0) == 0) return true;
  if (name.size() <= 5 || name.rfind("swap.", 0) != 0) return false;
  return std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The store's files in `folder`. A folder that holds anything else is refused whole.
std::vector<fs::path> store_files(const fs::path& folder) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    if (!is_store_file(name) || entry.is_symlink() || !entry.is_regular_file()) {
      throw train_setup_error(folder.string() + " holds '" + name + "', which terrace did not write: "
                              "it is left alone; remove it or choose another --dir");
    }
    files.push_back(entry.path());
  }
  if (ec) throw train_setup_error("cannot read " + folder.string() + ": " + ec.message());
  return files;
}

// Takes the lock of the store in `folder` (the one its tensor_store holds while open): the
// descriptor holding it, to close when done, or -1 for a store without a lock file. Throws when
// another process has the store open.
int lock_store(const fs::path& folder) {
  const int fd = ::open((folder / "lock").c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    throw train_setup_error("the store in " + folder.parent_path().string() +
                            " is open in another process");
  }
  return fd;
}

// Removes the store in `folder`: its files, then the folder, holding the store's own lock
// throughout (no other process may have it open, nor open it meanwhile).
void remove_store_folder(const fs::path& folder) {
  const std::vector<fs::path> files = store_files(folder);
  std::error_code ec;
  const fs::path lock = folder / "lock";
  const int fd = lock_store(folder);
  for (const fs::path& f : files) {
    if (f != lock) fs::remove(f, ec);
    if (ec) break;
  }
  if (!ec) fs::remove(lock, ec);
  if (fd >= 0) ::close(fd);  // the lock goes with it, after every file
  if (!ec) fs::remove(folder, ec);
  if (ec) throw train_setup_error("cannot remove " + folder.string() + ": " + ec.message());
}

}  // namespace

// Removes the engine's store and nothing else. A folder that holds anything else is refused
// whole, before a file is touched.
void remove_store(const fs::path& dir) { remove_store_folder(dir / "store"); }

namespace {

// The per-step log holds each step once: the steps after `last` (a resumed run's checkpoint;
// 0 for a fresh run) are dropped before this run logs them again. A killed run logged steps its
// last checkpoint did not keep; appended to, the log held them twice.
void keep_logged_steps(const fs::path& path, std::int64_t last) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return;
  std::ifstream in(path);
  std::string kept;
  for (std::string line; std::getline(in, line);) {
    char* end = nullptr;
    const long long step = std::strtoll(line.c_str(), &end, 10);
    if (end != line.c_str() && step >= 1 && step <= last) kept += line + "\n";
  }
  if (const std::string why = replace_file(path, kept); !why.empty()) {
    throw train_setup_error("cannot write the log '" + path.string() + "': " + why);
  }
}

// A fresh run's earlier store waits in <dir>/store.discarded until the new engine is made: only
// then is it removed. A configuration the engine refuses (a budget too small, an lr <= 0, an
// unknown allocator key) puts it back, so the refusal costs no checkpoint.
fs::path discarded_store(const fs::path& dir) { return dir / "store.discarded"; }

void set_store_aside(const fs::path& dir) {
  const fs::path aside = discarded_store(dir);
  std::error_code ec;
  // A run killed between the two leaves one behind: a store, removed as any (a folder of the
  // user's under that name is refused, untouched).
  if (fs::exists(fs::symlink_status(aside, ec))) remove_store_folder(aside);
  const fs::path folder = dir / "store";
  (void)store_files(folder);  // a foreign file is refused before anything moves
  const int fd = lock_store(folder);  // held through the rename: the lock file moves with it
  fs::rename(folder, aside, ec);
  if (fd >= 0) ::close(fd);
  if (ec) throw train_setup_error("cannot move " + folder.string() + " aside: " + ec.message());
}

// Puts a store set aside back where it was, unless the new engine made one there meanwhile.
void restore_store(const fs::path& dir) {
  std::error_code ec;
  const fs::path aside = discarded_store(dir);
  if (fs::is_directory(aside, ec) && !fs::exists(dir / "store", ec)) fs::rename(aside, dir / "store", ec);
}

// What a run's steps compute beyond the model's shape and seed (which the engine's record
// checks): its batches and its update rule. They are kept beside the store's files
// (<dir>/store/train-run, written when the store is made), so that a resume with other ones is
// refused rather than continued as a different run under the checkpoint's step numbers.
// Throughput settings (budgets, bandwidths) are not among them, nor are the device and the
// thread count (reproducibility_settings).
std::vector<std::pair<std::string, std::string>> run_settings(const train_options& o,
                                                              const std::vector<std::uint8_t>& corpus) {
  const auto number = [](double v) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return std::string(buf);
  };
  std::uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a: the text, wherever it lives now
  for (const std::uint8_t b : corpus) hash = (hash ^ b) * 0x100000001b3ull;
  char text[64];
  std::snprintf(text, sizeof text, "%zu bytes, FNV-1a %016llx", corpus.size(),
                static_cast<unsigned long long>(hash));
  std::vector<std::pair<std::string, std::string>> out = {
      {"--batch", std::to_string(o.model.batch)},
      {"--corpus", text},
      {"--lr", number(o.lr)},
      {"--clip", number(o.clip)},
      {"--delayed-update", o.delayed_update ? "on" : "off"},
  };
  if (o.delayed_update) out.emplace_back("--delayed-update-after", std::to_string(o.delayed_update_after));
  return out;
}

// What changes a run's bits but not what it computes: the GEMMs' summation order (cuBLAS or
// OpenBLAS, and OpenBLAS's blocking for its thread count). A checkpoint is the same on any of
// them, so a resume may change them (say onto a GPU); it then says that the continuation is not
// bitwise the run an uninterrupted one would have been.
std::vector<std::pair<std::string, std::string>> reproducibility_settings(const train_options& o) {
  std::vector<std::pair<std::string, std::string>> out = {{"--device", o.device}};
  if (o.device == "sim") out.emplace_back("--threads", std::to_string(model::effective_cpu_threads(o.model)));
  return out;
}

bool is_reproducibility_setting(const std::string& name) { return name == "--device" || name == "--threads"; }

fs::path run_settings_file(const fs::path& dir) { return dir / "store" / "train-run"; }

void save_run_settings(const fs::path& dir, const std::vector<std::pair<std::string, std::string>>& settings) {
  std::string text;
  for (const auto& [name, value] : settings) text += name + " " + value + "\n";
  if (const std::string why = replace_file(run_settings_file(dir), text); !why.empty()) {
    throw train_setup_error("cannot write " + run_settings_file(dir).string() + ": " + why);
  }
}

// A store from before the settings were kept has none to compare: it resumes as it did. Returns
// the notes for the reproducibility settings that changed.
std::vector<std::string> check_run_settings(const fs::path& dir,
                                            const std::vector<std::pair<std::string, std::string>>& settings) {
  std::vector<std::string> notes;
  std::ifstream in(run_settings_file(dir));
  for (std::string line; std::getline(in, line);) {
    const std::size_t space = line.find(' ');
    const std::string name = line.substr(0, space);
    const std::string kept = space == std::string::npos ? "" : line.substr(space + 1);
    const auto it = std::find_if(settings.begin(), settings.end(),
                                 [&](const auto& s) { return s.first == name; });
    const std::string now = it == settings.end() ? "none" : it->second;
    if (kept != now && is_reproducibility_setting(name)) {
      if (now == "none") continue;  // --threads under cuda: the device's note says it
      notes.push_back("the checkpoint was trained with " + name + " " + kept + ", this run has " +
                      now + ": its losses are not bitwise those of an uninterrupted run");
    } else if (kept != now) {
      throw train_setup_error("--resume: the checkpoint in " + dir.string() + " was trained with " +
                              name + " " + kept + ", not " + now + " (a resumed run continues "
                              "the same run: give its options, or --fresh to start over)");
    }
  }
  return notes;
}

void prepare_dir(const train_options& o) {
  const fs::path& dir = o.dir;
  if (o.resume) {
    if (!holds_store(dir)) {
      throw train_setup_error("--resume: " + dir.string() +
                              " holds no checkpoint (no store folder there)");
    }
    return;
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw train_setup_error("cannot create " + dir.string() + ": " + ec.message());
  if (!holds_store(dir)) {
    if (fs::exists(dir / "store", ec)) {
      throw train_setup_error((dir / "store").string() + " exists and is not a terrace store "
                              "(no index): it is left alone; choose another --dir");
    }
    return;
  }
  // A fresh run over an earlier one's checkpoint: the default directory is the demo's scratch and
  // is reused; a directory the user named is only cleared when asked.
  if (!o.dir_is_default && !o.fresh) {
    throw train_setup_error(dir.string() + " holds the checkpoint of an earlier run: --resume "
                            "continues it, --fresh discards it");
  }
  set_store_aside(dir);
}

// ------------------------------------------------------------------------------- the progress bar

std::string format_seconds(double s) {
  char buf[32];
  if (s < 1) {
    std::snprintf(buf, sizeof buf, "%.0f ms", s * 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f s", s);
  }
  return buf;
}

std::string gigabytes(double b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g GB", b / 1e9);
  return buf;
}

std::string percent(double fraction) {
  if (std::isnan(fraction)) return "n/a";
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100 * fraction);
  return buf;
}

class progress_bar {
 public:
  progress_bar(std::FILE* out, int steps) : out_(out), steps_(steps) {
    tty_ = out_ != nullptr && ::isatty(::fileno(out_)) != 0;
  }
  ~progress_bar() { finish(); }

  void line(const offload_step_stats& s, bool checkpointed) {
    if (out_ == nullptr) return;
    const int digits = static_cast<int>(std::to_string(steps_).size());
    std::string text = "step " + pad(std::to_string(s.step), digits) + "/" +
                       std::to_string(steps_) + "  loss " + fixed(s.loss, 4) + "  " +
                       format_seconds(s.seconds) + "/step  dev<->host " +
                       bytes(s.host_to_device_bytes + s.device_to_host_bytes) + "  host<->nvme " +
                       bytes(s.nvme_read_bytes + s.nvme_write_bytes) + "  hidden " +
                       percent(s.transfer_hidden) + (s.skipped ? "  (skipped: inf/nan)" : "") +
                       (checkpointed ? "  [checkpoint]" : "");
    if (tty_) {
      // Redraw one line: carriage return, the text, clear what a longer line left.
      std::fprintf(out_, "\r%s\x1b[K", text.c_str());
      drawn_ = true;
    } else {
      std::fprintf(out_, "%s\n", text.c_str());
    }
    std::fflush(out_);
  }

  void finish() {
    if (drawn_) {
      std::fputc('\n', out_);
      std::fflush(out_);
      drawn_ = false;
    }
  }

 private:
  static std::string pad(std::string s, int width) {
    while (static_cast<int>(s.size()) < width) s.insert(s.begin(), ' ');
    return s;
  }
  static std::string fixed(double v, int decimals) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
    return buf;
  }

  std::FILE* out_;
  int steps_;
  bool tty_ = false;
  bool drawn_ = false;
};

// ------------------------------------------------------------------------------- setup

device_options device_options_for(const train_options& o, std::size_t resident_memory) {
  device_options d;
  if (o.device == "sim") {
    d.capacity = o.resident ? std::max(o.device_memory, resident_memory) : o.device_memory;
    d.copy_bandwidth = o.copy_bandwidth;
  }
  return d;
}

// What a resident run needs on the device: every param and gradient, the activations, and the
// allocator's slack (a quarter more, plus two small-pool segments per stream).
std::size_t resident_device_memory(const model::char_model_config& config) {
  const std::size_t tensors = model::parameter_count(config) * 6;
  return tensors + tensors / 4 + char_model_activation_bytes(config) + (16u << 20);
}

offload_engine_options engine_options_for(const train_options& o, const device_backend& device) {
  offload_engine_options e;
  e.device_budget = o.device_budget;
  e.device_allocator = parse_alloc_conf(o.alloc_conf, e.device_allocator, kTrainReservedAllocKeys);
  // The report replays the recorded trace; --save-trace writes it out.
  e.device_allocator.record_trace = o.write_report || !o.save_trace.empty();
  e.host_budget = o.host_budget;
  e.optimizer_host_budget = o.optimizer_host_budget;
  e.pinned_limit = o.pinned_limit;
  e.nvme_dir = o.dir;
  e.store_capacity = o.store_capacity;
  e.checkpoints = o.checkpoints;
  e.resume = o.resume;
  e.optimizer.adam.lr = o.lr;
  e.optimizer.adam.threads = o.optimizer_threads;
  e.optimizer.chunk_elements = o.chunk_elements;
  e.clip_norm = o.clip;
  e.delayed_update = o.delayed_update;
  e.delayed_update_after = o.delayed_update_after;
  e.seed = o.seed;
  e.copy_bandwidth = device.properties().name == "sim" ? o.copy_bandwidth : 0.0;
  if (o.resident) {
    // Nothing offloaded: the whole device for tensors, prefetch as far as it likes, optimizer
    // state and home copies in host memory.
    e.device_budget = 0;
    e.prefetch_window = device.properties().capacity;
    e.host_budget = 0;
    e.optimizer_host_budget = SIZE_MAX;
  }
  return e;
}

std::string model_text(const model::char_model_config& c) {
  return std::to_string(c.layers) + " blocks x " + std::to_string(c.width) + ", context " +
         std::to_string(c.context) + ", batch " + std::to_string(c.batch) +
         (c.recompute_blocks ? ", blocks recomputed in backward" : "");
}

}  // namespace

fs::path default_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const std::string folder = exe.parent_path().filename().string();
    // <build>/tools/terrace, <build>/tests/..., <build>/tools/bench_train: the build tree is on
    // the disk the build lives on (a tmpfs /tmp would hold the offloaded state in RAM).
    if (folder == "tools" || folder == "tests") return exe.parent_path().parent_path() / "train-state";
  }
  const char* tmp = std::getenv("TMPDIR");
  return fs::path(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") / "terrace-train";
}

train_result run_train(const train_options& options) {
  train_options o = options;
  if (o.dir.empty()) o.dir = default_dir();
  if (o.steps < 1) throw train_setup_error("--steps must be at least 1");
  if (o.checkpoint_every < 0) throw train_setup_error("--checkpoint-every must be >= 0");
  // The sim device's capacity: 0 would be make_device's default (8 GiB), not what was asked.
  if (o.device == "sim" && o.device_memory == 0) {
    throw train_setup_error("--device-memory must be more than 0 (the sim device's capacity)");
  }
  // The engine clips only for a norm > 0: a negative or NaN one would turn clipping off unsaid.
  if (!(o.clip >= 0)) {
    char got[32];
    std::snprintf(got, sizeof got, "%g", o.clip);
    throw train_setup_error(std::string("--clip must be >= 0 (0: no clipping), got ") + got);
  }
  // Checked here, in the option's name: the optimizer would refuse it too, but in its own
  // terms (its field and source expression).
  if (!(o.lr > 0) || !std::isfinite(o.lr)) {
    char got[32];
    std::snprintf(got, sizeof got, "%g", o.lr);
    throw train_setup_error(std::string("--lr must be a positive number, got ") + got);
  }
  if (o.device != "sim" && o.device != "cuda") {
    throw train_setup_error("--device must be sim or cuda, not '" + o.device + "'");
  }
  try {
    model::validate(o.model);
  } catch (const logic_error& e) {
    throw train_setup_error(e.what());
  }
  const std::vector<std::uint8_t> corpus = load_corpus(o.corpus, o.model.context);
  // Files written once the store exists or after training: a folder that is not there is found
  // out now, before --fresh removes anything or a new store is made (which the next run would
  // take for a checkpoint). The log is opened right after the store is made, so a folder given
  // as the log is refused now too.
  for (const fs::path& out : {o.write_report ? o.report : fs::path(), o.save_trace, o.log}) {
    if (out.empty()) continue;
    std::error_code ec;
    const fs::path folder = out.has_parent_path() ? out.parent_path() : fs::path(".");
    if (!fs::is_directory(folder, ec)) {
      throw train_setup_error("cannot write '" + out.string() + "': " + folder.string() +
                              " is not a directory");
    }
  }
  if (std::error_code ec; !o.log.empty() && fs::is_directory(o.log, ec)) {
    throw train_setup_error("cannot write the log '" + o.log.string() + "': it is a directory");
  }
  prepare_dir(o);
  auto settings = run_settings(o, corpus);
  for (auto& s : reproducibility_settings(o)) settings.push_back(std::move(s));
  std::vector<std::string> notes;
  if (o.resume) notes = check_run_settings(o.dir, settings);

  std::unique_ptr<device_backend> device;
  std::unique_ptr<offload_engine> engine;
  // Until the run is ready to train, a failure undoes a fresh run's store (the engine's own
  // failures already did) and puts the earlier one back: the next --resume must not find an
  // untrained store where a checkpoint was.
  struct restore_on_failure {
    const fs::path& dir;
    bool fresh;
    std::unique_ptr<offload_engine>& engine;
    bool armed = true;
    ~restore_on_failure() {
      if (!armed) return;
      if (fresh && engine != nullptr && engine->store() != nullptr) {
        engine.reset();  // closes the store's files
        try {
          remove_store(dir);
        } catch (...) {  // refused or failed: left as it is, and the earlier one with it
          return;
        }
      }
      restore_store(dir);
    }
  } put_back{o.dir, !o.resume, engine};
  try {
    device = make_device(o.device, device_options_for(o, resident_device_memory(o.model)));
    const offload_engine_options eo = engine_options_for(o, *device);
    engine = std::make_unique<offload_engine>(
        *device,
        [&](caching_allocator& activations, stream_ref compute) {
          return make_char_layered_model(o.model, o.seed, *device, activations, compute);
        },
        eo);
  } catch (const out_of_memory& e) {
    throw train_setup_error(e.what());
  } catch (const logic_error& e) {
    throw train_setup_error(e.what());
  } catch (const io_error& e) {
    throw train_setup_error(e.what());
  } catch (const device_error& e) {  // no GPU for --device cuda, among others
    throw train_setup_error(e.what());
  }
  if (!o.resume && engine->store() != nullptr) save_run_settings(o.dir, settings);

  train_result r;
  r.dir = o.dir;
  r.notes = std::move(notes);
  r.parameters = engine->parameter_count();
  r.state_bytes = engine->state_bytes();
  r.device_memory = device->properties().capacity;
  r.tensor_device_budget = engine->tensor_device_budget();

  std::FILE* log = nullptr;
  if (!o.log.empty()) {
    keep_logged_steps(o.log, engine->step_count());
    log = std::fopen(o.log.c_str(), "a");
    if (log == nullptr) {
      throw train_setup_error("cannot open the log '" + o.log.string() + "': " +
                              std::strerror(errno));
    }
  }
  struct closer {
    std::FILE* f;
    ~closer() {
      if (f != nullptr) std::fclose(f);
    }
  } close_log{log};
  // Ready to train: the earlier checkpoint a fresh run set aside goes now.
  put_back.armed = false;
  if (std::error_code ec; fs::exists(discarded_store(o.dir), ec)) {
    remove_store_folder(discarded_store(o.dir));
  }
  // After a resume that changed a reproducibility setting, the kept ones are this run's, from
  // when it trains: a later resume on the same machine continues it without a note.
  if (o.resume && !r.notes.empty() && engine->store() != nullptr) save_run_settings(o.dir, settings);

  std::uint64_t cursor = 0;
  if (const auto& from = engine->resumed_from()) cursor = from->data_cursor;
  r.first_step = engine->step_count() + 1;
  const std::int64_t run_steps = o.steps - r.first_step + 1;
  if (run_steps >= 8) r.steady_from_step = r.first_step + std::max<std::int64_t>(4, run_steps / 4);
  {
    progress_bar bar(o.progress, o.steps);
    for (std::int64_t s = r.first_step; s <= o.steps; ++s) {
      if (s == r.steady_from_step) {  // the whole run's peak is the larger of the two
        r.device_peak_reserved = engine->device_memory().stats().reserved_bytes[0].peak;
        engine->device_memory().reset_peak_stats();
      }
      const std::vector<std::uint8_t> batch = sample_batch(corpus, o.model, o.seed, cursor);
      const offload_step_stats st = engine->step(batch.data());
      ++cursor;
      const bool checkpoint = o.checkpoints && ((o.checkpoint_every > 0 && s % o.checkpoint_every == 0) ||
                                                s == o.steps);
      if (checkpoint) engine->checkpoint(cursor);
      r.steps.push_back(st);
      if (log != nullptr) {
        // Flushed per step: a run killed mid-way leaves every finished step in the log.
        std::fprintf(log, "%lld %a %.6f %.6f %lld %lld %lld %lld %.6f %.6f%s\n",
                     static_cast<long long>(st.step), static_cast<double>(st.loss), st.loss,
                     st.seconds, static_cast<long long>(st.host_to_device_bytes),
                     static_cast<long long>(st.device_to_host_bytes),
                     static_cast<long long>(st.nvme_read_bytes),
                     static_cast<long long>(st.nvme_write_bytes), st.exposed_transfer_seconds,
                     st.transfer_seconds, checkpoint ? " checkpoint" : "");
        std::fflush(log);
      }
      bar.line(st, checkpoint);
      if (o.on_step) o.on_step(st, checkpoint);
    }
  }
  engine->finish_update();  // delayed_update: the last step's update, before reading the state

  r.tiers = engine->tiers().stats();
  r.optimizer = engine->optimizer().stats();
  r.pinned_bytes = engine->pinned_bytes();
  const allocator_stats device_stats = engine->device_memory().stats();
  r.device_peak_reserved = std::max(r.device_peak_reserved, device_stats.reserved_bytes[0].peak);
  if (r.steady_from_step > 0) {
    r.steady_peak_reserved = device_stats.reserved_bytes[0].peak;
    r.steady_peak_allocated = device_stats.allocated_bytes[0].peak;
  }
  r.plan = engine->device_memory().plan_stats();
  if (tensor_store* store = engine->store()) {
    r.store_capacity = store->capacity();
    r.store_used = store->used_bytes();
  }
  // A resume already at (or past) --steps trained nothing: the last run's trace and report stay
  // as they are rather than being replaced by ones of the engine's setup alone.
  if (r.steps.empty()) return r;
  // Training is done and checkpointed from here: a trace or report that cannot be written (a full
  // disk, a bad path, a replay of the report that fails) is reported after the summary, with exit
  // 1, and never costs the summary or passes for a setup error.
  try {
    // One snapshot for both: it copies the whole recorded trace.
    const memory_snapshot snap = !o.save_trace.empty() || o.write_report
                                     ? engine->device_memory().snapshot()
                                     : memory_snapshot{};
    if (!o.save_trace.empty()) {
      // Written beside and renamed over, as the report: a full disk or a kill mid-write never
      // leaves a truncated trace, which would replay as a shorter run.
      std::ostringstream text;
      write_trace_jsonl(text, snap.trace);
      if (const std::string why = replace_file(o.save_trace, text.str()); !why.empty()) {
        throw io_error("cannot write the trace '" + o.save_trace.string() + "': " + why);
      }
      r.trace = o.save_trace;
    }
    if (o.write_report) {
      const fs::path report = o.report.empty() ? o.dir / "memory-report.html" : o.report;
      r.report_summary = write_memory_report(
          snap, engine->device_memory().config(), report,
          "terrace train: " + model_text(o.model) + " on " + device->properties().name);
      r.report = report;
    }
  } catch (const std::exception& e) {
    r.output_error = message_without_origin(e);
  }
  return r;
}

std::string format_train_summary(const train_options& o, const train_result& r) {
  std::string s;
  char buf[512];
  const auto add = [&](const char* fmt, auto... args) {
    std::snprintf(buf, sizeof buf, fmt, args...);
    s += buf;
  };
  add("terrace train: %.1f M-parameter char MLP (%s)\n", static_cast<double>(r.parameters) / 1e6,
      model_text(o.model).c_str());
  add("  model state     %s (bf16 params, fp32 grads, fp32 master, m, v) = %.1fx the device "
      "memory (%s)\n",
      bytes(static_cast<std::int64_t>(r.state_bytes)).c_str(),
      static_cast<double>(r.state_bytes) / static_cast<double>(r.device_memory),
      bytes(static_cast<std::int64_t>(r.device_memory)).c_str());
  if (r.steps.empty()) {
    add("  steps           none: the checkpoint in %s is already at step %lld of %d\n",
        r.dir.c_str(), static_cast<long long>(r.first_step - 1), o.steps);
    return s;
  }
  std::vector<double> times;
  double fb = 0, opt = 0, opt_wait = 0, exposed = 0, transfer = 0;
  std::int64_t up = 0, down = 0, nvme_r = 0, nvme_w = 0;
  for (const auto& st : r.steps) {
    times.push_back(st.seconds);
    fb += st.forward_backward_seconds;
    opt += st.optimizer_seconds;
    opt_wait += st.optimizer_wait_seconds;
    exposed += st.exposed_transfer_seconds;
    transfer += st.transfer_seconds;
    up += st.host_to_device_bytes;
    down += st.device_to_host_bytes;
    nvme_r += st.nvme_read_bytes;
    nvme_w += st.nvme_write_bytes;
  }
  std::sort(times.begin(), times.end());
  const double n = static_cast<double>(r.steps.size());
  add("  steps           %lld..%lld, loss %.4f -> %.4f\n", static_cast<long long>(r.first_step),
      static_cast<long long>(r.steps.back().step), r.steps.front().loss, r.steps.back().loss);
  add("  step time       median %s (mean forward+backward %s, optimizer %s%s)\n",
      format_seconds(times[times.size() / 2]).c_str(), format_seconds(fb / n).c_str(),
      format_seconds(opt / n).c_str(),
      o.delayed_update ? (" beside the next step, waited for " + format_seconds(opt_wait / n)).c_str()
                       : "");
  add("  device<->host   %s up, %s down; the host waited %s on copies that take %s at %s/s: "
      "%s hidden\n",
      bytes(up).c_str(), bytes(down).c_str(), format_seconds(exposed).c_str(),
      transfer > 0 ? format_seconds(transfer).c_str() : "n/a",
      o.device == "sim" ? gigabytes(o.copy_bandwidth).c_str() : "?",
      transfer > 0 ? percent(std::clamp(1.0 - exposed / transfer, 0.0, 1.0)).c_str() : "n/a");
  add("  host<->NVMe     %s read, %s written (optimizer state: %s on the host, %s on NVMe; "
      "the optimizer waited %s for I/O)\n",
      bytes(nvme_r).c_str(), bytes(nvme_w).c_str(),
      bytes(static_cast<std::int64_t>(r.optimizer.host_state_bytes)).c_str(),
      bytes(static_cast<std::int64_t>(r.optimizer.nvme_state_bytes)).c_str(),
      format_seconds(r.optimizer.io_wait_seconds).c_str());
  add("  tiers           device: %s for params and grads (peak %s), %s reserved at peak; pinned "
      "host: %s; NVMe store: %s used of %s\n",
      bytes(static_cast<std::int64_t>(r.tensor_device_budget)).c_str(),
      bytes(r.tiers.device_bytes_peak).c_str(), bytes(r.device_peak_reserved).c_str(),
      bytes(static_cast<std::int64_t>(r.pinned_bytes)).c_str(),
      bytes(static_cast<std::int64_t>(r.store_used)).c_str(),
      bytes(static_cast<std::int64_t>(r.store_capacity)).c_str());
  if (r.steady_from_step > 0) {
    const double unused = unused_fraction(r.steady_peak_allocated, r.steady_peak_reserved);
    add("  steady state    steps %lld..%lld: device peak reserved %s, peak allocated %s (%s unused)\n",
        static_cast<long long>(r.steady_from_step), static_cast<long long>(o.steps),
        bytes(r.steady_peak_reserved).c_str(), bytes(r.steady_peak_allocated).c_str(),
        percent(unused).c_str());
  }
  if (r.plan.enabled && !r.plan.counterfactual) {
    add("  planned policy  %s of %lld device allocations from the plan over %lld iterations (%lld "
        "lost), arena %s for a lower bound of %s, %lld device-side stream waits\n",
        percent(r.plan.hit_rate()).c_str(), static_cast<long long>(r.plan.allocs_under_plan),
        static_cast<long long>(r.plan.iterations), static_cast<long long>(r.plan.lost_iterations),
        bytes(r.plan.arena_bytes).c_str(), bytes(r.plan.lower_bound_bytes).c_str(),
        static_cast<long long>(r.plan.stream_waits));
    if (r.plan.widenings > 0 || r.plan.narrowings > 0) {
      add("                  laid out again for steps that freed its blocks later: %lld time(s); for "
          "want of room on the device: %lld time(s)\n",
          static_cast<long long>(r.plan.widenings), static_cast<long long>(r.plan.narrowings));
    }
    if (r.plan.lazy_arenas > 0) {
      add("                  the device could not hold the arena beside the blocks live at the "
          "boundary: mapped page by page %lld time(s), %lld request(s) found no page\n",
          static_cast<long long>(r.plan.lazy_arenas), static_cast<long long>(r.plan.map_refusals));
    }
  }
  add("  prefetch        %lld hits, %lld on demand, %lld evictions, %lld schedule misses\n",
      static_cast<long long>(r.tiers.prefetch_hits), static_cast<long long>(r.tiers.demand_fetches),
      static_cast<long long>(r.tiers.evictions), static_cast<long long>(r.tiers.schedule_misses));
  if (o.checkpoints) {
    add("  checkpoint      step %lld in %s (continue with --resume --dir %s)\n",
        static_cast<long long>(r.steps.back().step), r.dir.c_str(), r.dir.c_str());
  }
  if (!r.trace.empty()) add("  device trace    %s\n", r.trace.c_str());
  if (!r.report.empty()) {
    add("  memory report   %s\n", r.report.c_str());
    s += "\n" + r.report_summary;
  }
  return s;
}

}  // namespace terrace::tools
