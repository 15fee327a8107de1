// SPDX-License-Identifier: Apache-2.0
#include "tools/json_sax.hpp"

#include <utility>

namespace terrace::tools {

using json = nlohmann::json;

bool scalar_sax::null() { return value(json(nullptr)); }
bool scalar_sax::boolean(bool b) { return value(json(b)); }
bool scalar_sax::number_integer(number_integer_t n) { return value(json(n)); }
bool scalar_sax::number_unsigned(number_unsigned_t n) { return value(json(n)); }
bool scalar_sax::number_float(number_float_t x, const string_t&) { return value(json(x)); }
bool scalar_sax::string(string_t& text) { return value(json(std::move(text))); }
bool scalar_sax::binary(binary_t& b) { return value(json::binary(std::move(b))); }
bool scalar_sax::parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
  error = e.what();
  return false;
}

bool json_dom_builder::start_object(std::size_t) { return open(json::object()); }
bool json_dom_builder::start_array(std::size_t) { return open(json::array()); }
bool json_dom_builder::end_object() { return close(); }
bool json_dom_builder::end_array() { return close(); }
bool json_dom_builder::key(string_t& k) {
  key_ = std::move(k);
  return true;
}

json json_dom_builder::take() {
  stack_.clear();
  return std::exchange(root_, json());
}

// Puts `v` where the parser is (the root, the next list element, or under the last key).
json* json_dom_builder::place(json v) {
  if (stack_.empty()) return &(root_ = std::move(v));
  json& parent = *stack_.back().value;
  if (parent.is_array()) return &parent.emplace_back(std::move(v));
  return &(parent[key_] = std::move(v));
}

bool json_dom_builder::value(json v) {
  const bool digest = under_digest_key();
  json* at = place(std::move(v));
  if (digest) *at = digest_->of(*at);
  return true;
}

bool json_dom_builder::open(json container) {
  const bool digest = under_digest_key();
  stack_.push_back({place(std::move(container)), digest});
  return true;
}

bool json_dom_builder::close() {
  const level done = stack_.back();
  stack_.pop_back();
  if (done.digest) *done.value = digest_->of(*done.value);
  return true;
}

bool json_dom_builder::under_digest_key() const {
  return digest_ != nullptr && !stack_.empty() && stack_.back().value->is_object() &&
         key_ == digest_->key;
}

}  // namespace terrace::tools
