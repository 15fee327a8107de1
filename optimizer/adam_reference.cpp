// SPDX-License-Identifier: Apache-2.0
#include "optimizer/adam_reference.hpp"

#include <cmath>

#include "optimizer/half.hpp"

namespace terrace::reference {

void adam_step(const adam_options& o, std::int64_t step, std::span<const double> grad,
               double grad_mul, adam_state& state) {
  const double lr = o.lr;
  const double beta1 = o.beta1;
  const double beta2 = o.beta2;
  const double eps = o.eps;
  const double wd = o.weight_decay;
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  for (std::size_t i = 0; i < grad.size(); ++i) {
    double g = grad[i] * grad_mul;
    double& p = state.param[i];
    double& m = state.exp_avg[i];
    double& v = state.exp_avg_sq[i];
    if (o.mode == adam_mode::lion) {
      p *= 1.0 - lr * wd;
      const double c = beta1 * m + (1.0 - beta1) * g;
      p -= lr * (c > 0 ? 1.0 : c < 0 ? -1.0 : c);
      m = beta2 * m + (1.0 - beta2) * g;
      if (o.state_dtype == dtype::bf16) m = detail::bf16_to_float(detail::float_to_bf16(static_cast<float>(m)));
      continue;  // v is not Lion's
    }
    if (o.mode == adam_mode::adamw) {
      p *= 1.0 - lr * wd;  // decoupled: decay the weight itself
    } else if (wd != 0) {
      g += wd * p;  // coupled: an L2 penalty in the gradient (torch skips it for 0: 0 * inf)
    }
    m = beta1 * m + (1.0 - beta1) * g;
    v = beta2 * v + (1.0 - beta2) * g * g;
    const double m_hat = m / bias_correction1;
    const double v_hat = v / bias_correction2;
    p -= lr * m_hat / (std::sqrt(v_hat) + eps);
    // The update uses this step's moments at full precision; only what is stored is rounded.
    if (o.state_dtype == dtype::bf16) {
      m = detail::bf16_to_float(detail::float_to_bf16(static_cast<float>(m)));
      v = detail::bf16_to_float(detail::float_to_bf16(static_cast<float>(v)));
    }
  }
}

}  // namespace terrace::reference
