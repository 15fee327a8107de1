// SPDX-License-Identifier: Apache-2.0
// Rendering of allocator_stats: PyTorch's flat memory_stats() keys as JSON, and a text table.
//
// Every name comes from the X-macros in stats.hpp, so a family or counter added there appears
// here (and in the tests, which build their expected keys from the same lists) without an edit.

#include "terrace/stats.hpp"

#include <cstdio>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace terrace {
namespace {

constexpr int kPools = 3;
static_assert(std::size(stat_pool_names) == kPools);

// One pool family seen by the renderers: its name and its three stats.
struct family_view {
  std::string_view name;
  const stat_array* stats;
};

template <class Fn>
void for_each_family(const allocator_stats& s, Fn&& fn) {
#define TERRACE_VISIT_FAMILY(field, name) fn(family_view{name, &s.field});
  TERRACE_POOL_STATS(TERRACE_VISIT_FAMILY)
#undef TERRACE_VISIT_FAMILY
}

template <class Fn>
void for_each_single(const allocator_stats& s, Fn&& fn) {
#define TERRACE_VISIT_SINGLE(field, name) fn(std::string_view{name}, s.field);
  TERRACE_SINGLE_STATS(TERRACE_VISIT_SINGLE)
#undef TERRACE_VISIT_SINGLE
}

template <class Fn>
void for_each_counter(const allocator_stats& s, Fn&& fn) {
#define TERRACE_VISIT_COUNTER(field, name) fn(std::string_view{name}, s.field);
  TERRACE_EVENT_COUNTERS(TERRACE_VISIT_COUNTER)
#undef TERRACE_VISIT_COUNTER
}

bool is_byte_family(std::string_view name) {
  constexpr std::string_view suffix = "_bytes";
  return name.size() >= suffix.size() && name.substr(name.size() - suffix.size()) == suffix;
}

std::string format_value(std::int64_t n, bool bytes) {
  return bytes ? human_bytes(n) : std::to_string(n);
}

void append_row(std::string& out, std::string_view a, std::string_view b, std::string_view c,
                std::string_view d, std::string_view e, std::string_view f) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%-22.*s %-10.*s %14.*s %14.*s %14.*s %14.*s\n",
                static_cast<int>(a.size()), a.data(), static_cast<int>(b.size()), b.data(),
                static_cast<int>(c.size()), c.data(), static_cast<int>(d.size()), d.data(),
                static_cast<int>(e.size()), e.data(), static_cast<int>(f.size()), f.data());
  out += buf;
}

// Three significant-ish digits are what a reader compares at a glance.
std::string format_bytes(bool negative, std::uint64_t magnitude) {
  static constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(magnitude);
  std::size_t u = 0;
  while (v >= 1024.0 && u + 1 < std::size(units)) {
    v /= 1024.0;
    ++u;
  }
  char buf[48];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%s%llu B", negative ? "-" : "",
                  static_cast<unsigned long long>(magnitude));
  } else {
    std::snprintf(buf, sizeof buf, "%s%.2f %s", negative ? "-" : "", v, units[u]);
  }
  return buf;
}
}  // namespace

std::string human_bytes(std::int64_t n) {
  // Negative values only appear if a caller fed inconsistent stats; show them rather than hide.
  // The magnitude is taken unsigned: INT64_MIN has no positive int64_t.
  const bool negative = n < 0;
  const auto magnitude = negative ? std::uint64_t{0} - static_cast<std::uint64_t>(n)
                                  : static_cast<std::uint64_t>(n);
  return format_bytes(negative, magnitude);
}

// Not through the signed overload: sizes from 2^63 up (SIZE_MAX budgets and capacities) would
// turn negative there.
std::string human_bytes(std::uint64_t n) { return format_bytes(false, n); }


std::string to_json(const allocator_stats& s) {
  // nlohmann::json keeps keys sorted, which is also the order torch.cuda.memory_stats() returns.
  nlohmann::json j = nlohmann::json::object();
  for_each_family(s, [&](const family_view& f) {
    for (int p = 0; p < kPools; ++p) {
      const std::string prefix = std::string(f.name) + "." + stat_pool_names[p] + ".";
      const stat& st = (*f.stats)[static_cast<std::size_t>(p)];
      j[prefix + "current"] = st.current;
      j[prefix + "peak"] = st.peak;
      j[prefix + "allocated"] = st.allocated;
      j[prefix + "freed"] = st.freed;
    }
  });
  for_each_single(s, [&](std::string_view name, const stat& st) {
    const std::string prefix = std::string(name) + ".";
    j[prefix + "current"] = st.current;
    j[prefix + "peak"] = st.peak;
    j[prefix + "allocated"] = st.allocated;
    j[prefix + "freed"] = st.freed;
  });
  for_each_counter(s, [&](std::string_view name, std::int64_t v) { j[std::string(name)] = v; });
  j["largest_free_block"] = s.largest_free_block;
  j["cached_free_bytes"] = s.cached_free_bytes;
  j["external_fragmentation"] = s.external_fragmentation;
  j["fragmentation"] = s.fragmentation;
  j["peak_fragmentation"] = s.peak_fragmentation;
  return j.dump();
}

std::string to_text(const allocator_stats& s) {
  std::string out;
  append_row(out, "family", "pool", "current", "peak", "allocated", "freed");
  for_each_family(s, [&](const family_view& f) {
    const bool bytes = is_byte_family(f.name);
    for (int p = 0; p < kPools; ++p) {
      const stat& st = (*f.stats)[static_cast<std::size_t>(p)];
      append_row(out, p == 0 ? f.name : std::string_view{}, stat_pool_names[p],
                 format_value(st.current, bytes), format_value(st.peak, bytes),
                 format_value(st.allocated, bytes), format_value(st.freed, bytes));
    }
  });
  for_each_single(s, [&](std::string_view name, const stat& st) {
    append_row(out, name, "", std::to_string(st.current), std::to_string(st.peak),
               std::to_string(st.allocated), std::to_string(st.freed));
  });
  out += "\n";
  char buf[160];
  for_each_counter(s, [&](std::string_view name, std::int64_t v) {
    std::snprintf(buf, sizeof buf, "%-24.*s %lld\n", static_cast<int>(name.size()), name.data(),
                  static_cast<long long>(v));
    out += buf;
  });
  out += "\n";
  std::snprintf(buf, sizeof buf, "%-24s %s\n", "largest_free_block",
                human_bytes(s.largest_free_block).c_str());
  out += buf;
  std::snprintf(buf, sizeof buf, "%-24s %s\n", "cached_free_bytes",
                human_bytes(s.cached_free_bytes).c_str());
  out += buf;
  std::snprintf(buf, sizeof buf, "%-24s %.2f%%  (1 - largest free block / cached free)\n",
                "external_fragmentation", 100.0 * s.external_fragmentation);
  out += buf;
  std::snprintf(buf, sizeof buf, "%-24s %.2f%%  (1 - active / reserved, now)\n", "fragmentation",
                100.0 * s.fragmentation);
  out += buf;
  std::snprintf(buf, sizeof buf, "%-24s %.2f%%  (1 - peak active / peak reserved)\n",
                "peak_fragmentation", 100.0 * s.peak_fragmentation);
  out += buf;
  return out;
}

}  // namespace terrace
