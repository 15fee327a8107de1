// SPDX-License-Identifier: Apache-2.0
// The char model (kernels/char_model.hpp) on the simulated device, i.e. the cpu implementation:
// gradients against a float64 reference (itself checked by finite differences), determinism,
// the untrained loss, learning, errors, activation accounting, the wait for the stream, and the
// step time of the default configuration (printed). In a CUDA build, also the run-time loading of
// cuBLAS (kernels/cublas_loader.hpp), which needs no GPU: its errors, and the toolkit's library.
//
// Parameters and gradients live in plain host vectors: on the sim device, device memory is host
// memory, and keeping them out of the allocator leaves its statistics to the model's activations.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/char_model.hpp"
#if defined(TERRACE_TEST_MODEL_WITH_CUDA)
#include "kernels/cublas_loader.hpp"
#endif
#include "optimizer/half.hpp"
#include "terrace/caching_allocator.hpp"
#include "terrace/error.hpp"
#include "terrace/sim_device.hpp"
#include "tests/char_model_reference.hpp"
#include "tests/char_model_test_support.hpp"
#include "tests/inert_backend.hpp"

namespace terrace::model {
namespace {

using testing::make_weights;
using testing::model_weights;

// A sim device, an allocator over it and a stream: what the offload engine hands the model.
struct rig {
  std::unique_ptr<device_backend> dev;
  std::unique_ptr<caching_allocator> memory;
  stream_ref stream;
  rig() {
    dev = make_device("sim", {});
    memory = std::make_unique<caching_allocator>(*dev);
    stream = dev->create_stream();
  }
  ~rig() {
    dev->synchronize_device();
    dev->destroy_stream(stream);
  }
  std::unique_ptr<char_model> model(const char_model_config& c) {
    return make_char_model(c, *dev, *memory, stream);
  }
  std::int64_t allocated() const { return memory->stats().allocated_bytes[0].current; }
};

struct step_result {
  float loss = 0;
  std::vector<std::vector<float>> grads;
};

// One batch: forward through every layer, the loss, backward through every layer.
step_result run_step(char_model& m, const model_weights& w, const std::vector<std::uint8_t>& tokens) {
  step_result r;
  const int n = static_cast<int>(w.bf16.size());
  m.begin_batch(tokens.data());
  for (int l = 0; l < n; ++l) m.forward(l, w.bf16[static_cast<std::size_t>(l)].data());
  r.loss = m.loss();
  r.grads.resize(w.bf16.size());
  for (int l = n - 1; l >= 0; --l) {
    auto& g = r.grads[static_cast<std::size_t>(l)];
    g.assign(w.bf16[static_cast<std::size_t>(l)].size(), NAN);  // "writes, not accumulates"
    m.backward(l, w.bf16[static_cast<std::size_t>(l)].data(), g.data());
  }
  return r;
}

char_model_config tiny() {
  char_model_config c;
  c.vocab = 11;
  c.context = 3;
  c.embed = 4;
  c.width = 6;
  c.layers = 2;
  c.batch = 5;
  c.cpu_threads = 1;
  return c;
}

std::vector<std::vector<double>> widened(const model_weights& w) {
  std::vector<std::vector<double>> p;
  for (std::size_t l = 0; l < w.bf16.size(); ++l) p.push_back(w.widened(l));
  return p;
}

// ---------------------------------------------------------------------------------- layers

TEST(CharModel, LayersOfTheDefaultConfig) {
  const char_model_config c;
  const auto specs = layers(c);
  ASSERT_EQ(specs.size(), 19u);
  EXPECT_EQ(specs[0].name, "embedding");
  EXPECT_EQ(specs[0].elements, 256u * 32);
  EXPECT_EQ(specs[1].name, "input");
  EXPECT_EQ(specs[1].elements, 8u * 32 * 1024 + 1024);
  EXPECT_EQ(specs[2].name, "block000");
  EXPECT_EQ(specs[17].name, "block015");
  EXPECT_EQ(specs[2].elements, 1024u * 1024 + 1024);
  EXPECT_EQ(specs[18].name, "output");
  EXPECT_EQ(specs[18].elements, 1024u * 256 + 256);
  std::size_t total = 0;
  for (const auto& s : specs) total += s.elements;
  EXPECT_EQ(parameter_count(c), total);
}

TEST(CharModel, InitIsDeterministicScaledAndPinned) {
  const auto c = tiny();
  const auto a = make_weights(c, 42), b = make_weights(c, 42), other = make_weights(c, 43);
  EXPECT_EQ(a.master, b.master);
  EXPECT_NE(a.master[2], other.master[2]);
  // Biases are zero: the tail of every layer but the embedding.
  for (int l = 1; l < static_cast<int>(a.master.size()); ++l) {
    const auto& m = a.master[static_cast<std::size_t>(l)];
    const std::size_t out = l == static_cast<int>(a.master.size()) - 1 ? 11u : 6u;
    for (std::size_t j = m.size() - out; j < m.size(); ++j) EXPECT_EQ(m[j], 0.0f) << "layer " << l;
  }
  // The scales of the header comment, from a layer large enough to measure them.
  char_model_config big;
  big.width = 512;
  big.layers = 16;
  std::vector<float> block(layers(big)[2].elements);
  init_layer(big, 2, 7, block.data());
  double sum = 0, sq = 0;
  const std::size_t n = 512u * 512;
  for (std::size_t i = 0; i < n; ++i) sum += block[i], sq += double(block[i]) * block[i];
  const double expected = std::sqrt(2.0 / 512) / 4;  // sqrt(2/fan_in)/sqrt(16)
  EXPECT_NEAR(sum / n, 0.0, 0.01 * expected);
  EXPECT_NEAR(std::sqrt(sq / n), expected, 0.01 * expected);
  // A checksum of every bit of the tiny model's initial values with seed 42: the values are
  // promised to be the same everywhere, so a platform (libm) that computes them differently fails
  // here rather than in a comparison of training runs.
  std::uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (const auto& layer : a.master)
    for (float v : layer) {
      std::uint32_t bits;
      std::memcpy(&bits, &v, 4);
      for (int k = 0; k < 4; ++k) hash = (hash ^ ((bits >> (8 * k)) & 0xffu)) * 1099511628211ull;
    }
  EXPECT_EQ(hash, 0x5c07d4c8850fba19ull) << std::hex << "checksum 0x" << hash;
}

TEST(CharModel, Bf16ConversionIsHalfHpps) {
  const float values[] = {1.0f, -2.5f, 1.00390625f /* tie, rounds to even */, 3.14159265f, 1e-40f,
                          65504.0f, INFINITY, -0.0f};
  for (float v : values) {
    std::uint16_t h;
    to_bf16(&v, 1, &h);
    EXPECT_EQ(h, terrace::detail::float_to_bf16(v)) << v;
    float back;
    from_bf16(&h, 1, &back);
    const float expected = terrace::detail::bf16_to_float(h);
    EXPECT_EQ(std::memcmp(&back, &expected, sizeof(float)), 0) << v;
  }
  std::uint16_t h;
  const float nan = NAN;
  to_bf16(&nan, 1, &h);
  EXPECT_EQ(h, 0x7fc0);
}

// ------------------------------------------------------------------------------ gradients

// The reference against central finite differences in float64, for every parameter of the tiny
// model: this is what makes the reference a reference.
TEST(CharModel, ReferenceMatchesFiniteDifferences) {
  const auto c = tiny();
  const auto w = make_weights(c, 1);
  const auto tokens = testing::random_tokens(c, 2);
  auto p = widened(w);
  const auto ref = testing::reference_step(c, p, tokens.data(), true);
  constexpr double h = 1e-6;
  for (std::size_t l = 0; l < p.size(); ++l) {
    for (std::size_t i = 0; i < p[l].size(); ++i) {
      const double keep = p[l][i];
      p[l][i] = keep + h;
      const double up = testing::reference_step(c, p, tokens.data(), false).loss;
      p[l][i] = keep - h;
      const double down = testing::reference_step(c, p, tokens.data(), false).loss;
      p[l][i] = keep;
      const double fd = (up - down) / (2 * h);
      EXPECT_NEAR(ref.grads[l][i], fd, 1e-7 + 1e-6 * std::abs(fd)) << "layer " << l << " element " << i;
    }
  }
}

// The model (fp32 from bf16 weights) against the float64 reference on the same bf16 values:
// every gradient of every layer, within what fp32 arithmetic explains.
void expect_gradients_match_the_reference(rig& r, const char_model_config& c) {
  SCOPED_TRACE("vocab " + std::to_string(c.vocab) + " context " + std::to_string(c.context) +
               " embed " + std::to_string(c.embed) + " width " + std::to_string(c.width) +
               " layers " + std::to_string(c.layers) + " batch " + std::to_string(c.batch) +
               (c.recompute_blocks ? " recomputed" : "") + " threads " + std::to_string(c.cpu_threads));
  auto m = r.model(c);
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    const auto w = make_weights(c, seed);
    const auto tokens = testing::random_tokens(c, seed + 10);
    const auto got = run_step(*m, w, tokens);
    const auto ref = testing::reference_step(c, widened(w), tokens.data(), true);
    EXPECT_NEAR(got.loss, ref.loss, 1e-5 * ref.loss);
    std::size_t layers_with_gradient = 0;
    for (std::size_t l = 0; l < ref.grads.size(); ++l) {
      double scale = 0;
      for (double g : ref.grads[l]) scale = std::max(scale, std::abs(g));
      layers_with_gradient += scale > 0;
      for (std::size_t i = 0; i < ref.grads[l].size(); ++i) {
        EXPECT_NEAR(got.grads[l][i], ref.grads[l][i], 1e-5 * scale + 1e-4 * std::abs(ref.grads[l][i]))
            << "seed " << seed << " layer " << l << " element " << i;
      }
    }
    // A width of 1 may have its one unit switched off by the relu (no gradient below it, rightly);
    // at other widths every layer has one, so that no layer's check is empty.
    if (c.width > 1) {
      EXPECT_EQ(layers_with_gradient, ref.grads.size()) << "a layer has no gradient: its check is empty";
    } else {
      EXPECT_GT(layers_with_gradient, 0u);
    }
  }
}

TEST(CharModel, GradientsMatchTheReference) {
  rig r;
  expect_gradients_match_the_reference(r, tiny());
}

// Shapes at the edges of the kernels' loops: one of everything, widths that are no multiple of
// any SIMD width, a vocabulary of 3, one block, blocks recomputed in backward, two threads.
TEST(CharModel, GradientsMatchTheReferenceAtEdgeShapes) {
  rig r;
  const auto shape = [&](std::size_t vocab, std::size_t context, std::size_t embed, std::size_t width,
                         std::size_t layers, std::size_t batch, bool recompute, int threads) {
    char_model_config c = tiny();
    c.vocab = vocab;
    c.context = context;
    c.embed = embed;
    c.width = width;
    c.layers = layers;
    c.batch = batch;
    c.recompute_blocks = recompute;
    c.cpu_threads = threads;
    expect_gradients_match_the_reference(r, c);
  };
  shape(3, 1, 1, 1, 1, 1, false, 1);
  shape(3, 1, 1, 1, 1, 1, true, 1);
  shape(5, 2, 3, 7, 2, 1, false, 1);
  shape(7, 4, 5, 17, 1, 3, true, 2);
  shape(11, 3, 4, 33, 2, 9, false, 2);
}

// ---------------------------------------------------------------------------- behaviour

TEST(CharModel, RunsAreBitwiseRepeatable) {
  char_model_config c;
  c.width = 256;
  c.layers = 3;
  c.batch = 32;
  c.cpu_threads = 2;  // threaded GEMMs: the thread count is part of the configuration
  const auto w = make_weights(c, 5);
  std::vector<step_result> runs;
  for (int run = 0; run < 2; ++run) {
    rig r;  // a fresh device and allocator each time: addresses differ, results must not
    auto m = r.model(c);
    step_result last;
    for (std::uint64_t batch = 0; batch < 2; ++batch) last = run_step(*m, w, testing::random_tokens(c, batch));
    runs.push_back(std::move(last));
  }
  EXPECT_EQ(std::memcmp(&runs[0].loss, &runs[1].loss, sizeof(float)), 0);
  for (std::size_t l = 0; l < runs[0].grads.size(); ++l) {
    ASSERT_EQ(runs[0].grads[l].size(), runs[1].grads[l].size());
    EXPECT_EQ(std::memcmp(runs[0].grads[l].data(), runs[1].grads[l].data(), runs[0].grads[l].size() * 4), 0)
        << "layer " << l;
  }
}

// Activation checkpointing (recompute_blocks): the same loss and gradients, bit for bit, with
// fewer bytes held between forward and backward (each block's r is made again in its backward).
TEST(CharModel, RecomputedBlocksGiveTheSameBitsWithLessHeld) {
  char_model_config c;
  c.width = 256;
  c.layers = 4;
  c.batch = 32;
  c.cpu_threads = 2;
  const auto w = make_weights(c, 9);
  std::vector<step_result> runs;
  std::vector<std::int64_t> held_after_forward;
  for (const bool recompute : {false, true}) {
    c.recompute_blocks = recompute;
    rig r;
    auto m = r.model(c);
    const auto tokens = testing::random_tokens(c, 2);
    m->begin_batch(tokens.data());
    const int n = static_cast<int>(w.bf16.size());
    for (int l = 0; l < n; ++l) m->forward(l, w.bf16[static_cast<std::size_t>(l)].data());
    held_after_forward.push_back(r.allocated());
    runs.push_back(run_step(*m, w, tokens));
    EXPECT_EQ(r.allocated(), 0);
  }
  EXPECT_EQ(std::memcmp(&runs[0].loss, &runs[1].loss, sizeof(float)), 0);
  for (std::size_t l = 0; l < runs[0].grads.size(); ++l) {
    EXPECT_EQ(std::memcmp(runs[0].grads[l].data(), runs[1].grads[l].data(), runs[0].grads[l].size() * 4), 0)
        << "layer " << l;
  }
  // Four blocks' r (32 x 256 floats each) are no longer held.
  EXPECT_EQ(held_after_forward[0] - held_after_forward[1], 4 * 32 * 256 * 4);
}

// 16 residual blocks at the default vocab: the init keeps the stream stable and the logits
// small, so an untrained model predicts nearly uniformly (the tolerance is mostly the batch of 64
// random targets: the logits are not exactly zero).
TEST(CharModel, UntrainedLossIsNearLnVocab) {
  char_model_config c;
  c.width = 256;
  c.cpu_threads = 2;
  rig r;
  auto m = r.model(c);
  const auto w = make_weights(c, 9);
  const auto got = run_step(*m, w, testing::random_tokens(c, 3));
  EXPECT_NEAR(got.loss, std::log(256.0), 0.05);
  for (const auto& g : got.grads)
    for (float v : g) ASSERT_TRUE(std::isfinite(v));
}

TEST(CharModel, SgdLowersTheLoss) {
  constexpr std::string_view text =
      "the quick brown fox jumps over the lazy dog. the lazy dog sleeps in the sun. "
      "a quick brown dog jumps over the sleeping fox. the fox and the dog are friends. ";
  char_model_config c;
  c.embed = 16;
  c.width = 64;
  c.layers = 2;
  c.batch = 32;
  c.cpu_threads = 1;
  rig r;
  auto m = r.model(c);
  auto w = make_weights(c, 11);
  testing::lcg g{12};
  constexpr int steps = 300;
  constexpr float lr = 0.5f;
  std::vector<float> losses;
  for (int step = 0; step < steps; ++step) {
    const auto got = run_step(*m, w, testing::text_batch(c, text, g));
    losses.push_back(got.loss);
    for (std::size_t l = 0; l < w.master.size(); ++l)
      for (std::size_t i = 0; i < w.master[l].size(); ++i) w.master[l][i] -= lr * got.grads[l][i];
    w.refresh();
  }
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) first += losses[static_cast<std::size_t>(i)] / 10;
  for (int i = steps - 20; i < steps; ++i) last += losses[static_cast<std::size_t>(i)] / 20;
  std::printf("sgd: loss %.3f (first 10 steps) -> %.3f (last 20)\n", first, last);
  EXPECT_NEAR(first, std::log(256.0), 0.5);
  EXPECT_LT(last, 0.4 * first);
}

