// SPDX-License-Identifier: Apache-2.0
// Crash consistency: a child process puts, erases and checkpoints in a loop and is killed with
// SIGKILL at a random moment, many times over. After each kill the store is reopened and must hold
// exactly some committed generation: the last one the child reported, or the one after it (a commit
// whose report the kill cut off), with every tensor's bytes exactly as that generation wrote them.
//
// The workload is a pure function of the generation number, so the parent can recompute what any
// generation must contain without trusting anything the child wrote.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "scratch_dir.hpp"
#include "terrace/error.hpp"
#include "terrace/tensor_store.hpp"

namespace terrace {
namespace {

struct version {
  std::uint64_t written_in;  // the generation that wrote it
  std::size_t size;
};
using model = std::map<std::string, version>;

std::vector<unsigned char> content(const std::string& id, std::uint64_t gen, std::size_t n) {
  std::vector<unsigned char> v(n);
  std::uint64_t x = std::hash<std::string>{}(id) ^ (gen * 0x9E3779B97F4A7C15ull) ^ 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<unsigned char>(x);
  }
  return v;
}

// The changes that generation `gen` makes: puts (id, size) and erases.
struct step {
  std::vector<std::pair<std::string, std::size_t>> puts;
  std::vector<std::string> erases;
};
step step_for(std::uint64_t gen) {
  std::mt19937_64 rng(gen);
  step s;
  for (int i = 0, n = 1 + static_cast<int>(rng() % 6); i < n; ++i)
    s.puts.emplace_back("t" + std::to_string(rng() % 24), rng() % (400 << 10) + 1);
  for (int i = 0, n = static_cast<int>(rng() % 3); i < n; ++i) s.erases.push_back("t" + std::to_string(rng() % 24));
  return s;
}

model model_at(std::uint64_t gen) {
  model m;
  for (std::uint64_t g = 1; g <= gen; ++g) {
    auto s = step_for(g);
    for (auto& [id, size] : s.puts) m[id] = {g, size};
    for (auto& id : s.erases) m.erase(id);
  }
  return m;
}

tensor_store_options options() {
  tensor_store_options o;
  o.capacity = 64 << 20;
  o.block_size = 64 << 10;
  o.queue_depth = 8;
  return o;
}

// The child: continue from whatever generation is committed, forever; report each commit.
[[noreturn]] void child(const std::filesystem::path& dir, int report_fd) {
  try {
    auto s = tensor_store::open(dir, options());
    for (std::uint64_t gen = s.generation() + 1;; ++gen) {
      auto st = step_for(gen);
      std::vector<std::vector<unsigned char>> keep;
      std::vector<io_handle> hs;
      for (auto& [id, size] : st.puts) {
        keep.push_back(content(id, gen, size));
        hs.push_back(s.put(id, keep.back().data(), size));
      }
      for (auto& id : st.erases)
        if (s.contains(id)) s.erase(id);
      for (auto& h : hs) h.wait();
      if (s.checkpoint() != gen) ::_exit(3);
      if (::write(report_fd, &gen, sizeof gen) != sizeof gen) ::_exit(4);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "crash child: %s\n", e.what());
    ::_exit(2);
  }
}

TEST(TensorStoreCrash, KillNineAtRandomMomentsLosesNothingCommitted) {
  testing::scratch_dir dir("crash");
  { tensor_store::create(dir.path(), options()); }
  std::mt19937 rng(12345);
  std::uint64_t reported = 0;
  int kills = 0, advanced_past_report = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(12);
  while (std::chrono::steady_clock::now() < deadline || kills < 20) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      child(dir.path(), fds[1]);
    }
    ::close(fds[1]);
    std::this_thread::sleep_for(std::chrono::microseconds(2000 + rng() % 60000));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the child exited by itself with " << WEXITSTATUS(status);
    std::uint64_t g;
    while (::read(fds[0], &g, sizeof g) == sizeof g) reported = g;
    ::close(fds[0]);
    ++kills;

    auto s = tensor_store::open(dir.path(), options());
    const std::uint64_t got = s.generation();
    ASSERT_TRUE(got == reported || got == reported + 1)
        << "recovered generation " << got << " but the child last reported " << reported;
    advanced_past_report += got != reported;
    reported = got;
    const model m = model_at(got);
    std::vector<std::string> want_ids;
    for (auto& [id, v] : m) want_ids.push_back(id);
    ASSERT_EQ(s.ids(), want_ids) << "generation " << got;
    for (auto& [id, v] : m) {
      std::vector<unsigned char> out(v.size);
      s.get(id, out.data(), out.size()).wait();  // CRC-checked too
      ASSERT_TRUE(out == content(id, v.written_in, v.size)) << id << " in generation " << got;
    }
  }
  RecordProperty("kills", kills);
  RecordProperty("generations", static_cast<int>(reported));
  std::printf("crash test: %d kills, reached generation %llu (%d recovered a commit the report missed)\n", kills,
              static_cast<unsigned long long>(reported), advanced_past_report);
  EXPECT_GT(reported, 5u) << "the children made too little progress to test anything";
}

// A create killed at a random moment: the directory it leaves must be one that open() accepts
// (the create committed) or one that a second create() turns into a store. Found in review: a
// kill after the swap files were made and before the index committed left a directory that
// create() (swap.0 exists) and open() (no index) both refused.
TEST(TensorStoreCrash, KillNineDuringCreateLeavesADirectoryThatCreateOrOpenAccepts) {
  tensor_store_options o = options();
  o.capacity = std::uint64_t{256} << 20;
  o.files = 4;
  std::mt19937 rng(777);
  int interrupted = 0, committed = 0, before_anything = 0;
  for (int i = 0; i < 30 || interrupted < 3; ++i) {
    ASSERT_LT(i, 600) << "never killed a create between its first swap file and its index";
    testing::scratch_dir dir("create-crash");
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      try {
        tensor_store::create(dir.path(), o);
      } catch (...) {
        ::_exit(2);
      }
      ::_exit(0);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100 + rng() % 60000));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << "the create failed by itself";
    if (std::filesystem::exists(dir.path() / "index")) {
      ++committed;
      EXPECT_NO_THROW(tensor_store::open(dir.path(), o)) << "iteration " << i;
      continue;
    }
    const bool made_files = std::filesystem::exists(dir.path() / "swap.0");
    (made_files ? interrupted : before_anything) += 1;
    try {
      tensor_store::open(dir.path(), o);
      ADD_FAILURE() << "iteration " << i << ": opened a store whose create did not commit";
    } catch (const io_error& e) {
      if (made_files) {
        EXPECT_NE(std::string(e.what()).find("create() was interrupted"), std::string::npos) << e.what();
      }
    }
    try {
      auto s = tensor_store::create(dir.path(), o);
      const std::vector<unsigned char> v(1000, 7);
      s.put("v", v.data(), v.size()).wait();
      s.checkpoint();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << i << ": create after the kill: " << e.what();
    }
    EXPECT_NO_THROW(tensor_store::open(dir.path(), o)) << "iteration " << i;
  }
  std::printf("create crash test: %d kills mid-create, %d after the commit, %d before any swap file\n", interrupted,
              committed, before_anything);
}

}  // namespace
}  // namespace terrace
