// SPDX-License-Identifier: Apache-2.0
/// @file offload_adam.hpp
/// @brief ZeRO-Offload / ZeRO-Infinity optimizer state: fp32 master weights and Adam moments in
/// host memory or on NVMe, stepped by the CPU Adam in chunks, pipelined with the I/O.
///
/// Each parameter group (one model layer, typically) owns `elements` fp32 master weights and m, v
/// (options.adam.state_dtype). Groups are placed in the order they are added: their state stays
/// in host memory while `host_state_budget` allows, and the rest lives in the tensor store, cut
/// into chunks of `chunk_elements` (one store tensor per chunk: master, m and v back to back, so
/// one read and one write per chunk, each checksummed). A step over NVMe-resident groups runs a
/// three-stage pipeline through rotating pinned staging buffers:
///
///     read chunk i+1  |  step chunk i  |  write chunk i-1
///
/// so that the CPU update and both I/O directions overlap. Results are bitwise those of
/// adam_optimizer::step over the same buffers in memory, wherever the state lives.
///
/// Persistence: checkpoint() writes every group's state and the step counter to the store and
/// commits it; a new offload_adam over the reopened store that adds the same names (without
/// initial values) resumes from there.
///
/// Store ids: chunk k of group `name` is "<name>#<k>" (k in decimal, from 0), holding
/// [master f32 | m | v] of elements [k * chunk_elements, ...) back to back; the step counter and
/// the group table live in "#offload_adam.meta". No two of these ids can coincide. One store
/// serves one offload_adam (its other tensors must not use these names). Capacity: the NVMe
/// groups' state plus one chunk; twice that once checkpoints are taken (the store keeps the
/// checkpointed extents until the next checkpoint commits). docs/offload.md has the details.
///
/// Calls on one object are serialised (one mutex); step_count() never blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "terrace/adam.hpp"
#include "terrace/pinned_pool.hpp"
#include "terrace/tensor_store.hpp"

namespace terrace {

using group_id = std::uint32_t;

struct offload_adam_options {
  adam_options adam;
  /// Elements per pipeline chunk of NVMe-resident state (default 4 Mi). A multiple of 64: chunks
  /// then start where adam_optimizer's own thread cuts may, which keeps results bitwise equal.
  std::size_t chunk_elements = std::size_t{1} << 22;
  /// Bytes of state (master + m + v) kept in host memory; groups that do not fit go to NVMe.
  /// Placement is a prefix of the add order: the first group that does not fit and every later
  /// one go to NVMe. 0 with a store: everything on NVMe. Without a store: must be 0, and
  /// everything is on the host.
  std::size_t host_state_budget = 0;
  /// Staging buffers of the pipeline (>= 3: one reading, one stepping, one writing).
  unsigned pipeline_depth = 3;
};

/// @brief One group's inputs and outputs for a step (host memory).
struct offload_group_step {
  group_id group = 0;
  const void* grad = nullptr;  ///< elements of adam_step_options::grad_dtype
  void* param_copy = nullptr;  ///< optional: the updated params as copy_dtype (nullptr: none)
};

struct offload_adam_stats {
  std::int64_t nvme_read_bytes = 0;
  std::int64_t nvme_write_bytes = 0;
  std::int64_t chunks_stepped = 0;  ///< NVMe chunks stepped through the pipeline
  double step_seconds = 0;      ///< wall time inside step(), summed over all steps
  double io_wait_seconds = 0;   ///< of which the CPU waited for a read or a staging buffer
  std::size_t host_state_bytes = 0;
  std::size_t nvme_state_bytes = 0;
};

class offload_adam {
 public:
  /// `staging` provides the pipeline's buffers (and host-resident state); `nvme` is optional.
  /// Both must outlive this object.
  /// @throws logic_error for bad options (see adam_optimizer, chunk_elements 0 or not a multiple
  ///         of 64, depth < 3, a host budget without a store, adam_mode::lion).
  offload_adam(const offload_adam_options& options, pinned_host_pool& staging,
               tensor_store* nvme = nullptr);
  /// @brief The constructor's checks of `options` (adam_optimizer's included), for a store made
  /// (`with_store`) or not, without making anything: a caller that creates the store first can
  /// refuse bad options before it writes a file.
  /// @throws logic_error as the constructor.
  static void check_options(const offload_adam_options& options, bool with_store);
  /// @brief Which of groups of these sizes, added in this order to an offload_adam with a store,
  /// get their state on NVMe: the placement add() makes (on the host in add order while
  /// host_state_budget allows; the first group that does not fit and every later one on NVMe),
  /// for a caller that sizes the store or the staging before it adds them.
  static std::vector<bool> nvme_placement(const offload_adam_options& options,
                                          std::span<const std::size_t> group_elements);
  ~offload_adam();
  offload_adam(const offload_adam&) = delete;
  offload_adam& operator=(const offload_adam&) = delete;

