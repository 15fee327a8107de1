// SPDX-License-Identifier: Apache-2.0
// The "cuda-vmm" backend: the "cuda" backend plus virtual memory (cuMemAddressReserve, cuMemCreate,
// cuMemMap), for expandable segments.
//
// Mapping: every page of map_granularity gets its own physical allocation (one
// CUmemGenericAllocationHandle), as PyTorch's expandable segments do. cuMemUnmap must cover exactly
// what one cuMemMap mapped, and the allocator's empty_cache() unmaps whatever whole pages are free,
// which need not match the ranges it once mapped; with one handle per page any page-aligned run of
// mapped pages can be unmapped.
//
// Address ranges start on a multiple of map_granularity, as the sim's do: the book and the
// allocator count pages from there. cuMemAddressReserve takes only a power of two (or 0) as its
// alignment, though, and map_granularity may be any multiple of the driver's minimum (20 MiB, say).
// Such a page is reached by reserving one page more, aligned to the largest power of two that
// divides the page (a multiple of the minimum, itself a power of two), and handing out the first
// page boundary inside; cuMemAddressFree then gets the driver's range back, as reserved.
//
// Plain segments (reserve/release) are inherited from the "cuda" backend: cudaMalloc. They do not
// need to grow, and cudaMalloc is one call where a mapped segment would be an address reservation,
// one allocation per page and an access change.
//
// The driver API is reached only through cudaGetDriverEntryPointByVersion (CUDA 12.5 and later),
// at the ABI version each function has had since CUDA 10.2, so nothing links libcuda; the floor on
// the driver is the one the statically linked runtime sets, not these functions.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "terrace/device.hpp"
#include "terrace/error.hpp"
#include "tiers/backends.hpp"
#include "tiers/cuda_common.hpp"
#include "tiers/vmm_book.hpp"

namespace terrace::detail {

namespace {

constexpr unsigned vmm_abi_version = 10020;  // cuMem* as introduced in CUDA 10.2
constexpr unsigned error_text_abi_version = 6000;

// The driver functions this backend uses, resolved once per backend.
struct driver_api {
  PFN_cuMemGetAllocationGranularity_v10020 get_granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  // Only for messages: absent, a code is printed as a number.
  PFN_cuGetErrorName_v6000 error_name = nullptr;
  PFN_cuGetErrorString_v6000 error_string = nullptr;

  template <class Fn>
  static void load(Fn& fn, const char* symbol, unsigned version) {
    fn = reinterpret_cast<Fn>(cuda_driver_entry_point(symbol, version));
  }

  static driver_api resolve() {
    driver_api api;
    load(api.get_granularity, "cuMemGetAllocationGranularity", vmm_abi_version);
    load(api.address_reserve, "cuMemAddressReserve", vmm_abi_version);
    load(api.address_free, "cuMemAddressFree", vmm_abi_version);
    load(api.create, "cuMemCreate", vmm_abi_version);
    load(api.release, "cuMemRelease", vmm_abi_version);
    load(api.map, "cuMemMap", vmm_abi_version);
    load(api.unmap, "cuMemUnmap", vmm_abi_version);
    load(api.set_access, "cuMemSetAccess", vmm_abi_version);
    try {
      load(api.error_name, "cuGetErrorName", error_text_abi_version);
      load(api.error_string, "cuGetErrorString", error_text_abi_version);
    } catch (const device_error&) {
      api.error_name = nullptr;
      api.error_string = nullptr;
    }
    return api;
  }

  std::string text(CUresult result) const {
    const char* name = nullptr;
    const char* description = nullptr;
    if (error_name != nullptr) (void)error_name(result, &name);
    if (error_string != nullptr) (void)error_string(result, &description);
    std::string out = name != nullptr ? name : "CUresult " + std::to_string(result);
    if (description != nullptr) out += std::string(" (") + description + ")";
    return out;
  }
};

// ============================================================================ the backend

class cuda_vmm_backend final : public cuda_backend {
 public:
  explicit cuda_vmm_backend(const device_options& options)
      // The book's granularity is known only once the driver has been asked, below.
      : cuda_backend(options, "cuda-vmm"), api_(driver_api::resolve()), book_("cuda-vmm", 0) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device();
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

