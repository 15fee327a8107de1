// SPDX-License-Identifier: Apache-2.0
/// @file json_sax.hpp
/// @brief What the trace readers share on nlohmann's SAX interface, which both the JSON parser and
/// the pickle reader (read_pickle) drive: a base that hands every scalar on as a json value, and
/// a DOM builder that digests values under one key as soon as they are complete.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace terrace::tools {

/// @brief The SAX events of a scalar, each handed on as the json value it is, and the parse error
/// kept.
class scalar_sax : public nlohmann::json_sax<nlohmann::json> {
 public:
  std::string error;

  bool null() override;
  bool boolean(bool b) override;
  bool number_integer(number_integer_t n) override;
  bool number_unsigned(number_unsigned_t n) override;
  bool number_float(number_float_t x, const string_t& text) override;
  bool string(string_t& text) override;
  bool binary(binary_t& b) override;
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override;

 protected:
  virtual bool value(nlohmann::json v) = 0;
};

/// @brief A digest of every value under one object key, taken as soon as the value is complete:
/// only the digest is kept. For a large value repeated many times whose digest is small: a memory
/// snapshot's stack frames, each a list of frame dicts (5 bytes of pickle per frame when shared, a
/// few hundred bytes of JSON each, spelled out at every use).
struct value_digest {
  std::string key;
  std::function<nlohmann::json(const nlohmann::json&)> of;
};

/// @brief nlohmann's DOM builder with one addition: a value under the digest's key is replaced by
/// its digest as soon as it is complete. (nlohmann's callback parser could do that, but it
/// searches each object's parent list after it ends: quadratic in a list of events.) One builder
/// builds one value after another: take() hands each over once it is complete.
class json_dom_builder final : public scalar_sax {
 public:
  explicit json_dom_builder(const value_digest* digest = nullptr) : digest_(digest) {}

  bool start_object(std::size_t) override;
  bool start_array(std::size_t) override;
  bool end_object() override;
  bool end_array() override;
  bool key(string_t& k) override;

  /// The containers open in the value being built (0 before it starts and once it is complete).
  [[nodiscard]] std::size_t depth() const { return stack_.size(); }
  /// A scalar, as the SAX calls for one hand it over.
  bool scalar(nlohmann::json v) { return value(std::move(v)); }
  /// The value built, leaving the builder ready for the next.
  nlohmann::json take();

 private:
  struct level {
    nlohmann::json* value;
    bool digest;  // it sits under the digest's key
  };
  nlohmann::json* place(nlohmann::json v);
  bool value(nlohmann::json v) override;
  bool open(nlohmann::json container);
  bool close();
  [[nodiscard]] bool under_digest_key() const;

  const value_digest* digest_;
  nlohmann::json root_;
  std::vector<level> stack_;
  std::string key_;
};

}  // namespace terrace::tools