TEST(CharModel, ActivationsCountAgainstTheDeviceAndAreFreed) {
  const auto c = tiny();
  rig r;
  auto m = r.model(c);
  const auto w = make_weights(c, 3);
  const auto tokens = testing::random_tokens(c, 4);
  ASSERT_EQ(r.allocated(), 0);
  m->begin_batch(tokens.data());
  for (int l = 0; l < 5; ++l) m->forward(l, w.bf16[static_cast<std::size_t>(l)].data());
  // x0, h0, two (r, h) pairs and the probabilities, each at least its floats (blocks round up).
  const std::int64_t floats = 5 * 12 + 5 * 6 + 4 * 5 * 6 + 5 * 11;
  EXPECT_GE(r.allocated(), floats * 4);
  EXPECT_GE(r.memory->stats().allocation[0].current, 7);
  std::vector<float> grad;
  for (int l = 4; l >= 0; --l) {
    grad.assign(w.bf16[static_cast<std::size_t>(l)].size(), 0);
    m->backward(l, w.bf16[static_cast<std::size_t>(l)].data(), grad.data());
    if (l > 0) {
      EXPECT_GT(r.allocated(), 0) << "freed before backward of layer 0";
    }
  }
  EXPECT_EQ(r.allocated(), 0);
  // A batch abandoned after forward (evaluation) is freed by the next begin_batch.
  m->begin_batch(tokens.data());
  for (int l = 0; l < 5; ++l) m->forward(l, w.bf16[static_cast<std::size_t>(l)].data());
  EXPECT_GT(r.allocated(), 0);
  m->begin_batch(tokens.data());
  EXPECT_EQ(r.allocated(), 0);
  m->forward(0, w.bf16[0].data());
  m.reset();  // and the destructor frees what is left
  EXPECT_EQ(r.allocated(), 0);
  r.memory->check_invariants();
}

