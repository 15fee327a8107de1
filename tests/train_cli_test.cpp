// SPDX-License-Identifier: Apache-2.0
// `terrace train` as a user runs it: the built program, its progress lines, summary, memory
// report, per-step log, resume, and its exit code 2 with a message for each configuration that
// cannot train.
#include <gtest/gtest.h>

#include <algorithm>

#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "run_command.hpp"
#include "scratch_dir.hpp"
#include "terrace/device.hpp"

#ifndef TERRACE_CLI_PATH
#error "TERRACE_CLI_PATH must name the built terrace program"
#endif

namespace {

using terrace::testing::run_command;
using terrace::testing::run_result;
using terrace::testing::scratch_dir;

// A model small enough for a test; one OpenBLAS thread so that runs compare bitwise.
const std::string kSmall =
    " --layers 3 --width 128 --embed 16 --batch 16 --threads 1 --quiet --device-memory 12MiB ";

run_result train(const std::string& args) {
  return run_command(std::string("'") + TERRACE_CLI_PATH + "' train" + kSmall + args);
}

std::vector<std::string> lines_of(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// The exact loss (the log's second field, a hex float) of each logged step.
std::vector<std::string> exact_losses(const std::filesystem::path& log) {
  std::vector<std::string> out;
  for (const std::string& line : lines_of(log)) {
    std::istringstream fields(line);
    std::string step, loss;
    fields >> step >> loss;
    out.push_back(step + " " + loss);
  }
  return out;
}

TEST(TrainCli, TrainsAndWritesSummaryLogAndReport) {
  scratch_dir dir("cli-train");
  const auto report = dir.path() / "report.html";
  const auto log = dir.path() / "steps.log";
  // Without --quiet the progress bar goes to stderr, one plain line per step (not a tty here).
  const run_result r = run_command(std::string("'") + TERRACE_CLI_PATH + "' train --layers 3 " +
                                   "--width 128 --embed 16 --batch 16 --threads 1 --steps 4 " +
                                   "--device-memory 12MiB --dir '" + dir.path().string() +
                                   "' --report '" + report.string() + "' --log '" + log.string() +
                                   "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* want : {"step 1/4", "step 4/4", "loss", "dev<->host", "host<->nvme", "hidden",
                           "[checkpoint]", "model state", "device<->host", "host<->NVMe",
                           "memory report", "peak reserved"}) {
    EXPECT_NE(r.output.find(want), std::string::npos) << "no '" << want << "' in:\n" << r.output;
  }
  EXPECT_EQ(r.output.find('\r'), std::string::npos) << "a redrawn bar on a pipe";
  const auto lines = lines_of(log);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0].rfind("1 0x", 0), 0u) << lines[0];
  EXPECT_NE(lines[3].find("checkpoint"), std::string::npos) << lines[3];
  std::ifstream page(report);
  std::stringstream html;
  html << page.rdbuf();
  EXPECT_NE(html.str().find("<svg"), std::string::npos);
  EXPECT_NE(html.str().find("terrace train"), std::string::npos);
}

TEST(TrainCli, ResumeContinuesTheLossCurve) {
  scratch_dir whole("cli-whole"), parts("cli-parts");
  const auto whole_log = whole.path() / "log", parts_log = parts.path() / "log";
  ASSERT_EQ(train("--steps 6 --no-report --dir '" + whole.path().string() + "' --log '" +
                  whole_log.string() + "'")
                .exit_code,
            0);
  // Three steps, stop (a checkpoint at the end), then resume up to six.
  ASSERT_EQ(train("--steps 3 --no-report --dir '" + parts.path().string() + "' --log '" +
                  parts_log.string() + "'")
                .exit_code,
            0);
  // A run killed after its checkpoint had logged steps the checkpoint did not keep (found in
  // review: the resumed run appended them again, so they appeared twice).
  std::ofstream(parts_log, std::ios::app) << "4 0x1p+0 killed\n5 0x1p+0 killed\n";
  const run_result resumed = train("--steps 6 --no-report --resume --dir '" +
                                   parts.path().string() + "' --log '" + parts_log.string() + "'");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("steps           4..6"), std::string::npos) << resumed.output;
  EXPECT_EQ(exact_losses(parts_log), exact_losses(whole_log));
  // A fresh run in a directory the user named, which holds a checkpoint, is refused.
  const run_result again = train("--steps 2 --no-report --dir '" + parts.path().string() + "'");
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_NE(again.output.find("--resume continues it, --fresh discards it"), std::string::npos)
      << again.output;
}

