// SPDX-License-Identifier: Apache-2.0
// The offloaded optimizer (include/terrace/offload_adam.hpp): group placement, the chunk pipeline
// over the tensor store, the bookkeeping of unfinished steps (failed, or made in parts), checkpoint
// and resume.
//
// Bitwise equality with one adam_optimizer::step rests on two facts about adam.cpp: the update is
// element-wise, and an element goes through the SIMD body or the scalar tail depending only on
// its position relative to a 64-aligned cut from its tensor's start. Chunks therefore start at
// multiples of 64 elements of their group (chunk_elements % 64 == 0 is required), and the step
// number the kernel sees comes from set_step_count(t - 1) before each call.
//
// Store layout (docs/offload.md): group `name` is the store tensors "<name>#<k>", k = 0, 1, ...
// in decimal, each the chunk's [master f32 | m | v] back to back; the ids cannot collide (the last
// '#' of an id always separates the name from the digits). One more tensor, kMetaId (which ends
// in no digits, so no group's id can equal it), holds the step counter and the group table at the
// last checkpoint.
#include "terrace/stats.hpp"
#include "terrace/offload_adam.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <vector>

#include "terrace/error.hpp"

namespace terrace {
namespace {

// Bytes of optimizer state per parameter: the fp32 master and the two moments.
std::size_t state_bytes_per_element(const adam_options& o) { return 4 + 2 * size_of(o.state_dtype); }

// The placement rule, for add() and nvme_placement() alike: in add order, on the host while the
// budget allows; once one group went to NVMe, so do all later ones ("the rest lives in the
// store"), which keeps placement a prefix and easy to predict. `host_used` is within the budget
// (each host group fit it).
bool next_goes_to_nvme(bool any_on_nvme, std::size_t host_used, std::size_t bytes, std::size_t budget) {
  return any_on_nvme || bytes > budget - host_used;
}

using clock_type = std::chrono::steady_clock;

// Chunk starts are multiples of this (see the file comment): adam.cpp's cut_align.
constexpr std::size_t kChunkAlign = 64;
// The extent granule of the store (tensor_store allocates in 4 KiB units for O_DIRECT).
constexpr std::size_t kStoreGranule = 4096;
constexpr char kMetaId[] = "#offload_adam.meta";
constexpr char kMetaMagic[8] = {'T', 'O', 'A', 'D', 'A', 'M', '0', '1'};

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }


// Rethrows the exception in flight with `prefix` in front of its message, keeping its type (a
// checksum_error stays one, with its errno), so callers can still tell corruption from EIO.
[[noreturn]] void rethrow_with(const std::string& prefix) {
  try {
    throw;
  } catch (const checksum_error& e) {
    throw checksum_error(prefix + e.what(), e.code());
  } catch (const io_error& e) {
    throw io_error(prefix + e.what(), e.code());
  } catch (const out_of_memory& e) {
    throw out_of_memory(prefix + e.what());
  } catch (const logic_error& e) {
    throw logic_error(prefix + e.what());
  }
}

// ---------------------------------------------------------------------------- the meta record

struct meta_group {
  std::string name;
  std::uint64_t elements;
};

struct meta_record {
  std::uint32_t state_dtype = 0;
  std::uint64_t chunk_elements = 0;
  std::int64_t step = 0;
  std::vector<meta_group> groups;
};

template <class T>
void append(std::vector<std::byte>& out, const T& v) {
  const auto* p = reinterpret_cast<const std::byte*>(&v);
  out.insert(out.end(), p, p + sizeof v);
}

std::vector<std::byte> encode(const meta_record& m) {
  std::vector<std::byte> out;
  for (char c : kMetaMagic) out.push_back(static_cast<std::byte>(c));
  append(out, m.state_dtype);
  append(out, m.chunk_elements);
  append(out, m.step);
  append(out, static_cast<std::uint64_t>(m.groups.size()));
  for (const meta_group& g : m.groups) {
    append(out, g.elements);
    append(out, static_cast<std::uint32_t>(g.name.size()));
    const auto* p = reinterpret_cast<const std::byte*>(g.name.data());
    out.insert(out.end(), p, p + g.name.size());
  }
  return out;
}

meta_record decode(const std::vector<std::byte>& in) {
  std::size_t at = 0;
  const auto malformed = [] {
    return io_error(std::string("terrace: offload_adam: the store's '") + kMetaId +
                    "' record is malformed (written by something else?)");
  };
  const auto take = [&](void* out, std::size_t n) {
    if (in.size() - at < n) throw malformed();
    std::memcpy(out, in.data() + at, n);
    at += n;
  };
  char magic[8];
  take(magic, sizeof magic);
  if (std::memcmp(magic, kMetaMagic, sizeof magic) != 0) throw malformed();
  meta_record m;
  take(&m.state_dtype, sizeof m.state_dtype);
  take(&m.chunk_elements, sizeof m.chunk_elements);
  take(&m.step, sizeof m.step);
  std::uint64_t count = 0;
  take(&count, sizeof count);
  for (std::uint64_t i = 0; i < count; ++i) {
    meta_group g;
    std::uint32_t length = 0;
    take(&g.elements, sizeof g.elements);
    take(&length, sizeof length);
    if (in.size() - at < length) throw malformed();
    g.name.assign(reinterpret_cast<const char*>(in.data() + at), length);
    at += length;
    m.groups.push_back(std::move(g));
  }
  return m;
}

}  // namespace

// =============================================================================== the optimizer