// The cpu model computes on the host, so it must first wait for what the stream was ordered
// after (here a 100 ms "transfer"), and say how long it waited.
TEST(CharModel, WaitsForTheStreamAndCountsTheWait) {
  const auto c = tiny();
  rig r;
  auto m = r.model(c);
  const auto w = make_weights(c, 3);
  const auto tokens = testing::random_tokens(c, 4);
  m->begin_batch(tokens.data());
  std::vector<std::uint16_t> late(w.bf16[0].size(), 0);  // all zero until the "copy" lands
  const auto enqueued = std::chrono::steady_clock::now();
  enqueue_host_function(*r.dev, r.stream, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    late = w.bf16[0];
  });
  const double called_after =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - enqueued).count();
  m->forward(0, late.data());
  // The "copy" ends at least 100 ms after it was queued, so forward waited for what was left of
  // that when it was called (a 1 ms margin for its own work before the wait); a fixed bound such
  // as 80 ms failed whenever the test thread was paused for 20 ms between the two calls.
  EXPECT_GE(m->stats().wait_seconds, 0.1 - called_after - 0.001);
  for (int l = 1; l < 5; ++l) m->forward(l, w.bf16[static_cast<std::size_t>(l)].data());
  // Had it read the embedding before the "copy", the loss would differ from the reference's.
  const auto ref = testing::reference_step(c, widened(w), tokens.data(), false);
  EXPECT_NEAR(m->loss(), ref.loss, 1e-5 * ref.loss);
  EXPECT_GT(m->stats().compute_seconds, 0.0);
}

