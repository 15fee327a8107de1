// SPDX-License-Identifier: Apache-2.0
// Format detection, and the Kineto and RMM readers (snapshots: snapshot_import.cpp). Each maps its
// input to trace_events and states where PyTorch's own reserved figure comes from. Errors name the
// file and the line (text formats) or byte (pickle), and are terrace::logic_error (bad input)
// whatever the JSON library threw: a value of the wrong type is the input's fault, not a failure
// of the program.
#include "tools/trace_import.hpp"

#include <algorithm>
#include <cstdint>
#include <map>

#include <nlohmann/json.hpp>

#include "terrace/error.hpp"
#include "tools/import_values.hpp"
#include "tools/json_sax.hpp"
#include "tools/replay.hpp"
#include "tools/snapshot_import.hpp"
#include "tools/trace_input.hpp"

namespace terrace::tools {

namespace {

using json = nlohmann::json;

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// ------------------------------------------------------------------ Kineto

// A Kineto trace is mostly kernels, operators and their arguments; only its "[memory]" events
// are used. Built whole, a 718 MB trace took 4.5 GB and 21 s. This reader builds, of each event
// of the list, only the fields a memory event uses (name, ts, and five of args), and keeps the
// event only if it is one: the rest of the document is scanned and never built. (nlohmann's
// callback parser can drop values too, but it searches the list for each one it drops: 23 s.)
class kineto_memory_reader final : public scalar_sax {
 public:
  json events = json::array();         // the memory events, in order
  std::vector<std::size_t> positions;  // each one's index in the file's list
  bool found_list = false;

  bool start_object(std::size_t) override {
    if (depth_ == 0) root_is_object_ = true;
    if (at_element()) {
      start_element(true);
    } else if (in_used_field()) {
      if (depth_ == element_depth_ + 1 && key_ == "args") {
        in_args_ = true;
        current_["args"] = json::object();  // a repeated key counts as its last value
      } else {
        field() = json::object();  // not a value of the field's type: refused when read
      }
    } else if (names_the_list()) {
      drop_list();  // traceEvents, last given, is not a list
    }
    ++depth_;
    return true;
  }
  bool end_object() override {
    --depth_;
    if (in_args_ && depth_ == element_depth_ + 1) in_args_ = false;
    if (in_element_ && depth_ == element_depth_) finish_element(true);
    return true;
  }
  bool start_array(std::size_t) override {
    if (depth_ == 0) list_at(1);
    else if (names_the_list()) list_at(2);
    else if (at_element()) start_element(false);
    else if (in_used_field()) field() = json::array();
    ++depth_;
    return true;
  }
  bool end_array() override {
    --depth_;
    if (depth_ + 1 == element_depth_) element_depth_ = -1;  // the list ends
    if (in_element_ && depth_ == element_depth_) finish_element(false);
    return true;
  }
  bool key(string_t& k) override {
    if (depth_ == 1 || (in_element_ && depth_ <= element_depth_ + 2)) key_ = std::move(k);
    return true;
  }

 private:
  bool at_element() const { return element_depth_ >= 0 && depth_ == element_depth_; }
  bool names_the_list() const { return depth_ == 1 && root_is_object_ && key_ == "traceEvents"; }
  // The value about to start is one a memory event uses: name, ts or args of an event, or one
  // of five of its args.
  bool in_used_field() const {
    if (element_is_object_ && !in_args_ && depth_ == element_depth_ + 1) {
      return key_ == "name" || key_ == "ts" || key_ == "args";
    }
    return in_args_ && depth_ == element_depth_ + 2 &&
           (key_ == "Addr" || key_ == "Bytes" || key_ == "Device Type" || key_ == "Device Id" ||
            key_ == "Total Reserved");
  }
  json& field() { return in_args_ ? current_["args"][key_] : current_[key_]; }
  // A document may name traceEvents more than once; as when it is read whole, the last counts.
  void list_at(int depth) {
    drop_list();
    element_depth_ = depth;
    found_list = true;
  }
  void drop_list() {
    events = json::array();
    positions.clear();
    next_index_ = 0;
    found_list = false;
  }
  void start_element(bool object) {
    in_element_ = true;
    element_is_object_ = object;
    key_.clear();
    current_ = object ? json::object() : json();
  }
  void finish_element(bool object) {
    in_element_ = element_is_object_ = false;
    const std::size_t index = next_index_++;
    if (!object) return;  // not an event at all
    const auto name = current_.find("name");
    if (name == current_.end() || *name != "[memory]") return;
    events.push_back(std::move(current_));
    positions.push_back(index);
  }
  // A scalar: an element of the list (not an event), a field a memory event uses, or traceEvents
  // given as something other than a list.
  bool value(json v) override {
    if (at_element()) {
      start_element(false);
      finish_element(false);
    } else if (in_used_field()) {
      field() = std::move(v);
    } else if (names_the_list()) {
      drop_list();
    }
    return true;
  }

