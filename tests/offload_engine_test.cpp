// SPDX-License-Identifier: Apache-2.0
// The offload training engine (include/terrace/offload_engine.hpp) with the demo's char model on
// the sim device: offloading changes no bit of the losses, a run killed with SIGKILL resumes
// where its last checkpoint left off, every configuration that cannot train fails before the
// first step with an error that says why, and with a fast copy engine the copies hide behind
// compute. With delayed_update the same holds, and each step computes with the params of the step
// before the last.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <limits>
#include <vector>

#include "refusing_device.hpp"
#include "scratch_dir.hpp"
#include "terrace/error.hpp"
#include "terrace/offload_engine.hpp"
#include "terrace/tensor_store.hpp"
#include "tools/train.hpp"

namespace terrace {
namespace {

using tools::train_options;
using tools::train_result;

// Small enough for a test, large enough that a tiny device budget holds about two layers.
model::char_model_config small_model() {
  model::char_model_config c;
  c.layers = 6;
  c.width = 256;
  c.embed = 16;
  c.context = 8;
  c.batch = 16;
  c.cpu_threads = 1;  // the GEMMs' blocking may depend on it: fixed, for bitwise comparisons
  return c;
}

train_options base_options(const std::filesystem::path& dir, int steps) {
  train_options o;
  o.model = small_model();
  o.steps = steps;
  o.dir = dir;
  o.dir_is_default = false;
  o.write_report = false;
  o.checkpoint_every = 0;
  o.copy_bandwidth = 0;  // as fast as memcpy: the tests are about bits, not time
  o.optimizer_threads = 1;
  o.chunk_elements = 1 << 14;  // several chunks per layer: the NVMe pipeline really pipelines
  return o;
}

// The offloaded configuration: every layer is evicted from a device that holds about two, home
// copies of params and gradients spill to NVMe, and all optimizer state lives on NVMe.
train_options offloaded(const std::filesystem::path& dir, int steps) {
  train_options o = base_options(dir, steps);
  const std::size_t activations = tools::char_model_activation_bytes(o.model);
  const std::size_t block = 256 * 257;  // elements of one residual block
  // The engine keeps 1 MiB and 1/32 of the budget as the allocator's slack (offload_engine.cpp);
  // what is left for params and gradients holds between one and two layers.
  o.device_memory = activations + (1u << 20) + 2 * block * 6 + (256u << 10);
  const std::size_t tensors = o.device_memory - activations - (1u << 20) - o.device_memory / 32;
  // Pinned memory for the device's home copies and two layers more: less than the model's.
  o.host_budget = tensors + 2 * block * 6;
  o.optimizer_host_budget = 0;
  return o;
}

std::vector<float> losses(const train_result& r) {
  std::vector<float> out;
  for (const auto& s : r.steps) out.push_back(s.loss);
  return out;
}

bool bitwise_equal(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// ----------------------------------------------------------------------------- equality

TEST(OffloadEngine, OffloadedLossesEqualResidentBitwise) {
  testing::scratch_dir resident_dir("engine-resident"), offloaded_dir("engine-offloaded");
  train_options ro = base_options(resident_dir.path(), 10);
  ro.resident = true;
  const train_result resident = tools::run_train(ro);
  const train_result off = tools::run_train(offloaded(offloaded_dir.path(), 10));

  // The offloaded run really offloaded: layers were evicted and fetched again every step, home
  // copies went to NVMe and came back, and the optimizer's state lived there.
  EXPECT_GT(off.tiers.evictions, 10 * 4);
  EXPECT_GT(off.tiers.nvme_write_bytes, 0);
  EXPECT_GT(off.tiers.nvme_read_bytes, 0);
  EXPECT_EQ(off.optimizer.host_state_bytes, 0u);
  EXPECT_GT(off.optimizer.nvme_state_bytes, 0u);
  const double params_and_grads = static_cast<double>(off.parameters) * 6;
  EXPECT_LT(static_cast<double>(off.tensor_device_budget), params_and_grads / 3);
  // And the resident one did not: nothing was evicted and no state went to NVMe.
  EXPECT_EQ(resident.tiers.evictions, 0);
  EXPECT_EQ(resident.optimizer.nvme_state_bytes, 0u);

  const auto a = losses(resident), b = losses(off);
  ASSERT_EQ(a.size(), 10u);
  ASSERT_EQ(b.size(), 10u);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "step " << i + 1 << ": resident " << a[i]
                                           << ", offloaded " << b[i];
  }
  // It learns: the last loss is well below the first (ln 256 = 5.55 for an untrained model).
  EXPECT_LT(a.back(), a.front() - 0.5f);
}

// Only gradients go down: an evicted parameter never changed on the device, so it is dropped, not
// copied home. Found in review: forward and backward acquired parameters for update, and every
// eviction copied one home (at the demo's 28 MiB device, 119 MiB down per step instead of 66).
TEST(OffloadEngine, OnlyGradientsAreCopiedHome) {
  testing::scratch_dir dir("engine-down");
  const train_result off = tools::run_train(offloaded(dir.path(), 4));
  ASSERT_EQ(off.steps.size(), 4u);
  EXPECT_GT(off.tiers.evictions, 4 * 4);
  for (const auto& s : off.steps) {
    EXPECT_EQ(s.device_to_host_bytes, static_cast<std::int64_t>(off.parameters) * 4)
        << "step " << s.step << ": fp32 gradients are 4 bytes per parameter";
  }
}

// Backward hands each gradient's device block back as soon as its copy home is queued
// (tier_manager::offload): the next backward overwrites it, so nothing on the device outlives its
// step. The planned policy then places every block of a step in its arena; before, the last
// layers' gradients stayed cached until the next forward evicted them, and the device allocator
// had to keep them outside the plan, in memory of their own.
//
// Optimizer state on NVMe: when reads land and home copies leave reorders a step's fetches and
// evictions on the copy stream, so that under ThreadSanitizer on a loaded machine no step's order
// may repeat another's. The plan then allows for every order seen with the step's requests, and
// is laid out again when a step frees a block later still (docs/planning.md). Before that, no plan
// was made in 11 of 260 such runs; since, in none of 80 (12 and 24 steps).
TEST(OffloadEngine, NoDeviceBlockOutlivesItsStep) {
  testing::scratch_dir dir("engine-planned");
  train_options o = offloaded(dir.path(), 12);
  o.alloc_conf = "policy:planned";
  const train_result r = tools::run_train(o);
  EXPECT_GT(r.plan.iterations, 0);
  EXPECT_EQ(r.plan.lost_iterations, 0);
  EXPECT_EQ(r.plan.unplanned_allocs, 0);
  EXPECT_EQ(r.plan.planned_slots, r.plan.period_allocs);
}

// ----------------------------------------------------------------------------- kill and resume

// A child trains with a checkpoint every 3 steps and tells the parent through a pipe when one is
// committed; the parent SIGKILLs it right after the first, in the middle of the next steps. The
// resumed run continues from the last committed checkpoint, and its losses are bitwise those of
// an uninterrupted run from there on.
TEST(OffloadEngine, KilledRunResumesFromItsLastCheckpoint) {
  constexpr int kSteps = 9;
  testing::scratch_dir reference_dir("engine-ref"), dir("engine-kill");
  const train_result reference = tools::run_train(offloaded(reference_dir.path(), kSteps));
  ASSERT_EQ(reference.steps.size(), static_cast<std::size_t>(kSteps));

  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(fds[0]);
    train_options o = offloaded(dir.path(), kSteps);
    o.checkpoint_every = 3;
    o.on_step = [&](const offload_step_stats& s, bool checkpointed) {
      if (checkpointed) {
        const std::int64_t step = s.step;
        (void)!::write(fds[1], &step, sizeof step);
      }
      // Never finished: a parent descheduled after the first report found the child exited 0.
      // The kill still lands anywhere in steps 4..8; here at the latest, after step 6's commit
      // (SIGALRM ends a child whose parent failed before killing it).
      if (s.step == kSteps - 1) {
        ::alarm(60);
        ::pause();
      }
    };
    try {
      tools::run_train(o);
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  std::int64_t checkpointed = 0;
  ASSERT_EQ(::read(fds[0], &checkpointed, sizeof checkpointed),
            static_cast<ssize_t>(sizeof checkpointed));
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ::close(fds[0]);
  ASSERT_TRUE(WIFSIGNALED(status)) << "the child finished before it was killed";
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
  EXPECT_EQ(checkpointed, 3);

  train_options o = offloaded(dir.path(), kSteps);
  o.resume = true;
  const train_result resumed = tools::run_train(o);
  // The last committed checkpoint is step 3, or step 6 if the kill landed after that commit.
  ASSERT_TRUE(resumed.first_step == 4 || resumed.first_step == 7) << resumed.first_step;
  ASSERT_EQ(resumed.steps.size(), static_cast<std::size_t>(kSteps - resumed.first_step + 1));
  for (std::size_t i = 0; i < resumed.steps.size(); ++i) {
    const std::size_t at = static_cast<std::size_t>(resumed.first_step - 1) + i;
    EXPECT_EQ(resumed.steps[i].step, static_cast<std::int64_t>(at + 1));
    EXPECT_TRUE(bitwise_equal(resumed.steps[i].loss, reference.steps[at].loss))
        << "step " << at + 1 << ": resumed " << resumed.steps[i].loss << ", uninterrupted "
        << reference.steps[at].loss;
  }
}

TEST(OffloadEngine, ResumeRefusesAnotherSeedAndAnEmptyDirectory) {
  testing::scratch_dir dir("engine-seed"), empty("engine-empty");
  train_options o = offloaded(dir.path(), 2);
  tools::run_train(o);
  o.resume = true;
  o.seed = 2;
  try {
    tools::run_train(o);
    FAIL() << "a resume with another seed trained";
  } catch (const tools::train_setup_error& e) {
    EXPECT_NE(std::string(e.what()).find("seed"), std::string::npos) << e.what();
  }
  train_options none = offloaded(empty.path(), 2);
  none.resume = true;
  EXPECT_THROW(tools::run_train(none), tools::train_setup_error);
  // A fresh run in a directory holding a checkpoint is refused unless asked to start over.
  train_options again = offloaded(dir.path(), 2);
  EXPECT_THROW(tools::run_train(again), tools::train_setup_error);
  again.fresh = true;
  EXPECT_EQ(tools::run_train(again).steps.size(), 2u);
}

// ----------------------------------------------------------------------------- delayed update

// The offloaded configuration (home copies spilling to NVMe included) with delayed_update.
train_options offloaded_delayed(const std::filesystem::path& dir, int steps) {
  train_options o = offloaded(dir, steps);
  o.delayed_update = true;
  o.delayed_update_after = 0;  // delayed from the first step
  return o;
}

TEST(OffloadEngine, DelayedUpdateOffloadedEqualsResidentAndResumesBitwise) {
  constexpr int kSteps = 8;
  testing::scratch_dir resident_dir("dpu-resident"), offloaded_dir("dpu-offloaded"),
      resumed_dir("dpu-resumed");
  train_options ro = base_options(resident_dir.path(), kSteps);
  ro.resident = true;
  ro.delayed_update = true;
  ro.delayed_update_after = 0;
  ro.checkpoint_every = 4;  // a checkpoint completes the running update: the same in every run
  const train_result resident = tools::run_train(ro);
  train_options oo = offloaded_delayed(offloaded_dir.path(), kSteps);
  oo.checkpoint_every = 4;
  const train_result off = tools::run_train(oo);
  EXPECT_GT(off.tiers.evictions, kSteps * 4);
  EXPECT_GT(off.tiers.host_evictions, 0);  // home copies went to NVMe under the update thread
  EXPECT_GT(off.optimizer.nvme_state_bytes, 0u);
  const auto a = losses(resident), b = losses(off);
  ASSERT_EQ(a.size(), static_cast<std::size_t>(kSteps));
  ASSERT_EQ(b.size(), a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "step " << i + 1 << ": resident " << a[i]
                                           << ", offloaded " << b[i];
    EXPECT_EQ(off.steps[i].step, static_cast<std::int64_t>(i + 1));
  }
  EXPECT_LT(a.back(), a.front() - 0.5f);  // it learns

  // Stopped at the checkpoint of step 4 and resumed: steps 5..8 as in the uninterrupted run.
  train_options first = offloaded_delayed(resumed_dir.path(), 4);
  tools::run_train(first);
  train_options rest = offloaded_delayed(resumed_dir.path(), kSteps);
  rest.resume = true;
  const train_result resumed = tools::run_train(rest);
  ASSERT_EQ(resumed.first_step, 5);
  ASSERT_EQ(resumed.steps.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(bitwise_equal(resumed.steps[i].loss, b[4 + i]))
        << "step " << 5 + i << ": resumed " << resumed.steps[i].loss << ", uninterrupted " << b[4 + i];
  }
}

// ----------------------------------------------------------------------------- bad input

// The engine made directly, so that the error types are the engine's own.
struct engine_fixture {
  explicit engine_fixture(std::size_t device_memory) {
    device_options d;
    d.capacity = device_memory;
    device = make_device("sim", d);
  }
  std::unique_ptr<offload_engine> make(const offload_engine_options& o) {
    return std::make_unique<offload_engine>(
        *device,
        [&](caching_allocator& activations, stream_ref compute) {
          return tools::make_char_layered_model(small_model(), 1, *device, activations, compute);
        },
        o);
  }
  std::unique_ptr<device_backend> device;
};

// A corpus shorter than one row (context + 1 bytes) has no batch to give: refused, not read past
// its end (load_corpus refuses such a file; the function does not count on it).
TEST(OffloadEngine, ABatchFromACorpusShorterThanARowIsRefused) {
  const auto config = small_model();
  const std::size_t row = static_cast<std::size_t>(config.context) + 1;
  EXPECT_THROW(tools::sample_batch(std::vector<std::uint8_t>(row - 1, 'a'), config, 1, 0), logic_error);
  EXPECT_THROW(tools::sample_batch({}, config, 1, 0), logic_error);
  const auto batch = tools::sample_batch(std::vector<std::uint8_t>(row, 'a'), config, 1, 0);
  EXPECT_EQ(batch.size(), static_cast<std::size_t>(config.batch) * row);
}

// The loss of one step on a fixed batch: an engine that was made trains.
float one_step_loss(offload_engine& engine) {
  const auto batch = tools::sample_batch(std::vector<std::uint8_t>(1000, 'a'), small_model(), 1, 0);
  return engine.step(batch.data()).loss;
}

template <class F>
std::string oom_message(F&& f) {
  try {
    f();
  } catch (const out_of_memory& e) {
    return e.what();
  }
  return "(no out_of_memory)";
}

TEST(OffloadEngineBadInput, DeviceBudgetBelowOneLayer) {
  engine_fixture f(64u << 20);
  offload_engine_options o;
  o.device_budget = 1u << 20;  // activations + slack take it all: no room for a layer
  const std::string what = oom_message([&] { f.make(o); });
  EXPECT_NE(what.find("device budget"), std::string::npos) << what;
  EXPECT_NE(what.find("cannot hold one layer"), std::string::npos) << what;
  EXPECT_NE(what.find("activations"), std::string::npos) << what;
  // A budget past the device is a logic error, not a shortage.
  o.device_budget = 128u << 20;
  EXPECT_THROW(f.make(o), logic_error);
}

TEST(OffloadEngineBadInput, HostBudgetBelowOneLayer) {
  testing::scratch_dir dir("engine-host");
  engine_fixture f(16u << 20);
  offload_engine_options o;
  o.nvme_dir = dir.path();
  o.host_budget = 64u << 10;
  const std::string what = oom_message([&] { f.make(o); });
  EXPECT_NE(what.find("host budget"), std::string::npos) << what;
  EXPECT_NE(what.find("at least"), std::string::npos) << what;
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "store")) << "a store was created anyway";
  // Without a store, a host budget has nowhere to put the rest.
  offload_engine_options no_dir;
  no_dir.host_budget = 64u << 20;
  EXPECT_THROW(f.make(no_dir), logic_error);
}

TEST(OffloadEngineBadInput, DiskSmallerThanTheState) {
  testing::scratch_dir dir("engine-disk");
  engine_fixture f(16u << 20);
  offload_engine_options o;
  o.nvme_dir = dir.path();
  o.optimizer_host_budget = 0;  // all optimizer state on NVMe
  o.store_capacity = 1u << 20;
  const std::string what = oom_message([&] { f.make(o); });
  EXPECT_NE(what.find("cannot hold the state"), std::string::npos) << what;
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "store")) << "a store was created anyway";
  // What it asks for is enough.
  o.store_capacity = 0;
  auto engine = f.make(o);
  EXPECT_GT(engine->required_store_bytes(), 1u << 20);
  EXPECT_GE(engine->store()->capacity(), engine->required_store_bytes());
}

