// SPDX-License-Identifier: Apache-2.0
/// @file pickle_reader.hpp
/// @brief A restricted unpickler: reads the plain-data subset of Python's pickle format (protocols
/// 2-5: None, bools, ints, floats, str, bytes, lists, tuples, dicts, sets) into JSON, and refuses
/// every opcode that could name or run code (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ,
/// NEWOBJ, EXT, PERSID, ...). PyTorch's memory snapshot pickles are plain data and read fully.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace terrace::tools {

/// @brief A digest of every value under one dict key, taken as soon as the value is built: only
/// the digest is kept. For a large value repeated many times whose digest is small: a memory
/// snapshot's stack frames, each a list of shared frame dicts (5 bytes of pickle per frame, a few
/// hundred bytes of JSON each, copied in full at every use).
struct pickle_digest {
  std::string key;
  std::function<nlohmann::json(const nlohmann::json&)> of;
};

/// @brief Decodes `data` (the whole pickle). Dict keys become strings (ints as decimal); tuples and
/// sets become arrays; bytes become strings. With `digest`, values under its key are replaced by
/// their digest.
/// @throws terrace::logic_error naming `source` and the byte offset for a refused or unknown
/// opcode, a truncated stream, a stack underflow or a missing STOP.
nlohmann::json read_pickle(std::string_view data, const std::string& source,
                           const pickle_digest* digest = nullptr);

}  // namespace terrace::tools
