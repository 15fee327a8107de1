// SPDX-License-Identifier: Apache-2.0
/// @file tier_manager.hpp
/// @brief Tensors across three tiers: NVMe, pinned host memory and the device, with
/// lifetime-driven (Belady) eviction and prefetch.
///
/// Each tensor has a home copy in pinned host memory (a pinned_host_pool buffer) and, while it is
/// wanted, a device copy (a caching_allocator block). The device holds at most `device_budget`
/// bytes of tensors. With a tensor_store attached, pinned memory holds at most `host_budget` bytes
/// of home copies: the others live on NVMe, read back through io_uring straight into pinned
/// buffers (the staging the copy up then uses), and written there before their host memory is
/// reused. The training loop brackets every use of a tensor with acquire/release:
///
///   void* w = tm.acquire(id, compute, access::read);   // device pointer, valid on `compute`
///   ... launch kernels on `compute` ...
///   tm.release(id, compute);                           // evictable once that work is done
///
/// acquire never blocks the host on a transfer: the compute stream is made to wait for the copy's
/// event. The order of acquires in one iteration is recorded (between the first two calls of
/// begin_iteration, with each acquire's access mode, or given by set_schedule); afterwards
///   - eviction takes the unpinned tensor whose next use is farthest (Belady's rule), counting only
///     uses that need the device data: one acquired with access::write next costs no copy up;
///   - prefetch copies the next tensors of the schedule up on a copy stream, in the order they will
///     be used (skipping uses with access::write), as far as the budget allows without evicting
///     anything needed sooner; with prefetch_across_iterations off it stops at the iteration's end.
/// Device blocks come from the caching allocator in stream order on the copy stream; a block given
/// back while a copy still uses it is fenced, and a caller's stream that gets memory of it without
/// a copy up to wait for (access::write) waits for exactly that copy (tier_manager.cpp).
/// An acquire that does not match the schedule is served on demand and counted; it is never an
/// error. A tensor written on the device is copied back home before its device memory is reused.
///
/// Thread-safe (one mutex); the intended use is one training thread plus the optimizer's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "terrace/caching_allocator.hpp"
#include "terrace/device.hpp"
#include "terrace/pinned_pool.hpp"
#include "terrace/tensor_store.hpp"

namespace terrace {

using tensor_id = std::uint32_t;

/// @brief What the caller will do with a tensor it acquires.
enum class access {
  read,   ///< the device copy is only read
  write,  ///< fully overwritten: no copy up is needed, and the device copy becomes the newest
  update  ///< read and modified: copied up if needed, and the device copy becomes the newest
};

struct tier_manager_options {
  /// Bytes of tensors the device may hold at once, in flight included (0: the device's capacity).
  std::size_t device_budget = 0;
  /// Bytes of copies up that prefetch may have in flight at once (0: a quarter of the budget, and
  /// then one copy of a larger tensor may be in flight alone).
  std::size_t prefetch_window = 0;
  /// How far ahead in the schedule an unexpected acquire looks for where the iteration went on
  /// (past the schedule's end into the next iteration too; such a match is taken once the next
  /// acquire follows it). The nearest match is taken, unless a farther one is preceded in the
  /// schedule by the last 16 acquires (a tensor used several times could otherwise lock `pos`
  /// onto a wrong place for good).
  std::size_t resync_distance = 64;
  /// With an NVMe store: bytes of home copies kept in pinned host memory (0: all of them). At most
  /// the pinned pool's capacity. When the pool refuses a buffer the budget has room for (its
  /// rounding, other users of the pool, the memlock limit), home copies move to NVMe for it.
  std::size_t host_budget = 0;
  /// Whether prefetch (device and NVMe) runs past the end of the schedule into the next
  /// iteration's first tensors. Set it to false when something between iterations replaces those
  /// tensors' home copies (an optimizer step: host_data(access::write), host_modified), which would
  /// drop what was prefetched: prefetch then stops at the iteration's last tensor, and
  /// begin_iteration() starts it again from the first -- call it as soon as the home copies are
  /// final.
  bool prefetch_across_iterations = true;
};

/// @brief Counters of a tier_manager (since construction).
struct tier_stats {
  std::int64_t host_to_device_bytes = 0;
  std::int64_t device_to_host_bytes = 0;
  std::int64_t host_to_device_copies = 0;
  std::int64_t device_to_host_copies = 0;
  std::int64_t evictions = 0;          ///< device copies dropped to make room
  std::int64_t prefetches = 0;         ///< copies up started ahead of use
  std::int64_t prefetch_hits = 0;      ///< acquires that found their tensor prefetched
  std::int64_t demand_fetches = 0;     ///< acquires that had to start their own copy up
  std::int64_t schedule_misses = 0;    ///< acquires that did not follow the recorded schedule
  /// Acquires whose stream was made to wait for a copy still using memory of the block they got
  /// (a reused block: the flush or the evicted prefetch of its previous owner)
  std::int64_t fence_waits = 0;
  std::int64_t device_bytes = 0;       ///< bytes of tensors on the device now
  std::int64_t device_bytes_peak = 0;
  std::int64_t nvme_read_bytes = 0;
  std::int64_t nvme_write_bytes = 0;
  std::int64_t host_evictions = 0;     ///< home copies moved from pinned memory to NVMe
  /// Of those, started ahead of need by an NVMe prefetch, the put not waited for (counted when
  /// started; one used before its put landed stays home).
  std::int64_t host_evictions_ahead = 0;
  /// Eviction puts that failed (I/O error); their tensors stayed home, unchanged. One started
  /// ahead of need fails silently otherwise (its caller did not ask for it).
  std::int64_t failed_puts = 0;
  std::int64_t nvme_prefetches = 0;    ///< NVMe reads started ahead of use
  std::int64_t nvme_waits = 0;         ///< calls that had to block on an NVMe read
  std::int64_t host_bytes = 0;         ///< bytes of home copies in pinned memory now
  std::int64_t host_bytes_peak = 0;
};

/// @brief The host and device tiers of training beyond GPU memory (see the file comment).
class tier_manager {
 public:
  /// `device_memory` must allocate from `device`; both, `host` and `nvme` (optional: without it
  /// every home copy stays in pinned memory) must outlive the manager.
  /// @throws logic_error for a budget larger than the device, or a host budget without a store or
  ///         above the pinned pool's capacity;
  ///         device_error if no copy stream can be created.
  tier_manager(device_backend& device, caching_allocator& device_memory, pinned_host_pool& host,
               tier_manager_options options = {}, tensor_store* nvme = nullptr);
  /// Waits for every copy, then returns all device blocks and host buffers.
  ~tier_manager();
  tier_manager(const tier_manager&) = delete;
  tier_manager& operator=(const tier_manager&) = delete;

