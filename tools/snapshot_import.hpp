// SPDX-License-Identifier: Apache-2.0
/// @file snapshot_import.hpp
/// @brief PyTorch memory snapshots (torch.cuda.memory._snapshot(): device_traces and segments),
/// read as a stream of SAX events from either encoding: JSON text (nlohmann's parser) or a
/// pickle (read_pickle). No document is built: each trace event becomes a trace_event as soon as
/// it is complete, of each segment only its size and device are kept, and the rest is skipped.
#pragma once

#include <cstdint>
#include <istream>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/json_sax.hpp"
#include "tools/trace_import.hpp"

namespace terrace::tools {

class snapshot_reader final : public scalar_sax {
 public:
  explicit snapshot_reader(std::string source);

  /// @brief The root is an object with an "action" and neither device_traces nor segments: one
  /// terrace trace event written on one line, not a snapshot.
  [[nodiscard]] bool is_one_trace_event() const;

  /// @brief The trace of the device with the most events, checked in the order a reader of the
  /// whole document would check it (what is missing, then that device's events, then the
  /// segments), and PyTorch's reserved figures from the segments.
  /// @throws terrace::logic_error naming the source and the event or segment.
  imported_trace finish(std::string format) &&;

  bool start_object(std::size_t n) override;
  bool start_array(std::size_t n) override;
  bool end_object() override;
  bool end_array() override;
  bool key(string_t& k) override;

 private:
  // What an open container outside a captured value is.
  enum class role : std::uint8_t { skipped, root, traces, device_trace, segments, segment };
  enum class shape : std::uint8_t { scalar, array, object };
  struct device_trace {
    bool is_list = false;
    std::size_t count = 0;             // its events, converted or not
    std::vector<trace_event> events;   // converted, up to the first that fails
    std::optional<std::string> error;  // why that one failed
  };

  bool value(nlohmann::json v) override;  // a scalar
  bool captures(shape s);  // a value starts: does it go to the capture's builder?
  bool close();
  bool forwarded(bool go_on);  // after a call handed to the capture's builder
  void captured(nlohmann::json v);
  void add_event(const nlohmann::json& e);

  std::string source_;
  std::vector<role> open_;
  std::string key_;  // the last key at the root or in a segment
  // The value being captured whole (a trace event, or a segment's size or device), built by
  // capture_ with stack frames digested to their text.
  bool capturing_ = false;
  bool capture_is_event_ = false;
  std::string capture_key_;
  json_dom_builder capture_;

  bool root_is_object_ = false;
  bool root_has_action_ = false;
  bool has_traces_ = false;
  bool traces_is_list_ = false;
  std::vector<device_trace> devices_;
  bool has_segments_ = false;
  bool segments_is_list_ = false;
  std::vector<nlohmann::json> segments_;  // each one's total_size and device, if it is an object
};

/// @brief A JSON snapshot read from `text`.
imported_trace torch_snapshot_json(std::istream& text, const std::string& source);

}  // namespace terrace::tools
