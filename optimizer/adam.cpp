// SPDX-License-Identifier: Apache-2.0
// The optimizer front: checks arguments, computes the per-step scalars, cuts the work over the
// thread pool and calls the kernels chosen by dispatch.cpp.
#include "terrace/adam.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "optimizer/adam_kernel.hpp"
#include "optimizer/thread_pool.hpp"
#include "terrace/error.hpp"

namespace terrace {

std::string_view to_string(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::bf16: return "bf16";
    case dtype::f16: return "f16";
  }
  return "?";
}

namespace {

// Cuts fall on multiples of this many elements from the start of their tensor, so that the SIMD
// body and the scalar tail cover the same elements whatever the thread count: results are then
// bitwise independent of it. 64 floats is also a whole number of cache lines for every dtype.
constexpr std::size_t cut_align = 64;
// Below this many elements per thread, waking threads costs more than it saves.
constexpr std::size_t min_per_thread = 1 << 15;

struct position {
  std::size_t tensor;
  std::size_t offset;
};

// Splits the concatenation of all tensors into `parts` ranges of about equal length: cut k is
// the start of part k. No tensor boundary forces a cut, so many small tensors cost what one
// large tensor of their total size costs.
std::vector<position> split(std::span<const adam_tensor> tensors, std::size_t total, unsigned parts) {
  std::vector<position> cuts(parts + 1, position{tensors.size(), 0});
  cuts[0] = {0, 0};
  std::size_t tensor = 0;
  std::size_t before = 0;  // elements in tensors [0, tensor)
  for (unsigned k = 1; k < parts; ++k) {
    const std::size_t target = total / parts * k + total % parts * k / parts;
    while (tensor < tensors.size() && before + tensors[tensor].size <= target) {
      before += tensors[tensor].size;
      ++tensor;
    }
    if (tensor == tensors.size()) break;
    cuts[k] = {tensor, (target - before) / cut_align * cut_align};
  }
  return cuts;
}

// Calls fn(tensor index, begin, end) for each non-empty piece between two cuts.
template <class Fn>
void for_each_piece(std::span<const adam_tensor> tensors, position from, position to, Fn&& fn) {
  for (std::size_t t = from.tensor; t < tensors.size() && t <= to.tensor; ++t) {
    const std::size_t begin = t == from.tensor ? from.offset : 0;
    const std::size_t end = t == to.tensor ? to.offset : tensors[t].size;
    if (begin < end) fn(t, begin, end);
  }
}

bool aligned(const void* p, std::size_t alignment) noexcept {
  return reinterpret_cast<std::uintptr_t>(p) % alignment == 0;
}

void check_buffer(const void* p, dtype t, std::size_t index, const char* name) {
  TERRACE_EXPECTS(p != nullptr, "adam: tensor " + std::to_string(index) + ": " + name + " is null");
  TERRACE_EXPECTS(aligned(p, size_of(t)), "adam: tensor " + std::to_string(index) + ": " + name +
                                              " is not aligned to its element size (" +
                                              std::to_string(size_of(t)) + " bytes, " +
                                              std::string(to_string(t)) + ")");
}

void check_adam_options(const adam_options& o) {
  TERRACE_EXPECTS(std::isfinite(o.lr) && o.lr > 0, "adam: lr must be > 0, got " + std::to_string(o.lr));
  TERRACE_EXPECTS(std::isfinite(o.beta1) && o.beta1 >= 0 && o.beta1 < 1,
                  "adam: beta1 must be in [0, 1), got " + std::to_string(o.beta1));
  TERRACE_EXPECTS(std::isfinite(o.beta2) && o.beta2 >= 0 && o.beta2 < 1,
                  "adam: beta2 must be in [0, 1), got " + std::to_string(o.beta2));
  TERRACE_EXPECTS(std::isfinite(o.eps) && o.eps > 0, "adam: eps must be > 0, got " + std::to_string(o.eps));
  TERRACE_EXPECTS(std::isfinite(o.weight_decay) && o.weight_decay >= 0,
                  "adam: weight_decay must be >= 0, got " + std::to_string(o.weight_decay));
  TERRACE_EXPECTS(o.mode == adam_mode::adam || o.mode == adam_mode::adamw || o.mode == adam_mode::lion,
                  "adam: unknown mode " + std::to_string(static_cast<int>(o.mode)));
  TERRACE_EXPECTS(o.state_dtype == dtype::f32 || o.state_dtype == dtype::bf16,
                  "adam: state_dtype must be f32 or bf16, got " + std::string(to_string(o.state_dtype)));
  // (An unknown value fell through dispatch's switch to the scalar kernels, silently.)
  TERRACE_EXPECTS(o.isa == simd_isa::automatic || o.isa == simd_isa::scalar || o.isa == simd_isa::avx2 ||
                      o.isa == simd_isa::avx512,
                  "adam: unknown isa " + std::to_string(static_cast<int>(o.isa)));
}

// Adds tensor `index`'s `size` to `total`. No buffer holds more than PTRDIFF_MAX bytes, so a larger
// size is a caller's mistake, typically a negative length converted to size_t (through the C ABI):
// unchecked, the total wrapped around, the split covered the wrong elements and the kernels ran
// off the buffers.
void add_size(std::size_t& total, std::size_t size, std::size_t index) {
  constexpr std::size_t max_elements = PTRDIFF_MAX / sizeof(float);
  TERRACE_EXPECTS(size <= max_elements - total,
                  "adam: tensor " + std::to_string(index) + " has size " + std::to_string(size) +
                      ", which takes the total past 2^61 elements: no buffer is that large "
                      "(a negative length converted to size_t?)");
  total += size;
}

void check_dtype(dtype t, const char* what) {
  TERRACE_EXPECTS(t == dtype::f32 || t == dtype::bf16 || t == dtype::f16,
                  std::string("adam: unknown ") + what + " dtype " + std::to_string(static_cast<int>(t)));
}

void check_scale(float grad_scale) {
  TERRACE_EXPECTS(std::isfinite(grad_scale) && grad_scale > 0,
                  "adam: grad_scale must be finite and > 0, got " + std::to_string(grad_scale));
}

// What the kernels multiply each gradient by, rounded to float once, as the update uses it.
float grad_multiplier(float grad_scale, float clip_coef) noexcept {
  return static_cast<float>(static_cast<double>(clip_coef) / grad_scale);
}

// The step's multiplier, after checking grad_scale and clip_coef. A grad_scale below ~1/FLT_MAX
// makes the multiplier inf, and every zero gradient NaN.
float checked_grad_multiplier(const adam_step_options& so) {
  check_scale(so.grad_scale);
  TERRACE_EXPECTS(std::isfinite(so.clip_coef) && so.clip_coef >= 0,
                  "adam: clip_coef must be finite and >= 0, got " + std::to_string(so.clip_coef));
  const float grad_mul = grad_multiplier(so.grad_scale, so.clip_coef);
  TERRACE_EXPECTS(std::isfinite(grad_mul), "adam: clip_coef / grad_scale (" + std::to_string(so.clip_coef) +
                                               " / " + std::to_string(so.grad_scale) +
                                               ") overflows float; grad_scale is too small");
  return grad_mul;
}

// The elements of `tensors`, after checking each gradient buffer: what a scan of the gradients
// alone (grad_norm, grads_finite) reads.
std::size_t checked_grads_total(std::span<const adam_tensor> tensors, dtype grad_dtype) {
  std::size_t total = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].size == 0) continue;
    check_buffer(tensors[i].grad, grad_dtype, i, "grad");
    add_size(total, tensors[i].size, i);
  }
  return total;
}

}  // namespace

