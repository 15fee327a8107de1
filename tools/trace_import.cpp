// SPDX-License-Identifier: Apache-2.0
// Format readers. Each maps its input to trace_events and states where PyTorch's own reserved
// figure comes from. Errors name the file and the line (text formats) or byte (pickle), and are
// terrace::logic_error (bad input) whatever the JSON library threw: a value of the wrong type is
// the input's fault, not a failure of the program.
#include "tools/trace_import.hpp"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>

#include <nlohmann/json.hpp>

#include "terrace/error.hpp"
#include "tools/pickle_reader.hpp"
#include "tools/replay.hpp"
#include "tools/trace_input.hpp"

namespace terrace::tools {

namespace {

using json = nlohmann::json;

// Values quoted in errors may hold any bytes (a pickle's strings are not checked for UTF-8): invalid
// sequences become U+FFFD rather than failing the error message itself, as in allocator/trace.cpp.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// A value quoted in an error: scalars as written, an array or object by its size only (the
// serializer recurses once per level: a value nested a million levels deep, which the parser
// takes without recursion, overflowed the stack while its error was being written).
std::string quote(const json& j) {
  if (j.is_array()) return "an array of " + std::to_string(j.size()) + " elements";
  if (j.is_object()) return "an object of " + std::to_string(j.size()) + " members";
  return dump(j);
}

// Runs one event's parser; a JSON type mismatch its checks did not name becomes a logic_error
// naming the file and the event.
template <class F>
auto per_event(const std::string& where, F&& parse) {
  try {
    return parse();
  } catch (const json::exception& e) {
    throw logic_error(where + ": " + e.what());
  }
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Sizes are added up in signed 64-bit figures (live and reserved bytes): larger ones are refused.
constexpr std::uint64_t kMaxSize = INT64_MAX;

// An unsigned integer written as text: decimal, or hexadecimal after 0x (addresses). Never octal
// (std::stoull's base 0 read "0100000000" as 16 MiB), and no sign or blanks (stoull took "-1" as
// 2^64 - 1).
std::optional<std::uint64_t> parse_u64(std::string_view s) {
  int base = 10;
  if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    s.remove_prefix(2);
    base = 16;
  }
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, base);
  if (s.empty() || ec != std::errc{} || end != s.data() + s.size()) return std::nullopt;
  return v;
}

// An address, size, stream or time: an unsigned integer up to `max`. A negative number, a fraction
// or one out of range is refused; casting it would wrap (-1 became 16 EiB) or be undefined (-1.5,
// 1e30). A float holding a whole number is accepted, as are strings (Kineto and some exporters
// write addresses as strings).
std::uint64_t as_u64(const json& v, const std::string& where, std::uint64_t max = UINT64_MAX) {
  std::optional<std::uint64_t> x;
  if (v.is_number_unsigned()) {
    x = v.get<std::uint64_t>();
  } else if (v.is_number_integer()) {  // signed: the pickle reader's integers are all int64
    if (v.get<std::int64_t>() >= 0) x = static_cast<std::uint64_t>(v.get<std::int64_t>());
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (d >= 0 && d < 18446744073709551616.0 && d == std::floor(d)) x = static_cast<std::uint64_t>(d);
  } else if (v.is_string()) {
    x = parse_u64(v.get_ref<const std::string&>());
  }
  if (!x || *x > max) {
    throw logic_error(where + ": expected an unsigned integer" +
                      (max == UINT64_MAX ? std::string() : " up to " + std::to_string(max)) +
                      ", got " + quote(v));
  }
  return *x;
}

// ------------------------------------------------------------------ PyTorch snapshots

// Frames only label blocks: a frame field of the wrong type is left out like a missing one, as a
// frame that is not a dict is.
std::string frame_field(const json& frame, const char* key, const char* missing) {
  const auto it = frame.find(key);
  if (it == frame.end()) return missing;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_number_integer()) return std::to_string(it->get<std::int64_t>());
  return missing;
}

