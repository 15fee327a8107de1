// SPDX-License-Identifier: Apache-2.0
/// @file adam.hpp
/// @brief The CPU Adam/AdamW optimizer of ZeRO-Offload-style training: fp32 master weights and
/// moments in host memory, updated in one fused, memory-bound pass.
///
/// Semantics are those of torch.optim.Adam (coupled weight decay: the decay is added to the
/// gradient) and torch.optim.AdamW (decoupled: the parameter is multiplied by 1 - lr * wd), with
/// amsgrad, maximize and capturable off. For step t (counted from 1):
///
///     g  = grad * clip_coef / grad_scale          (+ wd * p, Adam only)
///     p  = p * (1 - lr * wd)                      (AdamW only)
///     m  = beta1 * m + (1 - beta1) * g
///     v  = beta2 * v + (1 - beta2) * g * g
///     p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
///
/// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), on the same fused
/// pass, with decoupled weight decay and one moment (exp_avg; exp_avg_sq is not used):
///
///     g  = grad * clip_coef / grad_scale
///     p  = p * (1 - lr * wd)
///     p  = p - lr * sign(beta1 * m + (1 - beta1) * g)      (sign(0) = 0, sign(NaN) = NaN)
///     m  = beta2 * m + (1 - beta2) * g
///
/// The optimizer owns no tensor memory: callers pass spans (one flat buffer, or many tensors),
/// so the buffers can live wherever the tier manager put them (pinned host pools).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

namespace terrace {

/// @brief Element types of optimizer buffers.
enum class dtype : int { f32 = 0, bf16 = 1, f16 = 2 };

/// @brief Bytes per element of `t`.
constexpr std::size_t size_of(dtype t) noexcept { return t == dtype::f32 ? 4 : 2; }
/// @brief "f32", "bf16" or "f16".
std::string_view to_string(dtype t) noexcept;

/// @brief torch.optim.Adam (L2 penalty added to the gradient), torch.optim.AdamW (decoupled), or
/// Lion (decoupled; its usual settings are beta2 0.99 and a 3-10x smaller lr than AdamW's).
enum class adam_mode : int { adam = 0, adamw = 1, lion = 2 };

/// @brief The instruction set a kernel runs with. `automatic` picks the best the CPU supports.
enum class simd_isa : int { automatic = 0, scalar = 1, avx2 = 2, avx512 = 3 };
/// @brief "auto", "scalar", "avx2" or "avx512".
std::string_view to_string(simd_isa isa) noexcept;
/// @brief The best instruction set this CPU (and OS) supports, by CPUID.
simd_isa best_simd_isa() noexcept;

/// @brief Hyperparameters and execution settings, fixed at construction (lr can change).
struct adam_options {
  // Doubles, as torch's Python floats are: 1 - beta2 computed from a float beta2 would be off by
  // 1e-5 relative, far more than float rounding.
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  adam_mode mode = adam_mode::adamw;
  /// Element type of m and v: f32, or bf16 (half the state traffic; rounded to nearest even).
  dtype state_dtype = dtype::f32;
  /// Threads that run a step, the caller's included. 0: std::thread::hardware_concurrency().
  unsigned threads = 0;
  /// automatic: best_simd_isa(), unless TERRACE_ADAM_ISA (scalar|avx2|avx512) says otherwise.
  simd_isa isa = simd_isa::automatic;
};

/// @brief One tensor's buffers, all `size` elements long. Element types come from the options
/// (m, v) and from adam_step_options (grad, param_copy).
struct adam_tensor {
  float* param = nullptr;         ///< fp32 master weights, updated in place
  void* exp_avg = nullptr;        ///< m, state_dtype, updated in place
  void* exp_avg_sq = nullptr;     ///< v, state_dtype, updated in place (lion: unused, may be null)
  const void* grad = nullptr;     ///< the gradient, grad_dtype, read only
  void* param_copy = nullptr;     ///< optional: receives the updated param as copy_dtype
  std::size_t size = 0;
};

/// @brief What one step does besides the update. All of it is fused into the same pass.
struct adam_step_options {
  dtype grad_dtype = dtype::f32;
  /// Type of param_copy (when the tensors have one): bf16 or f16 for the GPU, or f32.
  dtype copy_dtype = dtype::bf16;
  /// The loss scale the gradients carry; they are divided by it (mixed-precision unscaling).
  float grad_scale = 1.0f;
  /// Multiplies the unscaled gradients: clip_coefficient() of the global norm, or 1.
  float clip_coef = 1.0f;
  /// If set, a step whose gradients hold an inf or NaN is skipped: nothing is written and the
  /// step counter does not advance (torch.cuda.amp.GradScaler's behaviour, which checks the
  /// unscaled values: a finite gradient that overflows when divided by a grad_scale < 1 counts). Costs a read-only
  /// scan of the gradients unless `grads_known_finite` says the caller already knows.
  bool check_finite = false;
  /// The caller already checked (grad_norm() reports finiteness): skips the scan.
  bool grads_known_finite = false;
};

/// @brief One flat set of buffers with their lengths in elements (param) and bytes (the rest),
/// for callers that hold spans: adam_optimizer::step checks that the lengths agree.
struct adam_buffers {
  std::span<float> param;
  std::span<std::byte> exp_avg;
  std::span<std::byte> exp_avg_sq;  ///< lion: unused, may be empty
  std::span<const std::byte> grad;
  std::span<std::byte> param_copy;  ///< empty: no copy
};

/// @brief The result of adam_optimizer::grad_norm.
struct grad_norm_result {
  double norm = 0;     ///< L2 norm of grad / grad_scale over all tensors
  bool finite = true;  ///< false if any element of grad / grad_scale is inf or NaN (norm is then
                       ///< meaningless)
};

/// @brief torch.nn.utils.clip_grad_norm_'s coefficient: min(1, max_norm / (norm + 1e-6)).
constexpr float clip_coefficient(double norm, double max_norm) noexcept {
  const double c = max_norm / (norm + 1e-6);
  return c < 1.0 ? static_cast<float>(c) : 1.0f;
}

/// @brief Adam/AdamW over caller-owned buffers, vectorised (AVX-512, AVX2 or scalar, chosen by
/// CPUID) and split over a small pool of threads owned by the optimizer.
///
/// One step reads every buffer once and writes each output once; the work is cut over the
/// concatenation of all tensors, so many small tensors cost what one large one does. Results,
/// grad_norm's included, do not depend on the thread count. Calls on one object are serialised;
/// distinct objects may step
/// concurrently.
class adam_optimizer {
 public:
  /// @brief Checks the options and starts the threads.
  /// @throws terrace::logic_error if lr <= 0, a beta is outside [0, 1), eps <= 0, weight_decay < 0
  /// (or any is not finite), state_dtype is f16, or the requested isa is unknown or not supported
  /// here; terrace::out_of_memory when the threads cannot be started.
  explicit adam_optimizer(const adam_options& options);
  /// @brief The constructor's checks of `options`, without starting anything: for a caller that
  /// makes other things (files, a store) before the optimizer and wants bad options refused first.
  /// @throws terrace::logic_error as the constructor.
  static void check_options(const adam_options& options);
  ~adam_optimizer();
  adam_optimizer(const adam_optimizer&) = delete;
  adam_optimizer& operator=(const adam_optimizer&) = delete;