namespace detail {

adam_scalars make_adam_scalars(const adam_options& o, std::int64_t step, float grad_scale,
                               float clip_coef) noexcept {
  // Python floats are doubles: torch computes these in double and the kernels see them as float.
  // Lion has no bias correction: its step size is lr.
  const bool lion = o.mode == adam_mode::lion;
  const double bc1 = lion ? 1.0 : 1.0 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = lion ? 1.0 : 1.0 - std::pow(o.beta2, static_cast<double>(step));
  const bool decoupled = o.mode == adam_mode::adamw || lion;
  return {
      static_cast<float>(o.beta1),
      static_cast<float>(o.beta2),
      static_cast<float>(1.0 - o.beta1),
      static_cast<float>(1.0 - o.beta2),
      static_cast<float>(o.eps),
      static_cast<float>(o.lr / bc1),
      static_cast<float>(1.0 / std::sqrt(bc2)),
      decoupled ? 0.0f : static_cast<float>(o.weight_decay),
      decoupled ? static_cast<float>(1.0 - o.lr * o.weight_decay) : 1.0f,
      grad_multiplier(grad_scale, clip_coef),
  };
}

}  // namespace detail

struct adam_optimizer::impl {
  explicit impl(const adam_options& o)
      : options(o),
        kernels(&detail::select_kernels(o.isa)),
        pool(o.threads != 0 ? o.threads : std::max(1u, std::thread::hardware_concurrency())) {
    options.isa = kernels->isa;
    options.threads = pool.size();
  }

  // Threads worth waking for `total` elements.
  unsigned parts_for(std::size_t total) const noexcept {
    const std::size_t useful = std::max<std::size_t>(1, total / min_per_thread);
    return static_cast<unsigned>(std::min<std::size_t>(pool.size(), useful));
  }

