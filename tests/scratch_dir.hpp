// SPDX-License-Identifier: Apache-2.0
// A fresh directory per test for the NVMe tier's tests, removed afterwards. It lives under
// $TERRACE_TEST_SCRATCH (or the build tree's scratch/ folder), not in tmpfs, so O_DIRECT is real.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <string>

#ifndef TERRACE_TEST_SCRATCH_DIR
#define TERRACE_TEST_SCRATCH_DIR "."
#endif

namespace terrace::testing {

class scratch_dir {
 public:
  explicit scratch_dir(const std::string& tag) {
    static std::atomic<int> counter{0};
    const char* env = std::getenv("TERRACE_TEST_SCRATCH");
    std::filesystem::path base = env && *env ? env : TERRACE_TEST_SCRATCH_DIR;
    path_ = base / (tag + "." + std::to_string(::getpid()) + "." + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~scratch_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace terrace::testing