// ------------------------------------------------------------------------------- errors

TEST(CharModel, BadConfigIsRefused) {
  const auto bad = [](auto edit) {
    char_model_config c = tiny();
    edit(c);
    return c;
  };
  const char_model_config cases[] = {
      bad([](auto& c) { c.vocab = 0; }),   bad([](auto& c) { c.vocab = 257; }),
      bad([](auto& c) { c.context = 0; }), bad([](auto& c) { c.embed = -1; }),
      bad([](auto& c) { c.width = 0; }),   bad([](auto& c) { c.layers = 0; }),
      bad([](auto& c) { c.batch = 0; }),   bad([](auto& c) { c.cpu_threads = -1; }),
      bad([](auto& c) { c.width = 1 << 16; }),  // a block of 2^32 elements
      // Found in review: layers + 3 (the layer count) overflowed int, and a list of 2^31 layers
      // was a std::length_error ("vector::reserve") instead of a refusal that says why.
      bad([](auto& c) { c.layers = 2147483647; }),
      bad([](auto& c) { c.layers = (1 << 20) + 1; }),
  };
  rig r;
  for (const auto& c : cases) {
    EXPECT_THROW(layers(c), logic_error);
    EXPECT_THROW(r.model(c), logic_error);
    float out[1];
    EXPECT_THROW(init_layer(c, 0, 1, out), logic_error);
  }
  std::vector<float> out(layers(tiny())[0].elements);
  EXPECT_THROW(init_layer(tiny(), -1, 1, out.data()), logic_error);
  EXPECT_THROW(init_layer(tiny(), 5, 1, out.data()), logic_error);
  EXPECT_THROW(init_layer(tiny(), 0, 1, nullptr), logic_error);
}