  /// @brief A new tensor of `bytes` (> 0) named `name` (unique; its id in the NVMe store), at home
  /// in pinned host memory and filled from `initial` when given. Without `initial`, a tensor of
  /// that name and size in the attached store is taken as its contents (resuming from a
  /// checkpoint) and stays on NVMe until used; otherwise the contents are undefined until written.
  /// @throws out_of_memory when the host tier cannot hold it, or at once (nothing moved to NVMe)
  ///         when it is larger than the whole host budget; logic_error for 0 bytes, a name
  ///         already added, or one longer than tensor_store::max_id_bytes.
  tensor_id add(std::string name, std::size_t bytes, const void* initial = nullptr);

  /// @brief The tensor's device copy, valid for work queued on `stream` from now on; pins it.
  /// `stream` is ordered after the manager's own copies (up, down, and those of the block's
  /// previous owners), never after the caller's other streams: work of another stream that wrote
  /// the tensor must be ordered by the caller (an event), as for any device memory. The copy up
  /// does not block the host; a tensor on NVMe is read into pinned memory first, and making room
  /// may wait for puts to NVMe and for copies down of the evicted tensors.
  /// Acquiring a pinned tensor again pins it again.
  /// @throws logic_error for an unknown id; out_of_memory when the tensor is larger than the
  ///         device budget, when acquired tensors leave no room in it, or their homes none in the
  ///         host budget; io_error from NVMe; device_error when the device refuses a copy or
  ///         an event (this tensor's, or a prefetch's: the tensor is then not acquired).
  void* acquire(tensor_id id, stream_ref stream, access mode = access::read);
  /// @brief Unpins; the device copy may be evicted once the work queued on `stream` so far is done.
  /// @throws logic_error for an unknown id or a tensor that is not acquired; device_error when
  ///         the device cannot record the event for `stream`: the tensor then stays acquired.
  void release(tensor_id id, stream_ref stream);

