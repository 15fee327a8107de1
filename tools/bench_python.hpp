// SPDX-License-Identifier: Apache-2.0
// The benchmarks' Python halves (tools/bench_adam_torch.py, ...) print one line each that the C++
// half parses: "RESULT <name> <seconds>" or "UNAVAILABLE <name> <reason>", and optionally
// "PAIRED <name> <ratio> <lowest> <highest>" (tools/bench_adam_torch.py).
#pragma once

#include <cstdio>
#include <cstring>
#include <string>

namespace terrace::tools {

/// What a Python half printed: its RESULT seconds, and where it also timed terrace's step
/// interleaved with its own, the median (lowest, highest) of their time / terrace's per pair
/// ("PAIRED <name> <median> <lowest> <highest>"). Negative: not printed.
struct python_figures {
  double seconds = -1;
  double paired = -1, paired_lowest = -1, paired_highest = -1;
};

/// @brief Runs `command` (a shell command line) and reads its lines; seconds is negative, with
/// `note` saying why (its UNAVAILABLE line, no output, or no shell), when there is no RESULT.
inline python_figures python_run(const std::string& command, std::string& note) {
  python_figures r;
  FILE* f = popen(command.c_str(), "r");
  if (f == nullptr) {
    note = "could not run: " + command;
    return r;
  }
  char line[4096];
  note = "no RESULT line from: " + command;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    char name[64];
    double s, lo, hi;
    if (std::sscanf(line, "RESULT %63s %lf", name, &s) == 2) r.seconds = s;
    if (std::sscanf(line, "PAIRED %63s %lf %lf %lf", name, &s, &lo, &hi) == 4) {
      r.paired = s;
      r.paired_lowest = lo;
      r.paired_highest = hi;
    }
    if (std::strncmp(line, "UNAVAILABLE", 11) == 0) {
      note = line;
      if (!note.empty() && note.back() == '\n') note.pop_back();
    }
  }
  pclose(f);
  return r;
}

/// @brief python_run's seconds alone.
inline double python_result(const std::string& command, std::string& note) {
  return python_run(command, note).seconds;
}

}  // namespace terrace::tools