// Found in review: validate() multiplied context*embed by width and by batch in long long without
// first bounding context*embed, so a product past 2^63 wrapped (undefined behaviour) and a config
// whose input projection has 2^63 + 2^15 elements was accepted, its layer list reporting a
// wrapped element count. The embedding (vocab x embed) was not bounded at all.
TEST(CharModel, HugeProductsOfSizesAreRefusedNotWrapped) {
  char_model_config c = tiny();
  c.context = 1 << 24;
  c.embed = 1 << 24;  // context*embed = 2^48
  c.width = 1 << 15;  // (context*embed)*width = 2^63: wraps in long long
  c.batch = 1 << 15;  // batch*(context*embed) = 2^63 too
  EXPECT_THROW(validate(c), logic_error);
  c = tiny();
  c.context = 1;
  c.width = 1;
  c.batch = 1;
  c.vocab = 256;
  c.embed = 1 << 24;  // an embedding of 2^32 elements
  EXPECT_THROW(validate(c), logic_error);
}

TEST(CharModel, DevicesWithoutHostMemoryOrAnotherAllocatorAreRefused) {
  auto null_dev = make_device("null", {});
  caching_allocator null_memory(*null_dev);
  try {
    make_char_model(tiny(), *null_dev, null_memory, {});
    ADD_FAILURE() << "the null device was accepted";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("null"), std::string::npos) << e.what();
  }
  rig r;
  EXPECT_THROW(make_char_model(tiny(), *r.dev, null_memory, r.stream), logic_error);
}