TEST(OffloadEngineBadInput, PinnedMemoryRefused) {
  engine_fixture f(16u << 20);
  offload_engine_options o;
  o.pinned_limit = 256u << 10;  // less than the params and gradients' home copies
  std::string what = oom_message([&] { f.make(o); });
  EXPECT_NE(what.find("cannot place"), std::string::npos) << what;
  EXPECT_NE(what.find("before training"), std::string::npos) << what;
  // The host refusing to lock memory (as mlock under RLIMIT_MEMLOCK would), injected.
  offload_engine_options plain;
  f.device->inject_out_of_memory(100);  // the pool retries once: refuse every reservation
  what = oom_message([&] { f.make(plain); });
  f.device->inject_out_of_memory(0);
  EXPECT_NE(what.find("injected"), std::string::npos) << what;
  EXPECT_NE(what.find("cannot place"), std::string::npos) << what;
  // The device is fine afterwards: the same configuration trains.
  auto engine = f.make(plain);
  EXPECT_TRUE(std::isfinite(one_step_loss(*engine)));
}

// A host budget above the pinned limit is no error: the limit binds first (the engine's check
// says whether the home copies fit it), and the tier manager is given the smaller of the two.
TEST(OffloadEngine, AHostBudgetAboveThePinnedLimitTrains) {
  testing::scratch_dir dir("engine-budget-above-limit");
  engine_fixture f(16u << 20);
  offload_engine_options o;
  o.nvme_dir = dir.path();
  o.host_budget = 256u << 20;
  o.pinned_limit = 128u << 20;
  auto engine = f.make(o);
  EXPECT_TRUE(std::isfinite(one_step_loss(*engine)));
}