// The engine's device allocator under the lifetime-aware plan, live: params stream through a
// device that holds a few layers, on a copy stream whose blocks the compute stream uses
// (record_stream), so the plan orders reuse with device-side waits. The allocator must not change
// what is computed: the losses equal the caching policy's bit for bit.
TEST(TrainCli, ThePlannedPolicyTrainsExactlyAsCachingDoes) {
  scratch_dir dir("cli-planned");
  const std::string common = " --layers 6 --width 256 --device-memory 2MiB --steps 8 --no-report ";
  const auto run = [&](const std::string& name, const std::string& conf) {
    const std::filesystem::path log = dir.path() / (name + ".log");
    const std::filesystem::path trace = dir.path() / (name + ".jsonl");
    const run_result r = train(common + conf + " --log '" + log.string() + "' --save-trace '" +
                               trace.string() + "' --dir '" + (dir.path() / name).string() + "'");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::size_t allocs = 0;
    for (const std::string& line : lines_of(trace)) {
      allocs += line.find("\"action\":\"alloc\"") != std::string::npos ? 1 : 0;
    }
    return std::make_tuple(r.output, exact_losses(log), allocs);
  };
  const auto [caching_out, caching, caching_allocs] = run("caching", "");
  const auto [planned_out, planned, planned_allocs] = run("planned", "--alloc-conf policy:planned");
  ASSERT_EQ(caching.size(), 8u);
  EXPECT_EQ(planned, caching);
  // The saved trace holds the arena's blocks too: the same requests as under caching.
  EXPECT_GT(caching_allocs, 0u);
  EXPECT_EQ(planned_allocs, caching_allocs);
  EXPECT_EQ(caching_out.find("planned policy"), std::string::npos) << caching_out;
  EXPECT_NE(planned_out.find("planned policy"), std::string::npos) << planned_out;
  EXPECT_EQ(planned_out.find(" over 0 iterations"), std::string::npos) << "never planned:\n"
                                                                       << planned_out;
  EXPECT_EQ(planned_out.find(" 0 device-side stream waits"), std::string::npos) << planned_out;
  // A missing order between the copy stream and the kernels shows as a run whose losses differ;
  // it depends on timing (one run in two before the tier manager's fence fix), so run again.
  for (int again = 0; again < 3; ++again) {
    const auto [out, losses, allocs] = run("planned-" + std::to_string(again), "--alloc-conf policy:planned");
    EXPECT_EQ(losses, caching) << "run " << again;
  }
}

// On the default model and device (28 MiB), the plan's 25.4 MiB arena does not fit beside the
// blocks the step before the installation leaves live; the device has virtual memory, so the
// arena is mapped page by page as those blocks are freed, and the plan serves the steps that
// follow (before: it was refused at every boundary, "0 iterations (3 lost)"). Same losses.
// The engine marks its steps for the device allocator, and marked iterations are compared stream
// by stream, so the plan no longer depends on how the copy stream's fetches and the compute
// stream's blocks interleave. Before, when it was learnt from that interleaving, half the runs on
// a loaded machine (eight at once on two cores) saw no two equal periods in 16 steps, and the
// test allowed three runs; measured since, 24 runs of 24 in the same conditions installed it.
// No device block outlives its step (gradients leave the device as backward makes them), so the
// arena is reserved whole at the boundary: before, the last layers' gradients were still cached
// there and it had to be mapped page by page.
TEST(TrainCli, OnTheDefaultDeviceThePlanIsInstalled) {
  scratch_dir dir("cli-planned-default");
  const auto run = [&](const std::string& name, const std::string& conf) {
    const std::filesystem::path log = dir.path() / (name + ".log");
    const run_result r = run_command(std::string("'") + TERRACE_CLI_PATH +
                                     "' train --threads 1 --quiet --steps 16 --no-report " + conf +
                                     " --log '" + log.string() + "' --dir '" +
                                     (dir.path() / name).string() + "'");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return std::make_pair(r.output, exact_losses(log));
  };
  const auto [caching_out, caching] = run("caching", "");
  ASSERT_EQ(caching.size(), 16u);
  // The steady state is measured from step 1 + max(4, 16 / 4) on, under either policy.
  EXPECT_NE(caching_out.find("steady state    steps 5..16: device peak reserved "),
            std::string::npos) << caching_out;
  const auto [planned_out, planned] = run("planned", "--alloc-conf policy:planned");
  EXPECT_EQ(planned, caching);
  ASSERT_NE(planned_out.find("planned policy"), std::string::npos) << planned_out;
  EXPECT_NE(planned_out.find("steady state    steps 5..16: device peak reserved "),
            std::string::npos) << planned_out;
  EXPECT_EQ(planned_out.find(" over 0 iterations"), std::string::npos) << planned_out;
  EXPECT_NE(planned_out.find("(0 lost)"), std::string::npos) << planned_out;
  EXPECT_EQ(planned_out.find("mapped page by page"), std::string::npos) << planned_out;
}

