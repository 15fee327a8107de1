// SPDX-License-Identifier: Apache-2.0
/// @file offload_engine.hpp
/// @brief Training beyond device memory, ZeRO-Offload / ZeRO-Infinity style, scheduled by
/// lifetimes: a layer-by-layer model's bf16 parameters and fp32 gradients are tier_manager
/// tensors (device / pinned host / NVMe), and its fp32 master weights and Adam moments live in an
/// offload_adam (host or NVMe).
///
/// One step:
///   forward   for each layer: acquire its bf16 params (prefetched ahead by the tier manager's
///             recorded schedule), run the layer on the compute stream, release;
///   backward  for each layer, last first: acquire params and the gradient (write), run, release,
///             and start copying the gradient home at once, giving its device block back
///             (tier_manager::offload: the next backward overwrites it);
///   optimizer global grad norm (clipping, optional), then the CPU Adam over every layer,
///             chunk-pipelined with NVMe; it writes the updated bf16 params straight into their
///             home copies (host_data(param, access::write)), from where the next forward's
///             prefetch takes them (host_modified drops the stale device copies). With
///             delayed_update it runs on its own thread beside the next step's forward instead.
///
/// The model is anything that implements layered_model (tools/train.hpp adapts the char-level
/// demo model). A fully resident configuration (budgets large enough) runs the same arithmetic in
/// the same order, so its losses are bitwise those of an offloaded one.
///
/// Persistence: checkpoint() puts the engine's own record (step, data cursor, seed) into the NVMe
/// store and commits it together with the optimizer's state in one store checkpoint. On resume the
/// bf16 params are regenerated from the fp32 masters: bf16(master) is exactly what the optimizer
/// wrote into them after its last step, so nothing else needs to be stored.
///
/// Every configuration error (a device budget too small for one layer's params + gradient +
/// activations, a host budget too small for one layer, a store too small for the state, pinned
/// memory refused) is raised by the constructor, before the first step.
///
/// A failed optimizer phase (an NVMe error in the CPU Adam, say) is finished, never dropped
/// half-done nor completed with another step's gradients: the engine keeps its gradients, and the
/// next step(), finish_update() or checkpoint() first runs the phase again with them, retrying
/// its I/O. The chunks and layers the failed attempt updated are not updated again, so the state
/// afterwards is bitwise that of a run without the error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "terrace/caching_allocator.hpp"
#include "terrace/config.hpp"
#include "terrace/device.hpp"
#include "terrace/offload_adam.hpp"
#include "terrace/tier_manager.hpp"

namespace terrace {

/// @brief What the engine needs from a model: layers of bf16 params with fp32 gradients of the
/// same element count, run one at a time on a stream. The model owns only its activations (on the
/// device, from the allocator it was made with); the engine owns params and gradients.
class layered_model {
 public:
  virtual ~layered_model() = default;
  virtual std::size_t layer_count() const = 0;
  /// A stable name: it names the layer's tensors in the NVMe store, so a resume finds them.
  virtual std::string layer_name(std::size_t layer) const = 0;
  virtual std::size_t layer_elements(std::size_t layer) const = 0;
  /// @brief The layer's fp32 initial values (layer_elements floats), deterministic.
  virtual void init_layer(std::size_t layer, float* out) const = 0;
  /// @brief The most device bytes the model's activations take at once, as the device allocator
  /// rounds them: with the largest layer's params and gradient it is what the device must hold.
  virtual std::size_t activation_bytes() const = 0;
  /// @brief Starts a batch (host memory, the model's own format).
  virtual void begin_batch(const void* batch) = 0;
  /// @brief Forward through `layer` (0, 1, ...): `params` is a device pointer valid on the stream.
  virtual void forward(std::size_t layer, const std::uint16_t* params) = 0;
  /// @brief The batch's loss; may block the host until it is known.
  virtual float loss() = 0;
  /// @brief Backward through `layer` (last .. 0): writes (not accumulates) the fp32 gradient.
  virtual void backward(std::size_t layer, const std::uint16_t* params, float* grad) = 0;
  /// @brief Seconds the host has spent, since the model was made, blocked on its stream before
  /// computing (on a host-computing backend: waiting for copies the stream was ordered after; 0
  /// where the device itself waits).
  virtual double wait_seconds() const = 0;
};

/// @brief Makes the model over the engine's device allocator (activations count against the
/// device) and compute stream. Called once, by the engine's constructor.
using layered_model_factory =
    std::function<std::unique_ptr<layered_model>(caching_allocator& activations, stream_ref compute)>;

struct offload_engine_options {
  // ---- the device
  /// Bytes of device memory the engine may use: params + gradients + the model's activations,
  /// plus the allocator's rounding. 0: the device's capacity.
  std::size_t device_budget = 0;
  /// Bytes of copies up that prefetch may have in flight (0: the tier manager's default).
  std::size_t prefetch_window = 0;
  /// The device allocator's settings (its trace recording included); the defaults here cut
  /// segments to size, so that tensors streaming through a small budget do not fragment it.
  allocator_config device_allocator = default_device_allocator();

