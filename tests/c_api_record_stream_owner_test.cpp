// SPDX-License-Identifier: Apache-2.0
// terrace_record_stream gets no device index (PyTorch's hook passes only the pointer and the
// stream), so it finds the owning device by the pointer. Devices whose addresses can coincide
// (the null backend gives every device the same fake address space) make that search ambiguous:
// the call must say so, not record the stream on whichever device it looked at first, whose
// block would then wait for the stream while the intended block would not.
//
// A process of its own: the backend is chosen before the first allocation.
#include <gtest/gtest.h>

#include <cstddef>
#include <string>

#include "terrace/terrace.h"

namespace {

constexpr std::size_t kBytes = 4096;

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST(CApiRecordStreamOwner, APointerLiveOnTwoDevicesIsRefusedNotGivenToTheFirst) {
  ASSERT_EQ(terrace_configure("device:null,device_capacity:64MiB"), TERRACE_OK)
      << terrace_last_error();
  void* on_first = terrace_malloc(kBytes, 0, nullptr);
  void* on_second = terrace_malloc(kBytes, 1, nullptr);
  ASSERT_NE(on_first, nullptr) << terrace_last_error();
  ASSERT_EQ(on_first, on_second)
      << "the premise: the null backend hands every device the same fake addresses";
  void* const other_stream = reinterpret_cast<void*>(0x99);

  terrace_record_stream(on_second, other_stream);
  const std::string err = terrace_last_error();
  EXPECT_TRUE(contains(err, "terrace_record_stream(")) << err;
  EXPECT_TRUE(contains(err, "devices 0 and 1")) << err;

  // Once only one device holds the address, the owner is plain again.
  terrace_free(on_first, kBytes, 0, nullptr);
  ASSERT_STREQ(terrace_last_error(), "");
  terrace_record_stream(on_second, other_stream);
  EXPECT_STREQ(terrace_last_error(), "");
  terrace_free(on_second, kBytes, 1, nullptr);
  EXPECT_STREQ(terrace_last_error(), "");
}

}  // namespace