// --recompute (activation checkpointing of the blocks) changes what is held, not what is computed.
TEST(TrainCli, RecomputedActivationsTrainTheSameBits) {
  scratch_dir dir("cli-recompute");
  std::vector<std::vector<std::string>> losses;
  for (const std::string flag : {"", "--recompute"}) {
    const std::filesystem::path log = dir.path() / ("log" + flag);
    const run_result r = train("--steps 6 --no-report " + flag + " --log '" + log.string() +
                               "' --dir '" + (dir.path() / ("state" + flag)).string() + "'");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    losses.push_back(exact_losses(log));
  }
  ASSERT_EQ(losses[0].size(), 6u);
  EXPECT_EQ(losses[1], losses[0]);
}

TEST(TrainCli, ConfigurationsThatCannotTrainExitTwoBeforeTraining) {
  scratch_dir dir("cli-bad");
  const std::string d = " --no-report --dir '" + dir.path().string() + "' ";
  struct bad_case {
    std::string args;
    std::string message;
  };
  const std::vector<bad_case> cases = {
      {"--device-memory 1MiB --steps 2", "cannot hold one layer"},
      {"--host-budget 64KiB --steps 2", "host budget"},
      {"--optimizer-host-budget 0 --store-capacity 1MiB --steps 2", "cannot hold the state"},
      {"--pinned-limit 64KiB --steps 2", "cannot place"},
      {"--corpus /nonexistent/corpus.txt --steps 2", "cannot read the corpus"},
      // Found in a user review: a folder was an uncaught stream error (exit 1, no name).
      {"--corpus '" + dir.path().string() + "' --steps 2",
       "cannot read the corpus '" + dir.path().string() + "': Is a directory"},
      {"--resume --steps 2", "holds no checkpoint"},
      {"--steps 0", "--steps must be at least 1"},
      // Found in review: a layer count past int was "error: vector::reserve", exit 1.
      {"--layers 2147483647 --steps 2", "char_model_config.layers must be at most 1048576"},
      // Found in a user review: a negative or NaN clip turned clipping off without a word.
      {"--clip -1 --steps 2", "--clip must be >= 0 (0: no clipping), got -1"},
      {"--clip nan --steps 2", "--clip must be >= 0 (0: no clipping), got nan"},
      // Found in review (docs): a bad --lr was refused by the optimizer in its own words
      // ("adam: lr ... (expected std::isfinite(o.lr) && o.lr > 0)"), not the option's.
      {"--lr -1 --steps 2", "--lr must be a positive number, got -1"},
      {"--lr inf --steps 2", "--lr must be a positive number, got inf"},
      // Found in a user review: a report asked for and refused at once was silently not written;
      // and --device-memory 0 was an 8 GiB device, which the help did not say.
      {"--report x.html --no-report --steps 2", "--report excludes --no-report"},
      {"--device-memory 0 --steps 2", "--device-memory must be more than 0"},
      {"--alloc-conf policy:nonsense --steps 2", "bad item 'policy:nonsense'"},
      // Found in review: a bad size did not say which of the six size options it was given to,
      // and --bandwidth 1e400 (infinity) passed its check to be refused by the sim device.
      {"--host-budget 12Q --steps 2", "--host-budget: unknown size suffix 'Q' in '12Q'"},
      {"--pinned-limit -1 --steps 2", "--pinned-limit: malformed size '-1': sizes cannot be negative"},
      {"--device-memory 0x1000 --steps 2", "--device-memory: malformed size '0x1000': hexadecimal"},
      {"--bandwidth 1e400 --steps 2", "--bandwidth must be a finite number >= 0 GB/s, got inf"},
      {"--bandwidth -1 --steps 2", "--bandwidth must be a finite number >= 0 GB/s, got -1"},
      // Found in review: the keys the command sets itself were taken and then ignored (device,
      // device_capacity, copy_bandwidth: the device comes from the flags) or overwritten
      // (record_trace: on for the report, off with --no-report), without a word.
      {"--alloc-conf policy:planned,device:null --steps 2", "bad item 'device:null': 'device' cannot be set here: use --device"},
      {"--alloc-conf device_capacity:1GiB --steps 2", "'device_capacity' cannot be set here: use --device-memory"},
      {"--alloc-conf copy_bandwidth:1e9 --steps 2", "'copy_bandwidth' cannot be set here: use --bandwidth"},
      {"--alloc-conf record_trace:true --steps 2", "'record_trace' cannot be set here: use --save-trace"},
      // Found in a user review: a folder that is not there failed only after training.
      {"--save-trace /nonexistent-dir/t.jsonl --steps 2", "/nonexistent-dir is not a directory"},
      // Found in review: a log that could not be written failed only once the NVMe store was
      // made, leaving a store that the next run took for an earlier run's checkpoint.
      {"--log /nonexistent-dir/log.txt --steps 2", "/nonexistent-dir is not a directory"},
      {"--log '" + dir.path().string() + "' --steps 2", dir.path().string() + "': it is a directory"},
      // Found in review: CLI11 read -1 as 2^64 - 1 and clamped an overflowing seed to it.
      {"--seed -1 --steps 2", "expected a whole number from 0 to 18446744073709551615, got '-1'"},
      {"--seed 99999999999999999999999 --steps 2", "got '99999999999999999999999'"},
  };
  for (const bad_case& c : cases) {
    const run_result r = train(c.args + d);
    EXPECT_EQ(r.exit_code, 2) << c.args << ":\n" << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.args << ":\n" << r.output;
    EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << c.args << " trained:\n" << r.output;
    EXPECT_FALSE(std::filesystem::exists(dir.path() / "store"))
        << c.args << " left a store behind";
  }
}