std::string frames_text(const json& frames) {
  if (!frames.is_array()) return {};
  // The innermost frames that are not PyTorch's own are the useful ones; keep the first two.
  std::string out;
  int kept = 0;
  for (const auto& f : frames) {
    if (!f.is_object()) continue;
    const std::string file = frame_field(f, "filename", "");
    if (file.find("torch/") != std::string::npos && kept == 0 && frames.size() > 1) continue;
    if (!out.empty()) out += " < ";
    out += frame_field(f, "name", "?") + " " + file + ":" + frame_field(f, "line", "0");
    if (++kept == 2) break;
  }
  return out;
}

trace_event snapshot_event(const json& e, const std::string& where) {
  if (!e.is_object() || !e.contains("action")) throw logic_error(where + ": no action");
  const json& a = e.at("action");
  const auto action = a.is_string() ? parse_trace_action(a.get<std::string>()) : std::nullopt;
  if (!action) throw logic_error(where + ": unknown action " + quote(a));
  trace_event ev;
  ev.action = *action;
  ev.addr = e.contains("addr") ? as_u64(e.at("addr"), where + " addr") : 0;
  ev.size = e.contains("size") ? as_u64(e.at("size"), where + " size", kMaxSize) : 0;
  ev.requested = ev.size;
  ev.stream = e.contains("stream") ? as_u64(e.at("stream"), where + " stream") : 0;
  if (e.contains("time_us")) {
    ev.time_ns = as_u64(e.at("time_us"), where + " time_us", UINT64_MAX / 1000) * 1000;
  }
  if (e.contains("tag") && e.at("tag").is_string()) ev.tag = e.at("tag").get<std::string>();
  if (ev.tag.empty() && e.contains("frames")) {
    const json& f = e.at("frames");  // a pickle's frames arrive as their text (read_pickle's digest)
    ev.tag = f.is_string() ? f.get<std::string>() : frames_text(f);
  }
  return ev;
}

imported_trace from_snapshot(const json& snap, const std::string& source, std::string format) {
  imported_trace t;
  t.format = std::move(format);
  if (!snap.is_object()) throw logic_error(source + ": a snapshot is a dict/object");
  // Any other object would read as an empty trace, and a wrong file as a trace with nothing in it.
  if (!snap.contains("device_traces") && !snap.contains("segments")) {
    throw logic_error(source + ": not a snapshot (it has neither device_traces nor segments)");
  }
  const json* traces = snap.contains("device_traces") ? &snap.at("device_traces") : nullptr;
  // The device whose trace is longest: snapshots list one (possibly empty) trace per device.
  const json* trace = nullptr;
  int device = 0;
  if (traces != nullptr) {
    if (!traces->is_array()) throw logic_error(source + ": device_traces is not a list");
    std::string counts;  // of the devices with events
    std::size_t busy = 0;
    for (std::size_t d = 0; d < traces->size(); ++d) {
      const json& tr = (*traces)[d];
      if (!tr.is_array()) throw logic_error(source + ": device_traces[" + std::to_string(d) + "] is not a list");
      if (trace == nullptr || tr.size() > trace->size()) {
        trace = &tr;
        device = static_cast<int>(d);
      }
      if (!tr.empty()) {
        ++busy;
        counts += (counts.empty() ? "" : ", ") + std::to_string(tr.size()) + " on device " +
                  std::to_string(d);
      }
    }
    if (busy > 1) {
      t.notes.push_back(source + ": trace events on " + std::to_string(busy) + " devices (" +
                        counts + "); replaying device " + std::to_string(device) +
                        ", the one with the most events");
    }
  }
  std::int64_t seg_delta = 0, seg_running = 0, seg_peak_rel = 0;
  if (trace != nullptr) {
    for (std::size_t i = 0; i < trace->size(); ++i) {
      const json& e = (*trace)[i];
      const std::string where = source + ": device_traces[" + std::to_string(device) + "][" +
                                std::to_string(i) + "]";
      trace_event ev = per_event(where, [&] { return snapshot_event(e, where); });
      const auto size = static_cast<std::int64_t>(ev.size);
      // Each size is at most kMaxSize, but a run of them must not overflow the totals either.
      const bool grows =
          ev.action == trace_action::segment_alloc || ev.action == trace_action::segment_map;
      const bool shrinks =
          ev.action == trace_action::segment_free || ev.action == trace_action::segment_unmap;
      if ((grows && __builtin_add_overflow(seg_running, size, &seg_running)) ||
          (shrinks && __builtin_sub_overflow(seg_running, size, &seg_running))) {
        throw logic_error(where + ": the segment events' sizes add up past 2^63 bytes");
      }
      seg_peak_rel = std::max(seg_peak_rel, seg_running);
      t.events.push_back(std::move(ev));
    }
    seg_delta = seg_running;
  }
  if (snap.contains("segments")) {
    const json& segs = snap.at("segments");
    if (!segs.is_array()) throw logic_error(source + ": segments is not a list");
    std::int64_t now = 0;
    for (std::size_t i = 0; i < segs.size(); ++i) {
      const json& s = segs[i];
      if (!s.is_object() || !s.contains("total_size")) {
        throw logic_error(source + ": segments[" + std::to_string(i) + "] has no total_size");
      }
      // PyTorch's segments name their device: only the replayed device's count.
      if (const auto d = s.find("device"); traces != nullptr && d != s.end() &&
                                           d->is_number_integer() && *d != device) {
        continue;
      }
      const std::uint64_t size = as_u64(s.at("total_size"), source + ": segments[" +
                                        std::to_string(i) + "] total_size", kMaxSize);
      if (size > kMaxSize - static_cast<std::uint64_t>(now)) {
        throw logic_error(source + ": segments add up to more than " + std::to_string(kMaxSize) + " bytes");
      }
      now += static_cast<std::int64_t>(size);
    }
    t.torch_reserved_now = now;
    // Reserved at the window's start was `now` minus what the trace's segment events added.
    std::int64_t before = 0, peak = 0;
    if (__builtin_sub_overflow(now, seg_delta, &before) ||
        __builtin_add_overflow(before, seg_peak_rel, &peak)) {
      throw logic_error(source + ": the segments and the segment events disagree past 2^63 bytes");
    }
    t.torch_reserved_peak = std::max(now, peak);
  }
  return t;
}