  // ---- the host
  /// With an NVMe dir: bytes of pinned home copies of params and gradients; the rest waits on
  /// NVMe. 0: all of them in pinned memory.
  std::size_t host_budget = 0;
  /// With an NVMe dir: bytes of optimizer state (fp32 master + m + v) kept in host memory; the
  /// other layers' state lives on NVMe. SIZE_MAX: all of it on the host. Ignored without a dir.
  std::size_t optimizer_host_budget = SIZE_MAX;
  /// The most pinned bytes the engine's pools may hold (0: the host decides, RLIMIT_MEMLOCK).
  std::size_t pinned_limit = 0;

  // ---- NVMe
  /// The NVMe tier's directory (empty: no NVMe tier). It must exist. A fresh engine creates its
  /// tensor store in <nvme_dir>/store (refusing one that exists, and removing it again if setting
  /// up fails); a resuming one opens it.
  std::filesystem::path nvme_dir;
  /// Bytes the store is created with (0: what the configuration needs, see required_store_bytes).
  std::uint64_t store_capacity = 0;
  /// Leave room for checkpoints: a tensor rewritten after a checkpoint takes new space while the
  /// committed copy is kept until the next checkpoint commits, so the store needs twice the state.
  /// false: checkpoint() refuses (logic_error) unless store_capacity left that room anyway.
  bool checkpoints = true;
  /// Resume from the store's last checkpoint instead of initialising the model.
  bool resume = false;

  // ---- the optimizer
  offload_adam_options optimizer{};
  /// Clip the global gradient L2 norm to this (torch.nn.utils.clip_grad_norm_); 0: no clipping.
  /// Finite and >= 0 (the constructor refuses anything else).
  double clip_norm = 0.0;
  /// Skip a step whose gradients hold an inf or NaN (nothing is updated).
  bool skip_nonfinite = true;
  /// ZeRO-Offload's delayed parameter update: the optimizer phase of step t (grad norm + CPU
  /// Adam) runs on a thread of its own beside step t+1, which therefore still computes with the
  /// params before it; its params are published after the backward of t+1 (which first waits
  /// until it has copied the gradients out, since it overwrites them). So the update of step t
  /// uses gradients computed on the params of step t-1 (one step staler than without it). Costs
  /// 6 B of pageable host memory per param (a copy of the gradients and of the new bf16 params).
  /// checkpoint() and finish_update() complete the running update: the next step is then not
  /// delayed, and a resumed run continues bitwise. An update that failed is finished the same
  /// way, by the call after the one that reported it (see offload_engine::step).
  bool delayed_update = false;
  /// delayed_update: the optimizer steps taken undelayed first. Adam's first updates are close to
  /// sign steps of size lr, and one step stale they overshoot (the demo's loss went 4.17, 13.79,
  /// 9.44 over steps 3-5 at lr 3e-4); ZeRO-Offload likewise delays only after its first steps.
  /// A resumed run past it delays from its first step. At least 0 (the constructor refuses less).
  std::int64_t delayed_update_after = 0;
  /// Recorded in checkpoints; a resume with another seed is refused.
  std::uint64_t seed = 0;

