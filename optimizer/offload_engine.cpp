// SPDX-License-Identifier: Apache-2.0
// The offload training engine (include/terrace/offload_engine.hpp): a layered model's params and
// gradients as tier_manager tensors, its optimizer state in an offload_adam, one store for both.
//
// The optimizer phase has two shapes. With every home copy in pinned memory (no host budget) the
// CPU Adam reads the gradients and writes the bf16 params in place, over all layers in one step,
// so its NVMe pipeline runs over the whole model. Under a host budget a host_data() call may move
// another home copy to NVMe, invalidating a pointer obtained before it, so a batch of layers is
// staged (step_staged). Either way the update is elementwise and its scalars depend only on the
// step count, so an offloaded run's losses are bitwise those of a resident one.
//
// With delayed_update (ZeRO-Offload's delayed parameter update) the optimizer phase runs on a
// thread of its own, beside the next step's forward and backward:
//   step t:  forward (params W_{t-2})  | update t-1: copies the grads of t-1 out, then steps
//            wait until it has copied   |   them into W_{t-1} in next_params
//            backward (params W_{t-2})  |   (backward overwrites the gradients' home copies)
//            wait for update t-1, publish W_{t-1} into the param home copies (forward and
//            backward of a step use the same params)
//            start update t
// The update thread never holds a home copy's pointer: it copies the gradients out under the
// tier manager's lock (read_home), so a home copy the training thread's acquires move to NVMe
// (under a host budget) cannot change under it; it steps them in grads_copy, writes next_params,
// and the training thread publishes those while no update runs. Every wait is at a fixed point of
// the step, so the run is deterministic, and resident and offloaded runs still agree bit for bit.
//
// A failed optimizer phase is finished, never dropped half-done nor completed with another step's
// gradients: offload_adam remembers the chunks it updated and finishes a step only when called
// again with the same gradients, so the engine keeps them where they are (the gradients' home
// copies, which no backward overwrites before the retry, or grads_copy once the delayed update
// has copied them out) and the next step(), finish_update() or checkpoint() runs the phase again
// first (finish_failed_update). Under a host budget the phase is one offload_adam step made in
// parts (step_part per staged batch, finish_step at the end), and the layers already published
// are skipped on the retry, so no layer is updated twice and every part sees the same step.
#include "terrace/stats.hpp"
#include "terrace/offload_engine.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <string>
#include <vector>

#include "optimizer/half.hpp"
#include "terrace/error.hpp"
#include "terrace/pinned_pool.hpp"
#include "terrace/tensor_store.hpp"

namespace terrace {
namespace {

using clock_type = std::chrono::steady_clock;

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * kKiB;
// The store allocates extents in 4 KiB units (O_DIRECT alignment).
constexpr std::uint64_t kExtent = 4 * kKiB;
// The engine's record: one 4 KiB block (an O_DIRECT unit), magic + version + fields.
constexpr std::size_t kRecordBytes = 4 * kKiB;
constexpr std::uint64_t kRecordMagic = 0x3164726365727274ull;  // "trrecrd1", little endian
constexpr const char* kRecordName = "engine.record";

std::uint64_t round_up(std::uint64_t n, std::uint64_t unit) { return (n + unit - 1) / unit * unit; }


double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// The record's layout in its 4 KiB block. `layout` fingerprints the model (layer count and
// sizes), so that a resume against another model is refused instead of reading garbage.
struct record_block {
  std::uint64_t magic;
  std::uint64_t version;
  std::int64_t step;
  std::uint64_t data_cursor;
  std::uint64_t seed;
  std::uint64_t layout;
};

// The tensors forward or backward holds acquired, released on the compute stream when the step
// throws part way (the model's kernel, or an acquire refused for room): left acquired, a tensor
// stays pinned for good, and every later optimizer phase (host_data), offload and checkpoint
// refuses it, so that the engine could neither train nor checkpoint again.
class acquired_tensors {
 public:
  acquired_tensors(tier_manager& tm, stream_ref stream) : tm_(tm), stream_(stream) {}
  acquired_tensors(const acquired_tensors&) = delete;
  acquired_tensors& operator=(const acquired_tensors&) = delete;
  ~acquired_tensors() {
    for (tensor_id id : held_) {
      try {
        tm_.release(id, stream_);
      } catch (...) {  // the step's own error is the one reported
      }
    }
  }
  // No default: a parameter acquired for update is marked newer on the device, and each eviction
  // then copied it home though it never changed (86ab01f did that to every forward and backward).
  void* acquire(tensor_id id, access mode) {
    void* p = tm_.acquire(id, stream_, mode);
    held_.push_back(id);
    return p;
  }
  // Forgotten only once released: a release that throws (an event the device cannot record)
  // leaves the tensor acquired, and the destructor releases it again.
  void release(tensor_id id) {
    tm_.release(id, stream_);
    held_.erase(std::find(held_.begin(), held_.end(), id));
  }

