// SPDX-License-Identifier: Apache-2.0
// Shared by the CPU and GPU Adam tests: typed buffers, random data and the tolerances against
// the float64 reference (optimizer/adam_reference.hpp).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "optimizer/half.hpp"
#include "terrace/adam.hpp"

namespace terrace::testing {

// n elements of `type`, 64-byte aligned storage (through the vector of uint64 words).
class typed_buffer {
 public:
  typed_buffer() = default;
  typed_buffer(dtype type, std::size_t n) : type_(type), n_(n), words_((n * size_of(type) + 7) / 8 + 1) {}
  void* data() noexcept { return words_.data(); }
  const void* data() const noexcept { return words_.data(); }
  std::size_t size() const noexcept { return n_; }
  std::size_t bytes() const noexcept { return n_ * size_of(type_); }
  dtype type() const noexcept { return type_; }

  float get(std::size_t i) const noexcept {
    if (type_ == dtype::f32) return static_cast<const float*>(data())[i];
    const std::uint16_t h = static_cast<const std::uint16_t*>(data())[i];
    return type_ == dtype::bf16 ? detail::bf16_to_float(h) : detail::f16_to_float(h);
  }
  void set(std::size_t i, float x) noexcept {
    if (type_ == dtype::f32) {
      static_cast<float*>(data())[i] = x;
    } else {
      static_cast<std::uint16_t*>(data())[i] =
          type_ == dtype::bf16 ? detail::float_to_bf16(x) : detail::float_to_f16(x);
    }
  }
  bool same_bytes(const typed_buffer& other) const noexcept {
    if (bytes() != other.bytes()) return false;
    return bytes() == 0 || std::memcmp(data(), other.data(), bytes()) == 0;  // memcmp(null) is UB
  }

 private:
  dtype type_ = dtype::f32;
  std::size_t n_ = 0;
  std::vector<std::uint64_t> words_;
};

// Tolerance of a kernel result against the float64 reference after `steps` steps: float32
// rounding of every stored value, accumulated over the steps; bf16 rounding when the moments are
// stored as bf16 (a one-ulp difference in a stored moment can persist, so the bound is loose).
struct tolerances {
  double param;  // relative to |p| per step
  double param_abs_per_lr;  // absolute, in units of lr per step
  double moment;  // relative to |m| (or |v|) plus the typical magnitude
};

inline tolerances tolerances_for(dtype state) {
  if (state == dtype::bf16) return {2e-7, 3e-2, 2e-2};
  return {2e-7, 2e-6, 4e-6};
}

inline std::mt19937_64 rng(std::uint64_t seed) { return std::mt19937_64(seed); }

}  // namespace terrace::testing
