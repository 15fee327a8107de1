// SPDX-License-Identifier: Apache-2.0
// The request-size mixes of bench_allocator, shared by its CPU and CUDA parts.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace terrace::bench {

enum class size_mix : int { fixed_512, fixed_1m, small_mixed, large_mixed, transformer, count };

inline const char* mix_name(size_mix m) {
  switch (m) {
    case size_mix::fixed_512: return "fixed_512B";
    case size_mix::fixed_1m: return "fixed_1MiB";
    case size_mix::small_mixed: return "mixed_64B_1MiB";
    case size_mix::large_mixed: return "mixed_1MiB_64MiB";
    case size_mix::transformer: return "transformer";
    case size_mix::count: break;
  }
  return "?";
}

inline constexpr std::size_t kMixLength = 4096;  // a power of two: the loops index with a mask

// REQUIRES: lo < hi. Log-uniform, so that every octave is as frequent as the next (what a
// real mix of small tensors looks like), from a fixed seed so that runs compare.
inline std::vector<std::size_t> log_uniform_sizes(std::size_t lo, std::size_t hi, std::uint64_t seed) {
  std::vector<std::size_t> out(kMixLength);
  std::uint64_t x = seed;
  const double llo = std::log2(static_cast<double>(lo));
  const double lhi = std::log2(static_cast<double>(hi));
  for (auto& s : out) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const double u = static_cast<double>(x >> 11) / 9007199254740992.0;  // [0, 1)
    s = static_cast<std::size_t>(std::exp2(llo + u * (lhi - llo)));
  }
  return out;
}

// One transformer layer's tensors at hidden 1024, sequence 512, batch 4, 16 heads, bf16: layer-norm
// statistics and kernel scratch (small pool), activations and dropout masks (20 MiB segments), QKV,
// MLP hidden states and attention probabilities (exact large segments), weighted by how often each
// appears in a forward + backward pass.
inline std::vector<std::size_t> transformer_sizes(std::uint64_t seed) {
  constexpr std::size_t KiB = 1024, MiB = 1024 * 1024;
  struct kind {
    std::size_t size;  // 0: random scratch in [64 B, 64 KiB)
    int weight;
  };
  constexpr kind kinds[] = {
      {16 * KiB, 3},  // layer-norm mean / rstd
      {0, 4},         // reduction and GEMM scratch
      {2 * MiB, 2},   // dropout masks (1 byte per element)
      {4 * MiB, 8},   // [b, s, h] activations and their gradients
      {12 * MiB, 2},  // QKV
      {16 * MiB, 3},  // MLP hidden, GELU
      {32 * MiB, 3},  // attention scores / probabilities
  };
  int total = 0;
  for (const kind& k : kinds) total += k.weight;
  std::vector<std::size_t> out(kMixLength);
  const auto scratch = log_uniform_sizes(64, 64 * KiB, seed ^ 0x5eed);
  std::uint64_t x = seed;
  for (std::size_t i = 0; i < out.size(); ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    int pick = static_cast<int>((x >> 33) % static_cast<std::uint64_t>(total));
    for (const kind& k : kinds) {
      if (pick < k.weight) {
        out[i] = k.size != 0 ? k.size : scratch[i];
        break;
      }
      pick -= k.weight;
    }
  }
  return out;
}

inline std::vector<std::size_t> mix_sizes(size_mix m) {
  constexpr std::size_t MiB = 1024 * 1024;
  switch (m) {
    case size_mix::fixed_512: return std::vector<std::size_t>(kMixLength, 512);
    case size_mix::fixed_1m: return std::vector<std::size_t>(kMixLength, MiB);
    case size_mix::small_mixed: return log_uniform_sizes(64, MiB, 1);
    case size_mix::large_mixed: return log_uniform_sizes(MiB, 64 * MiB, 2);
    case size_mix::transformer: return transformer_sizes(3);
    case size_mix::count: break;
  }
  return {};
}

}  // namespace terrace::bench
