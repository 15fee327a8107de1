// SPDX-License-Identifier: Apache-2.0
// The trace importers and the replay against malformed input: each seed mutates a valid trace of
// every format (terrace JSON lines; a PyTorch snapshot as JSON and as a pickle, generated and
// recorded; Kineto JSON; RMM CSV) a few times over, with byte flips, bytes that matter to the
// format, truncation, deleted and repeated ranges, numbers replaced by extreme ones, lines swapped
// and pickle length fields overwritten. The only acceptable outcomes:
//   - the importer refuses it with terrace::logic_error, naming the input;
//   - or it reads, and what `terrace compare` and `terrace report` make of it (the replay under
//     every policy, with the allocator's invariants checked along the way, the HTML page, each
//     run's text and JSON) succeeds or refuses the trace with terrace::logic_error (an
//     inconsistent trace).
// Anything else (another exception, a crash, a sanitizer report, a hang) is a defect: a user's
// damaged trace must get a clear error. One in four inputs also goes through import_trace from a
// file without an extension, so that format detection sees the damage too.
//
// TERRACE_FUZZ_SEED / TERRACE_FUZZ_SEEDS choose the seeds (fuzz_support.hpp).
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "fuzz_support.hpp"
#include "terrace/error.hpp"
#include "terrace/trace.hpp"
#include "tools/html_report.hpp"
#include "tools/replay.hpp"
#include "tools/replay_format.hpp"
#include "tools/trace_import.hpp"
#include "trace_fixtures.hpp"

namespace {

namespace tr = terrace::tools;
using terrace::trace_event;
using terrace::fuzz::fail;
using terrace::fuzz::fuzz_failure;

struct format_case {
  std::string name;    // also the input's name in errors: "fuzz.<name>"
  std::string valid;   // the unmutated input
  bool binary = false; // a pickle: no lines, length fields
  std::function<tr::imported_trace(std::string_view, const std::string&)> parse;
};

tr::imported_trace parse_jsonl(std::string_view text, const std::string& source) {
  std::istringstream in{std::string(text)};
  try {
    return {"terrace-jsonl", terrace::read_trace_jsonl(in), {}, {}, {}};
  } catch (const terrace::logic_error& e) {
    throw terrace::logic_error(source + ": " + e.what());
  }
}

const std::vector<format_case>& formats() {
  static const std::vector<format_case> cases = [] {
    auto ev = terrace::fixtures::small_trace();
    // A quarter of the trace is enough to reach every field; the mutations need short inputs to
    // land often on what matters.
    ev.resize(ev.size() / 4);
    std::ostringstream jsonl;
    terrace::write_trace_jsonl(jsonl, ev);
    const nlohmann::json snapshot = terrace::fixtures::to_snapshot(ev);
    // A recorded snapshot's shape too (tests/data, from an H100: segments with their blocks, and
    // segment events in the trace): its first segments and trace events.
    nlohmann::json recorded;
    std::ifstream(std::string(TERRACE_TEST_DATA_DIR) + "/h100_mlp_training_snapshot.json") >> recorded;
    recorded["segments"].erase(recorded["segments"].begin() + 4, recorded["segments"].end());
    auto& trace = recorded["device_traces"][0];
    trace.erase(trace.begin() + 150, trace.end());
    return std::vector<format_case>{
        {"jsonl", jsonl.str(), false, parse_jsonl},
        {"snapshot.json", snapshot.dump(1), false, tr::parse_torch_snapshot_json},
        {"pickle", terrace::fixtures::to_pickle(snapshot), true, tr::parse_torch_snapshot_pickle},
        {"recorded.json", recorded.dump(1), false, tr::parse_torch_snapshot_json},
        {"recorded.pickle", terrace::fixtures::to_pickle(recorded), true, tr::parse_torch_snapshot_pickle},
        {"kineto.json", terrace::fixtures::to_kineto(ev), false, tr::parse_kineto_json},
        {"csv", terrace::fixtures::to_rmm(ev), false, tr::parse_rmm_csv},
    };
  }();
  return cases;
}

// ---------------------------------------------------------------- mutations

class mutator {
 public:
  explicit mutator(std::uint64_t seed) : rng_(seed) {}