// The optimizer's NVMe staging buffers are made once, for the largest group that goes to NVMe,
// before any layer's buffers. Grown group by group instead (a 1.5 MiB chunk for 'input', then 3
// MiB for each block), the smaller buffers were freed after the tier manager had placed the
// input layer's home copies behind them: their 4.5 MiB hole, stranded between live buffers, held
// one of the three larger buffers, and a pinned limit of 22 MiB (found with `terrace train`) was
// refused with 4.5 MiB free, no piece of it large enough. 24 MiB was the least that trained.
TEST(OffloadEngine, GrowingOptimizerStagingStrandsNoPinnedHole) {
  testing::scratch_dir dir("engine-staging-hole");
  train_options o = base_options(dir.path(), 2);
  o.model.width = 512;
  o.model.embed = 32;  // 8 Ki elements of embedding: its state fits the optimizer's host budget
  o.model.batch = 64;
  o.chunk_elements = std::size_t{1} << 19;  // one chunk per group: each group's own size
  o.device_memory = 8u << 20;
  o.host_budget = 6u << 20;
  o.optimizer_host_budget = 256u << 10;  // the embedding's state on the host, the rest on NVMe
  o.pinned_limit = 22u << 20;
  const train_result r = tools::run_train(o);
  ASSERT_EQ(r.steps.size(), 2u);
  EXPECT_TRUE(std::isfinite(r.steps.back().loss));
  EXPECT_GT(r.optimizer.nvme_state_bytes, 0u);
  EXPECT_LE(r.pinned_bytes, o.pinned_limit);
}

// ----------------------------------------------------------------------------- overlap

// With a copy engine far faster than the step needs, the host hardly waits on copies: the
// generous bound (the benchmark carries the 5% target) keeps a loaded machine from failing it.
// The semantics, step by step: without a checkpoint in between, step t of a delayed run computes
// with the params of step t-2. Step 1 and 2 use the initial params W0 (the first update is
// published only after step 2's backward); step 3 uses W1, the params after one ordinary step on
// batch 1. Each is compared with ordinary engines fed the batch that gives the same params.
TEST(OffloadEngine, DelayedUpdateComputesWithTheParamsOfTwoStepsBefore) {
  const auto config = small_model();
  const auto corpus = tools::load_corpus("/usr/share/common-licenses/GPL-3", config.context);
  std::vector<std::vector<std::uint8_t>> batch;
  for (std::uint64_t i = 0; i < 3; ++i) batch.push_back(tools::sample_batch(corpus, config, 1, i));
  offload_engine_options o;
  o.optimizer.adam.threads = 1;
  engine_fixture fd(64u << 20), fa(64u << 20), fb(64u << 20);
  offload_engine_options od = o;
  od.delayed_update = true;
  auto delayed = fd.make(od);
  auto a = fa.make(o), b = fb.make(o);
  const float d1 = delayed->step(batch[0].data()).loss;
  const float d2 = delayed->step(batch[1].data()).loss;
  const offload_step_stats d3 = delayed->step(batch[2].data());
  EXPECT_EQ(d3.step, 3);
  EXPECT_FALSE(d3.skipped);
  EXPECT_EQ(delayed->step_count(), 2);  // the third update may still be running
  delayed->finish_update();
  EXPECT_EQ(delayed->step_count(), 3);

  const float a1 = a->step(batch[0].data()).loss;   // W0, then W1
  const float a3 = a->step(batch[2].data()).loss;   // W1 on batch 3
  const float b2 = b->step(batch[1].data()).loss;   // W0 on batch 2
  EXPECT_TRUE(bitwise_equal(d1, a1)) << d1 << " " << a1;
  EXPECT_TRUE(bitwise_equal(d2, b2)) << d2 << " " << b2;
  EXPECT_TRUE(bitwise_equal(d3.loss, a3)) << d3.loss << " " << a3;
  // And the delay is real: an ordinary run's step 2 computes with W1, not W0.
  engine_fixture fc(64u << 20);
  auto c = fc.make(o);
  c->step(batch[0].data());
  EXPECT_FALSE(bitwise_equal(c->step(batch[1].data()).loss, d2));
}