// Found in a user review (295a809): --device cuda without a GPU (or in a build without CUDA) was
// a device_error out of the engine's setup, exit 1; it is refused before training with exit 2.
TEST(TrainCli, DeviceCudaWithoutAGpuExitsTwoBeforeTraining) {
  if (terrace::cuda_device_available()) GTEST_SKIP() << "a GPU is present: --device cuda trains";
  scratch_dir dir("cli-no-gpu");
  const run_result r = train("--device cuda --steps 2 --no-report --dir '" + dir.path().string() + "'");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("device 'cuda' requested, but"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << "trained:\n" << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "store")) << "left a store behind";
}

// Found in review: a report or trace that could not be written after training threw past the
// summary (exit 1 with no summary, or 2 for a logic error, which means "could not train"), and
// the report was truncated before it was written. Now the summary comes first, then the error,
// exit 1; the checkpoint is saved.
TEST(TrainCli, AReportThatCannotBeWrittenAfterTrainingKeepsTheSummary) {
  scratch_dir dir("cli-report-fail");
  // A report into a folder that is not there is refused before training (exit 2); one whose
  // path is a folder fails only when it is written.
  const run_result early = train("--steps 1 --dir '" + dir.path().string() + "' --report '" +
                                 (dir.path() / "no-such-dir" / "r.html").string() + "'");
  EXPECT_EQ(early.exit_code, 2) << early.output;
  EXPECT_NE(early.output.find("no-such-dir is not a directory"), std::string::npos) << early.output;
  const auto folder = dir.path() / "a-folder";
  std::filesystem::create_directories(folder);
  const run_result r = train("--steps 1 --dir '" + dir.path().string() + "' --report '" +
                             folder.string() + "'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("steps           1..1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("error after training"), std::string::npos) << r.output;
  // Found in review: the error named the file but not why it could not be written.
  EXPECT_NE(r.output.find("a-folder': Is a directory"), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "store" / "index"));
}