  std::string mutate(std::string s, bool binary) {
    const int rounds = 1 + static_cast<int>(below(3));
    for (int r = 0; r < rounds && !s.empty(); ++r) once(s, binary);
    return s;
  }

 private:
  std::size_t below(std::size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_); }

  void once(std::string& s, bool binary) {
    const std::size_t at = below(s.size());
    switch (below(binary ? 7 : 8)) {
      case 0:  // one bit
        s[at] = static_cast<char>(s[at] ^ (1 << below(8)));
        return;
      case 1: {  // a byte that means something to one of the formats
        static constexpr std::string_view text_bytes = "\"{}[],:-+.eE0919\n\\ xX";
        static constexpr std::string_view pickle_ops = "}]()eutKJMGNqhjr.\x80\x88\x89\x8a\x8c\x94\x95\x93Rc";
        const std::string_view pick = binary ? pickle_ops : text_bytes;
        s[at] = pick[below(pick.size())];
        return;
      }
      case 2:  // truncated
        s.resize(at);
        return;
      case 3:  // a range gone
        s.erase(at, 1 + below(24));
        return;
      case 4: {  // a range repeated elsewhere
        const std::string piece = s.substr(at, 1 + below(64));
        s.insert(below(s.size() + 1), piece);
        return;
      }
      case 5:
        if (binary) {  // a 4-byte field (a length, a memo index, an integer) made huge or negative
          static constexpr std::array<std::uint32_t, 5> values{0xffffffffu, 0x7fffffffu, 0x80000000u, 0x10000u, 0u};
          const std::uint32_t v = values[below(values.size())];
          for (std::size_t i = 0; i < 4 && at + i < s.size(); ++i) s[at + i] = static_cast<char>(v >> (8 * i));
        } else {
          replace_number(s, at);
        }
        return;
      case 6:  // random bytes inserted
        for (std::size_t n = 1 + below(8); n > 0; --n) s.insert(s.begin() + static_cast<std::ptrdiff_t>(below(s.size() + 1)), static_cast<char>(below(256)));
        return;
      case 7:  // two lines swapped (text only): an event out of order
        swap_lines(s);
        return;
    }
  }

  // The run of number characters at or after `at` becomes an extreme value.
  void replace_number(std::string& s, std::size_t at) {
    static constexpr std::array<std::string_view, 14> values{
        "0", "-1", "-0", "1.5", "1e308", "-1e308", "4294967296", "9223372036854775807",
        "9223372036854775808", "18446744073709551615", "18446744073709551616",
        "99999999999999999999999999", "0x", "NaN"};
    auto is_number_char = [](char c) { return (c >= '0' && c <= '9') || c == 'x' || (c >= 'a' && c <= 'f'); };
    while (at < s.size() && !(s[at] >= '0' && s[at] <= '9')) ++at;
    if (at == s.size()) return;
    std::size_t begin = at, end = at;
    while (begin > 0 && is_number_char(s[begin - 1])) --begin;
    while (end < s.size() && is_number_char(s[end])) ++end;
    s.replace(begin, end - begin, values[below(values.size())]);
  }

  void swap_lines(std::string& s) {
    std::vector<std::string> lines;
    std::size_t from = 0;
    for (std::size_t nl; (nl = s.find('\n', from)) != std::string::npos; from = nl + 1) lines.push_back(s.substr(from, nl - from));
    if (from < s.size()) lines.push_back(s.substr(from));
    if (lines.size() < 2) return;
    std::swap(lines[below(lines.size())], lines[below(lines.size())]);
    s.clear();
    for (const auto& l : lines) s += l + '\n';
  }

  std::mt19937_64 rng_;
};

// ---------------------------------------------------------------- checks

std::string describe(std::uint64_t seed, const std::string& format, const std::string& input) {
  std::string shown = input.substr(0, 200);
  for (char& c : shown) if (static_cast<unsigned char>(c) < 0x20 && c != '\n') c = '?';
  return "seed " + std::to_string(seed) + ", " + format + " (" + std::to_string(input.size()) +
         " bytes, starting: " + shown + ")";
}