// delayed_update_after: the first updates are not delayed (Adam's first, near-sign steps
// overshoot when one step stale: the demo's loss jumped from 4.17 to 13.79). With 2, steps 1-3
// compute as an ordinary run's do; step 3's update is the first delayed, so step 4 computes
// with W2 where an ordinary run has W3.
TEST(OffloadEngine, DelayedUpdateAfterKStepsTakesThemOrdinarily) {
  const auto config = small_model();
  const auto corpus = tools::load_corpus("/usr/share/common-licenses/GPL-3", config.context);
  offload_engine_options o;
  o.optimizer.adam.threads = 1;
  offload_engine_options od = o;
  od.delayed_update = true;
  od.delayed_update_after = 2;
  engine_fixture fd(64u << 20), fa(64u << 20);
  auto delayed = fd.make(od);
  auto ordinary = fa.make(o);
  for (std::uint64_t i = 0; i < 4; ++i) {
    const auto batch = tools::sample_batch(corpus, config, 1, i);
    const offload_step_stats d = delayed->step(batch.data());
    const offload_step_stats a = ordinary->step(batch.data());
    EXPECT_EQ(d.step, a.step) << "step " << i + 1;  // the count once its update is applied
    if (i < 3) {
      EXPECT_TRUE(bitwise_equal(d.loss, a.loss)) << "step " << i + 1 << ": " << d.loss << " " << a.loss;
    } else {
      EXPECT_FALSE(bitwise_equal(d.loss, a.loss)) << "step 4 computes with W2 when delayed";
    }
  }
  delayed->finish_update();
  EXPECT_EQ(delayed->step_count(), 4);
}

// An error of the update thread (here: the optimizer's NVMe read of its state fails) comes out of
// the next step, which already ran forward and backward; the optimizer's state is the last
// completed step's, and the step after finishes the failed update before its own.
TEST(OffloadEngine, DelayedUpdateErrorComesOutOfTheNextStep) {
  testing::scratch_dir dir("dpu-error");
  const auto config = small_model();
  const auto corpus = tools::load_corpus("/usr/share/common-licenses/GPL-3", config.context);
  std::vector<std::vector<std::uint8_t>> batch;
  for (std::uint64_t i = 0; i < 4; ++i) batch.push_back(tools::sample_batch(corpus, config, 1, i));
  engine_fixture f(64u << 20);
  offload_engine_options o;
  o.nvme_dir = dir.path();
  o.optimizer_host_budget = 0;  // all optimizer state on NVMe: the update reads it
  o.optimizer.adam.threads = 1;
  o.delayed_update = true;
  auto engine = f.make(o);
  ASSERT_NE(engine->store(), nullptr);
  io_fault fault;
  fault.what = io_fault::kind::eio;
  fault.writes = false;
  engine->store()->inject_fault(fault);  // the update started by step 1 reads first
  engine->step(batch[0].data());
  EXPECT_THROW(engine->step(batch[1].data()), io_error);
  EXPECT_EQ(engine->step_count(), 0);
  EXPECT_TRUE(engine->update_failed());
  // The fault is gone: step 3's call finishes the update of step 1 (step 2 started none), then
  // the next steps update again.
  engine->step(batch[2].data());
  EXPECT_FALSE(engine->update_failed());
  engine->step(batch[3].data());
  engine->finish_update();
  EXPECT_EQ(engine->step_count(), 3);
}

// ----------------------------------------------------------------------------- a failed optimizer phase

// A model whose arithmetic is cheap and exact to follow, for the faults below: layers of given
// sizes, a loss that reads every param and gradients that depend on the params and on the batch
// (one float), so a param published wrong or an update applied twice or with another step's
// gradients shows in later losses and in the master weights.
struct probe_model : layered_model {
  probe_model(device_backend& d, stream_ref c, std::vector<std::size_t> sizes)
      : device(d), stream(c), sizes(std::move(sizes)) {}
  std::size_t layer_count() const override { return sizes.size(); }
  std::string layer_name(std::size_t l) const override { return "layer" + std::to_string(l); }
  std::size_t layer_elements(std::size_t l) const override { return sizes[l]; }
  void init_layer(std::size_t l, float* out) const override {
    for (std::size_t i = 0; i < sizes[l]; ++i) out[i] = 0.25f + 0.5f * weight(l, i);
  }
  std::size_t activation_bytes() const override { return 4096; }
  void begin_batch(const void* b) override {
    std::memcpy(&batch, b, sizeof batch);
    sum = 0;
  }
  // The sim device's memory is host memory: once the stream has caught up, the params are there.
  void forward(std::size_t l, const std::uint16_t* p) override {
    fail_once(fail_forward_at, l);
    device.synchronize(stream);
    for (std::size_t i = 0; i < sizes[l]; ++i) sum += static_cast<double>(param(p[i]) * weight(l, i));
  }
  float loss() override { return static_cast<float>(sum); }
  void backward(std::size_t l, const std::uint16_t* p, float* g) override {
    if (on_backward) on_backward(l);
    fail_once(fail_backward_at, l);
    device.synchronize(stream);
    for (std::size_t i = 0; i < sizes[l]; ++i) g[i] = 0.1f * param(p[i]) + batch * weight(l, i);
  }
  double wait_seconds() const override { return 0; }

  static float param(std::uint16_t bf16) {
    const std::uint32_t u = std::uint32_t{bf16} << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static float weight(std::size_t l, std::size_t i) {
    return static_cast<float>(((i * 2654435761u + l * 40503u) % 2001u)) / 1000.0f - 1.0f;
  }

  // A kernel that fails (a device error, say) in layer `at`, once; SIZE_MAX: none.
  static void fail_once(std::size_t& at, std::size_t l) {
    if (at != l) return;
    at = SIZE_MAX;
    throw std::runtime_error("probe model: injected failure in layer " + std::to_string(l));
  }

  device_backend& device;
  stream_ref stream;
  std::vector<std::size_t> sizes;
  float batch = 0;
  double sum = 0;
  std::size_t fail_forward_at = SIZE_MAX;
  std::size_t fail_backward_at = SIZE_MAX;
  std::function<void(std::size_t layer)> on_backward;  // called as backward begins
};

// One engine over probe_model on its own sim device and store directory.
struct probe_engine {
  probe_engine(const std::vector<std::size_t>& sizes, const offload_engine_options& o,
               std::size_t device_memory = 64u << 20) {
    device_options d;
    d.capacity = device_memory;
    device = make_device("sim", d);
    make(sizes, o);
  }
  void make(const std::vector<std::size_t>& sizes, const offload_engine_options& o) {
    engine.reset();
    engine = std::make_unique<offload_engine>(
        *device,
        [&](caching_allocator&, stream_ref compute) {
          return std::make_unique<probe_model>(*device, compute, sizes);
        },
        o);
  }
  float step(float batch) { return engine->step(&batch).loss; }
  std::vector<std::vector<float>> masters() {
    engine->finish_update();
    std::vector<std::vector<float>> out;
    for (std::size_t l = 0; l < engine->model().layer_count(); ++l) {
      out.emplace_back(engine->model().layer_elements(l));
      engine->optimizer().read_master(static_cast<group_id>(l), out.back().data());
    }
    return out;
  }
  std::unique_ptr<device_backend> device;
  std::unique_ptr<offload_engine> engine;
};

const std::vector<float> kProbeBatches = {1.0f, -0.5f, 0.75f, -1.0f, 0.25f};

// The losses of `ref`'s next `steps` steps over kProbeBatches: what a faulted run must reproduce.
std::vector<float> losses_of(probe_engine& ref, std::size_t steps) {
  std::vector<float> losses;
  for (std::size_t s = 0; s < steps; ++s) losses.push_back(ref.step(kProbeBatches[s]));
  return losses;
}

// Every master weight and the step count, bit for bit.
void expect_same_state(probe_engine& got, probe_engine& want, const std::string& when) {
  EXPECT_EQ(got.engine->step_count(), want.engine->step_count()) << when;
  const auto a = got.masters(), b = want.masters();
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t l = 0; l < a.size(); ++l) {
    ASSERT_EQ(std::memcmp(a[l].data(), b[l].data(), 4 * a[l].size()), 0)
        << when << ": layer " << l << " master differs";
  }
}

