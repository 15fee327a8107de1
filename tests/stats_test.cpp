// SPDX-License-Identifier: Apache-2.0
// allocator_stats rendering: PyTorch's flat memory_stats() keys in JSON, and the text table.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "terrace/stats.hpp"

namespace terrace {
namespace {

using json = nlohmann::json;

constexpr const char* kFields[] = {"current", "peak", "allocated", "freed"};

// The names one of stats.hpp's X-macro lists gives, in its order.
#define TERRACE_TEST_NAMES(list)                                \
  [] {                                                          \
    std::vector<std::string> v;                                 \
    list(TERRACE_TEST_NAME)                                     \
    return v;                                                   \
  }()
#define TERRACE_TEST_NAME(field, name) v.emplace_back(name);

std::vector<std::string> family_names() { return TERRACE_TEST_NAMES(TERRACE_POOL_STATS); }
std::vector<std::string> single_names() { return TERRACE_TEST_NAMES(TERRACE_SINGLE_STATS); }
std::vector<std::string> counter_names() { return TERRACE_TEST_NAMES(TERRACE_EVENT_COUNTERS); }

#undef TERRACE_TEST_NAME
#undef TERRACE_TEST_NAMES

std::set<std::string> expected_keys() {
  std::set<std::string> keys;
  for (const auto& f : family_names()) {
    for (const char* pool : stat_pool_names) {
      for (const char* field : kFields) keys.insert(f + "." + pool + "." + field);
    }
  }
  for (const auto& f : single_names()) {
    for (const char* field : kFields) keys.insert(f + "." + field);
  }
  for (const auto& c : counter_names()) keys.insert(c);
  for (const char* k : {"largest_free_block", "cached_free_bytes", "external_fragmentation",
                        "fragmentation", "peak_fragmentation"}) {
    keys.insert(k);
  }
  return keys;
}

// Stats where every number is distinct, so a value landing under the wrong key is caught.
allocator_stats distinct_stats() {
  allocator_stats s;
  std::int64_t next = 1;
  auto fill = [&](stat_array& a) {
    for (stat& st : a) {
      st.current = next++;
      st.peak = next++;
      st.allocated = next++;
      st.freed = next++;
    }
  };
#define TERRACE_TEST_FILL(field, name) fill(s.field);
  TERRACE_POOL_STATS(TERRACE_TEST_FILL)
#undef TERRACE_TEST_FILL
#define TERRACE_TEST_FILL_SINGLE(field, name) \
  s.field = {next, next + 1, next + 2, next + 3};  \
  next += 4;
  TERRACE_SINGLE_STATS(TERRACE_TEST_FILL_SINGLE)
#undef TERRACE_TEST_FILL_SINGLE
#define TERRACE_TEST_FILL_COUNTER(field, name) s.field = 1000 + next++;
  TERRACE_EVENT_COUNTERS(TERRACE_TEST_FILL_COUNTER)
#undef TERRACE_TEST_FILL_COUNTER
  s.largest_free_block = 3 << 20;
  s.cached_free_bytes = 5 << 20;
  s.external_fragmentation = 0.4;
  s.fragmentation = 0.25;
  s.peak_fragmentation = 0.125;
  return s;
}

TEST(StatsJson, HasExactlyPyTorchsKeysPlusTheFragmentationFigures) {
  const json j = json::parse(to_json(allocator_stats{}));
  ASSERT_TRUE(j.is_object());
  std::set<std::string> got;
  for (const auto& [key, value] : j.items()) {
    got.insert(key);
    EXPECT_TRUE(value.is_number()) << key;
  }
  EXPECT_EQ(got, expected_keys());
  // 9 families x 3 pools x 4 fields + 2 families without pools x 4 fields + 5 counters + 5
  // figures, as in the header today.
  EXPECT_EQ(got.size(), family_names().size() * 12 + single_names().size() * 4 + counter_names().size() + 5);
  EXPECT_TRUE(got.count("oversize_allocations.current"));  // torch.cuda.memory_summary() reads it
  EXPECT_TRUE(got.count("allocated_bytes.large_pool.peak"));
  EXPECT_TRUE(got.count("num_device_alloc"));
}

TEST(StatsJson, RoundTripsEveryValueUnderItsOwnKey) {
  const allocator_stats s = distinct_stats();
  const json j = json::parse(to_json(s));
  const auto check_family = [&](const std::string& name, const stat_array& a) {
    for (std::size_t p = 0; p < a.size(); ++p) {
      const std::string prefix = name + "." + stat_pool_names[p] + ".";
      EXPECT_EQ(j.at(prefix + "current").get<std::int64_t>(), a[p].current) << prefix;
      EXPECT_EQ(j.at(prefix + "peak").get<std::int64_t>(), a[p].peak) << prefix;
      EXPECT_EQ(j.at(prefix + "allocated").get<std::int64_t>(), a[p].allocated) << prefix;
      EXPECT_EQ(j.at(prefix + "freed").get<std::int64_t>(), a[p].freed) << prefix;
    }
  };
#define TERRACE_TEST_CHECK(field, name) check_family(name, s.field);
  TERRACE_POOL_STATS(TERRACE_TEST_CHECK)
#undef TERRACE_TEST_CHECK
#define TERRACE_TEST_CHECK_SINGLE(field, name)                                    \
  EXPECT_EQ(j.at(name ".current").get<std::int64_t>(), s.field.current) << name;     \
  EXPECT_EQ(j.at(name ".peak").get<std::int64_t>(), s.field.peak) << name;           \
  EXPECT_EQ(j.at(name ".allocated").get<std::int64_t>(), s.field.allocated) << name; \
  EXPECT_EQ(j.at(name ".freed").get<std::int64_t>(), s.field.freed) << name;
  TERRACE_SINGLE_STATS(TERRACE_TEST_CHECK_SINGLE)
#undef TERRACE_TEST_CHECK_SINGLE
#define TERRACE_TEST_CHECK_COUNTER(field, name) \
  EXPECT_EQ(j.at(name).get<std::int64_t>(), s.field) << name;
  TERRACE_EVENT_COUNTERS(TERRACE_TEST_CHECK_COUNTER)
#undef TERRACE_TEST_CHECK_COUNTER
  EXPECT_EQ(j.at("largest_free_block").get<std::int64_t>(), s.largest_free_block);
  EXPECT_EQ(j.at("cached_free_bytes").get<std::int64_t>(), s.cached_free_bytes);
  EXPECT_DOUBLE_EQ(j.at("external_fragmentation").get<double>(), 0.4);
  EXPECT_DOUBLE_EQ(j.at("fragmentation").get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(j.at("peak_fragmentation").get<double>(), 0.125);
}

TEST(StatsJson, ExtremeValuesSurvive) {
  allocator_stats s;
  s.reserved_bytes[0].allocated = INT64_MAX;
  s.allocated_bytes[2].current = -7;  // inconsistent, but rendered faithfully
  s.num_ooms = INT64_MIN;
  const json j = json::parse(to_json(s));
  EXPECT_EQ(j.at("reserved_bytes.all.allocated").get<std::int64_t>(), INT64_MAX);
  EXPECT_EQ(j.at("allocated_bytes.large_pool.current").get<std::int64_t>(), -7);
  EXPECT_EQ(j.at("num_ooms").get<std::int64_t>(), INT64_MIN);
}

TEST(StatsJson, IsOneFlatObjectOnOneLine) {
  const std::string text = to_json(distinct_stats());
  EXPECT_EQ(text.find('\n'), std::string::npos);
  const json j = json::parse(text);
  for (const auto& [key, value] : j.items()) EXPECT_FALSE(value.is_structured()) << key;
}

TEST(StatsText, NamesEveryFamilyPoolCounterAndFigure) {
  const std::string t = to_text(distinct_stats());
  for (const auto& f : family_names()) EXPECT_NE(t.find(f), std::string::npos) << f;
  for (const char* pool : stat_pool_names) EXPECT_NE(t.find(pool), std::string::npos) << pool;
  for (const char* field : kFields) EXPECT_NE(t.find(field), std::string::npos) << field;
  for (const auto& c : counter_names()) EXPECT_NE(t.find(c), std::string::npos) << c;
  for (const char* k : {"largest_free_block", "cached_free_bytes", "external_fragmentation",
                        "peak_fragmentation"}) {
    EXPECT_NE(t.find(k), std::string::npos) << k;
  }
}

// The line of the table for (family, pool): the family's first row names it, later rows do not.
std::string row_of(const std::string& text, const std::string& family, const std::string& pool) {
  std::size_t at = text.find("\n" + family + " ");
  if (at == std::string::npos) return {};
  for (int i = 0; i < 3; ++i) {
    const std::size_t end = text.find('\n', at + 1);
    const std::string line = text.substr(at + 1, end - at - 1);
    if (line.find(" " + pool + " ") != std::string::npos) return line;
    at = end;
  }
  return {};
}

TEST(StatsText, ByteFamiliesAreHumanReadableAndCountsArePlain) {
  allocator_stats s;
  s.allocated_bytes[0] = {3 << 20, 5 << 20, 7 << 20, 4 << 20};
  s.allocated_bytes[1] = {512, 512, 512, 0};
  s.allocation[0] = {3, 5, 1234567, 1234564};
  s.largest_free_block = 1536;
  s.fragmentation = 0.25;
  const std::string t = to_text(s);
  const std::string all = row_of(t, "allocated_bytes", "all");
  EXPECT_NE(all.find("3.00 MiB"), std::string::npos) << all;
  EXPECT_NE(all.find("5.00 MiB"), std::string::npos) << all;
  EXPECT_NE(all.find("7.00 MiB"), std::string::npos) << all;
  EXPECT_NE(all.find("4.00 MiB"), std::string::npos) << all;
  const std::string small = row_of(t, "allocated_bytes", "small_pool");
  EXPECT_NE(small.find("512 B"), std::string::npos) << small;
  const std::string counts = row_of(t, "allocation", "all");
  EXPECT_NE(counts.find("1234567"), std::string::npos) << counts;
  EXPECT_EQ(counts.find("MiB"), std::string::npos) << counts;
  EXPECT_NE(t.find("1.50 KiB"), std::string::npos) << t;
  EXPECT_NE(t.find("25.00%"), std::string::npos) << t;
}


// Found in review: the unsigned overload cast its size to int64_t, so every size from 2^63 up (a
// budget or capacity of SIZE_MAX in a refusal's message) was written as a negative number.
TEST(HumanBytes, SizesFromTwoToTheSixtyThreeUpArePositive) {
  EXPECT_EQ(human_bytes(std::uint64_t{1} << 63), "8.00 EiB");
  EXPECT_EQ(human_bytes(std::numeric_limits<std::uint64_t>::max()), "16.00 EiB");
  EXPECT_EQ(human_bytes(std::uint64_t{1536}), "1.50 KiB");
  EXPECT_EQ(human_bytes(std::uint64_t{512}), "512 B");
  // The signed overload keeps showing inconsistent (negative) stats, the most negative too.
  EXPECT_EQ(human_bytes(std::int64_t{-512}), "-512 B");
  EXPECT_EQ(human_bytes(std::numeric_limits<std::int64_t>::min()), "-8.00 EiB");
}

}  // namespace
}  // namespace terrace