  /// @brief The home (pinned host) copy, made current: waits for a copy down in flight, and copies
  /// a newer device copy down first. For the CPU optimizer and for checkpoints. Same as
  /// host_data(id, access::update).
  /// @throws logic_error for an unknown id or a tensor that is acquired (its device copy may be
  ///         changing); out_of_memory when the home copy was on NVMe and the host budget has no
  ///         room for it; io_error or checksum_error from the NVMe read; device_error when the
  ///         device refuses the copy down.
  void* host_data(tensor_id id);
  /// @brief host_data with what the caller will do: access::read and access::update make the home
  /// copy current as host_data(id) does (after an update, call host_modified). access::write
  /// says the caller overwrites the whole home copy: nothing is read back from NVMe or copied down
  /// from the device, the device copy is dropped and the home copy counts as modified (no
  /// host_modified needed). Copies in flight that touch the home buffer are waited for first.
  /// The caller writes the buffer after this returns, outside the manager's lock: while another
  /// thread's acquire may prefetch the tensor (copy it up), call host_modified(id) once the writing
  /// is done, so that a copy taken mid-write is dropped. (Under a host budget such a thread may
  /// even move the home copy to NVMe, invalidating the pointer: see read_home. The engine writes
  /// from the thread that acquires, where no prefetch runs meanwhile.)
  /// @throws as host_data(id).
  void* host_data(tensor_id id, access mode);
  /// @brief Copies the home copy, made current as host_data(id) makes it, into `out` (size(id)
  /// bytes), all under the manager's lock. A host_data() pointer may be invalidated by another
  /// thread's call that moves the home copy to NVMe (under a host budget); this cannot be. A
  /// tensor only on NVMe is read straight into `out` (no home buffer is taken; other calls wait
  /// for the read); one that holds no data yet (never written) reads as zeros, taking no buffer
  /// either. For an optimizer that runs beside the training thread (offload_engine's
  /// delayed_update).
  /// @throws as host_data(id), and logic_error for a null `out`.
  void read_home(tensor_id id, void* out);
  /// @brief Starts copying a device copy that is newer than the home copy down to it, on the copy
  /// stream after the work queued so far on the stream the tensor was last released on, without
  /// blocking the host; a later host_data() waits for that copy. The device copy stays (and stays
  /// usable). No-op when the home copy is current or the tensor is not on the device. For
  /// gradients, offloaded as backward produces them.
  /// @throws logic_error for an unknown id or a tensor that is acquired; device_error when the
  ///         device refuses the copy down.
  void flush(tensor_id id);
  /// @brief flush(), then gives the device block back at once (its memory is handed out again only
  /// after the copy down has read it): the tensor lives at home until acquired again. For
  /// gradients, whose device copy is never read again (the next backward overwrites it): kept
  /// cached, it would hold device memory until an eviction, often in the next iteration, where a
  /// planned device allocator sees a block that outlives its step. Not counted as an eviction.
  /// No-op when the tensor is not on the device.
  /// @throws as flush(); after a device_error the device block is kept.
  void offload(tensor_id id);
  /// @brief Says the home copy was changed on the host: the device copy is dropped.
  /// @throws logic_error for an unknown id, a tensor that is acquired, or one whose home copy is
  ///         on NVMe (call host_data first).
  void host_modified(tensor_id id);

  /// @brief Marks the start of a training iteration. The acquires between the first and second
  /// calls become the schedule (unless set_schedule gave one); later calls restart it and start
  /// prefetching its first tensors at once (without blocking on a transfer).
  /// NVMe read ahead never fails the call (the tensor's own acquire reads and reports).
  /// @throws device_error when the device refuses a prefetch's copy up (nothing is left half
  /// done: the tensor stays where it was, and its acquire fetches it).
  void begin_iteration();
  /// @brief Says the iteration begun last did not finish (it threw part-way). An iteration being
  /// recorded is dropped, and the next begin_iteration records again: otherwise its first part
  /// would become the schedule for good, and every later use a miss. A schedule in use is kept.
  void abandon_iteration();
  /// @brief Sets the access order of one iteration explicitly (replaces any recorded one).
  /// @throws logic_error for an unknown id.
  void set_schedule(std::vector<tensor_id> order);
  /// @brief The schedule in use (empty until recorded or set).
  std::vector<tensor_id> schedule() const;

  /// @brief Makes the NVMe store hold every tensor's current contents and commits a checkpoint
  /// there (tensor_store::checkpoint); a later run resumes by adding the same names.
  /// @returns the store's new generation. @throws logic_error without a store or while a tensor
  ///         is acquired; io_error from the store.
  std::uint64_t checkpoint();

  /// Each of on_device, on_host, size and name: @throws logic_error for an unknown id.
  bool on_device(tensor_id id) const;
  /// @brief Whether the home copy is in pinned memory (else only on NVMe).
  bool on_host(tensor_id id) const;
  std::size_t size(tensor_id id) const;
  std::string name(tensor_id id) const;  // a copy: add() may move the tensors' records
  tier_stats stats() const;
  /// @brief The stream the manager copies on (for tests and for callers that must order work
  /// after its copies).
  stream_ref copy_stream() const noexcept;

  /// @brief Checks the books (budget, pins, residency) and throws logic_error naming the first
  /// broken invariant. For tests.
  void check_invariants() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace terrace
