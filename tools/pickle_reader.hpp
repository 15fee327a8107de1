// SPDX-License-Identifier: Apache-2.0
/// @file pickle_reader.hpp
/// @brief A restricted unpickler: reads the plain-data subset of Python's pickle format (protocols
/// 2-5: None, bools, ints, floats, str, bytes, lists, tuples, dicts, sets) and refuses every
/// opcode that could name or run code (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ,
/// EXT, PERSID, ...). PyTorch's memory snapshot pickles are plain data and read fully.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace terrace::tools {

/// @brief Decodes `data` (the whole pickle) and hands the value it holds to `out` as SAX events,
/// as nlohmann's parser hands a JSON text: dict keys become strings (ints as decimal), tuples and
/// sets arrays, bytes strings. Nothing is built beyond the pickle machine's own compact values, so
/// a consumer that keeps only what it needs (the snapshot importer) holds no document. A shared
/// value (memoised, referred to again) is handed over at each use. The walk stops early if `out`
/// returns false.
/// @throws terrace::logic_error naming `source` and the byte offset for a refused or unknown
/// opcode, a truncated stream, a stack underflow, a missing STOP, nesting deeper than 200 levels,
/// or sharing that expands past a budget proportional to the input.
void read_pickle(std::string_view data, const std::string& source,
                 nlohmann::json_sax<nlohmann::json>& out);

/// @brief The value as JSON (small pickles, tests).
nlohmann::json read_pickle(std::string_view data, const std::string& source);

}  // namespace terrace::tools