// The SAX events of a scalar, each handed on as the json value it is, and the parse error kept:
// what the two readers below share.
class scalar_sax : public nlohmann::json_sax<json> {
 public:
  std::string error;

  bool null() override { return value(json(nullptr)); }
  bool boolean(bool b) override { return value(json(b)); }
  bool number_integer(number_integer_t n) override { return value(json(n)); }
  bool number_unsigned(number_unsigned_t n) override { return value(json(n)); }
  bool number_float(number_float_t x, const string_t&) override { return value(json(x)); }
  bool string(string_t& text) override { return value(json(std::move(text))); }
  bool binary(binary_t& b) override { return value(json::binary(std::move(b))); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    error = e.what();
    return false;
  }

 protected:
  virtual bool value(json v) = 0;
};

// Every event and block of a snapshot carries its stack as a list of frame dicts; only the
// frames' text is used, so each list becomes it as it is read. A pickle shares each distinct
// frame (5 bytes per use), JSON spells it out at every use: built whole, a snapshot recorded with
// stacks took about a hundred times its size in memory as a pickle, six times as JSON.
const pickle_digest& frames_digest() {
  static const pickle_digest digest{"frames", [](const json& f) { return f.is_string() ? f : json(frames_text(f)); }};
  return digest;
}

// nlohmann's DOM parser, with one addition: a value under the digest's key is replaced by its
// digest as soon as it is complete, as read_pickle does. (nlohmann's callback parser could do
// that, but it searches each object's parent list after it ends: quadratic in a list of events.)
class digesting_dom_builder final : public scalar_sax {
 public:
  explicit digesting_dom_builder(const pickle_digest* digest) : digest_(digest) {}
  json root;

  bool start_object(std::size_t) override { return open(json::object()); }
  bool start_array(std::size_t) override { return open(json::array()); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }

 private:
  struct level {
    json* value;
    bool digest;  // it sits under the digest's key
  };
  // Puts `v` where the parser is (the root, the next list element, or under the last key).
  json* place(json v) {
    if (stack_.empty()) return &(root = std::move(v));
    json& parent = *stack_.back().value;
    if (parent.is_array()) return &parent.emplace_back(std::move(v));
    return &(parent[key_] = std::move(v));
  }
  bool value(json v) override {
    const bool digest = under_digest_key();
    json* at = place(std::move(v));
    if (digest) *at = digest_->of(*at);
    return true;
  }
  bool open(json container) {
    const bool digest = under_digest_key();
    stack_.push_back({place(std::move(container)), digest});
    return true;
  }
  bool close() {
    const level done = stack_.back();
    stack_.pop_back();
    if (done.digest) *done.value = digest_->of(*done.value);
    return true;
  }
  bool under_digest_key() const {
    return digest_ != nullptr && !stack_.empty() && stack_.back().value->is_object() && key_ == digest_->key;
  }