// Found in review: any folder named `store` in --dir was taken for the engine's store, and
// --fresh deleted it whole, a user's files included. Only the store's own files are ever
// removed now, and a folder holding anything else is refused before one is touched.
TEST(TrainCli, FreshNeverDeletesFilesTerraceDidNotWrite) {
  scratch_dir dir("cli-fresh");
  const std::string d = " --no-report --dir '" + dir.path().string() + "' ";
  const auto mine = dir.path() / "store" / "notes.txt";
  std::filesystem::create_directories(mine.parent_path());
  std::ofstream(mine) << "a user's own file\n";
  run_result r = train("--fresh --steps 1" + d);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("not a terrace store"), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::exists(mine));
  // A real store with a foreign file in it: refused whole, the store left intact.
  std::filesystem::remove_all(mine.parent_path());
  ASSERT_EQ(train("--steps 1" + d).exit_code, 0);
  std::ofstream(dir.path() / "store" / "notes.txt") << "mine\n";
  r = train("--fresh --steps 1" + d);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("which terrace did not write"), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "store" / "notes.txt"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "store" / "index"));
  // Without it, --fresh clears the store and trains; --fresh with --resume is refused.
  std::filesystem::remove(dir.path() / "store" / "notes.txt");
  EXPECT_EQ(train("--fresh --steps 1" + d).exit_code, 0);
  EXPECT_NE(train("--fresh --resume --steps 2" + d).exit_code, 0);
}


// Found in review: --fresh removed the earlier checkpoint before the engine was made, so a
// configuration the engine refuses (a typo'd budget, an lr <= 0, an unknown allocator key) cost
// the user the checkpoint it was not going to replace. It is set aside and put back now.
TEST(TrainCli, FreshThatCannotTrainKeepsTheEarlierCheckpoint) {
  scratch_dir dir("cli-fresh-refused");
  const std::string d = " --no-report --dir '" + dir.path().string() + "' ";
  ASSERT_EQ(train("--steps 1" + d).exit_code, 0);
  for (const char* bad : {"--host-budget 1", "--lr -1", "--alloc-conf bogus:1"}) {
    const run_result r = train(std::string("--fresh --steps 2 ") + bad + d);
    EXPECT_EQ(r.exit_code, 2) << bad << ":\n" << r.output;
    EXPECT_TRUE(std::filesystem::exists(dir.path() / "store" / "index")) << bad << ":\n" << r.output;
    EXPECT_FALSE(std::filesystem::exists(dir.path() / "store.discarded")) << bad;
  }
  const run_result resumed = train("--resume --steps 2" + d);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("steps           2..2"), std::string::npos) << resumed.output;
  // A fresh run that trains replaces it, and leaves nothing set aside.
  ASSERT_EQ(train("--fresh --steps 1" + d).exit_code, 0);
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "store.discarded"));
}

// Found in review: a fresh run that failed after its engine had made the new store (here the log,
// a link into a folder that does not exist, cannot be opened) had already removed the earlier
// checkpoint and left the new, untrained store, which the next --resume took for a checkpoint of
// step 0. The earlier checkpoint is now kept until the run is ready to train, and the new store
// goes; in a folder that held none, none is left.
TEST(TrainCli, FreshThatFailsAfterItsStoreWasMadeKeepsTheEarlierCheckpoint) {
  scratch_dir dir("cli-fresh-late");
  const std::string d = " --no-report --dir '" + (dir.path() / "run").string() + "' ";
  const std::filesystem::path log = dir.path() / "steps.log";
  std::filesystem::create_symlink(dir.path() / "missing" / "steps.log", log);
  const std::string bad_log = " --log '" + log.string() + "'";

  const run_result first = train("--steps 1" + bad_log + d);
  EXPECT_EQ(first.exit_code, 2) << first.output;
  EXPECT_NE(first.output.find("cannot open the log"), std::string::npos) << first.output;
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "run" / "store")) << "an untrained store is left";

  ASSERT_EQ(train("--steps 2" + d).exit_code, 0);
  const run_result again = train("--fresh --steps 1" + bad_log + d);
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "run" / "store.discarded"));
  const run_result resumed = train("--resume --steps 3" + d);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("steps           3..3"), std::string::npos) << resumed.output;
}

