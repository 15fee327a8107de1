// SPDX-License-Identifier: Apache-2.0
#include "tools/import_values.hpp"

#include <charconv>
#include <cmath>

namespace terrace::tools {

using json = nlohmann::json;

std::string quote(const json& j) {
  if (j.is_array()) return "an array of " + std::to_string(j.size()) + " elements";
  if (j.is_object()) return "an object of " + std::to_string(j.size()) + " members";
  // A pickle's NaN or infinity: JSON text has no such number and would print "null".
  if (j.is_number_float() && !std::isfinite(j.get<double>())) {
    const double d = j.get<double>();
    return std::isnan(d) ? "nan" : d > 0 ? "inf" : "-inf";
  }
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

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

std::uint64_t as_u64(const json& v, const std::string& where, std::uint64_t max) {
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

}  // namespace terrace::tools
