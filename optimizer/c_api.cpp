// SPDX-License-Identifier: Apache-2.0
// The C ABI of the optimizer (terrace/optimizer.h), linked into libterrace.so. Every entry point
// runs its body inside guarded(): exceptions stop here and become a status code plus a per-thread
// message.
#include "terrace/optimizer.h"

#include <cstdint>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "terrace/adam.hpp"
#include "terrace/error.hpp"
#include "allocator/c_boundary.hpp"

struct terrace_adam {
  explicit terrace_adam(const terrace::adam_options& o) : optimizer(o) {}
  terrace::adam_optimizer optimizer;
};

namespace {

using terrace::c_boundary::guarded;

terrace::adam_optimizer& get(terrace_adam* adam) {
  TERRACE_EXPECTS(adam != nullptr, "the optimizer handle is NULL");
  return adam->optimizer;
}

terrace::dtype to_dtype(int t, const char* what) {
  TERRACE_EXPECTS(t == TERRACE_DTYPE_F32 || t == TERRACE_DTYPE_BF16 || t == TERRACE_DTYPE_F16,
                  std::string(what) + " dtype " + std::to_string(t) + " is not F32, BF16 or F16");
  return static_cast<terrace::dtype>(t);
}

template <class T>
void check_array(T* array, size_t count, const char* name) {
  TERRACE_EXPECTS(count == 0 || array != nullptr, std::string("the array ") + name + " is NULL");
}

// No caller holds that many tensors: a larger count is a negative one converted to size_t, which
// otherwise failed to size the tensor list and came back as TERRACE_EINTERNAL, "a bug".
void check_count(size_t count) {
  constexpr size_t max_count = PTRDIFF_MAX / sizeof(terrace::adam_tensor);
  TERRACE_EXPECTS(count <= max_count, "count " + std::to_string(count) +
                                          " is larger than any tensor list "
                                          "(a negative count converted to size_t?)");
}

}  // namespace

extern "C" {

TERRACE_API int terrace_adam_create(int mode, double lr, double beta1, double beta2, double eps,
                                    double weight_decay, int state_dtype, int threads,
                                    terrace_adam** out) {
  return guarded("terrace_adam_create", [&] {
    TERRACE_EXPECTS(out != nullptr, "out is NULL");
    *out = nullptr;
    TERRACE_EXPECTS(mode == TERRACE_ADAM || mode == TERRACE_ADAMW || mode == TERRACE_LION,
                    "mode " + std::to_string(mode) + " is not TERRACE_ADAM, TERRACE_ADAMW or TERRACE_LION");
    TERRACE_EXPECTS(threads >= 0, "threads must be >= 0, got " + std::to_string(threads));
    terrace::adam_options o;
    o.mode = static_cast<terrace::adam_mode>(mode);
    o.lr = lr;
    o.beta1 = beta1;
    o.beta2 = beta2;
    o.eps = eps;
    o.weight_decay = weight_decay;
    o.state_dtype = to_dtype(state_dtype, "state");
    o.threads = static_cast<unsigned>(threads);
    *out = new terrace_adam(o);
  });
}

TERRACE_API void terrace_adam_destroy(terrace_adam* adam) { delete adam; }

TERRACE_API int terrace_adam_step(terrace_adam* adam, size_t count, float* const* params,
                                  void* const* exp_avgs, void* const* exp_avg_sqs,
                                  const void* const* grads, void* const* param_copies,
                                  const size_t* sizes, int grad_dtype, int copy_dtype,
                                  float grad_scale, float clip_coef, int check_finite,
                                  int* stepped) {
  return guarded("terrace_adam_step", [&] {
    if (stepped != nullptr) *stepped = 0;
    auto& optimizer = get(adam);
    check_count(count);
    check_array(params, count, "params");
    check_array(exp_avgs, count, "exp_avgs");
    const bool lion = optimizer.options().mode == terrace::adam_mode::lion;
    if (!lion) check_array(exp_avg_sqs, count, "exp_avg_sqs");
    check_array(grads, count, "grads");
    check_array(sizes, count, "sizes");
    std::vector<terrace::adam_tensor> tensors(count);
    for (size_t i = 0; i < count; ++i) {
      tensors[i] = {params[i], exp_avgs[i], exp_avg_sqs != nullptr ? exp_avg_sqs[i] : nullptr, grads[i],
                    param_copies != nullptr ? param_copies[i] : nullptr, sizes[i]};
    }
    terrace::adam_step_options so;
    so.grad_dtype = to_dtype(grad_dtype, "grad");
    so.copy_dtype = to_dtype(copy_dtype, "copy");
    so.grad_scale = grad_scale;
    so.clip_coef = clip_coef;
    so.check_finite = check_finite != 0;
    const bool done = optimizer.step(tensors, so);
    if (stepped != nullptr) *stepped = done ? 1 : 0;
  });
}

TERRACE_API int terrace_adam_grad_norm(terrace_adam* adam, size_t count, const void* const* grads,
                                       const size_t* sizes, int grad_dtype, float grad_scale,
                                       double* norm, int* finite) {
  return guarded("terrace_adam_grad_norm", [&] {
    auto& optimizer = get(adam);
    TERRACE_EXPECTS(norm != nullptr, "norm is NULL");
    check_count(count);
    check_array(grads, count, "grads");
    check_array(sizes, count, "sizes");
    std::vector<terrace::adam_tensor> tensors(count);
    for (size_t i = 0; i < count; ++i) {
      tensors[i].grad = grads[i];
      tensors[i].size = sizes[i];
    }
    const terrace::grad_norm_result r =
        optimizer.grad_norm(tensors, to_dtype(grad_dtype, "grad"), grad_scale);
    *norm = r.norm;
    if (finite != nullptr) *finite = r.finite ? 1 : 0;
  });
}

TERRACE_API int terrace_adam_get_step(const terrace_adam* adam, int64_t* step) {
  return guarded("terrace_adam_get_step", [&] {
    TERRACE_EXPECTS(adam != nullptr, "the optimizer handle is NULL");
    TERRACE_EXPECTS(step != nullptr, "step is NULL");
    *step = adam->optimizer.step_count();
  });
}

TERRACE_API int terrace_adam_set_step(terrace_adam* adam, int64_t step) {
  return guarded("terrace_adam_set_step", [&] { get(adam).set_step_count(step); });
}

TERRACE_API int terrace_adam_set_lr(terrace_adam* adam, double lr) {
  return guarded("terrace_adam_set_lr", [&] { get(adam).set_lr(lr); });
}

TERRACE_API const char* terrace_adam_isa(const terrace_adam* adam) {
  if (adam == nullptr) return "";
  try {  // options() takes the optimizer's lock, which may throw (std::system_error)
    return terrace::to_string(adam->optimizer.options().isa).data();
  } catch (...) {
    return "";
  }
}


}  // extern "C"
