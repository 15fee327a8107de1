// SPDX-License-Identifier: Apache-2.0
// The io_uring engine when a thread cannot be made (EAGAIN: the process or cgroup is at its
// thread limit). This executable replaces pthread_create with one that fails a chosen call and
// passes the others to the C library's. A constructor that fails must give back everything it
// made: the ring (which holds the swap files it registered, and with them the store's swap-file
// locks), the eventfd and the bounce buffers.
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <string>

#include "scratch_dir.hpp"
#include "terrace/error.hpp"
#include "terrace/tensor_store.hpp"
#include "tiers/io_engine.hpp"

namespace {
// Calls to pass before the one that fails; -1: none fails.
std::atomic<int> creations_before_failure{-1};
}  // namespace

// Default visibility: the project builds with hidden symbols, and libstdc++ must reach this one.
extern "C" __attribute__((visibility("default"))) int pthread_create(pthread_t* thread, const pthread_attr_t* attr, void* (*start)(void*), void* arg) {
  using real_t = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  static const auto real = reinterpret_cast<real_t>(::dlsym(RTLD_NEXT, "pthread_create"));
  int n = creations_before_failure.load();
  while (n >= 0 && !creations_before_failure.compare_exchange_weak(n, n - 1)) {
  }
  if (n == 0) return EAGAIN;
  return real(thread, attr, start, arg);
}

namespace terrace {
namespace {

using testing::scratch_dir;
constexpr std::size_t MiB = 1024 * 1024;

int open_descriptors() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (::readdir(d) != nullptr) ++n;
  ::closedir(d);
  return n;
}

// The engine makes its ring thread, then its hook thread: either failing leaves nothing behind.
TEST(IoUringEngineThreadFailure, AConstructorThatCannotStartAThreadClosesWhatItOpened) {
  scratch_dir dir("engine-thread");
  const std::string name = (dir.path() / "file").string();
  const int fd = ::open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(MiB)), 0);
  detail::engine_options options;
  options.block_size = 64 * 1024;
  options.file_size = MiB;
  for (int fail_at : {0, 1}) {
    const int before = open_descriptors();
    creations_before_failure = fail_at;
    try {
      detail::make_io_uring_engine(options, {{fd, true, name}});
      ADD_FAILURE() << "thread " << fail_at << " failed, and the engine was made all the same";
    } catch (const io_error& e) {
      EXPECT_EQ(e.code(), EAGAIN) << e.what();
      EXPECT_NE(std::string(e.what()).find("cannot start the io_uring engine's threads"), std::string::npos) << e.what();
    }
    creations_before_failure = -1;
    EXPECT_EQ(open_descriptors(), before) << "thread " << fail_at << " failed: descriptors left open";
  }
  ::close(fd);
}

// What a user sees: an open that failed for want of a thread left the store's swap files held by
// a leaked ring, so the next open waited 30 s for their locks and failed.
TEST(IoUringEngineThreadFailure, AStoreWhoseOpenFailedForWantOfAThreadOpensAgainAtOnce) {
  scratch_dir dir("store-thread");
  tensor_store_options o;
  o.capacity = 4 * MiB;
  o.block_size = 64 * 1024;
  tensor_store::create(dir.path(), o);
  for (int fail_at : {0, 1}) {  // the engine's ring thread, then its hook thread
    creations_before_failure = fail_at;
    EXPECT_THROW(tensor_store::open(dir.path(), o), io_error) << fail_at;
    creations_before_failure = -1;
    const auto start = std::chrono::steady_clock::now();
    EXPECT_NO_THROW(tensor_store::open(dir.path(), o)) << fail_at;
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << fail_at;
  }
}

}  // namespace
}  // namespace terrace