 private:
  tier_manager& tm_;
  stream_ref stream_;
  std::vector<tensor_id> held_;
};

std::uint64_t fnv1a(std::uint64_t h, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

allocator_config offload_engine_options::default_device_allocator() {
  allocator_config c;
  // Tensors streaming through a budget of a few layers must not fragment it, so every request gets
  // a segment of its own size (rounded to 4 KiB), never split, and reused only for a request at
  // most 64 KiB smaller: a free gradient's 4 MiB is not whittled into a param's 2 MiB plus a hole,
  // and every free block is a whole segment that the allocator's release-and-retry can give back.
  // With PyTorch's defaults a 513 KiB tensor takes a slice of a 2 MiB small-pool segment and a
  // 5 MiB one a slice of a 20 MiB segment, which a small device cannot hand back while any slice
  // of it is live (measured: the demo ran out of a 32 MiB device with 7.8 MiB reserved but unused).
  c.small_size = 0;
  c.min_large_alloc = 1;
  c.large_round = 4 * kKiB;
  c.max_split_size = 1;
  c.large_segment_size = 64 * kKiB;
  return c;
}

// ------------------------------------------------------------------------------------- the books

struct offload_engine::impl {
  struct layer {
    std::string name;
    std::size_t elements = 0;
    tensor_id param = 0;
    tensor_id grad = 0;
    group_id group = 0;
    std::size_t delayed_at = 0;  // delayed_update: its offset in next_params and grads_copy
    // step_staged: this step's params are already in its home copy (a retry skips the layer).
    bool staged_done = false;
  };

  device_backend& device;
  offload_engine_options options;
  // Declaration order is teardown order reversed: the model's activations go back to the
  // allocator before it dies; the tier manager returns its blocks and buffers before the pools,
  // the allocator and the store it uses.
  caching_allocator memory;
  stream_ref compute{};
  std::optional<tensor_store> nvme;
  std::unique_ptr<pinned_host_pool> pinned;
  std::unique_ptr<tier_manager> tm;
  std::unique_ptr<offload_adam> adam;
  std::unique_ptr<layered_model> model;
  std::vector<layer> layers;
  std::size_t tensor_budget = 0;
  std::size_t params = 0;
  std::uint64_t store_bytes_needed = 0;
  std::optional<offload_engine_record> resumed;
  bool created_store = false;
  void* record_buffer = nullptr;  // a pinned 4 KiB block for the record's O_DIRECT I/O
  // Under a host budget: the optimizer's inputs and outputs for a batch of layers (step_staged).
  std::size_t stage_elements = 0;
  float* grad_stage = nullptr;
  std::uint16_t* param_stage = nullptr;

  // What one optimizer phase did (grad norm + CPU Adam).
  struct update_result {
    double grad_norm = 0;
    bool skipped = false;
    double seconds = 0;         // its wall time
    double grad_wait = 0;       // waiting for gradients to come home
    std::int64_t nvme_read = 0, nvme_write = 0;
    double io_wait = 0;
    // Counts another update's time and I/O with this one's (a failed phase finished first).
    void add_costs(const update_result& o) {
      seconds += o.seconds;
      grad_wait += o.grad_wait;
      nvme_read += o.nvme_read;
      nvme_write += o.nvme_write;
      io_wait += o.io_wait;
    }
  };
  // delayed_update: the bf16 params the running update writes (plain host memory, 2 B per
  // param: the home copies are published from here after the next backward; each layer at its
  // delayed_at), the update itself, and the optimizer's step count when it was last joined.
  std::vector<std::uint16_t> next_params;
  std::vector<float> grads_copy;       // the gradients it steps from (same offsets)
  std::future<void> grads_copied;      // ready once grads_copy is filled
  std::future<update_result> pending;
  std::int64_t completed_steps = 0;
  // delayed_update: grads_copy holds the gradients of the update last started (set by the update
  // thread once it has copied them; read after joining it).
  bool grads_in_copy = false;

  // An optimizer phase that threw, waiting to be finished with its own gradients
  // (finish_failed_update): `update` when grad norm or the CPU Adam (non-delayed: or writing
  // the params) failed, `publish` when only publishing a delayed update's params is left.
  enum class failed_phase { none, update, publish };
  failed_phase failed = failed_phase::none;

  // Whether the step about to run delays its update: delayed_update, once delayed_update_after
  // optimizer steps have been taken undelayed. completed_steps moves only when an update
  // succeeds, so for a failed phase this still says whether it was a delayed update's.
  bool delays_update() const {
    return options.delayed_update && completed_steps >= options.delayed_update_after;
  }

  impl(device_backend& d, const offload_engine_options& o)
      : device(d), options(o), memory(d, o.device_allocator) {}

  ~impl() {
    // A delayed update still running uses the tier manager and the optimizer.
    if (pending.valid()) pending.wait();
    // The model first: its activations are blocks of `memory`, freed on the compute stream.
    model.reset();
    adam.reset();
    tm.reset();
    if (record_buffer != nullptr) pinned->deallocate(record_buffer);
    if (grad_stage != nullptr) pinned->deallocate(grad_stage);
    if (param_stage != nullptr) pinned->deallocate(param_stage);
    if (compute.native != nullptr) {
      try {
        device.synchronize(compute);
      } catch (...) {
        // An error of the stream was reported by the step that caused it.
      }
    }
    if (compute.native != nullptr) device.destroy_stream(compute);
  }

  std::uint64_t layout_fingerprint() const {
    std::uint64_t h = 0xcbf29ce484222325ull;
    h = fnv1a(h, layers.size());
    for (const layer& l : layers) h = fnv1a(h, l.elements);
    return h;
  }

  std::size_t state_per_element() const {
    // bf16 param + fp32 grad + fp32 master + m + v (m and v in the optimizer's state dtype).
    return 2 + 4 + 4 + 2 * size_of(options.optimizer.adam.state_dtype);
  }

  // ---------------------------------------------------------------- checks before training

  void check_device_budget() {
    const std::size_t capacity = device.properties().capacity;
    if (options.device_budget == 0) options.device_budget = capacity;
    TERRACE_EXPECTS(options.device_budget <= capacity,
                    "offload engine: device budget " + human_bytes(options.device_budget) +
                        " exceeds the device's capacity (" + human_bytes(capacity) + ")");
    const std::size_t activations = model->activation_bytes();
    // Slack for the allocator: a block reused for a request up to large_segment_size smaller
    // (with the default allocator settings), rounding, and the small pool's segments if a caller's
    // settings have one.
    const std::size_t small_pool = options.device_allocator.small_size > 0
                                       ? 2 * options.device_allocator.small_segment_size
                                       : 0;
    const std::size_t slack = kMiB + small_pool + options.device_budget / 32;
    std::size_t worst = 0;
    const layer* worst_layer = &layers.front();
    for (const layer& l : layers) {
      const std::size_t need = l.elements * 6;
      if (need > worst) {
        worst = need;
        worst_layer = &l;
      }
    }
    const std::size_t fixed = activations + slack;
    if (options.device_budget < fixed + worst) {
      throw out_of_memory(
          "terrace: offload engine: the device budget of " + human_bytes(options.device_budget) +
          " cannot hold one layer: '" + worst_layer->name + "' needs " +
          human_bytes(worst_layer->elements * 2) + " of bf16 params + " +
          human_bytes(worst_layer->elements * 4) + " of fp32 gradient, and the model's " +
          "activations take " + human_bytes(activations) + " plus " + human_bytes(slack) +
          " of allocator slack: at least " + human_bytes(fixed + worst) + " are needed");
    }
    tensor_budget = options.device_budget - fixed;
  }

  // Every tensor on the device keeps its home copy in pinned memory (it is where an eviction
  // writes it back), so the host budget must cover the device's tensors plus the layer the
  // optimizer is stepping.
  void check_host_budget() {
    if (options.host_budget == 0) return;
    std::size_t worst = 0;
    const layer* worst_layer = &layers.front();
    for (const layer& l : layers) {
      if (l.elements * 6 > worst) {
        worst = l.elements * 6;
        worst_layer = &l;
      }
    }
    if (options.host_budget < tensor_budget + worst) {
      throw out_of_memory(
          "terrace: offload engine: the host budget of " + human_bytes(options.host_budget) +
          " is too small: it must hold the home copies of everything on the device (" +
          human_bytes(tensor_budget) + ") and one more layer for the optimizer ('" +
          worst_layer->name + "': " + human_bytes(worst_layer->elements * 2) +
          " of bf16 params + " + human_bytes(worst_layer->elements * 4) +
          " of fp32 gradient): at least " + human_bytes(tensor_budget + worst));
    }
  }

  // Bytes of the optimizer state that will live on NVMe (`all`: of every group, as a checkpoint
  // writes the host-resident groups too), in the store's chunks; which groups go there is
  // offload_adam's own placement (optimizer_state_on_nvme).
  std::uint64_t optimizer_store_bytes(bool all) const {
    const std::size_t per = 4 + 2 * size_of(options.optimizer.adam.state_dtype);
    const std::size_t chunk = options.optimizer.chunk_elements;
    const std::vector<bool> nvme_state = optimizer_state_on_nvme();
    std::uint64_t in_store = 0;
    for (const layer& l : layers) {
      if (!nvme_state[static_cast<std::size_t>(&l - layers.data())] && !all) continue;
      // One store tensor per chunk of master, m and v, each rounded to whole extents.
      for (std::size_t first = 0; first < l.elements; first += chunk) {
        const std::size_t n = std::min(chunk, l.elements - first);
        in_store += round_up(std::uint64_t{n} * per, kExtent);
      }
    }
    return in_store;
  }

  // Per layer, whether offload_adam will keep its optimizer state on NVMe (given a store), by
  // its own rule.
  std::vector<bool> optimizer_state_on_nvme() const {
    std::vector<std::size_t> elements;
    for (const layer& l : layers) elements.push_back(l.elements);
    return offload_adam::nvme_placement(optimizer_options(), elements);
  }

  std::uint64_t compute_store_bytes() const { return compute_store_bytes(options.checkpoints); }

  std::uint64_t compute_store_bytes(bool checkpoints) const {
    if (options.nvme_dir.empty()) return 0;
    // A checkpoint writes the host-resident optimizer state too.
    std::uint64_t state = optimizer_store_bytes(checkpoints) + kRecordBytes;
    std::uint64_t largest = kRecordBytes;
    if (options.host_budget != 0) {
      // Any param or gradient may be moved to NVMe to make room in the host budget.
      for (const layer& l : layers) {
        state += round_up(l.elements * 2, kExtent) + round_up(l.elements * 4, kExtent);
        largest = std::max<std::uint64_t>(largest, round_up(l.elements * 4, kExtent));
      }
    }
    const std::size_t per = 4 + 2 * size_of(options.optimizer.adam.state_dtype);
    largest = std::max<std::uint64_t>(
        largest, round_up(std::uint64_t{options.optimizer.chunk_elements} * per, kExtent));
    // A replacing put takes its new extent before it frees the old one: two largest tensors of
    // room. Checkpoints: a tensor replaced after a commit keeps its committed extent until the
    // next commit, so twice the state, and an eighth more for the holes that chunks of several
    // sizes leave between held extents (measured: the demo's store of 2 x state + one chunk ran
    // out with 13 MiB free in holes of at most 3 MiB, for a 6 MiB chunk). The optimizer's
    // step-counter record and the store's bookkeeping: 1 MiB covers them.
    const std::uint64_t room = 2 * largest + kMiB;
    return checkpoints ? 2 * state + state / 8 + room : state + room;
  }

  // ---------------------------------------------------------------- setup

  // The store lives in <nvme_dir>/store, a folder the engine creates on a fresh run: if setting
  // up fails after that, removing the folder leaves the directory as it was.
  std::filesystem::path store_dir() const { return options.nvme_dir / "store"; }

  void open_store() {
    if (options.nvme_dir.empty()) {
      TERRACE_EXPECTS(!options.resume, "offload engine: resume needs an NVMe dir");
      TERRACE_EXPECTS(options.host_budget == 0,
                      "offload engine: a host budget needs an NVMe dir to put the rest in");
      return;
    }
    store_bytes_needed = compute_store_bytes();
    tensor_store_options so;
    if (options.resume) {
      nvme.emplace(tensor_store::open(store_dir(), so));
    } else {
      so.capacity = options.store_capacity != 0 ? options.store_capacity : store_bytes_needed;
      if (so.capacity < store_bytes_needed) {
        throw out_of_memory(
            "terrace: offload engine: the NVMe store of " + human_bytes(so.capacity) + " in " +
            options.nvme_dir.string() + " cannot hold the state: it needs " +
            human_bytes(store_bytes_needed) + " (" +
            human_bytes(optimizer_store_bytes(options.checkpoints)) + " of optimizer state" +
            (options.host_budget != 0 ? std::string(", every param and gradient") : "") +
            (options.checkpoints ? ", twice over for checkpoints" : "") + ")");
      }
      std::error_code ec;
      if (!std::filesystem::create_directory(store_dir(), ec)) {
        throw io_error("terrace: offload engine: cannot start a fresh store in " +
                           store_dir().string() + ": " +
                           (ec ? ec.message() : std::string("it exists (resume from it, or remove it)")),
                       ec.value());
      }
      created_store = true;
      try {
        nvme.emplace(tensor_store::create(store_dir(), so));
      } catch (const io_error& e) {
        throw io_error("terrace: offload engine: cannot create the NVMe store of " +
                           human_bytes(so.capacity) + " in " + store_dir().string() + ": " +
                           e.what(),
                       e.code());
      }
    }
    if (nvme->capacity() < store_bytes_needed) {
      throw out_of_memory("terrace: offload engine: the NVMe store in " + store_dir().string() +
                          " holds " + human_bytes(nvme->capacity()) +
                          " but this configuration needs " + human_bytes(store_bytes_needed));
    }
  }

  // Undoes a fresh store after a failed setup: nothing is left that a later run would mistake
  // for a checkpoint.
  void discard_created_store() noexcept {
    if (!created_store) return;
    adam.reset();
    tm.reset();
    nvme.reset();
    std::error_code ec;
    std::filesystem::remove_all(store_dir(), ec);
  }

  // Runs `fn`, saying what was being placed when memory (pinned buffers, the store) refused.
  template <class F>
  auto placing(const std::string& what, F&& fn) -> decltype(fn()) {
    try {
      return fn();
    } catch (const out_of_memory& e) {
      throw out_of_memory("terrace: offload engine: cannot place " + what + " before training (" +
                          human_bytes(static_cast<std::uint64_t>(
                              pinned->stats().reserved_bytes.current)) +
                          " pinned so far" +
                          (options.pinned_limit != 0
                               ? ", pinned limit " + human_bytes(options.pinned_limit)
                               : std::string()) +
                          "): " + e.what());
    }
  }

  void read_record() {
    if (!nvme->contains(kRecordName)) {
      throw io_error("terrace: offload engine: " + store_dir().string() +
                     " holds no checkpoint of the engine (no '" + kRecordName + "')");
    }
    nvme->get(kRecordName, record_buffer, kRecordBytes).wait();
    record_block r{};
    std::memcpy(&r, record_buffer, sizeof r);
    if (r.magic != kRecordMagic || r.version != 1) {
      throw io_error("terrace: offload engine: the record in " + options.nvme_dir.string() +
                     " is not an engine record of this version");
    }
    if (r.layout != layout_fingerprint()) {
      throw logic_error("terrace: offload engine: the checkpoint in " +
                        options.nvme_dir.string() +
                        " was made for another model (its layers differ from this one's)");
    }
    if (r.seed != options.seed) {
      throw logic_error("terrace: offload engine: the checkpoint in " +
                        options.nvme_dir.string() + " was made with seed " +
                        std::to_string(r.seed) + ", not " + std::to_string(options.seed));
    }
    resumed = offload_engine_record{r.step, r.data_cursor, r.seed};
  }

  // Bad option values, refused before anything is made or written: the optimizer's as its
  // constructor would (a fresh store would otherwise be created first, only to be removed), and
  // the engine's own: a clip_norm or delayed_update_after out of range would train silently as
  // if it were 0.
  void check_options() const {
    offload_adam::check_options(optimizer_options(), !options.nvme_dir.empty());
    TERRACE_EXPECTS(std::isfinite(options.clip_norm) && options.clip_norm >= 0,
                    "offload engine: clip_norm must be finite and >= 0 (0: no clipping), got " +
                        std::to_string(options.clip_norm));
    TERRACE_EXPECTS(options.delayed_update_after >= 0,
                    "offload engine: delayed_update_after must be >= 0, got " +
                        std::to_string(options.delayed_update_after));
    TERRACE_EXPECTS(std::isfinite(options.copy_bandwidth) && options.copy_bandwidth >= 0,
                    "offload engine: copy_bandwidth must be finite and >= 0 (0: unknown), got " +
                        std::to_string(options.copy_bandwidth));
  }

  // The optimizer's options as the engine makes it: a host budget only with a store.
  offload_adam_options optimizer_options() const {
    offload_adam_options ao = options.optimizer;
    ao.host_state_budget = options.nvme_dir.empty() ? 0 : options.optimizer_host_budget;
    return ao;
  }

  void setup(const layered_model_factory& make_model) {
    check_options();
    compute = device.create_stream();
    model = make_model(memory, compute);
    TERRACE_EXPECTS(model != nullptr && model->layer_count() > 0,
                    "offload engine: the model has no layers");
    for (std::size_t i = 0; i < model->layer_count(); ++i) {
      layer l;
      l.name = model->layer_name(i);
      l.elements = model->layer_elements(i);
      TERRACE_EXPECTS(l.elements > 0, "offload engine: layer '" + l.name + "' has no elements");
      params += l.elements;
      layers.push_back(std::move(l));
    }
    check_device_budget();
    check_host_budget();
    check_pinned_limit();
    open_store();
    try {
      place();
    } catch (...) {
      discard_created_store();
      throw;
    }
  }

  // The home copies of params and gradients that stay in pinned memory must fit the pinned
  // limit; checked before the store is created (the optimizer's own buffers come on top and are
  // checked as they are placed).
  void check_pinned_limit() const {
    if (options.pinned_limit == 0) return;
    std::size_t home = 0;
    for (const layer& l : layers) {
      home += round_up(l.elements * 2, kExtent) + round_up(l.elements * 4, kExtent);
    }
    if (options.host_budget != 0) home = std::min(home, options.host_budget);
    if (options.pinned_limit < home + kRecordBytes) {
      throw out_of_memory(
          "terrace: offload engine: cannot place the home copies of params and gradients before "
          "training: they need " + human_bytes(home) + " of pinned host memory, above the pinned "
          "limit of " + human_bytes(options.pinned_limit) +
          " (raise the limit, or set a host budget with an NVMe dir)");
    }
  }

  // The pools, the tier manager and the optimizer, then every layer's state in them.
  void place() {
    pinned_pool_options po;
    po.capacity = options.pinned_limit;
    // Regions of 64 MiB: large enough to amortise locking, small enough not to pin much more
    // than a small configuration uses.
    po.region_size = 64 * kMiB;
    pinned = std::make_unique<pinned_host_pool>(device, po);
    record_buffer = placing("the engine's record", [&] { return pinned->allocate(kRecordBytes); });
    if (options.host_budget != 0) {
      // The staging holds at least the largest layer, at most 4 Mi elements (24 MiB): a batch
      // that large already keeps the optimizer's pipeline busy.
      std::size_t largest = 0;
      for (const layer& l : layers) largest = std::max(largest, l.elements);
      stage_elements = std::max(largest, std::min(params, std::size_t{1} << 22));
      grad_stage = static_cast<float*>(placing("the optimizer's gradient staging", [&] {
        return pinned->allocate(stage_elements * 4);
      }));
      param_stage = static_cast<std::uint16_t*>(placing("the optimizer's param staging", [&] {
        return pinned->allocate(stage_elements * 2);
      }));
    }

    tier_manager_options to;
    to.device_budget = tensor_budget;
    to.prefetch_window = options.prefetch_window;
    to.host_budget = options.host_budget;
    // A budget above the pinned limit never binds (check_pinned_limit: the home copies it would
    // admit fit under the limit); the tier manager takes at most its pool's capacity.
    if (options.pinned_limit != 0) to.host_budget = std::min(to.host_budget, options.pinned_limit);
    // The optimizer step replaces every bf16 param's home copy (host_data(param, access::write)
    // drops its device copy): a prefetch that wrapped from the end of backward into the next
    // forward's params would copy up what is thrown away. step() restarts prefetch right after the
    // optimizer instead (begin_iteration).
    to.prefetch_across_iterations = false;
    tm = std::make_unique<tier_manager>(device, memory, *pinned, to, nvme ? &*nvme : nullptr);

    adam = std::make_unique<offload_adam>(optimizer_options(), *pinned, nvme ? &*nvme : nullptr);

    // The optimizer's NVMe staging, made now for the largest group that goes to NVMe, ahead of
    // every layer's buffers. Left to grow as the groups are added, each growth freed the smaller
    // buffers after the tier manager had placed a layer's home copies behind them, and their
    // hole, too small for the larger buffers, stayed stranded: `terrace train --pinned-limit
    // 22MiB` was refused with 4.5 MiB free, none of it in one piece of 3 MiB. The first step
    // makes the staging this large anyway: only the order changes, not the pinned bytes.
    if (nvme) {
      const std::vector<bool> nvme_state = optimizer_state_on_nvme();
      std::size_t largest = 0;
      for (std::size_t i = 0; i < layers.size(); ++i)
        if (nvme_state[i]) largest = std::max(largest, layers[i].elements);
      if (largest != 0) {
        placing("the optimizer's NVMe staging", [&] { adam->reserve_staging(largest); });
      }
    }

    if (options.resume) read_record();

    std::vector<float> master;
    std::vector<std::uint16_t> bf16;
    for (layer& l : layers) {
      master.resize(l.elements);
      bf16.resize(l.elements);
      if (options.resume) {
        l.group = placing("the optimizer state of '" + l.name + "'",
                          [&] { return adam->add(l.name, l.elements); });
        adam->read_master(l.group, master.data());
      } else {
        model->init_layer(static_cast<std::size_t>(&l - layers.data()), master.data());
        l.group = placing("the optimizer state of '" + l.name + "'",
                          [&] { return adam->add(l.name, l.elements, master.data()); });
      }
      // bf16(master), rounded to nearest even exactly as the optimizer's param copies are: the
      // forward of a resumed step sees the same bits as the uninterrupted run's.
      for (std::size_t i = 0; i < l.elements; ++i) bf16[i] = detail::float_to_bf16(master[i]);
      l.param = placing("the bf16 params of '" + l.name + "'", [&] {
        return tm->add("param/" + l.name, l.elements * 2, bf16.data());
      });
      // Gradients are written by backward before anything reads them: no initial contents.
      l.grad = placing("the gradient of '" + l.name + "'",
                       [&] { return tm->add("grad/" + l.name, l.elements * 4); });
    }
    if (resumed) adam->set_step_count(resumed->step);
    completed_steps = adam->step_count();
    if (options.delayed_update) {
      std::size_t at = 0;
      for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
        it->delayed_at = at;
        at += it->elements;
      }
      next_params.resize(at);
      grads_copy.resize(at);
    }
  }

  // ---------------------------------------------------------------- one step

  // Where the optimizer reads a layer's gradients: their home copy, or (delayed_update) the copy
  // the running update made of it.
  const void* gradients_of(const layer& l, bool delayed) {
    return delayed ? static_cast<const void*>(grads_copy.data() + l.delayed_at) : tm->host_data(l.grad);
  }

  // Global gradient norm and finiteness, one layer at a time (the same summation whatever the
  // budgets, so resident and offloaded runs agree bit for bit). Returns the seconds spent waiting
  // for gradients to come home.
  double grad_norm(double& norm, bool& finite, bool delayed) {
    double sum = 0, waited = 0;
    finite = true;
    for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
      const auto t = clock_type::now();
      const void* g = gradients_of(*it, delayed);
      waited += seconds_since(t);
      const offload_group_step s{it->group, g, nullptr};
      const grad_norm_result r = adam->grad_norm({&s, 1}, dtype::f32);
      if (!r.finite) finite = false;
      sum += r.norm * r.norm;
    }
    norm = std::sqrt(sum);
    return waited;
  }

