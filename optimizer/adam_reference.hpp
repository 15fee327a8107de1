// SPDX-License-Identifier: Apache-2.0
// The slow, obviously right Adam/AdamW that the kernel tests (CPU and GPU) compare against: one
// element at a time, in double, written the way torch.optim documents it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "terrace/adam.hpp"

namespace terrace::reference {

struct adam_state {
  std::vector<double> param;
  std::vector<double> exp_avg;
  std::vector<double> exp_avg_sq;
};

/// @brief Step number `step` (from 1) of torch.optim.Adam / AdamW, or of Lion (adam.hpp; v left
/// alone), with options `o`, on gradients `grad * grad_mul` (grad_mul = clip_coef / grad_scale).
/// When `o.state_dtype` is bf16, m and v are rounded to bf16 after the update, as the kernels store
/// them; everything else stays in double.
/// REQUIRES: grad and every vector of `state` have the same length; step >= 1.
void adam_step(const adam_options& o, std::int64_t step, std::span<const double> grad,
               double grad_mul, adam_state& state);

}  // namespace terrace::reference
