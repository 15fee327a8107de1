// SPDX-License-Identifier: Apache-2.0
// A benchmark's scratch folder on the file system it measures. The user names a folder (`--dir
// /mnt/nvme` is the natural way to say which drive); the benchmark works in a fresh folder of its
// own inside it and removes only that. The benchmarks used to empty the named folder itself, at
// start and at the end: pointed at a drive's mount point, they deleted everything on it.
#pragma once

#include <linux/magic.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

namespace terrace::tools {

class bench_scratch {
 public:
  /// Makes `parent` (and its parents) when missing, then `parent/<name>.<pid>`.
  /// @throws std::runtime_error when the folder cannot be made or exists already.
  bench_scratch(const std::filesystem::path& parent, const std::string& name) {
    const std::filesystem::path at = std::filesystem::absolute(parent);
    std::error_code ec;
    made_parent_ = std::filesystem::create_directories(at, ec);
    if (ec) throw std::runtime_error("cannot make " + at.string() + ": " + ec.message());
    path_ = at / (name + "." + std::to_string(::getpid()));
    if (!std::filesystem::create_directory(path_, ec) || ec) {
      const std::string why = ec ? ec.message() : "it exists already";
      remove_parent_if_made();
      throw std::runtime_error("cannot make the scratch folder " + path_.string() + ": " + why);
    }
  }
  /// Removes the scratch folder with all in it, and `parent` when this made it and it is empty.
  /// Whatever holds files in it (a store) must be closed first.
  ~bench_scratch() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
    remove_parent_if_made();
  }
  bench_scratch(const bench_scratch&) = delete;
  bench_scratch& operator=(const bench_scratch&) = delete;

  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  void remove_parent_if_made() noexcept {
    std::error_code ec;
    if (made_parent_) std::filesystem::remove(path_.parent_path(), ec);  // only if empty
  }
  std::filesystem::path path_;
  bool made_parent_ = false;
};

/// @brief Whether `path` is on a tmpfs, whose "disk" is memory: since Linux 6.6 it also accepts
/// O_DIRECT, so the store's own check does not tell.
inline bool on_tmpfs(const std::filesystem::path& path) {
  struct statfs fs {};
  return ::statfs(path.c_str(), &fs) == 0 && fs.f_type == TMPFS_MAGIC;
}

}  // namespace terrace::tools