struct offload_adam::impl {
  struct chunk {
    std::size_t begin = 0;  // first element within the group (a multiple of kChunkAlign)
    std::size_t count = 0;
    // Host-resident groups: the chunk's [master | m | v]. NVMe groups: nullptr, except after a
    // write of the chunk failed: then its updated bytes are rescued here until a later write
    // (step or checkpoint) succeeds, so a failed put never loses state. A pool buffer either way
    // (a rescue may hold a whole staging buffer).
    std::byte* host = nullptr;
    bool in_store = false;  // the store holds the current bytes of this chunk
    bool updated = false;   // updated by the open step (an earlier part, or a failed attempt of it)
  };
  struct group {
    std::string name;
    std::size_t elements = 0;
    bool nvme = false;
    // Listed by a failed call of the open step: the step may end only once all of it is updated.
    bool owed = false;
    std::vector<chunk> chunks;
  };
  // One chunk of an NVMe group going through the pipeline.
  struct work {
    group* g;
    std::size_t k;
    const std::byte* grad;
    std::byte* copy;
  };
  struct slot {
    std::byte* buffer = nullptr;
    std::optional<std::size_t> reading;  // work index whose read is in flight
    std::optional<std::size_t> writing;  // work index whose put is in flight
    io_handle read, write;
  };

  impl(const offload_adam_options& o, pinned_host_pool& p, tensor_store* s)
      : options(o), adam(o.adam), pool(p), store(s) {
    state_size = size_of(adam.options().state_dtype);
    element_bytes = state_bytes_per_element(adam.options());
    slots.resize(o.pipeline_depth);
  }

  ~impl() {
    // Every call drains its own transfers, so nothing is in flight here; buffers go back.
    for (group& g : groups)
      for (chunk& c : g.chunks) pool.deallocate(c.host);
    for (slot& s : slots) pool.deallocate(s.buffer);
  }

  // ---- layout

  std::string chunk_id(const group& g, std::size_t k) const { return g.name + "#" + std::to_string(k); }
  std::size_t chunk_bytes(const chunk& c) const { return c.count * element_bytes; }
  float* master_of(std::byte* base) const { return reinterpret_cast<float*>(base); }
  std::byte* m_of(std::byte* base, const chunk& c) const { return base + 4 * c.count; }
  std::byte* v_of(std::byte* base, const chunk& c) const { return base + (4 + state_size) * c.count; }

  std::vector<chunk> cut(std::size_t elements) const {
    std::vector<chunk> out;
    for (std::size_t b = 0; b < elements; b += options.chunk_elements) {
      chunk c;
      c.begin = b;
      c.count = std::min(options.chunk_elements, elements - b);
      out.push_back(c);
    }
    return out;
  }

  group& at(group_id id, const char* call) {
    if (id >= groups.size()) {
      throw logic_error(std::string("terrace: offload_adam: ") + call + " of unknown group id " +
                        std::to_string(id) + " (" + std::to_string(groups.size()) + " groups)");
    }
    return groups[id];
  }

  // Makes every staging buffer at least `bytes` long. A slot without one (it went to a rescued
  // chunk, or the pool refused it last time) gets one of staging_bytes, the size of the others.
  void ensure_staging(std::size_t bytes) {
    bytes = round_up(bytes, kStoreGranule);
    if (staging_bytes < bytes) {
      for (slot& s : slots) {
        pool.deallocate(s.buffer);
        s.buffer = nullptr;
      }
      staging_bytes = bytes;
    }
    for (slot& s : slots)
      if (s.buffer == nullptr) s.buffer = static_cast<std::byte*>(pool.allocate(staging_bytes));
  }

  // Staging for a group of `group_elements` (see the header); its chunks are at most
  // chunk_elements, so at most that many elements' state is needed.
  void reserve_staging(std::size_t group_elements) {
    if (store == nullptr || group_elements == 0) return;
    ensure_staging(std::min(group_elements, options.chunk_elements) * element_bytes);
  }

  // Waits for every transfer still on a slot, ignoring their errors (the caller is already
  // handling one); returns nothing about them. Used on error paths where buffers must be quiet.
  void quiesce_slots() {
    for (slot& s : slots) {
      try {
        s.read.wait();
      } catch (...) {
        // The read's data is discarded anyway.
      }
      s.reading.reset();
      s.read = io_handle();
    }
  }

  // ---- placement

  std::size_t host_bytes_used() const {
    std::size_t n = 0;
    for (const group& g : groups) n += g.nvme ? 0 : g.elements * element_bytes;
    return n;
  }
  bool any_on_nvme() const {
    return std::any_of(groups.begin(), groups.end(), [](const group& g) { return g.nvme; });
  }
  bool place_on_nvme(std::size_t elements) const {
    return store != nullptr && next_goes_to_nvme(any_on_nvme(), host_bytes_used(),
                                                 elements * element_bytes, options.host_state_budget);
  }

  // ---- add

  const meta_record& meta() {
    if (!resume_meta) {
      const std::optional<std::size_t> size = store->size_of(kMetaId);
      if (!size) {
        throw io_error(std::string("terrace: offload_adam: cannot resume: the store holds no checkpoint "
                                   "of an offload_adam (no '") + kMetaId + "' record)");
      }
      std::vector<std::byte> bytes(*size);
      store->get(kMetaId, bytes.data(), bytes.size()).wait();
      resume_meta = decode(bytes);
    }
    return *resume_meta;
  }