  // Everything in pinned memory (no host budget): the optimizer reads the gradients and writes
  // the bf16 params straight in their home copies, all layers in one step, so its NVMe pipeline
  // runs over the whole model. Nothing can move a home copy out meanwhile. With delayed_update
  // (any host budget) it touches no home copy: the gradients come from grads_copy and the bf16
  // params go to next_params, published later.
  double step_in_place(const adam_step_options& so, bool delayed) {
    double waited = 0;
    std::vector<offload_group_step> groups;
    // Last layer first: its gradient was copied home first.
    for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
      const auto t = clock_type::now();
      void* p = delayed ? next_params.data() + it->delayed_at : tm->host_data(it->param, access::write);
      const void* g = gradients_of(*it, delayed);
      waited += seconds_since(t);
      groups.push_back({it->group, g, p});
    }
    // host_data(access::write) already counted the home copies as modified and dropped the stale
    // device copies: the next forward fetches what this step writes.
    adam->step(groups, so);
    return waited;
  }

  // The optimizer phase: global grad norm (clipping, inf/NaN), then the CPU Adam. Touches only
  // the optimizer and the tier manager's home copies, so it may run on another thread
  // (delayed_update) while the training thread runs the next forward.
  // delayed_update: `copy_grads` copies the gradients out of their home copies first (a retry
  // whose gradients are in grads_copy already does not), and `copied`, if any, is told then.
  update_result run_update(bool delayed, std::promise<void>* copied = nullptr,
                           bool copy_grads = true) {
    const auto start = clock_type::now();
    const offload_adam_stats before = adam->stats();
    update_result u;
    if (delayed && copy_grads) {
      const auto t = clock_type::now();
      for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
        tm->read_home(it->grad, grads_copy.data() + it->delayed_at);
      }
      u.grad_wait += seconds_since(t);
      grads_in_copy = true;
    }
    if (copied != nullptr) copied->set_value();
    adam_step_options so;
    so.grad_dtype = dtype::f32;
    so.copy_dtype = dtype::bf16;
    bool finite = true;
    if (options.clip_norm > 0 || options.skip_nonfinite) {
      u.grad_wait += grad_norm(u.grad_norm, finite, delayed);
      so.grads_known_finite = finite;
      if (options.clip_norm > 0) so.clip_coef = clip_coefficient(u.grad_norm, options.clip_norm);
    }
    if (finite || !options.skip_nonfinite) {
      // delayed: the tier manager is not touched (grads_copy in, next_params out).
      u.grad_wait += delayed || options.host_budget == 0 ? step_in_place(so, delayed) : step_staged(so);
    } else {
      u.skipped = true;
    }
    const offload_adam_stats after = adam->stats();
    u.nvme_read = after.nvme_read_bytes - before.nvme_read_bytes;
    u.nvme_write = after.nvme_write_bytes - before.nvme_write_bytes;
    u.io_wait = after.io_wait_seconds - before.io_wait_seconds;
    u.seconds = seconds_since(start);
    return u;
  }

  // delayed_update: waits for the running update (rethrowing what it threw, which leaves it to
  // finish_failed_update); false if none.
  bool join_update(update_result& u) {
    if (grads_copied.valid()) grads_copied = {};
    if (!pending.valid()) return false;
    try {
      u = pending.get();
    } catch (...) {
      failed = failed_phase::update;
      throw;
    }
    completed_steps = adam->step_count();
    return true;
  }

  // delayed_update: waits until the running update has copied the gradients out (backward is
  // about to overwrite their home copies). An update that failed before that is joined, so that
  // its own error comes out.
  void wait_grads_copied() {
    if (!grads_copied.valid()) return;
    try {
      grads_copied.get();
    } catch (...) {
      update_result u;
      join_update(u);  // throws the update's error
      throw;
    }
  }

  // delayed_update: the joined update's params become the home copies (dropping stale device
  // copies), where the next forward's prefetch takes them. Nothing to publish for a skipped one.
  // A host_data() that fails (making room under a host budget) leaves the rest to
  // finish_failed_update, which publishes all of them again from next_params.
  void publish(const update_result& u) {
    if (u.skipped) return;
    try {
      for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
        std::memcpy(tm->host_data(it->param, access::write), next_params.data() + it->delayed_at,
                    it->elements * 2);
      }
    } catch (...) {
      failed = failed_phase::publish;
      throw;
    }
  }

  // Finishes the optimizer phase that threw, with its own gradients: they are still in their
  // home copies (nothing has run backward since: step() finishes it before its forward, and a
  // delayed update's copy fails before the backward that waits for it), or, once a delayed
  // update copied them, in grads_copy. offload_adam skips the chunks the failed attempt
  // updated, step_staged the layers it published; a delayed update's params go out as after any
  // update. Throws again if it fails again, leaving it failed (and the state consistent).
  // REQUIRES: failed != none; no update running (a failure is only known once it is joined).
  update_result finish_failed_update() {
    update_result u;
    const bool delayed = delays_update();  // as when the phase failed
    if (failed == failed_phase::update) {
      u = run_update(delayed, nullptr, /*copy_grads=*/!grads_in_copy);
      completed_steps = adam->step_count();
    }
    if (delayed) publish(u);
    failed = failed_phase::none;
    return u;
  }

  void finish_update() {
    if (failed != failed_phase::none) {
      finish_failed_update();
    } else {
      update_result u;
      if (!join_update(u)) return;
      publish(u);
    }
    start_next_iteration();  // prefetch the params just published
  }

  // Runs work that is only ahead of need, after the update: its failure (a copy or a reserve the
  // device refuses) is not the caller's. Thrown, it would fail a step or an update that has
  // happened, and a caller feeds a failed step's batch again: the update applied twice. What
  // needs the work later does it on demand and reports an error that persists. Anything else (a
  // logic error) is a defect and is not hidden.
  template <class Work>
  static void ahead_of_need(Work&& work) {
    try {
      work();
    } catch (const device_error&) {
    } catch (const out_of_memory&) {
    }
  }

  // Restarts the schedule once the params' home copies are final, prefetching the next forward's
  // first params (a failed prefetch leaves them to the forward's demand fetches).
  void start_next_iteration() {
    ahead_of_need([&] { tm->begin_iteration(); });
  }

  // Ends the device allocator's iteration and begins the next. Under the planned policy that is
  // where a repeated iteration's plan is made and its arena reserved; without the plan the caching
  // allocator serves.
  void mark_device_iteration() {
    ahead_of_need([&] { memory.end_iteration(); });
    ahead_of_need([&] { memory.begin_iteration(); });
  }

  // Under a host budget a host_data() call may move another home copy to NVMe, invalidating a
  // pointer obtained before it. So the gradients of a batch of layers are copied out into staging
  // buffers one by one, the batch is stepped there, and the bf16 params are copied into their
  // home copies one by one, each right after its host_data(). The batches are parts of one
  // offload_adam step (step_part, then finish_step), so every one sees the same step number, and
  // the update is elementwise, so the batching changes no bit of the result.
  // After a failure the same call finishes the step: layers already published are skipped, and
  // the batches are cut as before (from the layer sizes alone), so a layer the failed attempt
  // half-stepped sits at the same offsets, where param_stage (written only here) still holds the
  // params of its updated chunks (offload_adam does not write them again).
  double step_staged(const adam_step_options& so) {
    double waited = 0;
    std::size_t i = layers.size();
    while (i > 0) {
      std::size_t first = i, elements = 0;
      while (first > 0 && (first == i || elements + layers[first - 1].elements <= stage_elements)) {
        elements += layers[--first].elements;
      }
      std::vector<offload_group_step> groups;
      std::size_t at = 0;
      for (std::size_t k = i; k-- > first;) {
        const layer& l = layers[k];
        if (!l.staged_done) {
          const auto t = clock_type::now();
          const void* g = tm->host_data(l.grad);
          waited += seconds_since(t);
          std::memcpy(grad_stage + at, g, l.elements * 4);
          groups.push_back({l.group, grad_stage + at, param_stage + at});
        }
        at += l.elements;
      }
      if (!groups.empty()) adam->step_part(groups, so);
      at = 0;
      for (std::size_t k = i; k-- > first;) {
        layer& l = layers[k];
        if (!l.staged_done) {
          std::memcpy(tm->host_data(l.param, access::write), param_stage + at, l.elements * 2);
          l.staged_done = true;
        }
        at += l.elements;
      }
      i = first;
    }
    adam->finish_step();
    for (layer& l : layers) l.staged_done = false;
    return waited;
  }

  offload_step_stats step(const void* batch) {
    TERRACE_EXPECTS(batch != nullptr, "offload engine: step of a null batch");
    offload_step_stats s;
    const auto start = clock_type::now();
    const tier_stats tiers_before = tm->stats();
    const double wait_before = model->wait_seconds();
    // A failed optimizer phase first, with its own gradients (this step's backward would overwrite
    // them); if it fails again, nothing of this step has run.
    update_result retried;
    const bool finished_failed = failed != failed_phase::none;
    if (finished_failed) retried = finish_failed_update();
    const bool delayed = delays_update();
    const auto forward_start = clock_type::now();

    // The first step's acquires are recorded as the schedule (the call after its optimizer step
    // ends the recording); later this restarts the schedule, which that call already did unless
    // the previous step threw before reaching it. A first step that throws before its backward
    // is through drops its partial recording, and the next step records the whole iteration.
    struct abandon_unless_through {
      tier_manager& tm;
      bool through = false;
      ~abandon_unless_through() {
        if (through) return;
        try {
          tm.abandon_iteration();
        } catch (...) {  // a failed lock: the recording is kept, which only costs prefetches
        }
      }
    } iteration{*tm};
    tm->begin_iteration();
    model->begin_batch(batch);
    acquired_tensors held(*tm, compute);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const auto* p = static_cast<const std::uint16_t*>(held.acquire(layers[i].param, access::read));
      model->forward(i, p);
      held.release(layers[i].param);
    }
    s.loss = model->loss();
    // delayed_update: the last step's update runs beside this step; backward overwrites the
    // gradients' home copies, so it must have copied them out by now.
    if (grads_copied.valid()) {
      const auto copy_wait = clock_type::now();
      wait_grads_copied();
      s.optimizer_wait_seconds = seconds_since(copy_wait);
    }
    for (std::size_t i = layers.size(); i-- > 0;) {
      const auto* p = static_cast<const std::uint16_t*>(held.acquire(layers[i].param, access::read));
      auto* g = static_cast<float*>(held.acquire(layers[i].grad, access::write));
      // The gradient's block may have held a tensor whose copy down (flush) or copy up is still
      // queued: acquire(write) has ordered `compute` after exactly those copies (the tier
      // manager's fences), so the prefetches queued since stay hidden behind this backward.
      model->backward(i, p, g);
      held.release(layers[i].param);
      held.release(layers[i].grad);
      // Home while the layers below run their backward; its device block is free at once, since
      // the next backward overwrites the gradient (cached, it would outlive the step).
      tm->offload(layers[i].grad);
    }
    iteration.through = true;
    s.forward_backward_seconds = seconds_since(forward_start) - s.optimizer_wait_seconds;
    s.exposed_transfer_seconds = model->wait_seconds() - wait_before;

    update_result u;
    if (delayed) {
      // This step reports the update that finished during it (the failed one it finished first,
      // if any: no other was running), publishes its params, and starts its own update.
      if (finished_failed) {
        u = retried;
        s.optimizer_wait_seconds += retried.seconds;
      }
      const auto join_start = clock_type::now();
      if (join_update(u)) publish(u);
      s.optimizer_wait_seconds += seconds_since(join_start);
      std::promise<void> copied;
      grads_copied = copied.get_future();
      grads_in_copy = false;
      // No thread for the update (std::system_error): it is this step's failed update, which the
      // next call finishes from the gradients' home copies; otherwise it would be lost, unseen.
      struct unstarted_update {
        impl* engine;
        bool started = false;
        ~unstarted_update() {
          if (started) return;
          engine->grads_copied = {};
          engine->failed = failed_phase::update;
        }
      } start{this};
      pending = std::async(std::launch::async, [this, c = std::move(copied)]() mutable {
        try {
          return run_update(/*delayed=*/true, &c);
        } catch (...) {
          // The training thread may be waiting for the copy: tell it (no-op once the copy was
          // announced), then fail the update itself.
          try {
            c.set_exception(std::current_exception());
          } catch (const std::future_error&) {
          }
          throw;
        }
      });
      start.started = true;
    } else {
      try {
        u = run_update(/*delayed=*/false);
      } catch (...) {
        failed = failed_phase::update;  // its gradients stay in their home copies until then
        throw;
      }
      u.add_costs(retried);
      s.exposed_transfer_seconds += u.grad_wait;
      completed_steps = adam->step_count();
    }
    s.grad_norm = u.grad_norm;
    s.skipped = u.skipped;
    s.optimizer_seconds = u.seconds;
    s.optimizer_io_wait_seconds = u.io_wait;
    // One iteration of the device allocator ends here (the planned policy plans a repeated one):
    // before the next step's first params are fetched, so that those fetches fall in the step
    // that frees them.
    mark_device_iteration();
    // The params' home copies are final: the next forward's first params start coming up now,
    // while the caller gets its next batch.
    start_next_iteration();
    s.seconds = seconds_since(start);
    // delayed_update: the count once the update just started is applied (one less should it be
    // skipped, which the next step reports).
    s.step = completed_steps + (delayed ? 1 : 0);

    const tier_stats tiers_after = tm->stats();
    s.host_to_device_bytes = tiers_after.host_to_device_bytes - tiers_before.host_to_device_bytes;
    s.device_to_host_bytes = tiers_after.device_to_host_bytes - tiers_before.device_to_host_bytes;
    s.nvme_read_bytes = (tiers_after.nvme_read_bytes - tiers_before.nvme_read_bytes) + u.nvme_read;
    s.nvme_write_bytes = (tiers_after.nvme_write_bytes - tiers_before.nvme_write_bytes) + u.nvme_write;
    s.prefetch_hits = tiers_after.prefetch_hits - tiers_before.prefetch_hits;
    s.demand_fetches = tiers_after.demand_fetches - tiers_before.demand_fetches;
    const double moved = static_cast<double>(s.host_to_device_bytes + s.device_to_host_bytes);
    if (options.copy_bandwidth > 0 && moved > 0) {
      s.transfer_seconds = moved / options.copy_bandwidth;
      s.transfer_hidden =
          std::clamp(1.0 - s.exposed_transfer_seconds / s.transfer_seconds, 0.0, 1.0);
    } else {
      s.transfer_hidden = std::numeric_limits<double>::quiet_NaN();
    }
    return s;
  }

  std::uint64_t checkpoint(std::uint64_t data_cursor) {
    TERRACE_EXPECTS(nvme.has_value(), "offload engine: checkpoint without an NVMe dir");
    // A committed checkpoint keeps its extents until the next commit, so every step after it
    // needs room for the state twice. A store made without that room (checkpoints = false) would
    // commit, and then the next optimizer phase would run out of space part way, failing every
    // retry: refused here, before anything is written, and training goes on.
    const std::uint64_t needed = compute_store_bytes(/*checkpoints=*/true);
    if (nvme->capacity() < needed) {
      throw logic_error("terrace: offload engine: checkpoint() on a store made without room for "
                        "checkpoints (checkpoints = false): it holds " +
                        human_bytes(nvme->capacity()) + " and checkpoints need " +
                        human_bytes(needed) + "; nothing was committed (make the engine with "
                        "checkpoints = true, or a store_capacity of at least that)");
    }
    // A running update, or a failed optimizer phase (finished here with its own gradients, or
    // this throws and commits nothing): the state committed is every step's, whole, and a resume
    // continues from it.
    finish_update();
    record_block r{kRecordMagic, 1, adam->step_count(), data_cursor, options.seed,
                   layout_fingerprint()};
    std::memset(record_buffer, 0, kRecordBytes);
    std::memcpy(record_buffer, &r, sizeof r);
    // Put, then let the optimizer's checkpoint commit it together with its state: one commit, so
    // a crash leaves either both the old or both the new.
    nvme->put(kRecordName, record_buffer, kRecordBytes).wait();
    return adam->checkpoint();
  }
};

