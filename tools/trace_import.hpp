// SPDX-License-Identifier: Apache-2.0
/// @file trace_import.hpp
/// @brief Reads allocation traces in the formats people have: terrace JSON lines, PyTorch memory
/// snapshots (pickle from torch.cuda.memory._dump_snapshot, read by a restricted unpickler, or
/// terrace's JSON snapshot), PyTorch profiler (Kineto) JSON with `[memory]` events, and RMM's
/// logging CSV. Every format becomes terrace trace_events (alloc / free_requested, plus the
/// segment_* events a snapshot has).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/trace.hpp"

namespace terrace::tools {

struct imported_trace {
  std::string format;  ///< "terrace-jsonl", "torch-snapshot-pickle", "torch-snapshot-json", "kineto", "rmm-csv"
  std::vector<trace_event> events;
  /// What PyTorch itself reserved, when the input says: from a snapshot's segments (now, and the
  /// peak over its trace's segment events) or from Kineto's "Total Reserved".
  std::optional<std::int64_t> torch_reserved_now;
  std::optional<std::int64_t> torch_reserved_peak;
  /// What the reader chose that the user should know, one sentence each (the CLI prints them to
  /// stderr): e.g. that a trace of several devices was narrowed to one.
  std::vector<std::string> notes;
};

/// @brief Reads `path`, choosing the format by extension (.jsonl, .pickle/.pkl, .csv) or, failing
/// that, by content: a pickle, an RMM CSV header, JSON with `traceEvents` = Kineto, JSON objects
/// with an `action` one per line (one line included) or nothing but white space = terrace JSON
/// lines, else a snapshot, which must have `device_traces` or `segments`. `format` forces one: "jsonl", "pickle",
/// "snapshot-json", "kineto", "rmm" ("" or "auto" = detect). Of a snapshot or Kineto trace of
/// several devices, the one with the most events is read (said in `notes`).
/// @throws terrace::logic_error naming the file (and line or byte) for anything malformed, a pickle
/// opcode that could run code, or an unknown format.
imported_trace import_trace(const std::string& path, std::string_view format = {});

/// @brief The parsers on in-memory text, for tests. `source` names the input in errors.
imported_trace parse_kineto_json(std::string_view text, const std::string& source);
imported_trace parse_rmm_csv(std::string_view text, const std::string& source);
imported_trace parse_torch_snapshot_pickle(std::string_view bytes, const std::string& source);
imported_trace parse_torch_snapshot_json(std::string_view text, const std::string& source);

}  // namespace terrace::tools