// What `terrace compare` and `terrace report` do with a trace that reads: every policy replayed
// (with the allocator's invariants checked along the way), the HTML page and its summary, and each
// run's text and JSON.
void report_on(const std::vector<trace_event>& events, const std::string& where) {
  tr::replay_options base;
  base.check_invariants_every = 16;
  try {
    const tr::report_input in = tr::make_report_input(events, base, where, "fuzz");
    if (tr::render_html_report(in).find("</html>") == std::string::npos) fail(where + ": the page is cut short");
    tr::report_summary(in);
    for (const auto& [name, r] : in.runs) {
      tr::format_replay_text(r, {where, name == "expandable", ""});
      if (!nlohmann::json::parse(tr::format_replay_json(r, {where, name == "expandable", ""})).is_object()) {
        fail(where + ": " + name + ": the JSON output is not one object");
      }
    }
  } catch (const terrace::logic_error& e) {
    if (std::string_view(e.what()).find("trace") == std::string_view::npos) {
      fail(where + ": a refusal that does not say it is the trace's fault: " + e.what());
    }
  } catch (const std::exception& e) {
    fail(where + ": compare/report threw something other than logic_error: " + e.what());
  }
}

// Parses `input` (directly, or through a file when `via_file`) and replays what it reads; false
// when the importer refused it.
bool check_one(const format_case& f, const std::string& input, bool via_file, const std::string& where) {
  const std::string source = "fuzz." + f.name;
  struct removed_on_return {
    std::string path;
    ~removed_on_return() {
      std::error_code ignored;
      if (!path.empty()) std::filesystem::remove(path, ignored);
    }
  } file;
  const std::string& path = file.path;
  tr::imported_trace t;
  try {
    if (via_file) {
      file.path = (std::filesystem::temp_directory_path() /
                   ("terrace-import-fuzz-" + std::to_string(::getpid()))).string();
      std::ofstream(path, std::ios::binary | std::ios::trunc) << input;
      t = tr::import_trace(path);
    } else {
      t = f.parse(input, source);
    }
  } catch (const terrace::logic_error& e) {
    const std::string& named = via_file ? path : source;
    if (std::string_view(e.what()).find(named) == std::string_view::npos) {
      fail(where + ": the error does not name the input '" + named + "': " + e.what());
    }
    return false;
  } catch (const std::exception& e) {
    fail(where + ": the importer threw something other than logic_error: " + e.what());
  }
  report_on(t.events, where);
  return true;
}

TEST(TraceImportFuzz, DamagedTracesAreReadOrRefusedClearly) {
  // About 1 ms per seed in Release and 7 under ASan: a few seconds either way.
  const std::uint64_t default_seeds = terrace::fuzz::kAddressSanitized || terrace::fuzz::kThreadSanitized ? 300 : 1000;
  const auto seeds = terrace::fuzz::seeds_from_environment(default_seeds);
  if (!seeds) return;
  // The unmutated inputs read, and replay, without a refusal: otherwise the fuzzing would start
  // from inputs that are refused anyway and prove nothing.
  for (const format_case& f : formats()) {
    const auto t = f.parse(f.valid, "fuzz." + f.name);
    ASSERT_GT(t.events.size(), 20u) << f.name;
    EXPECT_NO_THROW(tr::replay(t.events)) << f.name;
  }
  std::size_t refused = 0, read = 0;
  for (std::uint64_t seed = seeds->first; seed < seeds->end(); ++seed) {
    mutator m(seed);
    for (const format_case& f : formats()) {
      const std::string input = m.mutate(f.valid, f.binary);
      const bool via_file = seed % 4 == 0;
      const std::string where = describe(seed, f.name, input);
      try {
        ++(check_one(f, input, via_file, where) ? read : refused);
      } catch (const fuzz_failure& failure) {
        FAIL() << failure.what << "\n  (rerun: TERRACE_FUZZ_SEED=" << seed << ")";
      }
    }
  }
  // Both outcomes must occur, or the mutations are too weak (all read) or too blunt (all refused).
  EXPECT_GT(read, 0u);
  EXPECT_GT(refused, 0u);
  std::printf("[          ] %zu damaged inputs read, %zu refused\n", read, refused);
  terrace::fuzz::print_passed(*seeds);
}

}  // namespace
