/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file terrace.h
 * @brief terrace's C ABI, for embedding: PyTorch's CUDAPluggableAllocator, ctypes, C trainers.
 *
 * The allocation functions have exactly the signatures torch.cuda.memory.CUDAPluggableAllocator
 * and its hooks expect (cudaStream_t is a pointer, passed here as void*):
 *
 *   alloc   = torch.cuda.memory.CUDAPluggableAllocator(path, "terrace_torch_malloc",
 *                                                      "terrace_torch_free")
 *   alloc.set_init_fn / set_reset_fn / set_memory_fraction_fn / set_record_stream_fn
 *     -> terrace_init, terrace_empty_cache, terrace_set_memory_fraction, terrace_record_stream
 *   alloc.set_begin_allocate_to_pool -> terrace_torch_begin_allocate_to_pool (refuses a capture)
 *
 * (tools/terrace_torch.py's install() does this.) PyTorch does not check its malloc hook's result
 * and never retries a free, so it gets its own pair: terrace_torch_malloc throws instead of
 * returning NULL, and terrace_torch_free frees a known pointer whatever size it is given. C
 * callers use terrace_malloc / terrace_free.
 *
 * One allocator per device index is created on first use, configured from TERRACE_ALLOC_CONF (or
 * terrace_configure, called before first use). The backend is `device` from that config: "auto"
 * (the default) picks CUDA when a GPU is present (cuda-vmm when expandable_segments is on) and the
 * simulated device otherwise. A config that cannot be used (a bad TERRACE_ALLOC_CONF, a backend
 * this build or machine lacks) fails each call that would create an allocator, and freezes
 * nothing: terrace_configure may still set another.
 *
 * No C++ exception ever crosses this boundary, except those of terrace_torch_malloc and
 * terrace_torch_begin_allocate_to_pool, which are for PyTorch's C++ caller alone. Functions that
 * can fail return 0 on success and a negative TERRACE_E* code on failure; terrace_malloc returns
 * NULL. terrace_last_error() then describes the failure (per thread). The free hooks cannot
 * report failure: a bad free (double, foreign) is refused (nothing is changed), counted in
 * num_bad_frees, and described by terrace_last_error().
 */
#ifndef TERRACE_TERRACE_H_
#define TERRACE_TERRACE_H_

#include <stddef.h>

#ifdef __cplusplus
#include <functional>
#include <utility>
struct CUstream_st; /* cudaStream_t is CUstream_st* */
#endif

#if defined(TERRACE_BUILDING_LIBRARY)
#define TERRACE_API __attribute__((visibility("default")))
#else
#define TERRACE_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum terrace_status {
  TERRACE_OK = 0,
  TERRACE_EINVAL = -1,       /* bad argument, bad config, double or foreign free */
  TERRACE_ENOMEM = -2,       /* out of device memory after releasing the cache */
  TERRACE_EDEVICE = -3,      /* the device backend failed (CUDA error, no GPU, ...) */
  TERRACE_EIO = -4,          /* a file could not be written */
  TERRACE_ERANGE = -5,       /* an output buffer is too small; *needed says how large */
  TERRACE_EINTERNAL = -6     /* anything else; a bug */
};

/* ---- The CUDAPluggableAllocator ABI ------------------------------------------------------- */

/** @brief Allocates `size` bytes usable in stream order on `stream`. NULL on failure (size 0 too).
 *  A size above PTRDIFF_MAX, negative as PyTorch's ssize_t, is a bad argument (not out of memory). */
TERRACE_API void* terrace_malloc(size_t size, int device, void* stream);
/** @brief Frees what terrace_malloc returned. `size` 0 skips the size check. `stream` is
 *  informational, as in PyTorch: the block goes back to the stream it was allocated on at once,
 *  not in order on `stream` as cudaFreeAsync would. A block used on other streams must be named
 *  to terrace_record_stream first, or those streams' queued work may meet its next owner. */
TERRACE_API void terrace_free(void* ptr, size_t size, int device, void* stream);
/** @brief PyTorch's malloc hook: as terrace_malloc, but a failure throws a std::runtime_error
 *  carrying terrace_last_error()'s text (PyTorch raises it as a Python RuntimeError) instead of
 *  returning NULL, which PyTorch would use as the tensor's address. Size 0 returns NULL. Never
 *  call it from C. */
