// SPDX-License-Identifier: Apache-2.0
// The benchmarks' Python halves (tools/bench_adam_torch.py, ...) print one line each that the C++
// half parses: "RESULT <name> <seconds>" or "UNAVAILABLE <name> <reason>".
#pragma once

#include <cstdio>
#include <cstring>
#include <string>

namespace terrace::tools {

/// @brief Runs `command` (a shell command line) and returns the seconds of its RESULT line, or a
/// negative value with `note` saying why (its UNAVAILABLE line, no output, or no shell).
inline double python_result(const std::string& command, std::string& note) {
  FILE* f = popen(command.c_str(), "r");
  if (f == nullptr) {
    note = "could not run: " + command;
    return -1;
  }
  char line[4096];
  double result = -1;
  note = "no RESULT line from: " + command;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    char name[64];
    double s;
    if (std::sscanf(line, "RESULT %63s %lf", name, &s) == 2) result = s;
    if (std::strncmp(line, "UNAVAILABLE", 11) == 0) {
      note = line;
      if (!note.empty() && note.back() == '\n') note.pop_back();
    }
  }
  pclose(f);
  return result;
}

}  // namespace terrace::tools