io_fault eio_after(bool reads, int skip) {
  io_fault f;
  f.what = io_fault::kind::eio;
  f.reads = reads;
  f.writes = !reads;
  f.skip = skip;
  return f;
}

// All optimizer state on NVMe in small chunks, so that a step reads and writes many of them.
offload_engine_options probe_options(const std::filesystem::path& dir, std::size_t chunk) {
  offload_engine_options o;
  o.nvme_dir = dir;
  o.optimizer_host_budget = 0;
  o.optimizer.chunk_elements = chunk;
  o.optimizer.adam.threads = 1;
  o.optimizer.adam.lr = 1e-2;
  o.clip_norm = 50.0;  // the retry recomputes the norm: the same gradients give the same one
  return o;
}

// An engine whose run is faulted and its uninterrupted reference: the same layers and options
// (`o`'s nvme_dir is replaced), each over a store directory of its own.
struct engine_and_reference {
  engine_and_reference(const std::string& name, const std::vector<std::size_t>& layers,
                       offload_engine_options o)
      : ref_dir(name + "-ref"), dir(name), ref(layers, in(o, ref_dir)), e(layers, in(o, dir)) {}
  static offload_engine_options in(offload_engine_options o, const testing::scratch_dir& d) {
    o.nvme_dir = d.path();
    return o;
  }
  testing::scratch_dir ref_dir, dir;
  probe_engine ref, e;
};

// Layers of 4096, 3000 and 5000 elements in chunks of 1024: one chunk is one store transfer
// (12 KiB), so `skip` counts chunks.
const std::vector<std::size_t> kSmallLayers = {4096, 3000, 5000};

// Steps batches 0..n-1 through `e`, with `fault` armed before step `at` (1-based), which must
// throw; each later step first finishes it. Returns the losses of the steps that succeeded.
std::vector<float> run_with_fault(probe_engine& e, std::size_t n, std::size_t at, const io_fault& fault) {
  std::vector<float> out;
  for (std::size_t s = 1; s <= n; ++s) {
    if (s != at) {
      out.push_back(e.step(kProbeBatches[s - 1]));
      continue;
    }
    e.engine->store()->inject_fault(fault);
    EXPECT_THROW(e.step(kProbeBatches[s - 1]), io_error) << "step " << s;
    EXPECT_TRUE(e.engine->update_failed());
    EXPECT_EQ(e.engine->step_count(), static_cast<std::int64_t>(s - 1));
  }
  EXPECT_FALSE(e.engine->update_failed());
  return out;
}

// Found in review: after an EIO in the optimizer phase the next step ran a fresh forward and
// backward and handed offload_adam its new gradients, which finished the failed step with them
// (the chunks not yet updated got step t from the new gradients, the others nothing) and
// reported success; checkpoint() then committed the mixed state. Now the next step first
// finishes the failed phase with its own gradients: bitwise an uninterrupted run.
TEST(OffloadEngineFaults, AFailedOptimizerPhaseIsFinishedWithItsOwnGradients) {
  struct scenario {
    bool reads;
    int skip;
  };
  // 12 chunks per step: the first, one part-way, the last; reads and writes.
  for (const scenario& sc : {scenario{true, 0}, scenario{true, 5}, scenario{true, 11},
                             scenario{false, 0}, scenario{false, 1}, scenario{false, 7},
                             scenario{false, 11}}) {
    SCOPED_TRACE(std::string(sc.reads ? "read" : "write") + " fault, skip " + std::to_string(sc.skip));
    engine_and_reference pair("fault-inplace", kSmallLayers, probe_options({}, 1024));
    probe_engine &ref = pair.ref, &e = pair.e;
    const std::vector<float> want = losses_of(ref, 4);
    const std::vector<float> got = run_with_fault(e, 4, 2, eio_after(sc.reads, sc.skip));
    // Step 2 is finished by step 3's call: steps 1, 3 and 4 report the uninterrupted losses.
    ASSERT_EQ(got.size(), 3u);
    EXPECT_TRUE(bitwise_equal(got[0], want[0]));
    EXPECT_TRUE(bitwise_equal(got[1], want[2])) << got[1] << " " << want[2];
    EXPECT_TRUE(bitwise_equal(got[2], want[3])) << got[2] << " " << want[3];
    expect_same_state(e, ref, "after step 4");
    EXPECT_EQ(e.engine->step_count(), 4);
  }
}

// The same under a host budget (step_staged): three layers in two staged batches ({2, 1} and
// {0}: the staging holds 4 Mi elements). Found in review: a failure after the first batch had
// stepped either wedged the engine (every later step refused: "set_step_count after a failed
// step") or, when the second batch had updated nothing, let the next step update the first
// batch's layers a second time. Now the batches are parts of one optimizer step, and the retry
// skips the layers already published.
TEST(OffloadEngineFaults, AFailedStagedPhaseUpdatesNoLayerTwice) {
  const std::vector<std::size_t> layers = {5u << 19, 1u << 20, 1u << 20};  // 2.5, 1, 1 Mi
  constexpr std::size_t kChunk = 1u << 18;  // 3 MiB of state: three 1 MiB transfers
  struct scenario {
    bool reads;
    int skip;
    const char* where;
  };
  // Batch 1 reads 8 chunks (24 transfers), batch 2 ten.
  for (const scenario& sc : {scenario{true, 15, "batch 1, layer 1"}, scenario{true, 24, "batch 2's first read"},
                             scenario{false, 22, "batch 1's last write"}, scenario{false, 36, "batch 2, part-way"}}) {
    SCOPED_TRACE(std::string(sc.reads ? "read" : "write") + " fault at " + sc.where);
    offload_engine_options o = probe_options({}, kChunk);
    o.host_budget = 256u << 20;  // room for every home copy: only the optimizer touches NVMe
    o.checkpoints = false;
    engine_and_reference pair("staged-fault", layers, o);
    probe_engine &ref = pair.ref, &e = pair.e;
    const std::vector<float> want = losses_of(ref, 3);
    const std::vector<float> got = run_with_fault(e, 3, 1, eio_after(sc.reads, sc.skip));
    ASSERT_EQ(got.size(), 2u);
    EXPECT_TRUE(bitwise_equal(got[0], want[1])) << got[0] << " " << want[1];
    EXPECT_TRUE(bitwise_equal(got[1], want[2])) << got[1] << " " << want[2];
    expect_same_state(e, ref, "after step 3");
  }
}