    device_scope scope(device());
    scope.check();
    std::size_t minimum = 0;
    check(api_.get_granularity(&minimum, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          "cuMemGetAllocationGranularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM)");
    std::size_t granularity = minimum;
    if (options.map_granularity != 0) {
      // A larger page means fewer handles per mapped byte (PyTorch maps 20 MiB pages in its large
      // pool); it must still be whole driver pages.
      TERRACE_EXPECTS(options.map_granularity % minimum == 0,
                      "cuda-vmm map_granularity " + std::to_string(options.map_granularity) +
                          " must be a multiple of the driver's minimum, " +
                          std::to_string(minimum));
      granularity = options.map_granularity;
    }
    properties_.supports_vmm = true;
    properties_.map_granularity = granularity;
    book_ = vmm_book("cuda-vmm", granularity);
  }

  ~cuda_vmm_backend() override {
    // Whatever the caller left mapped or reserved; errors ignored, this may run at exit.
    device_scope scope(device());
    std::lock_guard lock(mutex_);
    for (const auto& [address, handle] : pages_) {
      (void)api_.unmap(address, page());
      (void)api_.release(handle);
    }
    for (const auto& [address, driver] : reservations_) (void)api_.address_free(driver.base, driver.bytes);
  }

 private:
  std::size_t page() const noexcept { return properties_.map_granularity; }

  [[noreturn]] void fail(CUresult result, const std::string& call) const {
    throw device_error("terrace: " + call + " on CUDA device " + std::to_string(device()) +
                       " failed: " + api_.text(result));
  }

  void check(CUresult result, const std::string& call) const {
    if (result != CUDA_SUCCESS) fail(result, call);
  }

  void report(CUresult result, const std::string& call) const noexcept {
    std::fprintf(stderr, "terrace: %s on CUDA device %d failed: %s\n", call.c_str(), device(),
                 api_.text(result).c_str());
  }

  // ---------------------------------------------------------------------- address ranges
  // vmm_book (shared with sim and null) checks every call and words the refusals; pages_ holds
  // the driver's handle for each mapped page. Both change together under mutex_.

  void* do_reserve_address_range(std::size_t bytes) override {
    book_.check_range_size(bytes);
    const std::size_t p = page();
    const bool power_of_two = (p & (p - 1)) == 0;
    if (!power_of_two && bytes > SIZE_MAX - p) {
      throw device_error("terrace: device 'cuda-vmm': reserve_address_range of " + describe_bytes(bytes) +
                         " is larger than the address space");
    }
    // See the file comment: the driver's alignment must be a power of two.
    const reservation driver{0, power_of_two ? bytes : bytes + p};
    const std::size_t alignment = power_of_two ? p : p & (~p + 1);
    device_scope scope(device());
    scope.check();
    CUdeviceptr base = 0;
    const std::string call =
        "cuMemAddressReserve(" + describe_bytes(driver.bytes) + ", alignment " + describe_bytes(alignment) + ")";
    const CUresult reserved = api_.address_reserve(&base, driver.bytes, alignment, 0, 0);
    if (reserved == CUDA_ERROR_OUT_OF_MEMORY) {  // out of address space: the allocator's miss
      throw out_of_memory("terrace: device '" + properties_.name + "' (CUDA device " +
                          std::to_string(device()) + "): address space exhausted: " + call +
                          " failed with " + api_.text(reserved));
    }
    check(reserved, call);
    const CUdeviceptr address = (base + p - 1) / p * p;
    try {
      std::lock_guard lock(mutex_);
      reservations_.emplace(address, reservation{base, driver.bytes});
      try {
        book_.add_range(address, bytes);
      } catch (...) {
        reservations_.erase(address);
        throw;
      }
    } catch (...) {
      (void)api_.address_free(base, driver.bytes);
      throw;
    }
    return reinterpret_cast<void*>(address);
  }

  void do_release_address_range(void* p, std::size_t bytes) noexcept override {
    const auto address = reinterpret_cast<CUdeviceptr>(p);
    reservation driver;
    {
      std::lock_guard lock(mutex_);
      if (std::string why = book_.why_not_releasable(address, bytes); !why.empty()) {
        contract_violation(properties_.name, why);
      }
      book_.erase_range(address);
      const auto it = reservations_.find(address);  // present: the book knew the range
      driver = it->second;
      reservations_.erase(it);
    }
    device_scope scope(device());
    if (const CUresult r = api_.address_free(driver.base, driver.bytes); r != CUDA_SUCCESS) {
      report(r, "cuMemAddressFree(" + hex_address(driver.base) + ", " + describe_bytes(driver.bytes) + ")");
    }
  }

  // ---------------------------------------------------------------------- map / unmap