  group_id add(const std::string& name, std::size_t elements, const float* initial) {
    TERRACE_EXPECTS(!name.empty(), "offload_adam: a group needs a name");
    // Its chunks are "<name>#<k>" in the store: refused here, not at the first put of a step.
    constexpr std::size_t kChunkSuffix = 1 + 20;  // '#' and a 64-bit k in decimal
    TERRACE_EXPECTS(name.size() <= tensor_store::max_id_bytes - kChunkSuffix,
                    "offload_adam: a group name of " + std::to_string(name.size()) + " bytes (at most " +
                        std::to_string(tensor_store::max_id_bytes - kChunkSuffix) + ")");
    TERRACE_EXPECTS(elements > 0, "offload_adam: group '" + name + "' has 0 elements");
    for (const group& g : groups)
      TERRACE_EXPECTS(g.name != name, "offload_adam: a group named '" + name + "' exists already");
    TERRACE_EXPECTS(groups.size() < std::numeric_limits<group_id>::max(), "offload_adam: too many groups");
    // No buffer holds more than PTRDIFF_MAX bytes; past it the state's byte counts wrap around.
    TERRACE_EXPECTS(elements <= static_cast<std::size_t>(PTRDIFF_MAX) / element_bytes,
                    "offload_adam: group '" + name + "' has " + std::to_string(elements) +
                        " elements, more than any buffer of its state can hold (a negative length "
                        "converted to size_t?)");
    group g;
    g.name = name;
    g.elements = elements;
    g.nvme = place_on_nvme(elements);
    g.chunks = cut(elements);
    if (initial == nullptr) {
      resume(g);
    } else if (g.nvme) {
      write_initial(g, initial);
    } else {
      fill_host(g, initial);
    }
    groups.push_back(std::move(g));
    return static_cast<group_id>(groups.size() - 1);
  }

  void fill_host(group& g, const float* initial) {
    try {
      for (chunk& c : g.chunks) {
        c.host = static_cast<std::byte*>(pool.allocate(chunk_bytes(c)));
        std::memcpy(master_of(c.host), initial + c.begin, 4 * c.count);
        std::memset(m_of(c.host, c), 0, 2 * state_size * c.count);  // m and v: +0.0 in f32 and bf16
      }
    } catch (...) {
      for (chunk& c : g.chunks) {
        pool.deallocate(c.host);
        c.host = nullptr;
      }
      throw;
    }
  }

  // Checked before anything is written: the group's extents plus room for one chunk's
  // replacement (a put allocates the new extent before it frees the old one).
  void check_store_room(const group& g) const {
    std::uint64_t need = 0;
    std::uint64_t largest = 0;
    for (const chunk& c : g.chunks) {
      need += round_up(chunk_bytes(c), kStoreGranule);
      largest = std::max<std::uint64_t>(largest, round_up(chunk_bytes(c), kStoreGranule));
    }
    for (const group& other : groups)
      if (other.nvme) largest = std::max<std::uint64_t>(largest, round_up(chunk_bytes(other.chunks[0]), kStoreGranule));
    const std::uint64_t used = store->used_bytes();
    const std::uint64_t free = store->capacity() > used ? store->capacity() - used : 0;
    if (need + largest > free) {
      throw out_of_memory("terrace: offload_adam: the tensor store cannot hold group '" + g.name + "' (" +
                          std::to_string(g.elements) + " elements, " + human_bytes(need) + " of state in " +
                          std::to_string(g.chunks.size()) + " chunks, plus " + human_bytes(largest) +
                          " of room to replace a chunk): " + human_bytes(free) + " of " +
                          human_bytes(store->capacity()) + " is free; nothing was written");
    }
  }