#ifdef __cplusplus
TERRACE_API void* terrace_torch_malloc(size_t size, int device, void* stream);
#endif
/** @brief PyTorch's free hook: as terrace_free, but a pointer terrace allocated is freed at its
 *  allocation's size even when `size` differs (counted in terrace_stats_json's
 *  num_size_mismatched_frees, the first printed): PyTorch has forgotten the pointer and never
 *  retries. */
TERRACE_API void terrace_torch_free(void* ptr, size_t size, int device, void* stream);
/** @brief init hook: PyTorch passes the device count. Creates nothing yet; safe to call twice. */
TERRACE_API void terrace_init(int device_count);
/** @brief reset hook (torch.cuda.empty_cache): releases cached memory on every device. */
TERRACE_API void terrace_empty_cache(void);
/** @brief memory-fraction hook: caps reserved memory on `device`. */
TERRACE_API void terrace_set_memory_fraction(double fraction, int device);
/** @brief record-stream hook: `ptr` is also used on `stream`. NULL (an empty tensor) is ignored.
 *  The owning device is found by the pointer: one live on several devices (only the null
 *  backend's fake addresses coincide) is refused. */
TERRACE_API void terrace_record_stream(void* ptr, void* stream);
#ifdef __cplusplus
/** @brief CUDA graph hook (set_begin_allocate_to_pool), with PyTorch's C++ signature: device,
 *  MempoolId_t, and the filter of the streams that allocate into the pool. PyTorch calls it before
 *  a capture starts (torch.cuda.graph, torch.compile(mode="reduce-overhead")); it throws a
 *  std::runtime_error that PyTorch raises as a RuntimeError, so the capture never begins. A graph
 *  needs a pool of its own: blocks freed during capture must stay the graph's, because every
 *  replay writes them again. terrace has no such pools; without this hook a capture would run and
 *  its blocks be handed to other tensors while replays still write them. Never call it from C. */
TERRACE_API void terrace_torch_begin_allocate_to_pool(
    int device, std::pair<unsigned long long, unsigned long long> pool,
    std::function<bool(CUstream_st*)> allocates_into_pool);
#endif

/* ---- Configuration and observability (0 or a negative terrace_status) --------------------- */

/** @brief Sets the config ("key:value,...", as TERRACE_ALLOC_CONF) for allocators not yet created.
 *  TERRACE_EINVAL, with the config as it was, for a text with a bad item (named in
 *  terrace_last_error()) or once an allocator exists. */
TERRACE_API int terrace_configure(const char* conf);
/** @brief Writes device `device`'s stats as a JSON object keyed like torch.cuda.memory_stats() into
 *  `buf` (NUL-terminated). If `capacity` is too small returns TERRACE_ERANGE; `*needed` (if not NULL)
 *  always receives the size including the NUL, or 0 when the call fails otherwise. */
TERRACE_API int terrace_stats_json(int device, char* buf, size_t capacity, size_t* needed);
/** @brief Marks the start / end of a training iteration on `device` for the planned policy
 *  (TERRACE_ALLOC_CONF policy:planned): an iteration equal to one of the last four is planned and
 *  later ones served from the plan. Optional (the planner also finds the iteration itself). Its
 *  figures appear in terrace_stats_json as "plan.*" keys. Like a first allocation, the first mark
 *  creates the device's allocator, so the configuration is frozen from then on (the plan must
 *  see the first iteration's start); under the other policies the mark does nothing more than go
 *  into the trace when tracing is on. */
TERRACE_API int terrace_begin_iteration(int device);
TERRACE_API int terrace_end_iteration(int device);
/** @brief Resets the peak counters of `device`. */
TERRACE_API int terrace_reset_peak_stats(int device);
/** @brief Zeroes the accumulated counters of `device` (every figure's allocated and freed totals,
 *  num_alloc_retries, num_ooms, num_device_alloc/free, ...), as
 *  torch.cuda.reset_accumulated_memory_stats; current and peak figures stay. */
TERRACE_API int terrace_reset_accumulated_stats(int device);
/** @brief Turns trace recording on (1) or off (0) on every device. */
TERRACE_API int terrace_record_trace(int on);
/** @brief Writes device `device`'s snapshot (segments, blocks, trace) as JSON to `path`. */
TERRACE_API int terrace_dump_snapshot(int device, const char* path);
/** @brief Writes device `device`'s recorded trace as JSON lines to `path`. */
TERRACE_API int terrace_dump_trace(int device, const char* path);
/** @brief The last failure on this thread, or "" if none. Valid until the next call on this thread
 * (also during and after static destruction); at most 4095 characters, longer ones cut with "...". */
TERRACE_API const char* terrace_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* TERRACE_TERRACE_H_ */
