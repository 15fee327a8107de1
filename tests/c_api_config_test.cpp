// SPDX-License-Identifier: Apache-2.0
// The C ABI's configuration (terrace_configure, TERRACE_ALLOC_CONF) through libterrace.so, in a
// process of its own: c_api_test configures its process before any test runs, and the config can
// only be set before the first allocation, so what happens before that is tested here.
//
// ctest runs each test in a process of its own. Run as one binary, the tests share the process:
// they are declared in the order that works (the first needs a process that nothing configured).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "terrace/device.hpp"
#include "terrace/terrace.h"

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

nlohmann::json stats(int device) {
  std::size_t needed = 0;
  EXPECT_EQ(terrace_stats_json(device, nullptr, 0, &needed), TERRACE_ERANGE);
  std::string buf(needed + 256, '\0');
  EXPECT_EQ(terrace_stats_json(device, buf.data(), buf.size(), &needed), TERRACE_OK)
      << terrace_last_error();
  buf.resize(needed - 1);
  return nlohmann::json::parse(buf);
}

// A bad TERRACE_ALLOC_CONF is an error of every call that would create an allocator, each naming
// the variable and the bad item, until a good config is set; a refused terrace_configure leaves
// the config it would have replaced; nothing is created, and so nothing frozen, by a failure.
TEST(CApiConfig, BadConfigIsRefusedWholeAndCreatesNothing) {
  ASSERT_EQ(setenv("TERRACE_ALLOC_CONF", "device:sim,device_capacity:64MiB,max_split_size_mb:abc", 1), 0);
  EXPECT_EQ(terrace_malloc(4096, 0, nullptr), nullptr);
  std::string err = terrace_last_error();
  EXPECT_TRUE(contains(err, "terrace_malloc(4096, 0, ")) << err;
  EXPECT_TRUE(contains(err, "TERRACE_ALLOC_CONF: bad item 'max_split_size_mb:abc'")) << err;
  // PyTorch's hook throws the same text (PyTorch raises it as a RuntimeError).
  try {
    terrace_torch_malloc(4096, 0, nullptr);
    ADD_FAILURE() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), "'max_split_size_mb:abc'")) << e.what();
  }
  EXPECT_EQ(terrace_begin_iteration(0), TERRACE_EINVAL);
  EXPECT_TRUE(contains(terrace_last_error(), "'max_split_size_mb:abc'")) << terrace_last_error();
  // Nothing was made: the device reports zeros.
  const nlohmann::json before = stats(0);
  EXPECT_EQ(before["reserved_bytes.all.current"], 0);
  EXPECT_EQ(before["num_device_alloc"], 0);

  // terrace_configure still may set the config, and the environment is not read again.
  ASSERT_EQ(terrace_configure("device:sim,device_capacity:64MiB"), TERRACE_OK) << terrace_last_error();
  // Each refused text names its bad item and leaves the 64 MiB config as it was: a first item
  // that parses is not applied when a later one is refused.
  const std::vector<std::pair<const char*, const char*>> refused = {
      {"device_capacity:1GiB,bogus:1", "unknown key 'bogus'"},
      {"device_capacity:1GiB,device_capacity:2GiB", "'device_capacity' is already set by 'device_capacity:1GiB'"},
      {"device_capacity:1GiB,memory_fraction:2", "'memory_fraction:2'"},
      {"device_capacity:1GiB,garbage_collection_threshold:1.5", "[0, 1)"},
      {"device_capacity:1GiB,roundup_power2_divisions:[256:1,>:8]", "per-size form"},
      {"device_capacity:1GiB,backend:native", "a PYTORCH_CUDA_ALLOC_CONF key that terrace does not implement"},
      {"device:cuda,expandable_segments:True", "device 'cuda' has none"},
      {"device_capacity:99999999999999GiB", "does not fit in 64 bits"},
      {"device_capacity:-1", "sizes cannot be negative"},
  };
  for (const auto& [text, why] : refused) {
    EXPECT_EQ(terrace_configure(text), TERRACE_EINVAL) << text;
    err = terrace_last_error();
    EXPECT_TRUE(contains(err, std::string("terrace_configure(\"") + text + "\")")) << err;
    EXPECT_TRUE(contains(err, why)) << text << ": " << err;
  }

  // A backend this build or machine lacks fails at creation, which freezes nothing either.
  if (!terrace::cuda_device_available()) {
    ASSERT_EQ(terrace_configure("device:cuda"), TERRACE_OK) << terrace_last_error();
    EXPECT_EQ(terrace_malloc(4096, 0, nullptr), nullptr);
    EXPECT_TRUE(contains(terrace_last_error(), "cuda")) << terrace_last_error();
    ASSERT_EQ(terrace_configure("device:sim,device_capacity:64MiB"), TERRACE_OK) << terrace_last_error();
  }

  // The device is the 64 MiB one, not a 1 or 2 GiB one from a refused text.
  EXPECT_EQ(terrace_malloc(100 * MiB, 0, nullptr), nullptr);
  EXPECT_TRUE(contains(terrace_last_error(), "device capacity 64.00 MiB")) << terrace_last_error();
  void* p = terrace_malloc(MiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << terrace_last_error();
  terrace_free(p, MiB, 0, nullptr);
  EXPECT_STREQ(terrace_last_error(), "");
  // Now frozen: a good text is refused for that reason, a bad one for its own.
  EXPECT_EQ(terrace_configure("device:sim"), TERRACE_EINVAL);
  EXPECT_TRUE(contains(terrace_last_error(), "before the first allocation")) << terrace_last_error();
  EXPECT_EQ(terrace_configure("small_size:0x10"), TERRACE_EINVAL);
  EXPECT_TRUE(contains(terrace_last_error(), "hexadecimal")) << terrace_last_error();
  unsetenv("TERRACE_ALLOC_CONF");
}