// Found in review: the trace was written straight over --save-trace (a failed or killed write
// left a truncated trace that replays as a shorter run), and a failure did not say why. It is
// written beside and renamed over, as the report is.
TEST(TrainCli, ATraceThatCannotBeWrittenSaysWhyAndLeavesNoPartialFile) {
  scratch_dir dir("cli-trace-fail");
  const auto folder = dir.path() / "a-folder";
  std::filesystem::create_directories(folder);
  const run_result r = train("--steps 1 --no-report --dir '" + dir.path().string() +
                             "' --save-trace '" + folder.string() + "'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("a-folder': Is a directory"), std::string::npos) << r.output;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_NE(e.path().filename().string().rfind("a-folder.tmp", 0), 0u) << "the temporary was left";
  }
  const auto trace = dir.path() / "t.jsonl";
  // A file of the user's that happens to have the temporary's old name is not written over.
  std::ofstream(trace.string() + ".tmp") << "mine\n";
  const run_result ok = train("--fresh --steps 1 --no-report --dir '" + dir.path().string() +
                              "' --save-trace '" + trace.string() + "'");
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_FALSE(lines_of(trace).empty());
  EXPECT_EQ(lines_of(trace.string() + ".tmp"), std::vector<std::string>{"mine"});
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    if (e.path().filename().string().rfind("t.jsonl", 0) == 0) names.push_back(e.path().filename());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"t.jsonl", "t.jsonl.tmp"})) << "a temporary was left";
}

// Found in review: a resume checked only the model's shape and seed, so --resume with another
// --batch, --corpus or --lr went on under the checkpoint's step numbers as a different run, and
// said nothing. The run's settings are kept with its store and a resume that differs is refused.
TEST(TrainCli, ResumeWithOtherRunSettingsIsRefused) {
  scratch_dir dir("cli-resume-other");
  const std::string d = " --no-report --dir '" + dir.path().string() + "' ";
  const auto corpus = dir.path() / "other.txt";
  std::ofstream(corpus) << std::string(4096, 'a');
  ASSERT_EQ(train("--steps 2" + d).exit_code, 0);
  struct other_case {
    std::string args;
    std::string message;
  };
  const std::vector<other_case> cases = {
      {"--batch 4", "--batch 16, not 4"},
      {"--lr 0.001", "--lr 0.00029999999999999997, not 0.001"},
      {"--corpus '" + corpus.string() + "'", "--corpus"},
      {"--delayed-update", "--delayed-update off, not on"},
  };
  for (const other_case& c : cases) {
    const run_result r = train("--resume --steps 3 " + c.args + d);
    EXPECT_EQ(r.exit_code, 2) << c.args << ":\n" << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.args << ":\n" << r.output;
    EXPECT_EQ(r.output.find("step 3/"), std::string::npos) << c.args << " trained:\n" << r.output;
  }
  // The same settings resume; the store's own files, these included, go with --fresh.
  const run_result same = train("--resume --steps 3 --clip 1" + d);
  EXPECT_EQ(same.exit_code, 0) << same.output;
  EXPECT_NE(same.output.find("steps           3..3"), std::string::npos) << same.output;
  EXPECT_EQ(same.output.find("note:"), std::string::npos) << same.output;
  // Another thread count changes the GEMMs' bits, not what the run computes: it resumes, and says
  // so once (the next resume with it is the same run again).
  const run_result threads = train("--resume --steps 4 --threads 2" + d);
  EXPECT_EQ(threads.exit_code, 0) << threads.output;
  EXPECT_NE(threads.output.find("note: the checkpoint was trained with --threads 1, this run has 2: "
                                "its losses are not bitwise those of an uninterrupted run"),
            std::string::npos)
      << threads.output;
  const run_result again = train("--resume --steps 5 --threads 2" + d);
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(again.output.find("note:"), std::string::npos) << again.output;
  const run_result fresh = train("--fresh --steps 1 --batch 4" + d);
  EXPECT_EQ(fresh.exit_code, 0) << fresh.output;
  EXPECT_EQ(train("--resume --steps 2 --batch 4" + d).exit_code, 0);
}

}  // namespace