// A backend that calls itself "cuda", to ask for the cuda implementation without a GPU.
class named_cuda_device final : public terrace::testing::inert_backend {
 public:
  named_cuda_device() : inert_backend("cuda") { properties_.capacity = 1 << 20; }
};

#if !defined(TERRACE_TEST_MODEL_WITH_CUDA)
TEST(CharModel, CudaDeviceInABuildWithoutCudaIsAClearError) {
  named_cuda_device dev;
  caching_allocator memory(dev);
  try {
    make_char_model(tiny(), dev, memory, {});
    ADD_FAILURE() << "a cuda device was accepted by a build without CUDA";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("TERRACE_ENABLE_CUDA"), std::string::npos) << e.what();
  }
}
#else
// Sets (or, with nullopt, unsets) an environment variable for one scope; restores it after.
class scoped_env {
 public:
  scoped_env(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value->c_str(), 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~scoped_env() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

constexpr const char* bogus_cublas = "/nonexistent/terrace-test/libcublas-bogus.so.13";

// The loader's error: the library asked for, dlerror()'s text, and what to do.
void expect_clear_cublas_error(const std::string& what, const std::string& library) {
  for (const std::string& part :
       {library, std::string(detail::cublas_default_library()), std::string("LD_LIBRARY_PATH"),
        std::string(detail::cublas_library_env), std::string("nvidia/cublas/lib")}) {
    EXPECT_NE(what.find(part), std::string::npos) << "no '" << part << "' in: " << what;
  }
}

TEST(CublasLoader, TheSonameFollowsTheToolkitsMajorVersion) {
  const std::string soname = detail::cublas_default_library();
  ASSERT_EQ(soname.rfind("libcublas.so.", 0), 0u) << soname;
  EXPECT_GE(std::stoi(soname.substr(std::string("libcublas.so.").size())), 11) << soname;
  EXPECT_EQ(detail::cublas_entry_points().size(), 6u);
}

TEST(CublasLoader, AMissingLibraryIsAClearError) {
  try {
    detail::load_cublas(bogus_cublas);
    ADD_FAILURE() << "a missing library was loaded";
  } catch (const device_error& e) {
    expect_clear_cublas_error(e.what(), bogus_cublas);
    // dlerror()'s own text.
    EXPECT_NE(std::string(e.what()).find("cannot open shared object file"), std::string::npos) << e.what();
  }
  // A failure is not remembered as a table: it fails again, the same way.
  EXPECT_THROW(detail::load_cublas(bogus_cublas), device_error);
}

TEST(CublasLoader, ALibraryWithoutTheEntryPointsIsAClearError) {
  try {
    detail::load_cublas("libm.so.6");  // opens, but holds no cuBLAS
    ADD_FAILURE() << "libm was taken for cuBLAS";
  } catch (const device_error& e) {
    expect_clear_cublas_error(e.what(), "libm.so.6");
    for (const std::string& name : detail::cublas_entry_points()) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << "no " << name << " in: " << e.what();
    }
  }
}

TEST(CublasLoader, TheEnvironmentVariableChoosesTheLibrary) {
  const scoped_env env(detail::cublas_library_env, bogus_cublas);
  try {
    detail::cublas();
    ADD_FAILURE() << detail::cublas_library_env << "=" << bogus_cublas << " was not used";
  } catch (const device_error& e) {
    expect_clear_cublas_error(e.what(), bogus_cublas);
    EXPECT_NE(std::string(e.what()).find(std::string(detail::cublas_library_env) + "=" + bogus_cublas),
              std::string::npos)
        << e.what();
  }
}

// Where it matters: the error comes from make_char_model for a CUDA device, before the CUDA
// runtime is touched (this device is no GPU, and there may be none).
TEST(CharModel, CudaModelWithoutCublasIsAClearErrorFromMakeCharModel) {
  const scoped_env env(detail::cublas_library_env, bogus_cublas);
  named_cuda_device dev;
  caching_allocator memory(dev);
  try {
    make_char_model(tiny(), dev, memory, {});
    ADD_FAILURE() << "a cuda model was made without cuBLAS";
  } catch (const device_error& e) {
    expect_clear_cublas_error(e.what(), bogus_cublas);
  }
}

// Loading cuBLAS needs neither a GPU nor the driver (libcublas.so does not need libcuda.so.1), so
// where the toolkit this build used is installed, every entry point resolves here.
TEST(CublasLoader, TheToolkitsLibraryResolvesEveryEntryPoint) {
  const scoped_env env(detail::cublas_library_env, std::nullopt);
  const detail::cublas_api* api = nullptr;
  try {
    api = &detail::cublas();
  } catch (const device_error& e) {
    const std::string toolkit = detail::cublas_toolkit_library();
    if (!toolkit.empty() && std::filesystem::exists(toolkit)) {
      FAIL() << toolkit << " exists, yet: " << e.what();
    }
    GTEST_SKIP() << "no cuBLAS on this machine (nor the toolkit this build used): " << e.what();
  }
  EXPECT_EQ(detail::resolved_entry_points(*api), detail::cublas_entry_points().size());
  EXPECT_EQ(&detail::cublas(), api) << "loaded twice";
}
#endif

TEST(CharModel, CallsOutOfOrderAreRefusedAndChangeNothing) {
  const auto c = tiny();
  rig r;
  auto m = r.model(c);
  const auto w = make_weights(c, 3);
  auto tokens = testing::random_tokens(c, 4);
  std::vector<float> grad(w.bf16[4].size());
  EXPECT_THROW(m->forward(0, w.bf16[0].data()), logic_error);  // before begin_batch
  EXPECT_THROW(m->begin_batch(nullptr), logic_error);
  tokens[7] = 11;  // == vocab
  try {
    m->begin_batch(tokens.data());
    ADD_FAILURE() << "token 11 accepted with vocab 11";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("row 1, position 3"), std::string::npos) << e.what();
  }
  tokens[7] = 10;
  m->begin_batch(tokens.data());
  EXPECT_THROW(m->forward(1, w.bf16[1].data()), logic_error);  // layer 0 first
  EXPECT_THROW(m->forward(0, nullptr), logic_error);
  EXPECT_THROW(m->forward(-1, w.bf16[0].data()), logic_error);
  EXPECT_THROW(m->loss(), logic_error);
  for (int l = 0; l < 4; ++l) m->forward(l, w.bf16[static_cast<std::size_t>(l)].data());
  EXPECT_THROW(m->backward(4, w.bf16[4].data(), grad.data()), logic_error);  // forward incomplete
  m->forward(4, w.bf16[4].data());
  EXPECT_THROW(m->forward(4, w.bf16[4].data()), logic_error);
  EXPECT_THROW(m->backward(3, w.bf16[3].data(), grad.data()), logic_error);  // last layer first
  EXPECT_THROW(m->backward(4, w.bf16[4].data(), nullptr), logic_error);
  // Nothing above disturbed the batch: it completes and matches the reference.
  const auto ref = testing::reference_step(c, widened(w), tokens.data(), true);
  EXPECT_NEAR(m->loss(), ref.loss, 1e-5 * ref.loss);
  for (int l = 4; l >= 0; --l) {
    grad.assign(w.bf16[static_cast<std::size_t>(l)].size(), 0);
    m->backward(l, w.bf16[static_cast<std::size_t>(l)].data(), grad.data());
  }
  EXPECT_THROW(m->backward(0, w.bf16[0].data(), grad.data()), logic_error);  // batch over
}