  // Read-only pass over the gradients: (sum of squares, finite). Each tensor is scanned in chunks
  // of grad_scan_t's own float block from its start, each chunk's sum kept apart, and the sums
  // added in one fixed order: the norm, and the clip coefficient taken from it, do not depend on
  // how the chunks were shared between threads (pieces cut anywhere summed their blocks from
  // their own starts, and the partial sums were added in thread order: the norm's last bits
  // changed with the thread count).
  // `grad_mul`: finiteness is that of the gradients times it (adam_kernels::scan).
  detail::grad_scan_result scan(std::span<const adam_tensor> tensors, std::size_t total, dtype grad_dtype,
                                float grad_mul) {
    constexpr std::size_t kChunk = 4096;  // = grad_scan_t's block
    std::vector<std::size_t> first(tensors.size() + 1, 0);  // each tensor's first chunk
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      first[t + 1] = first[t] + (tensors[t].size + kChunk - 1) / kChunk;
    }
    const std::size_t chunks = first.back();
    std::vector<double> sums(chunks, 0.0);
    std::vector<std::uint8_t> finite(pool.size(), 1);
    const unsigned parts = parts_for(total);
    pool.run([&](unsigned k) {
      if (k >= parts) return;
      const std::size_t end = chunks * (k + 1) / parts;
      std::size_t c = chunks * k / parts;
      std::size_t t = static_cast<std::size_t>(std::upper_bound(first.begin(), first.end(), c) - first.begin()) - 1;
      for (; c < end; ++c) {
        while (c >= first[t + 1]) ++t;
        const std::size_t b = (c - first[t]) * kChunk;
        const std::size_t n = std::min(tensors[t].size - b, kChunk);
        const auto* g = static_cast<const std::byte*>(tensors[t].grad) + b * size_of(grad_dtype);
        const detail::grad_scan_result r = kernels->scan(g, grad_dtype, n, grad_mul);
        sums[c] = r.sum_squares;
        if (!r.finite) finite[k] = 0;
      }
    }, parts);
    detail::grad_scan_result all{0.0, true};
    for (const double x : sums) all.sum_squares += x;
    for (const std::uint8_t f : finite) all.finite = all.finite && f != 0;
    return all;
  }

  adam_options options;
  const detail::adam_kernels* kernels;
  detail::thread_pool pool;
  std::mutex mutex;  // one step or norm at a time; the pool and the counter are shared
  std::atomic<std::int64_t> steps{0};
};

void adam_optimizer::check_options(const adam_options& options) { check_adam_options(options); }

adam_optimizer::adam_optimizer(const adam_options& options) {
  check_options(options);
  impl_ = std::make_unique<impl>(options);
}

adam_optimizer::~adam_optimizer() = default;

std::int64_t adam_optimizer::step_count() const noexcept { return impl_->steps.load(std::memory_order_relaxed); }

void adam_optimizer::set_step_count(std::int64_t step) {
  // The next step computes step + 1 (signed overflow at INT64_MAX).
  TERRACE_EXPECTS(step >= 0 && step < INT64_MAX,
                  "adam: the step count must be in [0, 2^63 - 1), got " + std::to_string(step));
  std::lock_guard lock(impl_->mutex);
  impl_->steps.store(step, std::memory_order_relaxed);
}

void adam_optimizer::set_lr(double lr) {
  TERRACE_EXPECTS(std::isfinite(lr) && lr > 0, "adam: lr must be > 0, got " + std::to_string(lr));
  std::lock_guard lock(impl_->mutex);
  impl_->options.lr = lr;
}

adam_options adam_optimizer::options() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->options;
}

grad_norm_result adam_optimizer::grad_norm(std::span<const adam_tensor> tensors, dtype grad_dtype,
                                           float grad_scale) {
  check_dtype(grad_dtype, "grad");
  check_scale(grad_scale);
  const std::size_t total = checked_grads_total(tensors, grad_dtype);
  std::lock_guard lock(impl_->mutex);
  // finite: also after unscaling, so that a caller passing it on as grads_known_finite makes the
  // step skip what the step's own check would skip (clip_coef <= 1 only shrinks the values).
  const detail::grad_scan_result r = impl_->scan(tensors, total, grad_dtype, grad_multiplier(grad_scale, 1.0f));
  return {std::sqrt(r.sum_squares) / grad_scale, r.finite};
}

bool adam_optimizer::grads_finite(std::span<const adam_tensor> tensors, const adam_step_options& so) {
  check_dtype(so.grad_dtype, "grad");
  const float grad_mul = checked_grad_multiplier(so);
  const std::size_t total = checked_grads_total(tensors, so.grad_dtype);
  std::lock_guard lock(impl_->mutex);
  return impl_->scan(tensors, total, so.grad_dtype, grad_mul).finite;
}