  // ---- accounting
  /// The modelled copy bandwidth between host and device in bytes/s (the sim device's), used to
  /// turn bytes moved into transfer time for transfer_hidden; 0: unknown (hidden is then NaN).
  double copy_bandwidth = 0.0;

  /// @brief The allocator settings above: every request gets an exact-size segment (rounded to
  /// 4 KiB), never split, that goes back to the device whole, so a small budget does not fragment.
  static allocator_config default_device_allocator();
};

/// @brief What one step did. Byte counts are this step's; the tier split is device<->host (the
/// tier manager's copies) and host<->NVMe (its spills and reads plus the optimizer's state I/O).
struct offload_step_stats {
  /// The optimizer's step count after this step (delayed_update: once the update this step
  /// started is applied; one less should that update be skipped, which the next step reports).
  std::int64_t step = 0;
  float loss = 0;
  /// delayed_update: the fields about the update (skipped, grad_norm, optimizer_*) are those of
  /// the update that finished during this step (the previous step's), if any.
  bool skipped = false;             ///< gradients were not finite: nothing was updated
  double grad_norm = 0;             ///< global L2 norm before clipping
  double seconds = 0;               ///< wall time of the whole step (the training thread's)
  double forward_backward_seconds = 0;  ///< optimizer_wait_seconds not included
  double optimizer_seconds = 0;     ///< grad norm + CPU Adam (its NVMe I/O included)
  /// delayed_update: seconds the training thread waited for the update before backward; 0
  /// without delayed_update (the optimizer then runs on the training thread).
  double optimizer_wait_seconds = 0;
  std::int64_t host_to_device_bytes = 0;
  std::int64_t device_to_host_bytes = 0;
  std::int64_t nvme_read_bytes = 0;
  std::int64_t nvme_write_bytes = 0;
  /// Acquires of this step that found their tensor brought up ahead of use (tier_stats), and
  /// those that had to start their own copy up: after the step that records the schedule, a
  /// demand fetch is a copy that could not hide behind compute.
  std::int64_t prefetch_hits = 0;
  std::int64_t demand_fetches = 0;
  /// Seconds the host waited on the compute stream for copies (layered_model::wait_seconds).
  double exposed_transfer_seconds = 0;
  /// (host_to_device + device_to_host bytes) / copy_bandwidth: how long the copies occupy the
  /// one copy stream's link. 0 when the bandwidth is unknown.
  double transfer_seconds = 0;
  /// 1 - exposed / transfer_seconds, clamped to [0, 1]: the share of the copy time hidden behind
  /// compute. NaN when the bandwidth is unknown or nothing was copied.
  double transfer_hidden = 0;
  /// Seconds the optimizer waited for NVMe reads or staging buffers (offload_adam_stats).
  double optimizer_io_wait_seconds = 0;
};

/// @brief The engine's record in a checkpoint.
struct offload_engine_record {
  std::int64_t step = 0;            ///< optimizer steps taken
  std::uint64_t data_cursor = 0;    ///< the caller's position in its data (batches consumed)
  std::uint64_t seed = 0;
};

/// @brief Trains a layered_model with its state across device, pinned host memory and NVMe.
class offload_engine {
 public:
  /// @brief Sets up the tiers, the model (through `make_model`) and the optimizer, placing every
  /// layer's params, gradient and optimizer state (or resuming them from the store).
  /// @throws logic_error for bad options, before anything is written (a host budget without an
  ///         NVMe dir (an optimizer host budget is ignored then), a device budget above the
  ///         device's capacity, a clip_norm or copy_bandwidth that is negative or not finite, a
  ///         negative delayed_update_after, optimizer options offload_adam refuses, a resume
  ///         without a dir, a checkpoint whose seed or layers differ); out_of_memory, before any
  ///         step, when the device budget cannot hold one layer's params + gradient +
  ///         activations, when the host budget cannot hold one layer's params + gradient, when
  ///         the store is smaller than the state needs, or when pinned memory is refused;
  ///         io_error when the store cannot be created or opened (a full disk).
  offload_engine(device_backend& device, const layered_model_factory& make_model,
                 const offload_engine_options& options);
  ~offload_engine();
  offload_engine(const offload_engine&) = delete;
  offload_engine& operator=(const offload_engine&) = delete;