  const pickle_digest* digest_;
  std::vector<level> stack_;
  std::string key_;
};

json parse_json(std::istream& text, const std::string& source, const pickle_digest* digest = nullptr) {
  digesting_dom_builder builder(digest);
  // parse_error, and out_of_range for a number too large, come to parse_error().
  if (!json::sax_parse(text, &builder)) throw logic_error(source + ": malformed JSON: " + builder.error);
  return std::move(builder.root);
}

imported_trace torch_snapshot_json(std::istream& text, const std::string& source) {
  return from_snapshot(parse_json(text, source, &frames_digest()), source, "torch-snapshot-json");
}

}  // namespace

imported_trace parse_torch_snapshot_pickle(std::string_view bytes, const std::string& source) {
  return from_snapshot(read_pickle(bytes, source, &frames_digest()), source, "torch-snapshot-pickle");
}

imported_trace parse_torch_snapshot_json(std::string_view text, const std::string& source) {
  view_istream in(text);
  return torch_snapshot_json(in, source);
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

namespace {

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
      const bool fits = b.is_number_unsigned() ? b.get<std::uint64_t>() <= kMaxSize
                        : b.is_number_integer() ? b.get<std::int64_t>() != INT64_MIN
                                                : false;
      if (!fits) {
        throw logic_error(where + ": Bytes must be an integer from -" + std::to_string(kMaxSize) +
                          " to " + std::to_string(kMaxSize) + ", got " + quote(b));
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
                                      a.at("Total Reserved"), where + " Total Reserved", kMaxSize)));
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
      for (std::size_t k = 0; k < f.size(); ++k) {
        if (f[k] == "Action") col_action = static_cast<int>(k);
        if (f[k] == "Pointer") col_ptr = static_cast<int>(k);
        if (f[k] == "Size") col_size = static_cast<int>(k);
        if (f[k] == "Stream") col_stream = static_cast<int>(k);
      }
      if (col_action < 0 || col_ptr < 0 || col_size < 0) {
        throw logic_error(source + ":" + std::to_string(line_no) +
                          ": expected the header Thread,Time,Action,Pointer,Size,Stream");
      }
      continue;
    }
    const int need = std::max({col_action, col_ptr, col_size, col_stream});
    if (static_cast<int>(f.size()) <= need) {
      throw logic_error(source + ":" + std::to_string(line_no) + ": expected " +
                        std::to_string(need + 1) + " fields, got " + std::to_string(f.size()));
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
    ev.size = ev.requested = number(f[static_cast<std::size_t>(col_size)], "size", kMaxSize);
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
    // Kineto traces carry traceEvents; snapshots carry device_traces / segments; a terrace trace
    // is one object with an action per line, and may have one line only.
    if (head.find("\"traceEvents\"") != std::string_view::npos) return kineto_json(input.from_start(), path);
    auto jsonl = [&] {
      imported_trace t;
      t.format = "terrace-jsonl";
      try {
        t.events = read_trace_jsonl(input.from_start());
      } catch (const logic_error& e) {
        throw logic_error(path + ": " + e.what());
      }
      return t;
    };
    const first_line_facts first = input.first_line();
    if (first.more_lines) {  // one document over several lines, or a JSON-lines trace
      if (head[0] == '{' && first.names_action) return jsonl();
      return torch_snapshot_json(input.from_start(), path);
    }
    // One line: a snapshot written compactly (whose trace events have actions too) or a
    // one-event trace; its top-level keys tell.
    const json j = parse_json(input.from_start(), path, &frames_digest());
    if (j.is_object() && j.contains("action") && !j.contains("device_traces") &&
        !j.contains("segments")) {
      return jsonl();
    }
    return from_snapshot(j, path, "torch-snapshot-json");
  });
}

}  // namespace terrace::tools