bool adam_optimizer::step(const adam_buffers& b, const adam_step_options& so) {
  const std::size_t n = b.param.size();
  const std::size_t state = size_of(impl_->options.state_dtype);
  check_dtype(so.grad_dtype, "grad");
  check_dtype(so.copy_dtype, "copy");
  auto check_length = [n](std::size_t bytes, std::size_t element, const char* name) {
    TERRACE_EXPECTS(bytes == n * element, std::string("adam: ") + name + " holds " + std::to_string(bytes) +
                                              " bytes but param has " + std::to_string(n) +
                                              " elements, so it needs " + std::to_string(n * element));
  };
  check_length(b.exp_avg.size(), state, "exp_avg");
  const bool lion = impl_->options.mode == adam_mode::lion;
  if (!lion || !b.exp_avg_sq.empty()) check_length(b.exp_avg_sq.size(), state, "exp_avg_sq");
  check_length(b.grad.size(), size_of(so.grad_dtype), "grad");
  if (!b.param_copy.empty()) check_length(b.param_copy.size(), size_of(so.copy_dtype), "param_copy");
  const adam_tensor t{b.param.data(), b.exp_avg.data(), lion ? nullptr : b.exp_avg_sq.data(), b.grad.data(),
                      b.param_copy.empty() ? nullptr : b.param_copy.data(), n};
  return step(std::span<const adam_tensor>(&t, 1), so);
}

bool adam_optimizer::step(std::span<const adam_tensor> tensors, const adam_step_options& so) {
  check_dtype(so.grad_dtype, "grad");
  check_dtype(so.copy_dtype, "copy");
  const float grad_mul = checked_grad_multiplier(so);
  const dtype state = impl_->options.state_dtype;
  const bool lion = impl_->options.mode == adam_mode::lion;
  std::size_t total = 0;
  std::size_t with_copy = 0;
  std::size_t non_empty = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const adam_tensor& t = tensors[i];
    if (t.size == 0) continue;
    ++non_empty;
    check_buffer(t.param, dtype::f32, i, "param");
    check_buffer(t.exp_avg, state, i, "exp_avg");
    if (!lion) check_buffer(t.exp_avg_sq, state, i, "exp_avg_sq");
    check_buffer(t.grad, so.grad_dtype, i, "grad");
    if (t.param_copy != nullptr) {
      check_buffer(t.param_copy, so.copy_dtype, i, "param_copy");
      ++with_copy;
    }
    add_size(total, t.size, i);
  }
  TERRACE_EXPECTS(with_copy == 0 || with_copy == non_empty,
                  "adam: param_copy is set on " + std::to_string(with_copy) + " of " +
                      std::to_string(non_empty) + " tensors; set it on all or none");

  std::lock_guard lock(impl_->mutex);
  // The next step's number must fit (signed overflow; torch's counter would go on as a float).
  TERRACE_EXPECTS(impl_->steps.load(std::memory_order_relaxed) < INT64_MAX,
                  "adam: the step counter is at its maximum, 2^63 - 1; set_step_count() to go on");
  if (so.check_finite && !so.grads_known_finite && !impl_->scan(tensors, total, so.grad_dtype, grad_mul).finite) {
    return false;
  }

  const std::int64_t t = impl_->steps.load(std::memory_order_relaxed) + 1;
  const detail::adam_scalars s = detail::make_adam_scalars(impl_->options, t, so.grad_scale, so.clip_coef);
  const detail::adam_config c{so.grad_dtype, state, so.copy_dtype, with_copy != 0, lion};
  const std::size_t gsize = size_of(so.grad_dtype);
  const std::size_t ssize = size_of(state);
  const std::size_t csize = size_of(so.copy_dtype);

  const unsigned parts = impl_->parts_for(total);
  const std::vector<position> cuts = split(tensors, total, parts);
  const detail::adam_kernels& k = *impl_->kernels;
  impl_->pool.run([&](unsigned part) {
    if (part >= parts) return;
    for_each_piece(tensors, cuts[part], cuts[part + 1], [&](std::size_t i, std::size_t b, std::size_t e) {
      const adam_tensor& x = tensors[i];
      const detail::adam_span span{
          x.param + b,
          static_cast<std::byte*>(x.exp_avg) + b * ssize,
          lion ? nullptr : static_cast<std::byte*>(x.exp_avg_sq) + b * ssize,
          static_cast<const std::byte*>(x.grad) + b * gsize,
          c.has_copy ? static_cast<std::byte*>(x.param_copy) + b * csize : nullptr,
          e - b,
      };
      k.update(s, c, span);
    });
  }, parts);
  impl_->steps.store(t, std::memory_order_relaxed);
  return true;
}

}  // namespace terrace
