// SPDX-License-Identifier: Apache-2.0
// What the char model's cpu and gpu tests share: weights (fp32 masters and their bf16 copies, as
// the offload engine keeps them) and batches of tokens.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kernels/char_model.hpp"

namespace terrace::model::testing {

struct model_weights {
  std::vector<std::vector<float>> master;          ///< per layer, fp32
  std::vector<std::vector<std::uint16_t>> bf16;    ///< per layer, what the model reads

  /// The bf16 copies from the masters (after an update).
  void refresh() {
    for (std::size_t l = 0; l < master.size(); ++l) to_bf16(master[l].data(), master[l].size(), bf16[l].data());
  }
  /// Layer l as float64, exactly the values the model reads (bf16 widens exactly).
  std::vector<double> widened(std::size_t l) const {
    std::vector<float> f(bf16[l].size());
    from_bf16(bf16[l].data(), f.size(), f.data());
    return {f.begin(), f.end()};
  }
};

inline model_weights make_weights(const char_model_config& c, std::uint64_t seed) {
  model_weights w;
  const auto specs = layers(c);
  for (std::size_t l = 0; l < specs.size(); ++l) {
    w.master.emplace_back(specs[l].elements);
    w.bf16.emplace_back(specs[l].elements);
    init_layer(c, static_cast<int>(l), seed, w.master.back().data());
  }
  w.refresh();
  return w;
}

/// A small LCG, so that batches are the same on every platform (std:: distributions are not).
struct lcg {
  std::uint64_t state;
  std::uint32_t next() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<std::uint32_t>(state >> 33);
  }
};

/// batch rows of context+1 tokens, each below vocab.
inline std::vector<std::uint8_t> random_tokens(const char_model_config& c, std::uint64_t seed) {
  lcg g{seed};
  std::vector<std::uint8_t> t(static_cast<std::size_t>(c.batch) * (c.context + 1));
  for (auto& x : t) x = static_cast<std::uint8_t>(g.next() % static_cast<unsigned>(c.vocab));
  return t;
}

/// batch windows of context+1 consecutive bytes of `text`, at positions drawn from `g`.
inline std::vector<std::uint8_t> text_batch(const char_model_config& c, std::string_view text, lcg& g) {
  const std::size_t row = static_cast<std::size_t>(c.context) + 1;
  std::vector<std::uint8_t> t;
  t.reserve(static_cast<std::size_t>(c.batch) * row);
  for (int b = 0; b < c.batch; ++b) {
    const std::size_t at = g.next() % (text.size() - row + 1);
    for (std::size_t i = 0; i < row; ++i) t.push_back(static_cast<std::uint8_t>(text[at + i]));
  }
  return t;
}

}  // namespace terrace::model::testing
