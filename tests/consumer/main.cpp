// SPDX-License-Identifier: Apache-2.0
// Uses an installed terrace through both exported targets: the C++ API (terrace::terrace) on a
// "sim" device, and the C ABI (terrace::c, libterrace.so) as PyTorch would call it. Exits 0 only
// if every check holds; each failure says which.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include <terrace/caching_allocator.hpp>
#include <terrace/device.hpp>
#include <terrace/error.hpp>
#include <terrace/terrace.h>

namespace {

int g_failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "terrace_consumer: FAILED: %s\n", what);
    ++g_failures;
  }
}

void use_cpp_api() {
  terrace::device_options options;
  options.capacity = std::size_t{64} << 20;
  auto device = terrace::make_device("sim", options);
  check(device != nullptr, "make_device(\"sim\") returns a backend");
  if (!device) return;
  check(device->properties().name == "sim", "the backend calls itself \"sim\"");

  terrace::caching_allocator allocator(*device);
  constexpr std::size_t kBytes = std::size_t{1} << 20;
  void* p = allocator.allocate(kBytes);
  check(p != nullptr, "caching_allocator::allocate(1 MiB) returns memory");
  if (p == nullptr) return;
  // The sim device hands out host memory: writing all of it proves the block is really there.
  std::memset(p, 0x5a, kBytes);
  check(allocator.stats().allocated_bytes[0].current >= static_cast<std::int64_t>(kBytes),
        "allocated_bytes.all.current counts the live block");
  allocator.deallocate(p);
  check(allocator.stats().allocated_bytes[0].current == 0,
        "allocated_bytes.all.current is 0 after deallocate");

  // Exceptions thrown inside the static library must be catchable by type in the consumer.
  bool refused = false;
  try {
    allocator.deallocate(p);
  } catch (const terrace::logic_error&) {
    refused = true;
  }
  check(refused, "a double free throws terrace::logic_error");
  allocator.check_invariants();
}

void use_c_abi() {
  check(terrace_configure("device:sim,device_capacity:64MiB") == TERRACE_OK,
        "terrace_configure accepts a sim device");
  void* p = terrace_malloc(4096, 0, nullptr);
  check(p != nullptr, "terrace_malloc(4096) returns memory");
  if (p == nullptr) {
    std::fprintf(stderr, "terrace_consumer: terrace_last_error: %s\n", terrace_last_error());
    return;
  }
  std::memset(p, 0xa5, 4096);
  terrace_free(p, 4096, 0, nullptr);
  check(std::strcmp(terrace_last_error(), "") == 0, "terrace_free of a live block succeeds");

  // A second free must be refused and explained, never crash.
  terrace_free(p, 4096, 0, nullptr);
  check(std::strlen(terrace_last_error()) > 0, "a double terrace_free sets terrace_last_error");
}

}  // namespace

int main() {
  try {
    use_cpp_api();
    use_c_abi();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "terrace_consumer: FAILED: unexpected exception: %s\n", e.what());
    return 1;
  }
  if (g_failures != 0) return 1;
  std::printf("terrace_consumer: OK (terrace %s, C++ API and C ABI)\n",
              TERRACE_CONSUMER_EXPECTED_VERSION);
  return 0;
}
