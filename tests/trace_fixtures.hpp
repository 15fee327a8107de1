// SPDX-License-Identifier: Apache-2.0
// One small generated training trace written in each foreign format the importers read (Kineto
// JSON, RMM CSV, a PyTorch snapshot as JSON and as a pickle), for the importer tests and the
// importer fuzzer. The pickle writer is the test's own, so that no test needs Python for one.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "terrace/trace.hpp"
#include "trace_generator.hpp"

namespace terrace::fixtures {

// Three iterations of a two-layer model: a few hundred events.
inline std::vector<trace_event> small_trace() {
  tracegen::training_trace_options o;
  o.layers = 2;
  o.hidden = 128;
  o.seq_len = 64;
  o.vocab = 1024;
  o.iterations = 3;
  return tracegen::generate_training_trace(o);
}

inline bool is_alloc_or_free(const trace_event& e) {
  return e.action == trace_action::alloc || e.action == trace_action::free_requested;
}

// The trace's allocs and frees as Kineto `[memory]` events, with a running "Total Reserved" (the
// peak of live bytes), after one event that is not a memory event.
inline std::string to_kineto(const std::vector<trace_event>& ev) {
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "aten::mm"}, {"ph", "X"}, {"ts", 0}});
  std::int64_t reserved = 0, live = 0;
  for (std::size_t i = 0; i < ev.size(); ++i) {
    const auto& e = ev[i];
    if (!is_alloc_or_free(e)) continue;
    const auto bytes = static_cast<std::int64_t>(e.size);
    live += e.action == trace_action::alloc ? bytes : -bytes;
    reserved = std::max(reserved, live);
    events.push_back({{"name", "[memory]"}, {"ph", "i"}, {"ts", static_cast<double>(i)},
                      {"args", {{"Device Type", 1}, {"Device Id", 0}, {"Addr", e.addr},
                                {"Bytes", e.action == trace_action::alloc ? bytes : -bytes},
                                {"Total Reserved", reserved}}}});
  }
  return nlohmann::json{{"traceEvents", events}}.dump();
}

inline std::string to_rmm(const std::vector<trace_event>& ev) {
  std::string s = "Thread,Time,Action,Pointer,Size,Stream\n";
  char buf[160];
  for (const auto& e : ev) {
    if (!is_alloc_or_free(e)) continue;
    std::snprintf(buf, sizeof buf, "140001,10:00:00:%06zu,%s,0x%lx,%lu,0x%lx\n", s.size() % 1000000,
                  e.action == trace_action::alloc ? "allocate" : "free",
                  static_cast<unsigned long>(e.addr), static_cast<unsigned long>(e.size),
                  static_cast<unsigned long>(e.stream));
    s += buf;
  }
  return s;
}

// PyTorch's snapshot layout: one 1 MiB segment and one device trace whose events carry a frame.
inline nlohmann::json to_snapshot(const std::vector<trace_event>& ev) {
  nlohmann::json trace = nlohmann::json::array();
  for (const auto& e : ev) {
    if (!is_alloc_or_free(e)) continue;
    trace.push_back({{"action", std::string(to_string(e.action))}, {"addr", e.addr},
                     {"size", e.size}, {"stream", e.stream}, {"time_us", e.time_ns / 1000},
                     {"frames", {{{"filename", "train.py"}, {"line", 42}, {"name", e.tag}}}}});
  }
  return {{"segments", {{{"total_size", 1 << 20}, {"address", 0}, {"blocks", nlohmann::json::array()}}}},
          {"device_traces", {trace}}};
}

// `j` as a protocol-2 pickle, as Python's pickler writes one: dicts and lists filled between a
// MARK and SETITEMS / APPENDS, and every string memoised (BINPUT / LONG_BINPUT) and fetched back
// (BINGET / LONG_BINGET) when it repeats, as PyTorch's repeated frame strings are.
class pickle_writer {
 public:
  std::string write(const nlohmann::json& j) {
    out_ = "\x80\x02";
    value(j);
    out_ += '.';
    return out_;
  }

 private:
  void u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out_ += static_cast<char>(v >> (8 * i));
  }

  void value(const nlohmann::json& j) {
    switch (j.type()) {
      case nlohmann::json::value_t::object:
        out_ += '}';
        if (j.empty()) return;
        out_ += '(';
        for (const auto& [k, v] : j.items()) {
          string(k);
          value(v);
        }
        out_ += 'u';
        return;
      case nlohmann::json::value_t::array:
        out_ += ']';
        if (j.empty()) return;
        out_ += '(';
        for (const auto& v : j) value(v);
        out_ += 'e';
        return;
      case nlohmann::json::value_t::string: return string(j.get<std::string>());
      case nlohmann::json::value_t::boolean: out_ += j.get<bool>() ? '\x88' : '\x89'; return;
      case nlohmann::json::value_t::number_float: {
        const double d = j.get<double>();
        std::uint64_t bits;
        std::memcpy(&bits, &d, sizeof bits);
        out_ += 'G';
        for (int i = 7; i >= 0; --i) out_ += static_cast<char>(bits >> (8 * i));  // big-endian
        return;
      }
      case nlohmann::json::value_t::number_integer:
      case nlohmann::json::value_t::number_unsigned: return integer(j);
      default: out_ += 'N'; return;
    }
  }

  void integer(const nlohmann::json& j) {
    if (j.is_number_unsigned() && j.get<std::uint64_t>() > INT64_MAX) {
      // LONG1: little-endian two's complement, a zero byte on top to keep it positive.
      const auto v = j.get<std::uint64_t>();
      out_ += "\x8a\x09";
      for (int i = 0; i < 8; ++i) out_ += static_cast<char>(v >> (8 * i));
      out_ += '\0';
      return;
    }
    const auto v = j.get<std::int64_t>();
    if (v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';
      u32(static_cast<std::uint32_t>(v));
      return;
    }
    out_ += "\x8a\x08";
    for (int i = 0; i < 8; ++i) out_ += static_cast<char>(static_cast<std::uint64_t>(v) >> (8 * i));
  }

  void string(const std::string& s) {
    if (auto it = memo_.find(s); it != memo_.end()) {
      if (it->second < 256) {
        out_ += 'h';
        out_ += static_cast<char>(it->second);
      } else {
        out_ += 'j';
        u32(it->second);
      }
      return;
    }
    out_ += 'X';
    u32(static_cast<std::uint32_t>(s.size()));
    out_ += s;
    const auto index = static_cast<std::uint32_t>(memo_.size());
    memo_.emplace(s, index);
    if (index < 256) {
      out_ += 'q';
      out_ += static_cast<char>(index);
    } else {
      out_ += 'r';
      u32(index);
    }
  }

  std::string out_;
  std::map<std::string, std::uint32_t> memo_;
};

inline std::string to_pickle(const nlohmann::json& j) { return pickle_writer{}.write(j); }

}  // namespace terrace::fixtures
