// SPDX-License-Identifier: Apache-2.0
// The demo model of `terrace train` as the offload engine sees it: the char model (kernels/) as a
// layered_model, the corpus it reads, and its deterministic batches.
#include <algorithm>
#include <fstream>
#include <ios>
#include <iterator>
#include <string>
#include <system_error>

#include "terrace/error.hpp"
#include "tools/train.hpp"

namespace terrace::tools {
namespace {

// splitmix64: a counter-based generator, so batch i needs no state from batches before it.
std::uint64_t splitmix64(std::uint64_t& x) {
  std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::size_t round_up(std::size_t n, std::size_t unit) { return (n + unit - 1) / unit * unit; }

class char_layered_model final : public layered_model {
 public:
  char_layered_model(const model::char_model_config& config, std::uint64_t seed,
                     device_backend& device, caching_allocator& activations, stream_ref stream)
      : config_(config),
        seed_(seed),
        specs_(model::layers(config)),
        model_(model::make_char_model(config, device, activations, stream)) {}

  std::size_t layer_count() const override { return specs_.size(); }
  std::string layer_name(std::size_t layer) const override { return specs_.at(layer).name; }
  std::size_t layer_elements(std::size_t layer) const override {
    return specs_.at(layer).elements;
  }
  void init_layer(std::size_t layer, float* out) const override {
    model::init_layer(config_, static_cast<int>(layer), seed_, out);
  }
  std::size_t activation_bytes() const override { return char_model_activation_bytes(config_); }
  void begin_batch(const void* batch) override {
    model_->begin_batch(static_cast<const std::uint8_t*>(batch));
  }
  void forward(std::size_t layer, const std::uint16_t* params) override {
    model_->forward(static_cast<int>(layer), params);
  }
  float loss() override { return model_->loss(); }
  void backward(std::size_t layer, const std::uint16_t* params, float* grad) override {
    model_->backward(static_cast<int>(layer), params, grad);
  }
  double wait_seconds() const override { return model_->stats().wait_seconds; }

 private:
  model::char_model_config config_;
  std::uint64_t seed_;
  std::vector<model::layer_spec> specs_;
  std::unique_ptr<model::char_model> model_;
};

}  // namespace

std::vector<std::uint8_t> load_corpus(const std::string& path, int context) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw train_setup_error("cannot read the corpus '" + path +
                            "' (--corpus names another text file)");
  }
  std::vector<std::uint8_t> bytes;
  try {
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::ios_base::failure& e) {  // a read error (a directory, EIO): the file's fault
    const std::error_code& code = e.code();
    throw train_setup_error("cannot read the corpus '" + path + "': " +
                            (code && code != std::io_errc::stream ? code.message() : e.what()));
  }
  if (bytes.size() < static_cast<std::size_t>(context) + 1) {
    throw train_setup_error("the corpus '" + path + "' holds " + std::to_string(bytes.size()) +
                            " bytes: fewer than one context of " + std::to_string(context) +
                            " plus its target");
  }
  return bytes;
}

std::vector<std::uint8_t> sample_batch(const std::vector<std::uint8_t>& corpus,
                                       const model::char_model_config& config, std::uint64_t seed,
                                       std::uint64_t index) {
  const std::size_t row = static_cast<std::size_t>(config.context) + 1;
  // load_corpus refuses such a corpus; anything else would read past its end.
  if (corpus.size() < row) {
    throw logic_error("terrace train: a corpus of " + std::to_string(corpus.size()) +
                      " bytes has no batch: one row is context + 1 = " + std::to_string(row) +
                      " bytes");
  }
  const std::size_t starts = corpus.size() - row + 1;
  std::vector<std::uint8_t> out(static_cast<std::size_t>(config.batch) * row);
  std::uint64_t state = seed * 0xd1342543de82ef95ull + index;
  (void)splitmix64(state);  // decorrelate neighbouring indices before the first draw
  for (std::size_t b = 0; b < static_cast<std::size_t>(config.batch); ++b) {
    const std::size_t at = static_cast<std::size_t>(splitmix64(state) % starts);
    std::copy_n(corpus.begin() + static_cast<std::ptrdiff_t>(at), row, out.begin() + b * row);
  }
  return out;
}

// What kernels/char_model_cpu.cpp allocates, at its peak (backward of the first block, or of the
// input projection): every forward activation (each block's r only without recompute_blocks;
// with it, one r recomputed in backward), dh, dr, dx0 and one layer's weights widened to fp32. Small blocks round to 512 B and are carved from the small pool's segments; larger ones get
// segments of their own (offload_engine_options::default_device_allocator).
std::size_t char_model_activation_bytes(const model::char_model_config& c) {
  model::validate(c);
  const allocator_config a = offload_engine_options::default_device_allocator();
  const std::size_t batch = static_cast<std::size_t>(c.batch);
  const std::size_t width = static_cast<std::size_t>(c.width);
  const std::size_t in = static_cast<std::size_t>(c.context) * static_cast<std::size_t>(c.embed);
  std::size_t small = 0, large = 0;
  const auto block = [&](std::size_t floats) {
    const std::size_t bytes = round_up(floats * 4, 512);
    if (bytes <= a.small_size) {
      small += bytes;
    } else {
      large += round_up(bytes, a.large_round);
    }
  };
  block(batch * in);                                 // x0
  for (int l = 0; l <= c.layers; ++l) block(batch * width);  // h after the input and each block
  if (c.recompute_blocks) {
    block(batch * width);  // one block's r, made again in its backward (scratch)
  } else {
    for (int l = 0; l < c.layers; ++l) block(batch * width);  // r of each block
  }
  block(batch * static_cast<std::size_t>(c.vocab));  // probs
  block(batch * width);                              // dh
  block(batch * width);                              // dr (scratch)
  block(batch * in);                                 // dx0
  std::size_t widest = 0;
  for (const auto& s : model::layers(c)) widest = std::max(widest, s.elements);
  block(widest);                                     // the widened weights (scratch)
  // A small pool's last segment is partly used (the engine's default settings have none).
  return (small > 0 ? round_up(small, a.small_segment_size) : 0) + large;
}

std::unique_ptr<layered_model> make_char_layered_model(const model::char_model_config& config,
                                                       std::uint64_t seed, device_backend& device,
                                                       caching_allocator& activations,
                                                       stream_ref stream) {
  return std::make_unique<char_layered_model>(config, seed, device, activations, stream);
}

}  // namespace terrace::tools