  void write_initial(group& g, const float* initial) {
    check_store_room(g);
    ensure_staging(chunk_bytes(g.chunks[0]));
    std::vector<std::optional<io_handle>> puts(g.chunks.size());
    std::exception_ptr failure;
    for (std::size_t k = 0; k < g.chunks.size() && !failure; ++k) {
      chunk& c = g.chunks[k];
      slot& s = slots[k % slots.size()];
      try {
        s.write.wait();  // the buffer's previous put
        std::byte* b = s.buffer;
        std::memcpy(master_of(b), initial + c.begin, 4 * c.count);
        std::memset(m_of(b, c), 0, 2 * state_size * c.count);
        s.write = store->put(chunk_id(g, k), b, chunk_bytes(c));
        puts[k] = s.write;
        counters.nvme_write_bytes += static_cast<std::int64_t>(chunk_bytes(c));
      } catch (...) {
        failure = std::current_exception();
      }
    }
    for (slot& s : slots) {
      try {
        s.write.wait();
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      s.write = io_handle();
    }
    if (failure) {
      // Not added: take back what did land, so the store does not keep half a group.
      for (std::size_t k = 0; k < g.chunks.size(); ++k)
        if (puts[k] && store->contains(chunk_id(g, k))) store->erase(chunk_id(g, k));
      try {
        std::rethrow_exception(failure);
      } catch (...) {
        rethrow_with("terrace: offload_adam: adding group '" + g.name + "' failed (nothing of it is kept): ");
      }
    }
    for (chunk& c : g.chunks) c.in_store = true;
    // Chunks of an older group of this name beyond the new count would only waste store space.
    for (std::size_t k = g.chunks.size(); store->contains(chunk_id(g, k)); ++k) store->erase(chunk_id(g, k));
  }

  void resume(group& g) {
    TERRACE_EXPECTS(store != nullptr, "offload_adam: group '" + g.name +
                                          "' has no initial values and there is no store to resume it from");
    const meta_record& m = meta();
    // The counter is shared by every group: a resume may set it while nothing has (no step, no
    // resume yet), else it must find it where the checkpoint left it. Rewound after steps, it
    // would give every group the wrong bias correction from then on.
    if (adam.step_count() != 0 && adam.step_count() != m.step) {
      throw logic_error("terrace: offload_adam: cannot resume group '" + g.name + "' from the checkpoint of step " +
                        std::to_string(m.step) + ": this optimizer is at step " +
                        std::to_string(adam.step_count()) +
                        " (the step counter is shared by all groups: resume every group before the first step)");
    }
    const auto it = std::find_if(m.groups.begin(), m.groups.end(), [&](const meta_group& x) { return x.name == g.name; });
    if (it == m.groups.end()) {
      throw io_error("terrace: offload_adam: cannot resume group '" + g.name +
                     "': the store's last checkpoint has no such group");
    }
    if (it->elements != g.elements) {
      throw io_error("terrace: offload_adam: cannot resume group '" + g.name + "': the checkpoint holds " +
                     std::to_string(it->elements) + " elements, the caller asks for " + std::to_string(g.elements));
    }
    if (m.state_dtype != static_cast<std::uint32_t>(adam.options().state_dtype) ||
        m.chunk_elements != options.chunk_elements) {
      throw io_error("terrace: offload_adam: cannot resume group '" + g.name + "': the checkpoint was written with " +
                     std::string(to_string(static_cast<dtype>(m.state_dtype))) + " moments and chunks of " +
                     std::to_string(m.chunk_elements) + " elements, this optimizer has " +
                     std::string(to_string(adam.options().state_dtype)) + " and " +
                     std::to_string(options.chunk_elements));
    }
    for (std::size_t k = 0; k < g.chunks.size(); ++k) {
      if (store->size_of(chunk_id(g, k)) != chunk_bytes(g.chunks[k])) {
        throw io_error("terrace: offload_adam: cannot resume group '" + g.name + "': store tensor '" +
                       chunk_id(g, k) + "' is missing or has the wrong size");
      }
    }
    if (!g.nvme) {
      std::vector<io_handle> reads;
      std::exception_ptr failure;
      try {
        for (chunk& c : g.chunks) {
          c.host = static_cast<std::byte*>(pool.allocate(chunk_bytes(c)));
          reads.push_back(store->get(chunk_id(g, &c - g.chunks.data()), c.host, chunk_bytes(c)));
          counters.nvme_read_bytes += static_cast<std::int64_t>(chunk_bytes(c));
        }
      } catch (...) {
        failure = std::current_exception();
      }
      wait_all(reads, failure);
      if (failure) {
        for (chunk& c : g.chunks) {
          pool.deallocate(c.host);
          c.host = nullptr;
        }
        std::rethrow_exception(failure);
      }
    }
    for (chunk& c : g.chunks) c.in_store = true;
    adam.set_step_count(m.step);
    steps.store(m.step, std::memory_order_relaxed);
  }

  // ---- step

  void validate(std::span<const offload_group_step> list, const adam_step_options& so) {
    const auto known = [](dtype t) { return t == dtype::f32 || t == dtype::bf16 || t == dtype::f16; };
    TERRACE_EXPECTS(known(so.grad_dtype) && known(so.copy_dtype), "offload_adam: unknown grad or copy dtype");
    TERRACE_EXPECTS(std::isfinite(so.grad_scale) && so.grad_scale > 0,
                    "offload_adam: grad_scale must be finite and > 0, got " + std::to_string(so.grad_scale));
    TERRACE_EXPECTS(std::isfinite(so.clip_coef) && so.clip_coef >= 0,
                    "offload_adam: clip_coef must be finite and >= 0, got " + std::to_string(so.clip_coef));
    std::vector<bool> seen(groups.size(), false);
    std::size_t with_copy = 0;
    for (const offload_group_step& s : list) {
      group& g = at(s.group, "step");
      TERRACE_EXPECTS(!seen[s.group], "offload_adam: group '" + g.name + "' is listed twice in one step");
      seen[s.group] = true;
      const auto aligned = [](const void* p, std::size_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; };
      TERRACE_EXPECTS(s.grad != nullptr && aligned(s.grad, size_of(so.grad_dtype)),
                      "offload_adam: group '" + g.name + "': grad is null or not aligned to its element size");
      if (s.param_copy != nullptr) {
        TERRACE_EXPECTS(aligned(s.param_copy, size_of(so.copy_dtype)),
                        "offload_adam: group '" + g.name + "': param_copy is not aligned to its element size");
        ++with_copy;
      }
    }
    TERRACE_EXPECTS(with_copy == 0 || with_copy == list.size(),
                    "offload_adam: param_copy is set on " + std::to_string(with_copy) + " of " +
                        std::to_string(list.size()) + " groups; set it on all or none");
  }

  std::vector<adam_tensor> grad_tensors(std::span<const offload_group_step> list) {
    std::vector<adam_tensor> out;
    for (const offload_group_step& s : list) {
      adam_tensor t;
      t.grad = s.grad;
      t.size = at(s.group, "grad_norm").elements;
      out.push_back(t);
    }
    return out;
  }

  adam_tensor chunk_tensor(std::byte* base, const chunk& c, const std::byte* grad, std::byte* copy) const {
    return adam_tensor{master_of(base), m_of(base, c), v_of(base, c), grad, copy, c.count};
  }

  // A failed write: the chunk's new bytes (in slot `s`, about to be reused) move to a pinned
  // buffer of their own. When the pool has no room for one (it is shared, and often full under a
  // host budget), the slot's buffer itself becomes the chunk's: the next call that stages
  // allocates the slot a new one, and fails cleanly if it cannot.
  void rescue(chunk& c, slot& s) {
    c.in_store = false;
    if (c.host == nullptr) {
      try {
        c.host = static_cast<std::byte*>(pool.allocate(chunk_bytes(c)));
      } catch (...) {
        c.host = s.buffer;
        s.buffer = nullptr;
        return;
      }
    }
    std::memcpy(c.host, s.buffer, chunk_bytes(c));
  }

  // ---- the open step: what may continue and end it

  static bool fully_updated(const group& g) {
    return std::all_of(g.chunks.begin(), g.chunks.end(), [](const chunk& c) { return c.updated; });
  }

  static std::vector<group_id> sorted_groups(std::span<const offload_group_step> list) {
    std::vector<group_id> ids;
    for (const offload_group_step& s : list) ids.push_back(s.group);
    std::sort(ids.begin(), ids.end());
    return ids;
  }

  std::string names_of(const std::vector<group_id>& ids) const {
    std::string out;
    for (group_id id : ids) out += (out.empty() ? "'" : ", '") + groups[id].name + "'";
    return out.empty() ? "none" : out;
  }

  std::string unfinished(std::int64_t t) const {
    return "offload_adam: step " + std::to_string(t) + " is unfinished (";
  }

  // A call made while a step is open continues that step, so it must not mix another into it:
  // other options would step some of its chunks differently, and a call that ends it must leave
  // no group that a failed call listed half-stepped, or not stepped at all, without a word.
  // Checked before anything is read or written.
  void check_continues_open_step(std::span<const offload_group_step> list, const adam_step_options& so,
                                 bool finish) const {
    const std::int64_t t = adam.step_count() + 1;
    TERRACE_EXPECTS(so.grad_dtype == open_options.grad_dtype && so.copy_dtype == open_options.copy_dtype &&
                        so.grad_scale == open_options.grad_scale && so.clip_coef == open_options.clip_coef,
                    unfinished(t) + "a failed call, or step_part() calls) was made with other step options "
                    "(grad and copy dtypes, grad_scale, clip_coef): continue it with the same ones");
    const std::vector<group_id> listed = sorted_groups(list);
    if (failed_step_groups) {
      TERRACE_EXPECTS(finish, unfinished(t) + "step() failed part way): finish it with step() and the same "
                              "groups, not with step_part()");
      TERRACE_EXPECTS(listed == *failed_step_groups,
                      unfinished(t) + "step() failed part way over groups " + names_of(*failed_step_groups) +
                          "); this call lists " + names_of(listed) + ": call step() again with the same "
                          "groups, gradients and options to finish it");
    }
    if (finish) {
      const std::vector<group_id> left = owed_and_unfinished(listed);
      TERRACE_EXPECTS(left.empty(), unfinished(t) + "a failed call left groups " + names_of(left) +
                                        " not wholly stepped); this call, which ends the step, does not "
                                        "list them: list them too, with the same gradients");
    }
  }

  // The groups a failed call of the open step listed that are not wholly updated and not in
  // `listed` (sorted).
  std::vector<group_id> owed_and_unfinished(const std::vector<group_id>& listed) const {
    std::vector<group_id> out;
    for (std::size_t id = 0; id < groups.size(); ++id) {
      const group& g = groups[id];
      if (g.owed && !fully_updated(g) && !std::binary_search(listed.begin(), listed.end(), id)) {
        out.push_back(static_cast<group_id>(id));
      }
    }
    return out;
  }

  // finish_step(): the step made in parts ends; every part that failed must have been retried.
  void end_parts() {
    const std::int64_t t = adam.step_count() + 1;
    if (open) {
      TERRACE_EXPECTS(!failed_step_groups, unfinished(t) + "step() failed part way over groups " +
                                               names_of(*failed_step_groups) +
                                               "): finish it with step() and the same groups, not finish_step()");
      const std::vector<group_id> left = owed_and_unfinished({});
      TERRACE_EXPECTS(left.empty(), unfinished(t) + "a failed step_part() left groups " + names_of(left) +
                                        " not wholly stepped): retry that part, with the same gradients, "
                                        "before finish_step()");
    }
    finish_step(t);
  }

  // One step (`finish`), or one part of a step left open for finish_step().
  bool step(std::span<const offload_group_step> list, const adam_step_options& so, bool finish) {
    const auto start = clock_type::now();
    struct timer {
      double& into;
      clock_type::time_point start;
      ~timer() { into += seconds_since(start); }
    } step_timer{counters.step_seconds, start};
    validate(list, so);
    if (open) check_continues_open_step(list, so, finish);
    // adam_optimizer::step's own decision (the gradients times clip_coef / grad_scale), made once
    // for every chunk; grad_norm's finiteness leaves clip_coef out.
    if (so.check_finite && !so.grads_known_finite && !adam.grads_finite(grad_tensors(list), so)) return false;
    adam_step_options chunk_options = so;
    chunk_options.grads_known_finite = true;  // decided above, once for the whole step
    const std::int64_t t = adam.step_count() + 1;
    if (!open) {
      for (group& g : groups) {
        g.owed = false;
        for (chunk& c : g.chunks) c.updated = false;
      }
      failed_step_groups.reset();
      open_options = so;
    }
    const std::size_t gsize = size_of(so.grad_dtype);
    const std::size_t csize = size_of(so.copy_dtype);

    std::vector<adam_tensor> host_work;
    std::vector<chunk*> host_chunks;
    std::vector<work> nvme_work;
    std::size_t largest = 0;
    for (const offload_group_step& s : list) {
      group& g = groups[s.group];
      for (std::size_t k = 0; k < g.chunks.size(); ++k) {
        chunk& c = g.chunks[k];
        if (c.updated) continue;  // updated by an earlier part or a failed attempt of this step
        const std::byte* grad = static_cast<const std::byte*>(s.grad) + c.begin * gsize;
        std::byte* copy = s.param_copy ? static_cast<std::byte*>(s.param_copy) + c.begin * csize : nullptr;
        if (g.nvme) {
          nvme_work.push_back({&g, k, grad, copy});
          largest = std::max(largest, chunk_bytes(c));
        } else {
          host_work.push_back(chunk_tensor(c.host, c, grad, copy));
          host_chunks.push_back(&c);
        }
      }
    }
    std::exception_ptr failure;
    std::string where;
    try {
      // A refusal of the pinned pool here fails this call like an I/O error: a part must be
      // owed, or finish_step() would end the step without its groups.
      if (!nvme_work.empty()) {
        where = " allocating its pinned staging buffers";
        ensure_staging(largest);
      }
      run(t, host_work, host_chunks, nvme_work, chunk_options, failure, where);
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
    if (failure) {
      adam.set_step_count(t - 1);
      // A step made in parts stays open after a failed part, even one that updated nothing:
      // finish_step() must not end it without that part. A failed step() that updated nothing
      // is as if it had not been called.
      open = !finish || std::any_of(groups.begin(), groups.end(), [](const group& g) {
        return std::any_of(g.chunks.begin(), g.chunks.end(), [](const chunk& c) { return c.updated; });
      });
      if (open) {
        for (const offload_group_step& s : list) groups[s.group].owed = true;
        if (finish) failed_step_groups = sorted_groups(list);
      }
      try {
        std::rethrow_exception(failure);
      } catch (...) {
        rethrow_with("terrace: offload_adam: step " + std::to_string(t) + " failed" + where +
                     ". The step counter stays at " + std::to_string(t - 1) +
                     "; chunks not yet written keep their previous state" +
                     (open ? (finish ? "; the chunks already updated are remembered: call step() again with "
                                       "the same groups, gradients and options to finish this step. Cause: "
                                     : "; the chunks already updated are remembered: call step_part() again "
                                       "with the same groups, gradients and options before finish_step(). "
                                       "Cause: ")
                           : ". Cause: "));
      }
    }
    if (finish) {
      finish_step(t);
    } else {
      // The step stays open: the next part sees step t again.
      adam.set_step_count(t - 1);
      open = true;
    }
    return true;
  }

  void finish_step(std::int64_t t) {
    adam.set_step_count(t);
    steps.store(t, std::memory_order_relaxed);
    open = false;
    failed_step_groups.reset();
  }

  // The step proper. On an error it stops issuing, drains every transfer, rescues the updated
  // chunks whose write did not land, and leaves the first error in `failure`.
  void run(std::int64_t t, std::vector<adam_tensor>& host_work, std::vector<chunk*>& host_chunks,
           std::vector<work>& nvme_work, const adam_step_options& so, std::exception_ptr& failure,
           std::string& where) {
    const std::size_t n = nvme_work.size();
    const std::size_t depth = slots.size();
    std::size_t stepped = 0;       // work items stepped (their bytes in their slot are new)
    std::vector<bool> put_done(n, false);

    const auto name_of = [&](std::size_t i) {
      const work& w = nvme_work[i];
      return " at group '" + w.g->name + "' chunk " + std::to_string(w.k) + " of " +
             std::to_string(w.g->chunks.size()) + " (store tensor '" + chunk_id(*w.g, w.k) + "')";
    };
    const auto timed_wait = [&](const io_handle& h) {
      if (h.ready()) return h.wait();
      const auto t0 = clock_type::now();
      try {
        h.wait();
      } catch (...) {
        counters.io_wait_seconds += seconds_since(t0);
        throw;
      }
      counters.io_wait_seconds += seconds_since(t0);
    };
    // Frees slot `s` of its put, if any: a landed put ends the chunk's rescue buffer. The handle
    // goes too, failed or not: add() waits on every slot's last put (write_initial), and must not
    // see this step's failure there.
    const auto finish_write = [&](slot& s) {
      if (!s.writing) return;
      const std::size_t i = *s.writing;
      try {
        timed_wait(s.write);
      } catch (...) {
        // The first error names its chunk; a put failing while the drain below waits for it
        // must not take its place in the message.
        if (!failure) where = name_of(i);
        s.writing.reset();
        s.write = io_handle();
        throw;
      }
      s.writing.reset();
      s.write = io_handle();
      put_done[i] = true;
      chunk& c = nvme_work[i].g->chunks[nvme_work[i].k];
      c.in_store = true;
      pool.deallocate(c.host);
      c.host = nullptr;
    };
    const auto issue_read = [&](std::size_t i) {
      slot& s = slots[i % depth];
      finish_write(s);
      const work& w = nvme_work[i];
      chunk& c = w.g->chunks[w.k];
      if (c.host != nullptr) {
        std::memcpy(s.buffer, c.host, chunk_bytes(c));  // rescued after an earlier failed write
      } else {
        where = name_of(i);
        s.read = store->get(chunk_id(*w.g, w.k), s.buffer, staging_bytes);
        counters.nvme_read_bytes += static_cast<std::int64_t>(chunk_bytes(c));
      }
      s.reading = i;
    };
    const auto step_chunk = [&](std::span<const adam_tensor> tensors) {
      adam.set_step_count(t - 1);  // each call advances it to t: every chunk sees step t
      adam.step(tensors, so);
    };

    try {
      // Reads run depth - 2 items ahead of the step: with depth 3, chunk i+1 is read while chunk
      // i is stepped and chunk i-1 written. The first ones go out before the host groups' step,
      // which they overlap.
      for (std::size_t i = 0; i < std::min(n, depth - 2); ++i) issue_read(i);
      if (!host_work.empty()) {
        where = " in the host-resident groups";
        step_chunk(host_work);
        for (chunk* c : host_chunks) {
          c->updated = true;
          c->in_store = false;
        }
      }
      for (std::size_t i = 0; i < n; ++i) {
        if (i + depth - 2 < n) issue_read(i + depth - 2);  // waits for the put of chunk i - 2
        slot& s = slots[i % depth];
        const work& w = nvme_work[i];
        chunk& c = w.g->chunks[w.k];
        where = name_of(i);
        timed_wait(s.read);
        s.reading.reset();
        s.read = io_handle();
        const adam_tensor x = chunk_tensor(s.buffer, c, w.grad, w.copy);
        step_chunk(std::span<const adam_tensor>(&x, 1));
        c.updated = true;
        c.in_store = false;
        ++stepped;
        ++counters.chunks_stepped;
        s.write = store->put(chunk_id(*w.g, w.k), s.buffer, chunk_bytes(c));
        s.writing = i;
        counters.nvme_write_bytes += static_cast<std::int64_t>(chunk_bytes(c));
      }
      for (slot& s : slots) finish_write(s);
      return;
    } catch (...) {
      failure = std::current_exception();
    }
    // Drain: reads are discarded; puts that land are kept; every stepped chunk whose put did not
    // land keeps its new bytes in a rescue buffer (its slot is untouched until here).
    quiesce_slots();
    for (slot& s : slots) {
      if (!s.writing) continue;
      try {
        finish_write(s);
      } catch (...) {
        // Reported through `failure` (the first error); this chunk is rescued below.
      }
    }
    for (std::size_t i = 0; i < stepped; ++i) {
      if (put_done[i]) continue;
      chunk& c = nvme_work[i].g->chunks[nvme_work[i].k];
      rescue(c, slots[i % depth]);
    }
  }

  // ---- the rest

  void read_master(group_id id, float* out) {
    TERRACE_EXPECTS(out != nullptr, "offload_adam: read_master into a null buffer");
    group& g = at(id, "read_master");
    for (std::size_t k = 0; k < g.chunks.size(); ++k) {
      chunk& c = g.chunks[k];
      if (c.host != nullptr) {
        std::memcpy(out + c.begin, master_of(c.host), 4 * c.count);
        continue;
      }
      ensure_staging(chunk_bytes(c));
      // A chunk's [master | m | v] is one tensor: the read takes all of it, the copy only master.
      store->get(chunk_id(g, k), slots[0].buffer, staging_bytes).wait();
      counters.nvme_read_bytes += static_cast<std::int64_t>(chunk_bytes(c));
      std::memcpy(out + c.begin, master_of(slots[0].buffer), 4 * c.count);
    }
  }

  std::uint64_t checkpoint() {
    TERRACE_EXPECTS(store != nullptr, "offload_adam: checkpoint without a tensor store");
    TERRACE_EXPECTS(!open, "offload_adam: checkpoint while a step is unfinished (a failed step, or "
                           "step_part() without finish_step()): finish it first, with the same "
                           "gradients (a checkpoint of half a step would resume wrong)");
    meta_record m;
    m.state_dtype = static_cast<std::uint32_t>(adam.options().state_dtype);
    m.chunk_elements = options.chunk_elements;
    m.step = adam.step_count();
    for (const group& g : groups) m.groups.push_back({g.name, g.elements});
    const std::vector<std::byte> meta_bytes = encode(m);

    struct pending {
      chunk* c;
      bool rescued;
      io_handle h;
    };
    std::vector<pending> puts;
    std::exception_ptr failure;
    try {
      for (group& g : groups) {
        for (std::size_t k = 0; k < g.chunks.size(); ++k) {
          chunk& c = g.chunks[k];
          if (c.in_store) continue;
          puts.push_back({&c, g.nvme, store->put(chunk_id(g, k), c.host, chunk_bytes(c))});
          counters.nvme_write_bytes += static_cast<std::int64_t>(chunk_bytes(c));
        }
      }
      puts.push_back({nullptr, false, store->put(kMetaId, meta_bytes.data(), meta_bytes.size())});
    } catch (...) {
      failure = std::current_exception();
    }
    for (pending& p : puts) {
      try {
        p.h.wait();
      } catch (...) {
        if (!failure) failure = std::current_exception();
        continue;
      }
      if (p.c == nullptr) continue;
      p.c->in_store = true;
      if (p.rescued) {  // an NVMe chunk's rescue buffer: the store has it now
        pool.deallocate(p.c->host);
        p.c->host = nullptr;
      }
    }
    if (failure) {
      try {
        std::rethrow_exception(failure);
      } catch (...) {
        rethrow_with("terrace: offload_adam: checkpoint failed (the last committed checkpoint stays): ");
      }
    }
    resume_meta.reset();  // a later resuming add reads the record just written
    return store->checkpoint();
  }

  offload_adam_options options;
  adam_optimizer adam;
  pinned_host_pool& pool;
  tensor_store* store;
  std::size_t state_size = 4;
  std::size_t element_bytes = 12;
  std::vector<group> groups;
  std::vector<slot> slots;
  std::size_t staging_bytes = 0;
  std::optional<meta_record> resume_meta;
  // A step is under way: some chunks carry `updated`, from a failed attempt (the next step()
  // finishes it) or from step_part() calls (finish_step() ends it).
  bool open = false;
  // The open step's first call's options: every later call of that step must have the same.
  adam_step_options open_options;
  // Set when a step() call failed part way: the groups it listed (sorted), which its retry must list.
  std::optional<std::vector<group_id>> failed_step_groups;
  // The counter as callers see it: the adam object's moves back and forth within a step.
  std::atomic<std::int64_t> steps{0};
  offload_adam_stats counters;
  mutable std::mutex mutex;  // one call at a time: the slots, the groups and the adam object are shared
};

// ============================================================================ the public calls

std::vector<bool> offload_adam::nvme_placement(const offload_adam_options& o,
                                              std::span<const std::size_t> group_elements) {
  const std::size_t per = state_bytes_per_element(o.adam);
  std::vector<bool> on_nvme;
  std::size_t host_used = 0;
  for (const std::size_t elements : group_elements) {
    const bool nvme = next_goes_to_nvme(!on_nvme.empty() && on_nvme.back(), host_used,
                                        elements * per, o.host_state_budget);
    if (!nvme) host_used += elements * per;
    on_nvme.push_back(nvme);
  }
  return on_nvme;
}

void offload_adam::check_options(const offload_adam_options& o, bool with_store) {
  adam_optimizer::check_options(o.adam);
  TERRACE_EXPECTS(o.chunk_elements > 0 && o.chunk_elements % kChunkAlign == 0,
                  "offload_adam: chunk_elements must be a positive multiple of 64 (chunks must "
                  "start where adam_optimizer's own thread cuts may, for bitwise-equal results), got " +
                      std::to_string(o.chunk_elements));
  TERRACE_EXPECTS(o.pipeline_depth >= 3,
                  "offload_adam: pipeline_depth must be >= 3 (one buffer reading, one stepping, "
                  "one writing), got " + std::to_string(o.pipeline_depth));
  TERRACE_EXPECTS(o.host_state_budget == 0 || with_store,
                  "offload_adam: a host_state_budget needs a tensor store for the groups beyond it");
  // Its layout (master, m, v per element, on the host and on NVMe) is Adam's; Lion would carry
  // a v it never reads.
  TERRACE_EXPECTS(o.adam.mode != adam_mode::lion,
                  "offload_adam: Lion is not supported here (its state layout is Adam's: master, "
                  "m and v); use adam_optimizer directly");
}

offload_adam::offload_adam(const offload_adam_options& options, pinned_host_pool& staging, tensor_store* nvme) {
  check_options(options, nvme != nullptr);
  impl_ = std::make_unique<impl>(options, staging, nvme);
}

offload_adam::~offload_adam() = default;

group_id offload_adam::add(const std::string& name, std::size_t elements, const float* initial_master) {
  std::lock_guard lock(impl_->mutex);
  return impl_->add(name, elements, initial_master);
}

void offload_adam::reserve_staging(std::size_t group_elements) {
  std::lock_guard lock(impl_->mutex);
  impl_->reserve_staging(group_elements);
}

grad_norm_result offload_adam::grad_norm(std::span<const offload_group_step> groups, dtype grad_dtype,
                                         float grad_scale) {
  std::lock_guard lock(impl_->mutex);
  const std::vector<adam_tensor> grads = impl_->grad_tensors(groups);
  return impl_->adam.grad_norm(grads, grad_dtype, grad_scale);
}

bool offload_adam::step(std::span<const offload_group_step> groups, const adam_step_options& step_options) {
  std::lock_guard lock(impl_->mutex);
  return impl_->step(groups, step_options, /*finish=*/true);
}

bool offload_adam::step_part(std::span<const offload_group_step> groups,
                             const adam_step_options& step_options) {
  std::lock_guard lock(impl_->mutex);
  return impl_->step(groups, step_options, /*finish=*/false);
}

void offload_adam::finish_step() {
  std::lock_guard lock(impl_->mutex);
  impl_->end_parts();
}

void offload_adam::read_master(group_id group, float* out) {
  std::lock_guard lock(impl_->mutex);
  impl_->read_master(group, out);
}

std::uint64_t offload_adam::checkpoint() {
  std::lock_guard lock(impl_->mutex);
  return impl_->checkpoint();
}

std::int64_t offload_adam::step_count() const noexcept { return impl_->steps.load(std::memory_order_relaxed); }

void offload_adam::set_step_count(std::int64_t step) {
  std::lock_guard lock(impl_->mutex);
  TERRACE_EXPECTS(!impl_->open, "offload_adam: set_step_count while a step is unfinished (a failed step, or "
                                "step_part() without finish_step()): finish the step first, with the same "
                                "gradients");
  impl_->adam.set_step_count(step);
  impl_->steps.store(step, std::memory_order_relaxed);
}

void offload_adam::set_lr(double lr) {
  std::lock_guard lock(impl_->mutex);
  // Within a step every chunk must see one learning rate.
  TERRACE_EXPECTS(!impl_->open, "offload_adam: set_lr while a step is unfinished (a failed step, or "
                                "step_part() without finish_step()): finish the step first, with the same "
                                "gradients");
  impl_->adam.set_lr(lr);
}

std::size_t offload_adam::elements(group_id group) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->at(group, "elements").elements;
}

bool offload_adam::on_nvme(group_id group) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->at(group, "on_nvme").nvme;
}

offload_adam_stats offload_adam::stats() const {
  std::lock_guard lock(impl_->mutex);
  offload_adam_stats s = impl_->counters;
  s.host_state_bytes = 0;
  s.nvme_state_bytes = 0;
  for (const auto& g : impl_->groups) (g.nvme ? s.nvme_state_bytes : s.host_state_bytes) += g.elements * impl_->element_bytes;
  return s;
}

}  // namespace terrace