// ------------------------------------------------------------------------------------- the API

offload_engine::offload_engine(device_backend& device, const layered_model_factory& make_model,
                               const offload_engine_options& options)
    : impl_(std::make_unique<impl>(device, options)) {
  TERRACE_EXPECTS(static_cast<bool>(make_model), "offload engine: no model factory");
  impl_->setup(make_model);  // check_options() first
}

offload_engine::~offload_engine() = default;

offload_step_stats offload_engine::step(const void* batch) { return impl_->step(batch); }

std::uint64_t offload_engine::checkpoint(std::uint64_t data_cursor) {
  return impl_->checkpoint(data_cursor);
}

const std::optional<offload_engine_record>& offload_engine::resumed_from() const noexcept {
  return impl_->resumed;
}

std::int64_t offload_engine::step_count() const noexcept { return impl_->completed_steps; }

void offload_engine::finish_update() { impl_->finish_update(); }

bool offload_engine::update_failed() const noexcept {
  return impl_->failed != impl::failed_phase::none;
}

std::size_t offload_engine::state_bytes() const noexcept {
  return impl_->params * impl_->state_per_element();
}

std::size_t offload_engine::parameter_count() const noexcept { return impl_->params; }

std::uint64_t offload_engine::required_store_bytes() const noexcept {
  return impl_->store_bytes_needed;
}

std::size_t offload_engine::tensor_device_budget() const noexcept { return impl_->tensor_budget; }

tier_manager& offload_engine::tiers() noexcept { return *impl_->tm; }
offload_adam& offload_engine::optimizer() noexcept { return *impl_->adam; }
caching_allocator& offload_engine::device_memory() noexcept { return impl_->memory; }
layered_model& offload_engine::model() noexcept { return *impl_->model; }
tensor_store* offload_engine::store() noexcept {
  return impl_->nvme ? &*impl_->nvme : nullptr;
}

std::size_t offload_engine::pinned_bytes() const {
  return static_cast<std::size_t>(impl_->pinned->stats().reserved_bytes.current);
}

}  // namespace terrace
