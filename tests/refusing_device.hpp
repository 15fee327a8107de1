// SPDX-License-Identifier: Apache-2.0
// A device whose next copies up, reserves, event records, stream waits or event synchronizes can be refused (device_error at the call), as a
// CUDA call can be (an invalid argument, a launch queue that is full); everything else goes to the
// device it wraps. The sim device's own fault injection covers reserves, maps and pinned memory,
// but a test cannot see whether it was used.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>

#include "terrace/device.hpp"
#include "terrace/error.hpp"

namespace terrace::testing {

class refusing_device final : public device_backend {
 public:
  explicit refusing_device(std::unique_ptr<device_backend> inner) : inner_(std::move(inner)) {
    properties_ = inner_->properties();
  }
  int refuse_copies_up = 0;
  int refuse_reserves = 0;
  int refuse_records = 0;
  int records_before_refusing = 0;  // records that pass before refuse_records applies
  int refuse_event_syncs = 0;
  int event_syncs_before_refusing = 0;  // as records_before_refusing, for refuse_event_syncs
  int refuse_waits = 0;  // a stream's wait for an event (cudaStreamWaitEvent)
  device_backend& inner() { return *inner_; }  // for enqueue_host_function

 private:
  void* do_reserve(std::size_t bytes) override {
    if (refuse_reserves > 0) {
      --refuse_reserves;
      throw device_error("test: reserve refused");
    }
    return inner_->reserve(bytes);
  }
  void do_release(void* p, std::size_t bytes) noexcept override { inner_->release(p, bytes); }
  std::size_t do_used_bytes() const noexcept override { return inner_->used_bytes(); }
  void* do_reserve_pinned_host(std::size_t bytes) override {
    return inner_->reserve_pinned_host(bytes);
  }
  void do_release_pinned_host(void* p, std::size_t bytes) noexcept override {
    inner_->release_pinned_host(p, bytes);
  }
  stream_ref do_create_stream() override { return inner_->create_stream(); }
  void do_destroy_stream(stream_ref s) noexcept override { inner_->destroy_stream(s); }
  void do_synchronize_stream(stream_ref s) override { inner_->synchronize(s); }
  void do_synchronize_device() override { inner_->synchronize_device(); }
  event_ref do_create_event() override { return inner_->create_event(); }
  void do_destroy_event(event_ref e) noexcept override { inner_->destroy_event(e); }
  void do_record(event_ref e, stream_ref s) override {
    if (refuse_records > 0 && records_before_refusing > 0) {
      --records_before_refusing;
    } else if (refuse_records > 0) {
      --refuse_records;
      throw device_error("test: event record refused");
    }
    inner_->record(e, s);
  }
  bool do_query(event_ref e) override { return inner_->query(e); }
  void do_wait(stream_ref s, event_ref e) override {
    if (refuse_waits > 0) {
      --refuse_waits;
      throw device_error("test: stream wait refused");
    }
    inner_->wait(s, e);
  }
  void do_synchronize_event(event_ref e) override {
    if (refuse_event_syncs > 0 && event_syncs_before_refusing > 0) {
      --event_syncs_before_refusing;
    } else if (refuse_event_syncs > 0) {
      --refuse_event_syncs;
      throw device_error("test: event synchronize refused");
    }
    inner_->synchronize(e);
  }
  void do_copy_async(void* dst, const void* src, std::size_t bytes, copy_kind kind,
                     stream_ref s) override {
    if (kind == copy_kind::host_to_device && refuse_copies_up > 0) {
      --refuse_copies_up;
      throw device_error("test: copy up refused");
    }
    inner_->copy_async(dst, src, bytes, kind, s);
  }
  std::unique_ptr<device_backend> inner_;
};

}  // namespace terrace::testing
