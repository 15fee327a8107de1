// SPDX-License-Identifier: Apache-2.0
// The `terrace` command line. Each subcommand is a setup function that declares its arguments and a
// run function that does the work, so that `report` and `compare` slot in beside `replay`.
//
// Exit codes: 0 success; 1 a device or runtime failure; 2 bad input (usage, configuration, a
// malformed or inconsistent trace).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <string>

#include "terrace/config.hpp"
#include "terrace/error.hpp"
#include "tools/replay.hpp"
#include "tools/replay_format.hpp"

namespace {

constexpr int kExitFailure = 1;
constexpr int kExitBadInput = 2;

// ------------------------------------------------------------------------------------- replay

struct replay_args {
  std::string trace;
  std::string device = "null";
  bool expandable = false;
  std::string conf;
  bool json = false;
  CLI::Option* device_option = nullptr;
};

CLI::App* setup_replay(CLI::App& app, replay_args& args) {
  CLI::App* cmd = app.add_subcommand(
      "replay",
      "Replay a JSON-lines allocation trace (alloc / free_requested events) through terrace's "
      "caching allocator and report peak memory, fragmentation and the allocator's stats.");
  cmd->add_option("TRACE", args.trace, "the trace, one JSON object per line")->required();
  args.device_option =
      cmd->add_option("--device", args.device,
                      "backend: null (addresses only, never touched: any trace fits), sim (host "
                      "memory), cuda, cuda-vmm")
          ->check(CLI::IsMember({"null", "sim", "cuda", "cuda-vmm"}))
          ->capture_default_str();
  cmd->add_flag("--expandable", args.expandable,
                "expandable segments (one growing virtual range per stream and pool)");
  cmd->add_option("--conf", args.conf,
                  "allocator options as in TERRACE_ALLOC_CONF, e.g. "
                  "max_split_size_mb:64,roundup_power2_divisions:4,device_capacity:80GiB");
  cmd->add_flag("--json", args.json, "print one JSON object instead of the text report");
  return cmd;
}

int run_replay(replay_args& args) {
  terrace::tools::replay_options options;
  options.config = terrace::parse_alloc_conf(args.conf);
  // An explicit --device wins; otherwise a `device:` key in --conf; otherwise null.
  if (args.device_option->count() != 0 || options.config.device == "auto") {
    options.device = args.device;
  } else {
    options.device = options.config.device;
  }
  if (args.expandable) options.config.expandable_segments = true;

  const auto events = terrace::tools::load_trace(args.trace);
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"terrace: a stream-ordered caching memory manager for deep-learning training"};
  app.require_subcommand(1);

  replay_args replay;
  CLI::App* replay_cmd = setup_replay(app, replay);

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
  } catch (const terrace::logic_error& e) {
    fmt::print(stderr, "{}: error: {}\n", command, e.what());
    return kExitBadInput;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: error: {}\n", command, e.what());
    return kExitFailure;
  }
  return kExitBadInput;  // unreachable: require_subcommand(1)
}
