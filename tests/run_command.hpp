// SPDX-License-Identifier: Apache-2.0
// Runs a command line for the CLI tests and keeps its exit code and output (stdout and stderr).
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace terrace::testing {

struct run_result {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

inline run_result run_command(const std::string& command) {
  run_result r;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) r.output.append(buf, n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace terrace::testing
