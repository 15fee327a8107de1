// SPDX-License-Identifier: Apache-2.0
// A device_backend that models nothing, for tests that need a backend with one behaviour of its
// own (counting reserves, a name, a host that refuses pinned memory): they derive from it and
// override only that. Streams and events are empty handles whose operations complete at once;
// memory and copies are refused with device_error unless a test overrides them.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "terrace/device.hpp"
#include "terrace/error.hpp"

namespace terrace::testing {

class inert_backend : public device_backend {
 public:
  explicit inert_backend(std::string name) { properties_.name = std::move(name); }

 protected:
  [[noreturn]] void refuse(const char* what) const {
    throw device_error("terrace test backend '" + properties_.name + "': " + what + " is not modelled");
  }

 private:
  void* do_reserve(std::size_t) override { refuse("reserve"); }
  void do_release(void*, std::size_t) noexcept override {}
  std::size_t do_used_bytes() const noexcept override { return 0; }
  stream_ref do_create_stream() override { return {}; }
  void do_destroy_stream(stream_ref) noexcept override {}
  void do_synchronize_stream(stream_ref) override {}
  void do_synchronize_device() override {}
  event_ref do_create_event() override { return {}; }
  void do_destroy_event(event_ref) noexcept override {}
  void do_record(event_ref, stream_ref) override {}
  bool do_query(event_ref) override { return true; }
  void do_wait(stream_ref, event_ref) override {}
  void do_synchronize_event(event_ref) override {}
  void do_copy_async(void*, const void*, std::size_t, copy_kind, stream_ref) override {
    refuse("copy_async");
  }
};

}  // namespace terrace::testing