// delayed_update: the failed update (of step 1, reported by step 2 after its backward) is
// finished by the next call with step 1's gradients, kept in the update's copy (step 2's
// backward overwrote the home copies); step 2's own update never started, so its batch is fed
// again. The run is then the uninterrupted one with finish_update() after step 1.
TEST(OffloadEngineFaults, AFailedDelayedUpdateIsFinishedWithItsOwnGradients) {
  for (bool reads : {true, false}) {
    SCOPED_TRACE(reads ? "read fault" : "write fault");
    offload_engine_options o = probe_options({}, 1024);
    o.delayed_update = true;
    engine_and_reference pair("dpu-fault", kSmallLayers, o);
    probe_engine &ref = pair.ref, &e = pair.e;
    std::vector<float> want;
    want.push_back(ref.step(kProbeBatches[0]));
    ref.engine->finish_update();
    for (std::size_t s = 1; s < 4; ++s) want.push_back(ref.step(kProbeBatches[s]));

    // Armed before step 1, whose update (on its own thread) is the store's only user: it fails
    // part-way, beside step 2.
    e.engine->store()->inject_fault(eio_after(reads, 5));
    EXPECT_TRUE(bitwise_equal(e.step(kProbeBatches[0]), want[0]));
    EXPECT_THROW(e.step(kProbeBatches[1]), io_error);
    EXPECT_TRUE(e.engine->update_failed());
    EXPECT_EQ(e.engine->step_count(), 0);
    std::vector<float> got;
    for (std::size_t s = 1; s < 4; ++s) got.push_back(e.step(kProbeBatches[s]));
    EXPECT_FALSE(e.engine->update_failed());
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(got[i], want[i + 1])) << "step " << i + 2 << ": " << got[i]
                                                       << " " << want[i + 1];
    }
    expect_same_state(e, ref, "after the last update");
    EXPECT_EQ(e.engine->step_count(), 4);
  }
}

// Found in review: a forward or backward that threw left its layer's param (and gradient)
// acquired, pinned for good; every later optimizer phase, offload and checkpoint then refused
// the acquired tensor, and the engine could neither train nor checkpoint again. Now the step
// releases what it holds as it unwinds, and the same batch stepped again goes on as if the failed
// step had not been.
TEST(OffloadEngineFaults, AModelThatThrowsLeavesNothingAcquired) {
  for (const bool delayed : {false, true}) {
    for (const bool in_backward : {false, true}) {
      SCOPED_TRACE(std::string(delayed ? "delayed_update, " : "in place, ") +
                   (in_backward ? "backward" : "forward"));
      offload_engine_options o = probe_options({}, 1024);
      o.delayed_update = delayed;
      engine_and_reference pair("model-fault", kSmallLayers, o);
      probe_engine &ref = pair.ref, &e = pair.e;
      const std::vector<float> want = losses_of(ref, 4);

      EXPECT_TRUE(bitwise_equal(e.step(kProbeBatches[0]), want[0]));
      auto& model = dynamic_cast<probe_model&>(e.engine->model());
      (in_backward ? model.fail_backward_at : model.fail_forward_at) = 1;
      EXPECT_THROW(e.step(kProbeBatches[1]), std::runtime_error);
      for (std::size_t s = 1; s < 4; ++s) {
        EXPECT_TRUE(bitwise_equal(e.step(kProbeBatches[s]), want[s])) << "step " << s + 1;
      }
      expect_same_state(e, ref, "after step 4");
      EXPECT_EQ(e.engine->checkpoint(0), ref.engine->checkpoint(0));
      EXPECT_EQ(e.engine->step_count(), 4);
    }
  }
}

// probe_options with every optimizer state on the host (no store), in place or delayed.
offload_engine_options host_state_options(bool delayed) {
  offload_engine_options o = probe_options({}, 1024);
  o.delayed_update = delayed;
  o.nvme_dir.clear();
  o.optimizer_host_budget = SIZE_MAX;
  return o;
}

// Puts a refusing_device between `e`'s engine (made again, with `o`) and its sim device.
testing::refusing_device& refuse_under(probe_engine& e, const offload_engine_options& o) {
  auto wrapped = std::make_unique<testing::refusing_device>(std::move(e.device));
  testing::refusing_device& dev = *wrapped;
  e.device = std::move(wrapped);
  e.make(kSmallLayers, o);
  return dev;
}

// A step ends by starting the next forward's prefetch (tier_manager::begin_iteration), after its
// optimizer step. A prefetch the device refuses there made step() throw although the step had
// happened: a caller told that a throwing step did not happen fed its batch again, and the
// update was applied twice. The prefetch is only ahead of need: the use fetches on demand.
TEST(OffloadEngineFaults, ARefusedPrefetchAfterTheUpdateDoesNotFailTheStep) {
  for (bool delayed : {false, true}) {
    SCOPED_TRACE(delayed ? "delayed_update" : "in place");
    offload_engine_options o = host_state_options(delayed);
    probe_engine ref(kSmallLayers, o);
    const std::vector<float> want = losses_of(ref, 3);

    probe_engine e(kSmallLayers, o);
    testing::refusing_device& dev = refuse_under(e, o);
    auto& model = dynamic_cast<probe_model&>(e.engine->model());
    EXPECT_TRUE(bitwise_equal(e.step(kProbeBatches[0]), want[0]));
    // Armed in the last backward of step 2: the first copy up after it is the next forward's
    // prefetch, started once the update is through.
    model.on_backward = [&dev](std::size_t layer) {
      if (layer == 0) dev.refuse_copies_up = 1;
    };
    float loss = 0;
    EXPECT_NO_THROW(loss = e.step(kProbeBatches[1]));
    model.on_backward = nullptr;
    EXPECT_EQ(dev.refuse_copies_up, 0) << "the test does not test: nothing was refused";
    EXPECT_TRUE(bitwise_equal(loss, want[1]));
    EXPECT_TRUE(bitwise_equal(e.step(kProbeBatches[2]), want[2]));
    expect_same_state(e, ref, "after step 3");
  }
}

// A step also ends the device allocator's iteration (end_iteration + begin_iteration), after its
// optimizer step; under the planned policy, that is where a repeated iteration's plan is made and
// its arena reserved. A device error there made step() throw although the update had happened
// (so a caller fed the batch again). The plan is an optimisation: the next iteration runs on the
// caching allocator, whose own reserves report an error that persists.
TEST(OffloadEngineFaults, ADeviceErrorInstallingThePlanAfterTheUpdateDoesNotFailTheStep) {
  for (bool delayed : {false, true}) {
    SCOPED_TRACE(delayed ? "delayed_update" : "in place");
    offload_engine_options o = host_state_options(delayed);
    o.device_allocator.policy = alloc_policy::planned;
    probe_engine ref(kSmallLayers, o);
    const std::vector<float> want = losses_of(ref, kProbeBatches.size());
    ASSERT_TRUE(ref.engine->device_memory().plan_stats().active) << "the test does not test: no plan";

    probe_engine e(kSmallLayers, o);
    testing::refusing_device& dev = refuse_under(e, o);
    auto& model = dynamic_cast<probe_model&>(e.engine->model());
    // Armed in each last backward until a plan exists: the steady steps reserve nothing else
    // after it, so the refused reserve is the arena's.
    bool armed = false;
    model.on_backward = [&](std::size_t layer) {
      if (layer == 0 && !e.engine->device_memory().plan_stats().active) {
        dev.refuse_reserves = 1;
        armed = true;
      }
    };
    for (std::size_t s = 0; s < kProbeBatches.size(); ++s) {
      float loss = 0;
      ASSERT_NO_THROW(loss = e.step(kProbeBatches[s])) << "step " << s + 1;
      EXPECT_TRUE(bitwise_equal(loss, want[s])) << "step " << s + 1;
      if (armed && dev.refuse_reserves == 0) model.on_backward = nullptr;
    }
    ASSERT_TRUE(armed);
    EXPECT_EQ(dev.refuse_reserves, 0) << "the test does not test: nothing was refused";
    expect_same_state(e, ref, "after the last step");
  }
}

