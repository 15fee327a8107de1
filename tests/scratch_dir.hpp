// SPDX-License-Identifier: Apache-2.0
// A fresh directory per test for the NVMe tier's tests, removed afterwards (and flip_byte, to
// corrupt a file in it). It lives under $TERRACE_TEST_SCRATCH (or the build tree's scratch/
// folder), not in tmpfs, so O_DIRECT is real.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
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

// Flips one bit of the byte at `offset` of `file` and syncs it: a corrupt extent or index on disk.
inline void flip_byte(const std::filesystem::path& file, std::uint64_t offset) {
  const int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= 0x40;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ::fsync(fd);
  ::close(fd);
}

}  // namespace terrace::testing
