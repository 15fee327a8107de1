// SPDX-License-Identifier: Apache-2.0
// The benchmarks' one median: every table quotes medians (the machines are noisy).
#pragma once

#include <algorithm>
#include <vector>

namespace terrace::tools {

/// @brief The median of `v`: the middle value, or the mean of the two middle values when the
/// count is even; 0 for an empty vector.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace terrace::tools