// Found in review: the step's release of a tensor forgot it before asking the tier manager, so a
// release that threw (the device refused the event that says when the stream is done with it;
// the tier manager then keeps the tensor acquired, to be released again) left the tensor pinned
// for good: every later optimizer phase refused its param (host_data while acquired), and the
// engine could not train again. Now the step releases it again as it unwinds.
TEST(OffloadEngineFaults, ARefusedReleaseLeavesNothingAcquired) {
  for (bool delayed : {false, true}) {
    SCOPED_TRACE(delayed ? "delayed_update" : "in place");
    offload_engine_options o = host_state_options(delayed);
    probe_engine ref(kSmallLayers, o);
    const std::vector<float> want = losses_of(ref, 4);

    probe_engine e(kSmallLayers, o);
    testing::refusing_device& dev = refuse_under(e, o);
    auto& model = dynamic_cast<probe_model&>(e.engine->model());
    EXPECT_TRUE(bitwise_equal(e.step(kProbeBatches[0]), want[0]));
    // The first record after a backward begins is the release of its layer's param.
    model.on_backward = [&dev](std::size_t layer) {
      if (layer == 1) dev.refuse_records = 1;
    };
    EXPECT_THROW(e.step(kProbeBatches[1]), device_error);
    model.on_backward = nullptr;
    ASSERT_EQ(dev.refuse_records, 0) << "the test does not test: nothing was refused";
    e.engine->tiers().check_invariants();
    for (std::size_t s = 1; s < 4; ++s) {
      EXPECT_TRUE(bitwise_equal(e.step(kProbeBatches[s]), want[s])) << "step " << s + 1;
    }
    expect_same_state(e, ref, "after step 4");
    EXPECT_EQ(e.engine->step_count(), 4);
  }
}

// Found in review: the first step's acquires are recorded as the schedule, and a first step that
// threw part-way left its first acquires as the schedule for good: every later use was a miss
// and a demand fetch. Its partial recording is now dropped and the next step records again.
TEST(OffloadEngineFaults, AFirstStepThatThrowsLeavesNoPartialSchedule) {
  offload_engine_options o = probe_options({}, 1024);
  probe_engine e(kSmallLayers, o);
  auto& model = dynamic_cast<probe_model&>(e.engine->model());
  model.fail_forward_at = 1;
  EXPECT_THROW(e.step(kProbeBatches[0]), std::runtime_error);
  for (std::size_t s = 0; s < 3; ++s) e.step(kProbeBatches[s]);
  // One iteration: each layer's param in forward, then its param and gradient in backward.
  EXPECT_EQ(e.engine->tiers().schedule().size(), 3 * kSmallLayers.size());
}

// checkpoint() after a failed step finishes it first, or, when finishing fails again, throws and
// commits nothing: a crash then resumes from the last whole step, never from a mixed one.
TEST(OffloadEngineFaults, ACheckpointAfterAFailedStepCommitsOnlyWholeSteps) {
  for (bool delayed : {false, true}) {
    SCOPED_TRACE(delayed ? "delayed_update" : "in place");
    testing::scratch_dir ref_dir("ckpt-fault-ref"), dir("ckpt-fault");
    offload_engine_options o = probe_options(ref_dir.path(), 1024);
    o.delayed_update = delayed;
    probe_engine ref(kSmallLayers, o);
    ref.step(kProbeBatches[0]);
    ref.engine->checkpoint(1);
    ref.step(kProbeBatches[1]);
    ref.engine->checkpoint(2);

    o.nvme_dir = dir.path();
    probe_engine e(kSmallLayers, o);
    e.step(kProbeBatches[0]);
    e.engine->checkpoint(1);
    // Step 2's optimizer phase fails part-way (delayed: in its update, which checkpoint joins;
    // armed before the step, since the update is the store's only user and starts with it).
    e.engine->store()->inject_fault(eio_after(false, 5));
    if (delayed) {
      e.step(kProbeBatches[1]);
      EXPECT_THROW(e.engine->checkpoint(2), io_error);
    } else {
      EXPECT_THROW(e.step(kProbeBatches[1]), io_error);
    }
    EXPECT_TRUE(e.engine->update_failed());
    // Finishing it fails too: nothing is committed, and the state resumes at step 1.
    e.engine->store()->inject_fault(eio_after(false, 2));
    EXPECT_THROW(e.engine->checkpoint(2), io_error);
    EXPECT_TRUE(e.engine->update_failed());
    {
      testing::scratch_dir crash_ref_dir("ckpt-fault-ref1");
      offload_engine_options r1 = o;
      r1.nvme_dir = crash_ref_dir.path();
      probe_engine one(kSmallLayers, r1);
      one.step(kProbeBatches[0]);
      one.engine->finish_update();
      // A copy of the store as a crash would leave it, resumed beside the live engine.
      const auto copy = dir.path() / "crash";
      std::filesystem::create_directories(copy);
      std::filesystem::copy(dir.path() / "store", copy / "store", std::filesystem::copy_options::recursive);
      offload_engine_options resume = o;
      resume.nvme_dir = copy;
      resume.resume = true;
      probe_engine crashed(kSmallLayers, resume);
      ASSERT_TRUE(crashed.engine->resumed_from().has_value());
      EXPECT_EQ(crashed.engine->resumed_from()->step, 1);
      EXPECT_EQ(crashed.engine->resumed_from()->data_cursor, 1u);
      expect_same_state(crashed, one, "resumed after the refused checkpoint");
    }
    // The fault is gone: checkpoint() finishes step 2 and commits it.
    e.engine->checkpoint(2);
    EXPECT_FALSE(e.engine->update_failed());
    expect_same_state(e, ref, "after the checkpoint");
    e.engine.reset();
    offload_engine_options resume = o;
    resume.resume = true;
    e.make(kSmallLayers, resume);
    EXPECT_EQ(e.engine->resumed_from()->step, 2);
    expect_same_state(e, ref, "resumed");
    EXPECT_TRUE(bitwise_equal(e.step(kProbeBatches[2]), ref.step(kProbeBatches[2])));
    expect_same_state(e, ref, "a step after the resume");
  }
}

// ----------------------------------------------------------------------------- review/engine