  int depth_ = 0;
  int element_depth_ = -1;  // the list's elements' depth while inside it
  bool root_is_object_ = false;
  bool in_element_ = false;
  bool element_is_object_ = false;  // the element being read is an object (maybe an event)
  bool in_args_ = false;
  std::size_t next_index_ = 0;
  std::string key_;  // the last key at depth 1 or inside an element
  json current_;
};

imported_trace kineto_json(std::istream& text, const std::string& source) {
  kineto_memory_reader reader;
  if (!json::sax_parse(text, &reader)) throw logic_error(source + ": malformed JSON: " + reader.error);
  if (!reader.found_list) throw logic_error(source + ": not a Kineto trace (no traceEvents list)");
  const json* events = &reader.events;
  const std::vector<std::size_t>& positions = reader.positions;
  // Each device has its own address space and its own Total Reserved: one device is replayed,
  // as from a snapshot, the one with the most memory events.
  struct device_events {
    std::vector<trace_event> events;
    std::int64_t peak = -1;
  };
  std::map<std::uint64_t, device_events> devices;
  for (std::size_t k = 0; k < events->size(); ++k) {
    const json& e = (*events)[k];
    const std::string where = source + ": traceEvents[" + std::to_string(positions.at(k)) + "]";
    per_event(where, [&] {
      if (!e.contains("args") || !e.at("args").is_object()) throw logic_error(where + ": no args");
      const json& a = e.at("args");
      // Device Type 0 is host memory; only device memory is replayed.
      if (a.contains("Device Type") && as_u64(a.at("Device Type"), where) == 0) return;
      if (!a.contains("Addr") || !a.contains("Bytes")) throw logic_error(where + ": needs Addr and Bytes");
      device_events& d =
          devices[a.contains("Device Id") ? as_u64(a.at("Device Id"), where + " Device Id") : 0];
      // Bytes is signed (a free is negative) and its magnitude a size: |Bytes| <= 2^63 - 1, so
      // INT64_MIN (whose negation overflows) and 2^64 - 1 (which read as -1) are refused.
      const json& b = a.at("Bytes");
      const bool fits = b.is_number_unsigned() ? b.get<std::uint64_t>() <= kMaxTraceSize
                        : b.is_number_integer() ? b.get<std::int64_t>() != INT64_MIN
                                                : false;
      if (!fits) {
        throw logic_error(where + ": Bytes must be an integer from -" + std::to_string(kMaxTraceSize) +
                          " to " + std::to_string(kMaxTraceSize) + ", got " + quote(b));
      }
      const auto bytes = b.get<std::int64_t>();
      trace_event ev;
      ev.action = bytes >= 0 ? trace_action::alloc : trace_action::free_requested;
      ev.addr = as_u64(a.at("Addr"), where + " Addr");
      ev.size = ev.requested = static_cast<std::uint64_t>(bytes >= 0 ? bytes : -bytes);
      if (e.contains("ts")) {  // microseconds, often fractional
        const json& ts = e.at("ts");
        const double us = ts.is_number() ? ts.get<double>() : -1.0;
        if (!(us >= 0 && us * 1000.0 < 18446744073709551616.0)) {
          throw logic_error(where + ": ts must be a time >= 0 in microseconds, got " + quote(ts));
        }
        ev.time_ns = static_cast<std::uint64_t>(us * 1000.0);
      }
      if (a.contains("Total Reserved")) {
        d.peak = std::max(d.peak, static_cast<std::int64_t>(as_u64(
                                      a.at("Total Reserved"), where + " Total Reserved", kMaxTraceSize)));
      }
      if (ev.size == 0) return;
      d.events.push_back(std::move(ev));
    });
  }
  imported_trace t;
  t.format = "kineto";
  if (devices.empty()) return t;
  auto busiest = devices.begin();
  for (auto it = devices.begin(); it != devices.end(); ++it) {
    if (it->second.events.size() > busiest->second.events.size()) busiest = it;
  }
  if (devices.size() > 1) {
    std::string counts;
    for (const auto& [id, d] : devices) {
      counts += (counts.empty() ? "" : ", ") + std::to_string(d.events.size()) + " on device " +
                std::to_string(id);
    }
    t.notes.push_back(source + ": memory events on " + std::to_string(devices.size()) +
                      " devices (" + counts + "); replaying device " +
                      std::to_string(busiest->first) + ", the one with the most events");
  }
  t.events = std::move(busiest->second.events);
  std::stable_sort(t.events.begin(), t.events.end(),
                   [](const trace_event& x, const trace_event& y) { return x.time_ns < y.time_ns; });
  if (busiest->second.peak >= 0) t.torch_reserved_peak = busiest->second.peak;
  return t;
}

}  // namespace

imported_trace parse_kineto_json(std::string_view text, const std::string& source) {
  view_istream in(text);
  return kineto_json(in, source);
}

// ------------------------------------------------------------------ RMM CSV

namespace {

imported_trace rmm_csv(std::istream& text, const std::string& source) {
  imported_trace t;
  t.format = "rmm-csv";
  std::size_t line_no = 0;
  int col_action = -1, col_ptr = -1, col_size = -1, col_stream = -1;
  std::size_t header_fields = 0;
  auto split = [](std::string_view line) {
    std::vector<std::string_view> f;
    std::size_t p = 0;
    while (true) {
      const std::size_t c = line.find(',', p);
      std::string_view x = line.substr(p, c == std::string_view::npos ? line.size() - p : c - p);
      while (!x.empty() && (x.front() == ' ' || x.front() == '"')) x.remove_prefix(1);
      while (!x.empty() && (x.back() == ' ' || x.back() == '"' || x.back() == '\r')) x.remove_suffix(1);
      f.push_back(x);
      if (c == std::string_view::npos) break;
      p = c + 1;
    }
    return f;
  };
  auto number = [&](std::string_view s, const char* what, std::uint64_t max) -> std::uint64_t {
    if (const auto v = parse_u64(s); v && *v <= max) return *v;
    throw logic_error(source + ":" + std::to_string(line_no) + ": bad " + what + " '" +
                      std::string(s) + "' (an unsigned integer up to " + std::to_string(max) +
                      ", decimal or 0x hexadecimal)");
  };
  std::string text_line;
  while (std::getline(text, text_line)) {
    std::string_view line = text_line;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const auto f = split(line);
    if (col_action < 0) {
      // A column named twice is ambiguous (which Size is the size?): refused, not the last taken.
      auto take = [&](int& col, std::size_t k) {
        if (col >= 0) {
          throw logic_error(source + ":" + std::to_string(line_no) + ": the header names column '" +
                            std::string(f[k]) + "' twice");
        }
        col = static_cast<int>(k);
      };
      for (std::size_t k = 0; k < f.size(); ++k) {
        if (f[k] == "Action") take(col_action, k);
        if (f[k] == "Pointer") take(col_ptr, k);
        if (f[k] == "Size") take(col_size, k);
        if (f[k] == "Stream") take(col_stream, k);
      }
      if (col_action < 0 || col_ptr < 0 || col_size < 0) {
        // Name what is missing: only these three are required, so RMM's whole header alone
        // would not tell a log with a renamed column what to change.
        std::string missing;
        int n = 0;
        for (const auto& [col, name] : {std::pair{col_action, "Action"}, std::pair{col_ptr, "Pointer"},
                                        std::pair{col_size, "Size"}}) {
          if (col >= 0) continue;
          missing += (n++ == 0 ? "'" : ", '") + std::string(name) + "'";
        }
        throw logic_error(source + ":" + std::to_string(line_no) + ": the header has no " + missing +
                          (n == 1 ? " column" : " columns") +
                          " (required: Action, Pointer, Size; RMM writes "
                          "Thread,Time,Action,Pointer,Size,Stream)");
      }
      header_fields = f.size();
      continue;
    }
    // One field per header column: more is as malformed as fewer (rows run together, a stray
    // comma), and replaying the first fields of such a row would invent an event.
    if (f.size() != header_fields) {
      throw logic_error(source + ":" + std::to_string(line_no) + ": expected " +
                        std::to_string(header_fields) + " fields, got " + std::to_string(f.size()));
    }
    const std::string_view action = f[static_cast<std::size_t>(col_action)];
    trace_event ev;
    if (action == "allocate") {
      ev.action = trace_action::alloc;
    } else if (action == "free") {
      ev.action = trace_action::free_requested;
    } else if (action == "allocate failure") {
      continue;  // nothing was allocated
    } else {
      throw logic_error(source + ":" + std::to_string(line_no) + ": unknown action '" +
                        std::string(action) + "' (expected allocate, free, allocate failure)");
    }
    ev.addr = number(f[static_cast<std::size_t>(col_ptr)], "pointer", UINT64_MAX);
    ev.size = ev.requested = number(f[static_cast<std::size_t>(col_size)], "size", kMaxTraceSize);
    if (col_stream >= 0) ev.stream = number(f[static_cast<std::size_t>(col_stream)], "stream", UINT64_MAX);
    // A request of 0 bytes returns a null pointer and its free frees it: nothing was held (two
    // of them live at once would otherwise be two allocations of address 0, an inconsistent
    // trace). The Kineto reader drops 0-byte events likewise.
    if (ev.size == 0 || ev.addr == 0) continue;
    ev.time_ns = t.events.size();
    t.events.push_back(ev);
  }
  if (col_action < 0) throw logic_error(source + ": empty file (no CSV header)");
  return t;
}

}  // namespace

imported_trace parse_rmm_csv(std::string_view text, const std::string& source) {
  view_istream in(text);
  return rmm_csv(in, source);
}

imported_trace import_trace(const std::string& path, std::string_view format) {
  std::string fmt(format);
  if (fmt.empty() || fmt == "auto") {
    if (ends_with(path, ".jsonl")) fmt = "jsonl";
    else if (ends_with(path, ".pickle") || ends_with(path, ".pkl")) fmt = "pickle";
    else if (ends_with(path, ".csv")) fmt = "rmm";
    else if (ends_with(path, ".json")) fmt = "json";
  }
  if (fmt == "jsonl") {
    imported_trace t;
    t.format = "terrace-jsonl";
    t.events = load_trace(path);
    return t;
  }
  trace_input input(path);
  const std::string_view head = input.head();
  if (fmt.empty() || fmt == "auto") {
    if (!head.empty() && static_cast<unsigned char>(head[0]) == 0x80) fmt = "pickle";
    else if (head.rfind("Thread,", 0) == 0) fmt = "rmm";
    else fmt = "json";
  }
  return reading(path, [&]() -> imported_trace {
    if (fmt == "pickle") return parse_torch_snapshot_pickle(input.all(), path);
    if (fmt == "rmm") return rmm_csv(input.from_start(), path);
    if (fmt == "kineto") return kineto_json(input.from_start(), path);
    if (fmt == "snapshot-json") return torch_snapshot_json(input.from_start(), path);
    if (fmt != "json") {
      throw logic_error(path + ": unknown trace format '" + fmt +
                        "' (jsonl, pickle, snapshot-json, kineto, rmm)");
    }
    // Nothing but white space: a JSON-lines trace of no events (the caller says there is nothing
    // to replay), not a JSON document that ends before it starts.
    if (head.size() < trace_input::kHeadBytes &&
        head.find_first_not_of(" \t\r\n") == std::string_view::npos) {
      imported_trace t;
      t.format = "terrace-jsonl";
      return t;
    }
    // Kineto traces carry traceEvents; snapshots carry device_traces / segments; a terrace trace
    // is one object with an action per line, and may have one line only.
    if (head.find("\"traceEvents\"") != std::string_view::npos) return kineto_json(input.from_start(), path);
    auto jsonl = [&] {
      imported_trace t;
      t.format = "terrace-jsonl";
      t.events = read_trace_jsonl_of(input.from_start(), path);
      return t;
    };
    const first_line_facts first = input.first_line();
    if (first.more_lines) {  // one document over several lines, or a JSON-lines trace
      const std::size_t text = head.find_first_not_of(" \t\r\n");  // blank lines may lead
      if (text != std::string_view::npos && head[text] == '{' && first.names_action) return jsonl();
      return torch_snapshot_json(input.from_start(), path);
    }
    // One line: a snapshot written compactly (whose trace events have actions too) or a
    // one-event trace; its top-level keys tell.
    snapshot_reader snapshot(path);
    if (!json::sax_parse(input.from_start(), &snapshot)) {
      throw logic_error(path + ": malformed JSON: " + snapshot.error);
    }
    if (snapshot.is_one_trace_event()) return jsonl();
    return std::move(snapshot).finish("torch-snapshot-json");
  });
}

}  // namespace terrace::tools