  /// @brief One training step over `batch` (passed to layered_model::begin_batch). If an
  /// optimizer phase failed earlier (update_failed()), it is finished first, with its own
  /// gradients; this step's stats then count its time and I/O (with delayed_update: it is the
  /// update this step reports, and this step is not delayed, as after finish_update()).
  /// @throws whatever the model, the tiers or the optimizer throw.
  ///         - From forward or backward: this step did not happen; the optimizer state is the
  ///           last completed step's.
  ///         - From the optimizer phase (grad norm, the CPU Adam and its NVMe I/O, writing the
  ///           params): update_failed() becomes true and the step's gradients are kept (the batch
  ///           is consumed: do not feed it again); the next step(), finish_update() or
  ///           checkpoint() finishes the phase with them before anything else. Until then the
  ///           optimizer state may be part way through this step (offload_adam::step).
  ///         - From finishing an earlier failed phase: that phase is still failed (state as
  ///           above) and nothing of this step ran.
  ///         With delayed_update the update thread's errors come out of the next step() (after
  ///         its forward, maybe its backward; its own update is then not started: feed its batch
  ///         again), finish_update() or checkpoint(), and it is that update which is finished
  ///         later.
  offload_step_stats step(const void* batch);

  /// @brief delayed_update: waits for the update the last step started and publishes its params
  /// (no-op without one). In any mode, finishes a failed optimizer phase (update_failed()) with
  /// its own gradients. Call it before reading the params, the optimizer's state or stats, or
  /// the tiers directly; the next step is then not delayed.
  /// @throws what the update threw (it is then finished by the next call, see step()).
  void finish_update();

  /// @brief Commits the engine's record (step, `data_cursor`, seed) and the optimizer's state to
  /// the NVMe store, atomically (one store checkpoint), after finish_update(): a failed optimizer
  /// phase is finished first, so what is committed is whole steps, never part of one.
  /// @returns the store's generation.
  /// @throws logic_error without an NVMe dir, or when the store has no room for checkpoints
  ///         (offload_engine_options::checkpoints), before anything is written; what
  ///         finish_update() throws (nothing is then
  ///         committed); io_error from the store.
  std::uint64_t checkpoint(std::uint64_t data_cursor);

  /// @brief True after an optimizer phase threw, until a step(), finish_update() or checkpoint()
  /// has finished it with its own gradients.
  bool update_failed() const noexcept;

  /// @brief The record this engine resumed from (nullopt for a fresh one).
  const std::optional<offload_engine_record>& resumed_from() const noexcept;
  /// @brief Optimizer steps taken (the resumed ones included); with delayed_update, not counting
  /// an update still running (finish_update).
  std::int64_t step_count() const noexcept;

  /// @brief Bytes of model state: bf16 params + fp32 grads + fp32 master + m + v.
  std::size_t state_bytes() const noexcept;
  std::size_t parameter_count() const noexcept;
  /// @brief The store capacity this configuration needs (0 without NVMe): the optimizer state
  /// placed on NVMe (all of it with `checkpoints`: a checkpoint writes the host-resident state
  /// too), every param and gradient if there is a host budget (any may spill), the record, each
  /// rounded to the store's 4 KiB extents; with `checkpoints` 2.125 times that (the committed
  /// copies are kept until the next commit, and holes form between them); plus two largest
  /// tensors (a replacing put takes its new extent before it frees the old one) and 1 MiB.
  std::uint64_t required_store_bytes() const noexcept;
  /// @brief The tier manager's device budget: device_budget minus activations and allocator slack.
  std::size_t tensor_device_budget() const noexcept;

  tier_manager& tiers() noexcept;
  offload_adam& optimizer() noexcept;
  caching_allocator& device_memory() noexcept;
  layered_model& model() noexcept;
  /// @brief The store, or nullptr without NVMe.
  tensor_store* store() noexcept;
  /// @brief Pinned bytes held by the engine's pools (home copies, staging, host-resident state).
  std::size_t pinned_bytes() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace terrace