// Options that cannot work are refused with a logic_error that names them, before the store is
// created: nothing is left in the directory. The optimizer's own options (lr, betas,
// pipeline_depth, Lion) were refused only once the store had been created (then removed again).
// Found in review: chunk_elements 0 hung the
// constructor (sizing the store stepped through each layer by 0 elements); a NaN or negative
// clip_norm, or a negative delayed_update_after or copy_bandwidth, went on silently as if they
// were 0.
TEST(OffloadEngineBadInput, OptionsThatCannotWorkAreRefusedBeforeAnythingIsWritten) {
  struct bad {
    const char* what;
    std::function<void(offload_engine_options&)> set;
  };
  const std::vector<bad> cases = {
      {"chunk_elements", [](offload_engine_options& o) { o.optimizer.chunk_elements = 0; }},
      {"chunk_elements", [](offload_engine_options& o) { o.optimizer.chunk_elements = 100; }},
      {"clip_norm", [](offload_engine_options& o) { o.clip_norm = std::nan(""); }},
      {"clip_norm", [](offload_engine_options& o) { o.clip_norm = -1.0; }},
      {"delayed_update_after", [](offload_engine_options& o) { o.delayed_update_after = -1; }},
      {"copy_bandwidth", [](offload_engine_options& o) { o.copy_bandwidth = -1.0; }},
      {"lr", [](offload_engine_options& o) { o.optimizer.adam.lr = std::nan(""); }},
      {"beta2", [](offload_engine_options& o) { o.optimizer.adam.beta2 = 1.0f; }},
      {"pipeline_depth", [](offload_engine_options& o) { o.optimizer.pipeline_depth = 2; }},
      {"Lion", [](offload_engine_options& o) { o.optimizer.adam.mode = adam_mode::lion; }},
  };
  for (const bad& c : cases) {
    SCOPED_TRACE(c.what);
    testing::scratch_dir dir("bad-option");
    offload_engine_options o = probe_options(dir.path(), 1024);
    c.set(o);
    // A store cannot be made in a folder that does not exist: an option refused only after the
    // engine tried to make one comes out as that io_error instead.
    o.nvme_dir = dir.path() / "missing";
    std::string message = "(no logic_error)";
    try {
      probe_engine e(kSmallLayers, o);
    } catch (const logic_error& err) {
      message = err.what();
    }
    EXPECT_NE(message.find(c.what), std::string::npos) << message;
    EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "something was written before the refusal";
  }
}

// A store made without room for checkpoints (checkpoints = false) cannot keep a committed copy
// beside the state the next steps rewrite. Found in review: checkpoint() committed anyway, and the
// next step's optimizer phase ran out of store space part way; every retry failed the same way
// and the run was wedged. Now checkpoint() refuses before writing anything, and training goes on.
TEST(OffloadEngineFaults, ACheckpointWithoutRoomForItIsRefusedAndTrainingGoesOn) {
  const std::vector<std::size_t> layers = {1u << 19, 1u << 19};  // 12 MiB of optimizer state
  testing::scratch_dir ref_dir("no-ckpt-ref"), dir("no-ckpt");
  offload_engine_options o = probe_options(ref_dir.path(), 1u << 16);
  o.checkpoints = false;
  probe_engine ref(layers, o);
  const std::vector<float> want = losses_of(ref, 3);
  o.nvme_dir = dir.path();
  probe_engine e(layers, o);
  EXPECT_TRUE(bitwise_equal(e.step(kProbeBatches[0]), want[0]));
  EXPECT_THROW(e.engine->checkpoint(1), logic_error);
  EXPECT_FALSE(e.engine->update_failed());
  for (std::size_t s = 1; s < 3; ++s) {
    float loss = 0;
    ASSERT_NO_THROW(loss = e.step(kProbeBatches[s])) << "step " << s + 1;
    EXPECT_TRUE(bitwise_equal(loss, want[s])) << "step " << s + 1;
  }
  expect_same_state(e, ref, "after step 3");
}

// Killed twice: a run checkpointed at step 2, killed after step 3, resumed, checkpointed at
// step 4, killed after step 5 and resumed again ends bitwise where the uninterrupted run with
// the same checkpoints does (losses, masters, step count, data cursor), in place and with
// delayed_update (which starts delaying at step 3, between the two checkpoints).
TEST(OffloadEngine, AResumedRunCheckpointsAndResumesAgainBitwise) {
  for (bool delayed : {false, true}) {
    SCOPED_TRACE(delayed ? "delayed_update" : "in place");
    testing::scratch_dir ref_dir("resume-twice-ref"), dir("resume-twice");
    offload_engine_options o = probe_options(ref_dir.path(), 1024);
    o.delayed_update = delayed;
    o.delayed_update_after = 3;
    probe_engine ref(kSmallLayers, o);
    std::vector<float> want;
    for (std::size_t s = 0; s < 5; ++s) {
      want.push_back(ref.step(kProbeBatches[s]));
      if (s == 1 || s == 3) ref.engine->checkpoint(s + 1);
    }

    o.nvme_dir = dir.path();
    probe_engine e(kSmallLayers, o);
    std::vector<float> got;
    got.push_back(e.step(kProbeBatches[0]));
    got.push_back(e.step(kProbeBatches[1]));
    e.engine->checkpoint(2);
    e.step(kProbeBatches[2]);  // lost with the kill
    offload_engine_options resume = o;
    resume.resume = true;
    e.make(kSmallLayers, resume);
    ASSERT_EQ(e.engine->resumed_from()->data_cursor, 2u);
    got.push_back(e.step(kProbeBatches[2]));
    got.push_back(e.step(kProbeBatches[3]));
    e.engine->checkpoint(4);
    e.step(kProbeBatches[4]);  // lost with the kill
    e.make(kSmallLayers, resume);
    ASSERT_EQ(e.engine->resumed_from()->data_cursor, 4u);
    ASSERT_EQ(e.engine->resumed_from()->step, 4);
    got.push_back(e.step(kProbeBatches[4]));
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t s = 0; s < want.size(); ++s) {
      EXPECT_TRUE(bitwise_equal(got[s], want[s])) << "step " << s + 1 << ": " << got[s] << " " << want[s];
    }
    expect_same_state(e, ref, "after step 5");
  }
}

// Overlap, asserted by what makes it possible rather than by a stopwatch: once the first step has
// recorded the schedule, every parameter a step acquires was already on its way up (a prefetch
// hit), so no copy is started at the moment compute needs it. That the copy stream then runs while
// compute does is TierManager.PrefetchedCopiesRunWhileComputeDoes; how much copy time this hides
// at each bandwidth, a timing on a shared machine, is bench_train's figure (docs/offload.md).
TEST(OffloadEngine, EveryCopyAfterTheFirstStepIsStartedAheadOfUse) {
  testing::scratch_dir dir("engine-overlap");
  train_options o = offloaded(dir.path(), 8);
  o.model.width = 512;
  const std::size_t block = 512 * 513;
  // Room for three blocks' parameters: the nine layers' tensors (embedding, input, six blocks,
  // output) cannot all stay on the device, so every step copies most of them up again.
  o.device_memory = tools::char_model_activation_bytes(o.model) + (1u << 20) + 3 * block * 6 +
                    (512u << 10);
  o.host_budget = 0;
  o.optimizer_host_budget = SIZE_MAX;
  o.copy_bandwidth = 50e9;
  const train_result r = tools::run_train(o);
  ASSERT_EQ(r.steps.size(), 8u);
  EXPECT_GT(r.steps[0].demand_fetches, 0) << "the first step records the schedule";
  for (std::size_t i = 1; i < r.steps.size(); ++i) {
    EXPECT_EQ(r.steps[i].demand_fetches, 0) << "step " << i + 1;
    EXPECT_GT(r.steps[i].prefetch_hits, 0) << "step " << i + 1;
    EXPECT_GT(r.steps[i].host_to_device_bytes, 0) << "step " << i + 1;
  }
  EXPECT_EQ(r.tiers.schedule_misses, 0);
}

}  // namespace
}  // namespace terrace