  void do_map(void* p, std::size_t bytes) override {
    const auto begin = reinterpret_cast<CUdeviceptr>(p);
    const CUdeviceptr end = begin + bytes;
    std::lock_guard lock(mutex_);
    book_.check_map(begin, bytes);

    const auto call = [&] {
      return "map(" + hex_address(begin) + ", " + describe_bytes(bytes) + ")";
    };
    device_scope scope(device());
    scope.check();
    std::vector<std::pair<CUdeviceptr, CUmemGenericAllocationHandle>> done;
    done.reserve(bytes / page());
    // On any failure every page of this call is given back, so a refused map changes nothing.
    const auto undo = [&] {
      for (const auto& [address, handle] : done) {
        (void)api_.unmap(address, page());
        (void)api_.release(handle);
      }
    };
    for (CUdeviceptr address = begin; address < end; address += page()) {
      CUmemGenericAllocationHandle handle = 0;
      if (const CUresult r = api_.create(&handle, page(), &prop_, 0); r != CUDA_SUCCESS) {
        undo();
        if (r == CUDA_ERROR_OUT_OF_MEMORY) throw_out_of_memory(call(), address - begin, r);
        fail(r, "cuMemCreate(" + describe_bytes(page()) + ") for " + call());
      }
      if (const CUresult r = api_.map(address, page(), 0, handle, 0); r != CUDA_SUCCESS) {
        (void)api_.release(handle);
        undo();
        if (r == CUDA_ERROR_OUT_OF_MEMORY) throw_out_of_memory(call(), address - begin, r);
        fail(r, "cuMemMap(" + hex_address(address) + ") for " + call());
      }
      done.emplace_back(address, handle);
    }
    if (const CUresult r = api_.set_access(begin, bytes, &access_, 1); r != CUDA_SUCCESS) {
      undo();
      if (r == CUDA_ERROR_OUT_OF_MEMORY) throw_out_of_memory(call(), bytes, r);
      fail(r, "cuMemSetAccess for " + call());
    }
    try {
      for (const auto& page_handle : done) pages_.insert(page_handle);
      book_.mark_mapped(begin, bytes);
    } catch (...) {
      for (const auto& page_handle : done) pages_.erase(page_handle.first);
      undo();
      throw;
    }
    add_used(bytes);
  }

  [[noreturn]] void throw_out_of_memory(const std::string& call, std::size_t mapped_before_failure,
                                        CUresult r) const {
    const std::string free_text = describe_free_device_memory();
    throw out_of_memory(
        "terrace: out of memory on device '" + properties_.name + "' (CUDA device " +
        std::to_string(device()) + "): " + call + " failed with " + api_.text(r) + " after " +
        describe_bytes(mapped_before_failure) + " (given back); the device has " + free_text);
  }

  void do_unmap(void* p, std::size_t bytes) noexcept override {
    const auto begin = reinterpret_cast<CUdeviceptr>(p);
    const CUdeviceptr end = begin + bytes;
    std::lock_guard lock(mutex_);
    if (std::string why = book_.why_not_unmappable(begin, bytes); !why.empty()) {
      contract_violation(properties_.name, why);
    }
    device_scope scope(device());
    for (auto it = pages_.find(begin); it != pages_.end() && it->first < end;
         it = pages_.erase(it)) {
      if (const CUresult r = api_.unmap(it->first, page()); r != CUDA_SUCCESS) {
        report(r, "cuMemUnmap(" + hex_address(it->first) + ", " + describe_bytes(page()) + ")");
      }
      if (const CUresult r = api_.release(it->second); r != CUDA_SUCCESS) {
        report(r, "cuMemRelease of the page at " + hex_address(it->first));
      }
    }
    book_.mark_unmapped(begin, bytes);
    sub_used(bytes);
  }

  driver_api api_;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  std::mutex mutex_;
  vmm_book book_;
  std::map<CUdeviceptr, CUmemGenericAllocationHandle> pages_;  // one handle per mapped page
  // The driver's range behind each range the book knows (by the address handed out): the same
  // one unless the page is not a power of two (see the file comment).
  struct reservation {
    CUdeviceptr base = 0;
    std::size_t bytes = 0;
  };
  std::map<CUdeviceptr, reservation> reservations_;
};

}  // namespace

std::unique_ptr<device_backend> make_cuda_vmm_device(const device_options& options) {
  return std::make_unique<cuda_vmm_backend>(options);
}

}  // namespace terrace::detail