  /// @brief Advances the step counter and updates every tensor; returns false (and changes
  /// nothing at all) if check_finite found an inf or NaN gradient.
  /// @throws terrace::logic_error on a null or misaligned buffer (each must be aligned to its
  /// element size), a tensor with size 0 is allowed; param_copy set on some tensors but not all;
  /// grad_scale <= 0, clip_coef < 0, either not finite, or clip_coef / grad_scale beyond float's
  /// range; sizes adding up past 2^61 elements (a negative length converted to size_t); the step
  /// counter already at INT64_MAX. Nothing is written when it throws. Not checked: buffers
  /// that overlap, whether a param and its own state or two tensors of the list (each must be
  /// distinct memory: the threads split the tensors between them, and an element seen twice
  /// would be updated twice, racing).
  bool step(std::span<const adam_tensor> tensors, const adam_step_options& step_options = {});

  /// @brief step() over one flat set of buffers.
  /// @throws terrace::logic_error as step(), and if a buffer's byte length is not param.size()
  /// times its element size.
  bool step(const adam_buffers& buffers, const adam_step_options& step_options = {});

  /// @brief L2 norm of grad / grad_scale over all tensors (only `grad` and `size` are read), and
  /// whether every element is finite: the read-only pass in front of clipping.
  /// @throws terrace::logic_error on a null or misaligned grad, grad_scale <= 0, or sizes adding up
  /// past 2^61 elements.
  grad_norm_result grad_norm(std::span<const adam_tensor> tensors, dtype grad_dtype,
                             float grad_scale = 1.0f);

  /// @brief Whether step() with these options would find the gradients finite: its check_finite
  /// scan (of grad * clip_coef / grad_scale, what the update multiplies them by), without the
  /// step. For a caller that steps the tensors in several calls and must decide once for all.
  /// @throws terrace::logic_error as step() would for the gradients and the options.
  bool grads_finite(std::span<const adam_tensor> tensors, const adam_step_options& step_options);

  /// @brief Steps taken so far (torch's state["step"]); the next step uses step_count() + 1.
  std::int64_t step_count() const noexcept;
  /// @brief Sets the counter, e.g. when resuming from a checkpoint.
  /// @throws terrace::logic_error if `step` < 0, or INT64_MAX (no next step could be numbered).
  void set_step_count(std::int64_t step);
  /// @brief Changes the learning rate (schedulers). @throws terrace::logic_error unless lr > 0.
  void set_lr(double lr);
  /// @brief The options in force (isa resolved, threads counted), copied under the optimizer's
  /// lock: set_lr() may run on another thread (a reference would be read unlocked beside it).
  /// Waits for a step in progress.
  adam_options options() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace terrace
