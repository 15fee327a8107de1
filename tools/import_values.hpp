// SPDX-License-Identifier: Apache-2.0
/// @file import_values.hpp
/// @brief The checks every trace reader applies to the values it reads: numbers that must be
/// unsigned and in range, values quoted in errors, and a JSON type error turned into one naming
/// the event. Errors are terrace::logic_error (bad input) whatever the JSON library threw: a value
/// of the wrong type is the input's fault, not a failure of the program.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "terrace/error.hpp"

namespace terrace::tools {

/// Sizes are added up in signed 64-bit figures (live and reserved bytes): larger ones are refused.
inline constexpr std::uint64_t kMaxTraceSize = INT64_MAX;

/// @brief A value quoted in an error: scalars as written, an array or object by its size only
/// (the serializer recurses once per level: a value nested a million levels deep, which the
/// parser takes without recursion, overflowed the stack while its error was being written).
/// Invalid UTF-8 (a pickle's strings are not checked) becomes U+FFFD rather than failing the
/// error message itself, as in allocator/trace.cpp.
std::string quote(const nlohmann::json& j);

/// @brief An unsigned integer written as text: decimal, or hexadecimal after 0x (addresses).
/// Never octal (std::stoull's base 0 read "0100000000" as 16 MiB), and no sign or blanks (stoull
/// took "-1" as 2^64 - 1).
std::optional<std::uint64_t> parse_u64(std::string_view s);

/// @brief An address, size, stream or time: an unsigned integer up to `max`. A negative number, a
/// fraction or one out of range is refused; casting it would wrap (-1 became 16 EiB) or be
/// undefined (-1.5, 1e30). A float holding a whole number is accepted, as are strings (Kineto and
/// some exporters write addresses as strings).
/// @throws terrace::logic_error starting with `where`.
std::uint64_t as_u64(const nlohmann::json& v, const std::string& where, std::uint64_t max = UINT64_MAX);

/// @brief Runs one event's parser; a JSON type mismatch its checks did not name becomes a
/// logic_error naming the file and the event.
template <class F>
auto per_event(const std::string& where, F&& parse) {
  try {
    return parse();
  } catch (const nlohmann::json::exception& e) {
    throw logic_error(where + ": " + e.what());
  }
}

}  // namespace terrace::tools
