// SPDX-License-Identifier: Apache-2.0
// The `terrace` command line. Each subcommand is a setup function that declares its arguments and a
// run function that does the work, so that `report` and `compare` slot in beside `replay`.
//
// Exit codes: 0 success; 1 a device or runtime failure; 2 bad input (usage, configuration, a
// device this build or machine does not have, a malformed or inconsistent trace).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "terrace/config.hpp"
#include "terrace/device.hpp"
#include "terrace/error.hpp"
#include "terrace/trace.hpp"
#include "tools/html_report.hpp"
#include "tools/replay.hpp"
#include "tools/replay_format.hpp"
#include "tools/trace_import.hpp"
#include "tools/train.hpp"

namespace {

// A whole number that fits in 64 unsigned bits, as written. CLI11 reads an unsigned option with
// strtoull, which takes "-1" as 2^64 - 1 and clamps an overflowing number to it: two seeds the
// user never gave, run without a word.
const CLI::Validator kUnsigned64(
    [](std::string& text) -> std::string {
      std::uint64_t value = 0;
      const char* const end = text.data() + text.size();
      const auto [stop, ec] = std::from_chars(text.data(), end, value);
      if (text.empty() || ec != std::errc() || stop != end) {
        return "expected a whole number from 0 to 18446744073709551615, got '" + text + "'";
      }
      return {};
    },
    "UINT64");

constexpr int kExitFailure = 1;
constexpr int kExitBadInput = 2;

// Reads the trace and says on stderr what the reader chose (stdout may be --json).
terrace::tools::imported_trace import(const char* command, const std::string& path,
                                      const std::string& format) {
  auto imported = terrace::tools::import_trace(path, format);
  for (const auto& note : imported.notes) fmt::print(stderr, "{}: note: {}\n", command, note);
  // A report of zeros would read as a measurement; a trace with nothing to replay is bad input
  // (the wrong file, or a snapshot taken before _record_memory_history).
  const bool allocates = std::any_of(imported.events.begin(), imported.events.end(), [](const auto& e) {
    return e.action == terrace::trace_action::alloc;
  });
  if (!allocates) {
    const std::size_t n = imported.events.size();
    throw terrace::logic_error(
        n == 0 ? fmt::format("{}: nothing to replay: the trace has no events", path)
               : fmt::format("{}: nothing to replay: none of its {} event{} is an allocation", path,
                             n, n == 1 ? "" : "s"));
  }
  return imported;
}

// A CUDA backend that this build or this machine cannot provide makes the --device (or --conf
// device:) value unusable: bad input, exit 2, said before the trace is read. A device_error from a
// device that exists stays a failed run (exit 1). make_device is the one place that knows why a
// backend is missing (no CUDA in this build, or no usable GPU), so its message is passed on.
void require_available_device(const std::string& name) {
  if ((name != "cuda" && name != "cuda-vmm") || terrace::cuda_device_available()) return;
  try {
    (void)terrace::make_device(name);
  } catch (const terrace::device_error& e) {
    throw terrace::logic_error(std::string(terrace::message_without_origin(e)));
  }
}

// The keys --conf (or --alloc-conf) takes, less `reserved`, from the parser itself so that the
// help cannot drift from it.
std::string conf_keys_help(const std::vector<terrace::alloc_conf_reserved_key>& reserved = {}) {
  std::vector<std::string_view> keys;
  for (std::string_view key : terrace::alloc_conf_keys()) {
    if (std::none_of(reserved.begin(), reserved.end(), [&](const auto& r) { return r.key == key; })) {
      keys.push_back(key);
    }
  }
  return fmt::format("; keys: {} (each once; README.md, \"Configuration\")", fmt::join(keys, ", "));
}

// compare and report run each policy with its own policy key over --conf, which would override
// these silently.
const std::vector<terrace::alloc_conf_reserved_key> kSetPerPolicy = {
    {"policy", "compare and report run every policy in turn"},
    {"expandable_segments", "compare and report run every policy in turn, expandable among them"}};

// ------------------------------------------------------------------------------------- replay

struct replay_args {
  std::string trace;
  std::string device = "null";
  bool expandable = false;
  std::string conf;
  bool json = false;
  std::string policy;
  std::string format = "auto";
  CLI::Option* device_option = nullptr;
};

constexpr const char* kFormatHelp =
    "input format: auto (by extension, then content), jsonl (terrace), pickle (PyTorch "
    "_dump_snapshot, read without running code), snapshot-json, kineto (profiler JSON with "
    "[memory] events), rmm (RMM logging CSV)";
constexpr const char* kTraceHelp =
    "the trace (see --format and docs/trace-format.md; - reads standard input)";

CLI::App* setup_replay(CLI::App& app, replay_args& args) {
  CLI::App* cmd = app.add_subcommand(
      "replay",
      "Replay an allocation trace (any format of --format) through terrace's allocator under "
      "one policy (--policy) and report peak memory, fragmentation and the allocator's stats.");
  cmd->add_option("TRACE", args.trace, kTraceHelp)->required();
  args.device_option =
      cmd->add_option("--device", args.device,
                      "backend: null (addresses only, never touched; 1 TiB unless --conf "
                      "device_capacity says more), sim (host memory), cuda, cuda-vmm")
          ->check(CLI::IsMember({"null", "sim", "cuda", "cuda-vmm"}))
          ->capture_default_str();
  cmd->add_flag("--expandable", args.expandable,
                "expandable segments (growing virtual ranges per stream and pool)");
  cmd->add_option("--conf", args.conf,
                  "allocator options as in TERRACE_ALLOC_CONF, e.g. "
                  "max_split_size_mb:64,roundup_power2_divisions:4,device_capacity:80GiB" +
                      conf_keys_help());
  cmd->add_flag("--json", args.json, "print one JSON object instead of the text report");
  cmd->add_option("--policy", args.policy,
                  "caching, expandable or planned (then --conf may not set policy or "
                  "expandable_segments); all = each in "
                  "turn (a JSON array with --json)")
      ->check(CLI::IsMember({"caching", "expandable", "planned", "all"}));
  cmd->add_option("--format", args.format, kFormatHelp)
      ->check(CLI::IsMember({"auto", "jsonl", "pickle", "snapshot-json", "kineto", "rmm"}))
      ->capture_default_str();
  return cmd;
}

// compare and report: --conf for every policy (replay_policies sets each policy), on the null
// backend unless --conf names a device.
terrace::tools::replay_options compare_options(const std::string& conf) {
  terrace::tools::replay_options o;
  o.config = terrace::parse_alloc_conf(conf, {}, kSetPerPolicy);
  o.device = o.config.device == "auto" ? "null" : o.config.device;
  require_available_device(o.device);
  return o;
}

int run_replay(replay_args& args) {
  terrace::tools::replay_options options;
  // With --policy or --expandable, those flags choose the policy: the same choice in --conf
  // would be overridden or contradicted without a word (expandable_segments:true under
  // --policy caching was dropped).
  const std::string chosen_by =
      (!args.policy.empty() ? "--policy " + args.policy : std::string("--expandable")) +
      " chooses the policy";  // outlives set_by_flags, which views it
  std::vector<terrace::alloc_conf_reserved_key> set_by_flags;
  if (!args.policy.empty() || args.expandable) {
    set_by_flags = {{"policy", chosen_by}, {"expandable_segments", chosen_by}};
  }
  options.config = terrace::parse_alloc_conf(args.conf, {}, set_by_flags);
  // An explicit --device, or a `device:` key in --conf (not both, unless they agree); otherwise null.
  if (args.device_option->count() != 0 || options.config.device == "auto") {
    if (options.config.device != "auto" && options.config.device != args.device) {
      throw terrace::logic_error("--device " + args.device + " contradicts device:" +
                                 options.config.device + " in --conf");
    }
    options.device = args.device;
  } else {
    options.device = options.config.device;
  }
  require_available_device(options.device);
  if (args.expandable) {
    // It would be dropped without a word: policy:caching and policy:planned turn it off again.
    if (!args.policy.empty() && args.policy != "expandable") {
      throw terrace::logic_error("--expandable contradicts --policy " + args.policy +
                                 " (--policy expandable is the same as --expandable)");
    }
    options.config.expandable_segments = true;
  }
  const auto imported = import("terrace replay", args.trace, args.format);
  const auto& events = imported.events;
  if (args.policy == "all") {
    // As compare runs them: caching and expandable measured over the planned policy's steady
    // state, so that one trace gives each policy one steady-state figure.
    std::vector<std::string> outputs;
    for (const auto& [p, r] : terrace::tools::replay_policies(events, options)) {
      const terrace::tools::replay_context ctx{args.trace, p == "expandable", args.conf};
      outputs.push_back(args.json ? terrace::tools::format_replay_json(r, ctx)
                                  : fmt::format("== policy {}\n{}", p,
                                                terrace::tools::format_replay_text(r, ctx)));
    }
    if (args.json) {
      fmt::print("[{}]\n", fmt::join(outputs, ","));
    } else {
      fmt::print("{}", fmt::join(outputs, "\n"));
    }
    return 0;
  }
  if (!args.policy.empty()) {
    options.config = terrace::parse_alloc_conf("policy:" + args.policy, options.config);
  }
  const auto result = terrace::tools::replay(events, options);

  const terrace::tools::replay_context context{args.trace, options.config.expandable_segments,
                                               args.conf};
  if (args.json) {
    fmt::print("{}\n", terrace::tools::format_replay_json(result, context));
  } else {
    fmt::print("{}", terrace::tools::format_replay_text(result, context));
  }
  return 0;
}

// ------------------------------------------------------------------- compare and report

struct compare_args {
  std::string trace;
  std::string conf;
  std::string format = "auto";
  bool json = false;
  std::string output;  // report only
};

void add_common(CLI::App* cmd, compare_args& args) {
  cmd->add_option("TRACE", args.trace, kTraceHelp)->required();
  cmd->add_option("--conf", args.conf,
                  "allocator options as in TERRACE_ALLOC_CONF, applied to every policy" +
                      conf_keys_help(kSetPerPolicy));
  cmd->add_option("--format", args.format, kFormatHelp)
      ->check(CLI::IsMember({"auto", "jsonl", "pickle", "snapshot-json", "kineto", "rmm"}))
      ->capture_default_str();
}

CLI::App* setup_compare(CLI::App& app, compare_args& args) {
  CLI::App* cmd = app.add_subcommand(
      "compare",
      "Replay a trace over the null backend under each policy (caching, expandable, planned) and "
      "put peak live, peak reserved, fragmentation, device allocations, the planned hit rate and "
      "events/s side by side, with what PyTorch itself reserved when the trace is a snapshot.");
  add_common(cmd, args);
  cmd->add_flag("--json", args.json, "print one JSON object");
  return cmd;
}

int run_compare(const compare_args& args) {
  const auto options = compare_options(args.conf);
  const auto imported = import("terrace compare", args.trace, args.format);
  const auto runs = terrace::tools::replay_policies(imported.events, options);
  using terrace::tools::format_bytes;
  if (args.json) {
    // Built as JSON, not pasted: the path may hold quotes, backslashes or invalid UTF-8.
    nlohmann::ordered_json j;
    j["trace"] = args.trace;
    j["format"] = imported.format;
    j["torch_reserved_peak"] = imported.torch_reserved_peak ? nlohmann::ordered_json(*imported.torch_reserved_peak)
                                                            : nlohmann::ordered_json(nullptr);
    j["policies"] = nlohmann::ordered_json::object();
    for (const auto& [name, r] : runs) {
      j["policies"][name] = nlohmann::ordered_json::parse(
          terrace::tools::format_replay_json(r, {args.trace, name == "expandable", args.conf}));
    }
    fmt::print("{}\n", j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
    return 0;
  }
  fmt::print("trace {} ({}, {} events)\n\n", args.trace, imported.format, imported.events.size());
  fmt::print("{:<36}", "");
  for (const auto& [name, r] : runs) fmt::print("{:>16}", name);
  // A snapshot whose segment list is empty says nothing of what PyTorch reserved: no column.
  const bool torch_known = imported.torch_reserved_peak && *imported.torch_reserved_peak > 0;
  if (torch_known) fmt::print("{:>16}", "pytorch");
  fmt::print("\n");
  auto row = [&](const char* label, auto cell, const std::string& torch = {}) {
    fmt::print("{:<36}", label);
    for (const auto& [name, r] : runs) fmt::print("{:>16}", cell(r));
    if (torch_known) fmt::print("{:>16}", torch);
    fmt::print("\n");
  };
  using R = terrace::tools::replay_result;
  // The caller's bytes are the same under every policy; the blocks holding them are not (each
  // policy rounds and splits in its own way), and fragmentation is measured against those.
  row("peak requested", [](const R& r) { return format_bytes(r.peak_requested_bytes); });
  row("peak live", [](const R& r) { return format_bytes(r.peak_allocated_bytes); });
  row("peak reserved", [](const R& r) { return format_bytes(r.peak_reserved_bytes); },
      torch_known ? format_bytes(*imported.torch_reserved_peak) : "");
  row("fragmentation", [](const R& r) { return fmt::format("{:.1f}%", 100 * r.fragmentation); },
      torch_known
          ? fmt::format("{:.1f}%", 100 * terrace::tools::unused_fraction(runs[0].second.peak_allocated_bytes,
                                                                          *imported.torch_reserved_peak))
          : "");
  row("steady-state peak requested", [](const R& r) { return format_bytes(r.steady_peak_requested_bytes); });
  row("steady-state peak live", [](const R& r) { return format_bytes(r.steady_peak_live_bytes); });
  row("steady-state peak reserved", [](const R& r) { return format_bytes(r.steady_peak_reserved_bytes); });
  row("steady-state fragmentation",
      [](const R& r) { return fmt::format("{:.1f}%", 100 * r.steady_fragmentation); });
  // The strict figure: what a policy reserves beyond the callers' bytes, its rounding and
  // unsplit remainders included (those count as live above).
  row("steady-state reserved not requested", [](const R& r) {
    return fmt::format("{:.1f}%", 100 * terrace::tools::unused_fraction(r.steady_peak_requested_bytes,
                                                                         r.steady_peak_reserved_bytes));
  });
  row("device allocations", [](const R& r) { return std::to_string(r.device_allocs); });
  row("planned hit rate", [](const R& r) {
    return r.plan.enabled ? fmt::format("{:.1f}%", 100 * r.plan.hit_rate()) : std::string("-");
  });
  row("planned iterations lost", [](const R& r) {
    return r.plan.enabled ? fmt::format("{} of {}", r.plan.lost_iterations, r.plan.iterations)
                          : std::string("-");
  });
  row("plan arena / lower bound", [](const R& r) {
    return r.plan.enabled && r.plan.lower_bound_bytes > 0 && r.plan.arena_bytes > 0
               ? fmt::format("{:.2f}x", static_cast<double>(r.plan.arena_bytes) /
                                            static_cast<double>(r.plan.lower_bound_bytes))
               : std::string("-");
  });
  row("pre-existing blocks", [](const R& r) {
    return r.preexisting_unplaced == 0
               ? std::to_string(r.preexisting_allocs)
               : fmt::format("{} ({} unplaced)", r.preexisting_allocs, r.preexisting_unplaced);
  });
  row("OOMs", [](const R& r) { return std::to_string(r.ooms); });
  row("events/s", [](const R& r) { return fmt::format("{:.3g}", r.events_per_second); });
  fmt::print("\npeak live = the blocks handed out (each request with its rounding and any remainder "
             "the policy did not split off); fragmentation = 1 - peak live / peak reserved "
             "(GMLake); reserved not requested = 1 - peak requested / peak reserved; ");
  const std::size_t steady_from = runs.back().second.steady_from_event;
  if (steady_from < imported.events.size()) {
    fmt::print("steady state = from the planned policy's first planned iteration (event {}).\n",
               steady_from);
  } else {
    fmt::print("no steady state: the planned policy formed no plan, so the steady-state rows are "
               "the whole trace's.\n");
  }
  return 0;
}

CLI::App* setup_report(CLI::App& app, compare_args& args) {
  CLI::App* cmd = app.add_subcommand(
      "report",
      "Write one self-contained HTML page (no scripts, no external assets): live vs reserved per "
      "policy over time, fragmentation over time, the segment map and the largest holders at the "
      "peak, and a plain-text summary.");
  add_common(cmd, args);
  cmd->add_option("-o,--output", args.output, "the HTML file to write")->required();
  return cmd;
}

// The page is written after the trace is read and replayed four times (minutes for a large
// trace): an output in a folder that is not there is said before all that.
void require_output_folder(const std::string& output) {
  const std::filesystem::path parent = std::filesystem::path(output).parent_path();
  std::error_code ec;
  const auto kind = std::filesystem::status(parent.empty() ? "." : parent, ec).type();
  if (kind == std::filesystem::file_type::directory) return;
  const std::string why = kind == std::filesystem::file_type::not_found ? std::strerror(ENOENT)
                          : ec                                            ? ec.message()
                                                                          : std::strerror(ENOTDIR);
  throw std::runtime_error("cannot write '" + output + "': " + why);
}

int run_report(const compare_args& args) {
  const auto options = compare_options(args.conf);
  require_output_folder(args.output);
  const auto imported = import("terrace report", args.trace, args.format);
  const auto in = terrace::tools::make_report_input(imported.events, options, args.trace,
                                                    imported.format, imported.torch_reserved_peak);
  const std::string page = terrace::tools::render_html_report(in);
  // A regular file (or a new one) is written beside and renamed over, so that a write that fails
  // part-way (a full disk) leaves the previous report whole, never a cut-short page. Anything
  // else (/dev/stdout, a pipe) is written in place: renaming over it would replace it.
  std::error_code ec;
  const auto kind = std::filesystem::status(args.output, ec).type();
  if (kind == std::filesystem::file_type::not_found || kind == std::filesystem::file_type::regular) {
    if (const std::string why = terrace::tools::replace_file(args.output, page); !why.empty()) {
      throw std::runtime_error("cannot write '" + args.output + "': " + why);
    }
  } else {
    std::ofstream out(args.output, std::ios::binary);
    if (!out) throw std::runtime_error("cannot write '" + args.output + "': " + std::strerror(errno));
    out << page;
    out.close();
    if (!out) throw std::runtime_error("cannot write '" + args.output + "': " + std::strerror(errno));
  }
  fmt::print("{}wrote {}\n", terrace::tools::report_summary(in), args.output);
  return 0;
}

// ------------------------------------------------------------------------------------- train

struct train_args {
  terrace::tools::train_options options;
  std::string dir;
  std::string report;
  std::string log;
  std::string save_trace;
  std::string device_memory = "28MiB";
  std::string device_budget = "0";
  std::string host_budget = "0";
  std::string optimizer_host_budget = "64MiB";
  std::string pinned_limit = "0";
  std::string store_capacity = "0";
  double bandwidth_gbs = 8;
  bool no_report = false;
  bool quiet = false;
};

CLI::App* setup_train(CLI::App& app, train_args& args) {
  terrace::tools::train_options& o = args.options;
  CLI::App* cmd = app.add_subcommand(
      "train",
      "Train a char-level MLP language model whose state (bf16 params, fp32 grads, fp32 master "
      "weights and Adam moments: 18 B per parameter) is many times the device memory: params "
      "stream to the device layer by layer ahead of use, gradients stream back as backward makes "
      "them, the CPU Adam steps the master weights in host memory and on NVMe. Prints a progress "
      "bar (stderr), a summary and writes a memory report (HTML).");
  // The last occurrence of an option wins, so that a script can override its own defaults.
  cmd->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->add_option("--steps", o.steps, "training steps (in all, a resumed run included)")
      ->capture_default_str();
  cmd->add_option("--layers", o.model.layers, "residual blocks")->capture_default_str();
  cmd->add_option("--width", o.model.width, "hidden width")->capture_default_str();
  cmd->add_option("--batch", o.model.batch, "predictions per step")->capture_default_str();
  cmd->add_option("--context", o.model.context, "characters of context")->capture_default_str();
  cmd->add_option("--embed", o.model.embed, "embedding width")->capture_default_str();
  cmd->add_option("--threads", o.model.cpu_threads,
                  "OpenBLAS threads on the sim device (0: the machine's)")
      ->capture_default_str();
  cmd->add_option("--lr", o.lr, "AdamW learning rate")->capture_default_str();
  cmd->add_option("--clip", o.clip, "clip the global gradient norm to this (0: no clipping)")
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "initial weights and batch sampling")
      ->check(kUnsigned64)
      ->capture_default_str();
  cmd->add_option("--corpus", o.corpus, "the text to learn")->capture_default_str();
  cmd->add_option("--device", o.device, "sim (host memory with a capacity and a copy bandwidth) "
                                        "or cuda")
      ->check(CLI::IsMember({"sim", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--device-memory", args.device_memory, "sim: the device's capacity (more than 0)")
      ->capture_default_str();
  cmd->add_option("--bandwidth", args.bandwidth_gbs,
                  "sim: copy bandwidth of each direction, host to device and device to host, in GB/s (0: as fast as memcpy)")
      ->capture_default_str();
  cmd->add_option("--device-budget", args.device_budget,
                  "device bytes the engine may use (0: the whole device)")
      ->capture_default_str();
  cmd->add_option("--alloc-conf", o.alloc_conf,
                  "keys as in TERRACE_ALLOC_CONF over the engine's device allocator settings "
                  "(exact-size segments), e.g. policy:planned for the lifetime-aware plan" +
                      conf_keys_help(terrace::tools::kTrainReservedAllocKeys));
  cmd->add_option("--host-budget", args.host_budget,
                  "pinned bytes for home copies of params and grads (0: all of them); the rest "
                  "waits on NVMe")
      ->capture_default_str();
  cmd->add_option("--optimizer-host-budget", args.optimizer_host_budget,
                  "bytes of optimizer state (master, m, v) kept in host memory; the rest on NVMe")
      ->capture_default_str();
  cmd->add_option("--pinned-limit", args.pinned_limit,
                  "most pinned host bytes (0: no limit of terrace's own)")
      ->capture_default_str();
  cmd->add_option("--dir", args.dir,
                  "the NVMe store's directory (default: <build>/train-state); on a disk: a tmpfs "
                  "holds the offloaded state in RAM, and where O_DIRECT is missing the store "
                  "falls back to buffered I/O with a warning");
  cmd->add_option("--store-capacity", args.store_capacity,
                  "bytes of the store (0: what the configuration needs)")
      ->capture_default_str();
  cmd->add_option("--checkpoint-every", o.checkpoint_every,
                  "checkpoint every this many steps (0: only at the end)")
      ->capture_default_str();
  CLI::Option* resume = cmd->add_flag("--resume", o.resume, "continue from the last checkpoint in --dir");
  cmd->add_flag("--fresh", o.fresh, "discard a checkpoint in --dir and start over")->excludes(resume);
  cmd->add_flag("--resident", o.resident,
                "budgets so large that nothing is offloaded (the peer run)");
  cmd->add_flag("--recompute", o.model.recompute_blocks,
                "activation checkpointing: each residual block keeps only its input, and backward "
                "recomputes the rest (half the blocks' activations, one more GEMM per block)");
  cmd->add_flag("--delayed-update", o.delayed_update,
                "run each step's CPU optimizer beside the next step's forward (ZeRO-Offload's "
                "delayed parameter update: one step staler gradients)");
  cmd->add_option("--delayed-update-after", o.delayed_update_after,
                  "with --delayed-update: take this many optimizer steps undelayed first (Adam's "
                  "first, largest updates overshoot when one step stale)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  CLI::Option* report = cmd->add_option("--report", args.report,
                                        "the memory report (HTML; default: <dir>/memory-report.html)");
  cmd->add_flag("--no-report", args.no_report, "write no memory report")->excludes(report);
  cmd->add_option("--save-trace", args.save_trace,
                  "write the device allocator's recorded trace here (terrace JSON lines, for "
                  "`terrace compare` and `terrace replay`)");
  cmd->add_option("--log", args.log,
                  "write one line per step: step, loss (exact, as a hex float), loss, seconds, "
                  "bytes up, down, NVMe read, written, exposed wait, transfer seconds (a fresh run "
                  "starts it anew; --resume keeps the steps its checkpoint holds)");
  cmd->add_flag("--quiet", args.quiet, "no progress bar");
  return cmd;
}

int run_train(train_args& args) {
  terrace::tools::train_options& o = args.options;
  // A size refused names its option: several take sizes.
  const auto size_option = [](const char* option, const std::string& text) {
    try {
      return terrace::parse_size(text);
    } catch (const terrace::logic_error& e) {
      throw terrace::logic_error(fmt::format("{}: {}", option, terrace::message_without_origin(e)));
    }
  };
  o.device_memory = size_option("--device-memory", args.device_memory);
  o.device_budget = size_option("--device-budget", args.device_budget);
  o.host_budget = size_option("--host-budget", args.host_budget);
  o.optimizer_host_budget = size_option("--optimizer-host-budget", args.optimizer_host_budget);
  o.pinned_limit = size_option("--pinned-limit", args.pinned_limit);
  o.store_capacity = size_option("--store-capacity", args.store_capacity);
  // 1e400 reads as infinity, and 1e300 GB/s is infinite bytes per second.
  if (!(args.bandwidth_gbs >= 0 && std::isfinite(args.bandwidth_gbs * 1e9))) {
    throw terrace::logic_error(fmt::format("--bandwidth must be a finite number >= 0 GB/s, got {}",
                                           args.bandwidth_gbs));
  }
  o.copy_bandwidth = args.bandwidth_gbs * 1e9;
  o.dir_is_default = args.dir.empty();
  o.dir = args.dir.empty() ? terrace::tools::default_dir() : std::filesystem::path(args.dir);
  o.report = args.report;
  o.log = args.log;
  o.save_trace = args.save_trace;
  o.write_report = !args.no_report;
  o.progress = args.quiet ? nullptr : stderr;
  try {
    const auto result = terrace::tools::run_train(o);
    for (const auto& note : result.notes) fmt::print(stderr, "terrace train: note: {}\n", note);
    fmt::print("{}", terrace::tools::format_train_summary(o, result));
    if (!result.output_error.empty()) {
      fmt::print(stderr, "terrace train: error after training (its checkpoint is saved): {}\n",
                 result.output_error);
      return kExitFailure;
    }
  } catch (const terrace::tools::train_setup_error& e) {
    fmt::print(stderr, "terrace train: error: {}\n", terrace::message_without_origin(e));
    return kExitBadInput;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"terrace: a stream-ordered caching memory manager for deep-learning training"};
  app.require_subcommand(1);
  app.set_version_flag("--version", TERRACE_VERSION);

  replay_args replay;
  CLI::App* replay_cmd = setup_replay(app, replay);
  compare_args compare, report;
  CLI::App* compare_cmd = setup_compare(app, compare);
  CLI::App* report_cmd = setup_report(app, report);
  train_args train;
  CLI::App* train_cmd = setup_train(app, train);

  // CLI11 takes an unknown first word for a missing subcommand: name it instead.
  const auto commands = app.get_subcommands([](CLI::App*) { return true; });
  if (argc > 1 && argv[1][0] != '-' &&
      std::none_of(commands.begin(), commands.end(),
                   [&](const CLI::App* c) { return c->get_name() == argv[1]; })) {
    std::vector<std::string> names;
    for (const CLI::App* c : commands) names.push_back(c->get_name());
    fmt::print(stderr, "terrace: unknown command '{}' ({}; see --help)\n", argv[1],
               fmt::join(names, ", "));
    return kExitBadInput;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : kExitBadInput;
  }

  const char* command = "terrace";
  try {
    if (replay_cmd->parsed()) {
      command = "terrace replay";
      return run_replay(replay);
    }
    if (compare_cmd->parsed()) {
      command = "terrace compare";
      return run_compare(compare);
    }
    if (report_cmd->parsed()) {
      command = "terrace report";
      return run_report(report);
    }
    if (train_cmd->parsed()) {
      command = "terrace train";
      return run_train(train);
    }
  } catch (const terrace::logic_error& e) {
    fmt::print(stderr, "{}: error: {}\n", command, terrace::message_without_origin(e));
    return kExitBadInput;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: error: {}\n", command, terrace::message_without_origin(e));
    return kExitFailure;
  }
  return kExitBadInput;  // unreachable: require_subcommand(1)
}