// Damaged and hostile texts: terrace_configure answers TERRACE_OK or TERRACE_EINVAL with a
// message, whatever the text; no exception reaches the caller (it would end the process here).
TEST(CApiConfig, ConfigureNeverThrowsWhateverTheText) {
  const std::string good =
      "device:sim,device_capacity:64MiB,small_size:512KiB,max_split_size_mb:64,"
      "roundup_power2_divisions:4,garbage_collection_threshold:0.5,expandable_segments:true,"
      "memory_fraction:0.5,policy:planned,plan_min_period:64,record_trace:1,trace_max_events:100";
  std::mt19937_64 rng(7);
  auto below = [&](std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng); };
  std::size_t ok = 0, einval = 0;
  for (int round = 0; round < 2000; ++round) {
    std::string text = good;
    for (int k = 0, n = 1 + static_cast<int>(below(4)); k < n; ++k) {
      const std::size_t at = below(text.size() + 1);
      switch (below(4)) {
        case 0: text.erase(at, 1 + below(8)); break;
        case 1: text.insert(at, 1, ",:[]-.0x9eEKiB "[below(15)]); break;
        case 2: text.insert(at, std::string(1 + below(3), static_cast<char>(1 + below(255)))); break;
        case 3: text.insert(at, text.substr(below(text.size() + 1), below(40))); break;  // duplicates
      }
    }
    SCOPED_TRACE(text);
    const int rc = terrace_configure(text.c_str());
    if (rc == TERRACE_OK) {
      ++ok;
      EXPECT_STREQ(terrace_last_error(), "");
    } else {
      ++einval;
      EXPECT_EQ(rc, TERRACE_EINVAL) << terrace_last_error();
      EXPECT_TRUE(contains(terrace_last_error(), "terrace_configure(")) << terrace_last_error();
      EXPECT_TRUE(contains(terrace_last_error(), "terrace: ")) << terrace_last_error();
    }
  }
  EXPECT_GT(einval, 100u);
  // Huge and empty texts. A text that parses is refused only if an allocator exists already (when
  // the binary runs every test in one process).
  const auto accepted = [](const std::string& text) {
    const int rc = terrace_configure(text.c_str());
    return rc == TERRACE_OK || (rc == TERRACE_EINVAL && contains(terrace_last_error(), "before the first allocation"));
  };
  EXPECT_TRUE(accepted(good));
  EXPECT_TRUE(accepted(std::string(1 << 20, ',')));
  EXPECT_TRUE(accepted(""));
  EXPECT_EQ(terrace_configure(("small_size:" + std::string(100000, '9')).c_str()), TERRACE_EINVAL);
  EXPECT_TRUE(contains(terrace_last_error(), "does not fit")) << std::string(terrace_last_error()).substr(0, 200);
  std::printf("[          ] %zu damaged texts accepted, %zu refused\n", ok, einval);
}

}  // namespace