  /// @brief A group of `elements` (> 0) named `name` (unique, not empty; store ids derive from
  /// it). Master weights from `initial_master`, m = v = 0; an NVMe group's state is written to the
  /// store before add returns. Without `initial_master`, the group's state is taken from the
  /// store's last checkpoint (resume), and the step counter from that checkpoint too.
  /// @throws logic_error for a duplicate or empty name, a name longer than
  ///         tensor_store::max_id_bytes - 21 (its chunks' ids), 0 elements, a resume without a store, or
  ///         a resume that would move a step counter already set (by a step or an earlier resume
  ///         from another checkpoint: resume every group before the first step);
  ///         io_error when resuming and the store has no checkpoint, no such group, or its size
  ///         (or chunk_elements, or state dtype) differs; out_of_memory when the store cannot hold
  ///         it (checked before anything is written) or pinned memory runs out. The group is not
  ///         added when add throws, and nothing of it stays in the store.
  group_id add(const std::string& name, std::size_t elements, const float* initial_master = nullptr);

  /// @brief Makes the NVMe pipeline's staging buffers (pipeline_depth of them, from the pinned
  /// pool) large enough now for the chunks of a group of `group_elements`, instead of as groups
  /// that large are added or stepped. Growing frees the smaller buffers and takes larger ones:
  /// whatever the caller placed in the pool in between sits behind the freed buffers, and their
  /// hole, too small for the larger ones, is stranded between live buffers. A caller that knows
  /// its largest NVMe group calls this before placing anything else. Nothing without a store.
  /// @throws out_of_memory when the pool refuses (buffers not taken are taken by the next call
  ///         that needs them, as after any refusal).
  void reserve_staging(std::size_t group_elements);

  /// @brief Global L2 norm and finiteness of the gradients (only `grad` is read).
  /// @throws logic_error for an unknown group, and as adam_optimizer::grad_norm.
  grad_norm_result grad_norm(std::span<const offload_group_step> groups, dtype grad_dtype,
                             float grad_scale = 1.0f);
  /// @brief One Adam step of every listed group (each at most once), pipelined over chunks.
  /// Returns false, changing nothing, when check_finite finds an inf or NaN (decided by a scan of
  /// all listed gradients before any state is read or written).
  /// @throws logic_error as adam_optimizer::step, before anything is written; io_error /
  ///         checksum_error from the store, naming the group, the chunk and its store tensor. Then
  ///         the step counter does not advance, and the chunks not yet written keep their
  ///         previous state. Chunks already updated keep their new state (a chunk whose write
  ///         failed keeps it in pinned memory until a later write lands), and are remembered:
  ///         calling step() again with the same groups, gradients and options finishes the step,
  ///         bitwise as if it had not failed. Until then checkpoint(), set_step_count() and set_lr()
  ///         refuse, and so does (logic_error, before anything is written; the step stays open) a
  ///         step() that lists other groups, a step() or step_part() with other grad or copy
  ///         dtypes, grad_scale or clip_coef, and finish_step(): none may mix another step in.
  bool step(std::span<const offload_group_step> groups, const adam_step_options& step_options = {});

  /// @brief One part of a step made over several calls, for a caller that cannot list every
  /// group at once (offload_engine stages a few layers at a time under a host budget): steps the
  /// listed groups as step step_count() + 1, exactly as step() would, but leaves the step open:
  /// the counter advances only at finish_step(), so every part sees the same step number. A chunk
  /// is stepped at most once per step: a chunk already updated in the open step (by an earlier
  /// part, or by a failed attempt of this one) is skipped, and its param_copy is not written
  /// again (the caller keeps what the first attempt wrote). So a caller retrying after an error
  /// may list a group again without updating it twice. check_finite scans only this part's
  /// gradients: scan all of them first (grad_norm) and pass grads_known_finite. While a step is
  /// open, checkpoint(), set_step_count() and set_lr() refuse; step() finishes it (listing the
  /// groups left). Every part has the step options (dtypes, grad_scale, clip_coef) of the first.
  /// @throws as step(); the step stays open with what was updated remembered (even when nothing
  ///         was), and the groups of the failed part must be stepped again (by a step_part(), or
  ///         the step() that ends the step) before the step may end. logic_error, before anything
  ///         is written, for other step options than the open step's, or after a failed step().
  bool step_part(std::span<const offload_group_step> groups,
                 const adam_step_options& step_options = {});
  /// @brief Ends the step that step_part() calls made: the step counter advances by one.
  /// @throws logic_error, changing nothing, while a failed part's groups are not wholly stepped,
  ///         or after a failed step() (which only step() with the same groups finishes).
  void finish_step();

  /// @brief Copies the group's current fp32 master weights into `out` (elements floats).
  /// @throws logic_error for an unknown group or a null `out`; io_error / checksum_error from the
  ///         store, out_of_memory when the pinned pool has no staging buffer (NVMe groups).
  void read_master(group_id group, float* out);

  /// @brief Writes all state (host-resident groups too) and the step counter to the store and
  /// commits a checkpoint (tensor_store::checkpoint).
  /// @returns the store's generation. @throws logic_error without a store or while a step is
  ///         unfinished (a failed one, or step_part() calls without finish_step()); io_error (the
  ///         last committed checkpoint stays).
  std::uint64_t checkpoint();

  std::int64_t step_count() const noexcept;
  /// @throws logic_error while a step is unfinished (see checkpoint()), or unless
  ///         0 <= step < INT64_MAX (as adam_optimizer::set_step_count).
  void set_step_count(std::int64_t step);
  /// @throws logic_error while a step is unfinished (see checkpoint()), or unless lr > 0.
  void set_lr(double lr);
  /// @throws logic_error for an unknown group (elements and on_nvme).
  std::size_t elements(group_id group) const;
  bool on_nvme(group_id group) const;
  offload_adam_stats stats() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace terrace