// ---------------------------------------------------------------------------- step time

// The default configuration (width 1024, 16 blocks, batch 64): forward + backward should be
// GEMM-bound, about 6 * parameters * batch flops. Printed for the record; the test checks only
// that the step computes a sane loss (timing assertions would be flaky on shared machines).
TEST(CharModel, DefaultConfigStepTime) {
  const char_model_config c;
  rig r;
  auto m = r.model(c);
  const auto w = make_weights(c, 1);
  const auto tokens = testing::random_tokens(c, 1);
  step_result got = run_step(*m, w, tokens);  // warm-up: allocator segments, OpenBLAS threads
  constexpr int steps = 3;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) got = run_step(*m, w, tokens);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
  const double flops = 6.0 * static_cast<double>(parameter_count(c)) * c.batch;
  std::printf("default config (%zu parameters, batch %d, %u hardware threads): %.1f ms per step, "
              "%.1f GFLOP/s (6*params*batch = %.2f GFLOP); wait %.3f s, compute %.3f s in all\n",
              parameter_count(c), c.batch, std::thread::hardware_concurrency(), seconds * 1e3,
              flops / seconds * 1e-9, flops * 1e-9, m->stats().wait_seconds, m->stats().compute_seconds);
  RecordProperty("step_ms", std::to_string(seconds * 1e3));
  EXPECT_NEAR(got.loss, std::log(256.0), 0.05);
}

}  // namespace
}  // namespace terrace::model
