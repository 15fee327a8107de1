// SPDX-License-Identifier: Apache-2.0
// A slow, obviously-right float64 reference of the char model (kernels/char_model.hpp): forward,
// loss and every layer's gradient, written from the math with plain loops and nothing shared
// with the implementations but the layer order and layout. The tests check it by central finite
// differences, then check the implementations against it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/char_model.hpp"

namespace terrace::model::testing {

struct reference_result {
  double loss = 0;
  std::vector<std::vector<double>> grads;  ///< per layer, the layout of the parameters
};

/// `params[l]` holds layer l's parameters (weights row-major in x out, then bias); `tokens`
/// batch rows of context+1 bytes. Gradients only when `with_grads`.
inline reference_result reference_step(const char_model_config& c,
                                       const std::vector<std::vector<double>>& params,
                                       const std::uint8_t* tokens, bool with_grads) {
  const int B = c.batch, C = c.context, E = c.embed, W = c.width, L = c.layers, V = c.vocab;
  const int row = C + 1, in = C * E;
  const auto tok = [&](int b, int i) { return static_cast<int>(tokens[b * row + i]); };
  using matrix = std::vector<std::vector<double>>;  // [batch][features]
  const auto make = [&](int cols) { return matrix(static_cast<std::size_t>(B), std::vector<double>(static_cast<std::size_t>(cols), 0.0)); };
  // y = x Wt + b, with Wt the layer's (n_in x n_out) weights and b following them.
  const auto affine = [&](const matrix& x, const std::vector<double>& p, int n_in, int n_out) {
    matrix y = make(n_out);
    for (int b = 0; b < B; ++b) {
      for (int j = 0; j < n_out; ++j) {
        double s = p[static_cast<std::size_t>(n_in) * n_out + j];
        for (int i = 0; i < n_in; ++i) s += x[b][i] * p[static_cast<std::size_t>(i) * n_out + j];
        y[b][j] = s;
      }
    }
    return y;
  };

  // ---- forward
  matrix x0 = make(in);
  for (int b = 0; b < B; ++b)
    for (int ci = 0; ci < C; ++ci)
      for (int k = 0; k < E; ++k) x0[b][ci * E + k] = params[0][static_cast<std::size_t>(tok(b, ci)) * E + k];
  std::vector<matrix> h(static_cast<std::size_t>(L) + 1), r(static_cast<std::size_t>(L) + 1);
  h[0] = affine(x0, params[1], in, W);
  for (auto& v : h[0])
    for (auto& x : v) x = std::max(x, 0.0);
  for (int l = 1; l <= L; ++l) {
    r[l] = affine(h[l - 1], params[static_cast<std::size_t>(l) + 1], W, W);
    h[l] = h[l - 1];
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < W; ++j) {
        r[l][b][j] = std::max(r[l][b][j], 0.0);
        h[l][b][j] += r[l][b][j];
      }
  }
  matrix logits = affine(h[L], params[static_cast<std::size_t>(L) + 2], W, V);
  reference_result out;
  matrix dlogits = make(V);
  for (int b = 0; b < B; ++b) {
    const double top = *std::max_element(logits[b].begin(), logits[b].end());
    double sum = 0;
    for (int j = 0; j < V; ++j) sum += std::exp(logits[b][j] - top);
    out.loss += std::log(sum) + top - logits[b][tok(b, C)];
    for (int j = 0; j < V; ++j) {
      dlogits[b][j] = (std::exp(logits[b][j] - top) / sum - (j == tok(b, C) ? 1.0 : 0.0)) / B;
    }
  }
  out.loss /= B;
  if (!with_grads) return out;

  // ---- backward: for y = x Wt + b, dWt = x^T dy, db = sum_b dy, dx = dy Wt^T.
  out.grads.resize(params.size());
  const auto affine_back = [&](const matrix& x, const matrix& dy, const std::vector<double>& p, int n_in,
                               int n_out, std::vector<double>& g) {
    g.assign(p.size(), 0.0);
    matrix dx = make(n_in);
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < n_out; ++j) {
        g[static_cast<std::size_t>(n_in) * n_out + j] += dy[b][j];
        for (int i = 0; i < n_in; ++i) {
          g[static_cast<std::size_t>(i) * n_out + j] += x[b][i] * dy[b][j];
          dx[b][i] += dy[b][j] * p[static_cast<std::size_t>(i) * n_out + j];
        }
      }
    return dx;
  };
  matrix dh = affine_back(h[L], dlogits, params[static_cast<std::size_t>(L) + 2], W, V,
                          out.grads[static_cast<std::size_t>(L) + 2]);
  for (int l = L; l >= 1; --l) {
    matrix dr = make(W);
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < W; ++j) dr[b][j] = r[l][b][j] > 0 ? dh[b][j] : 0.0;
    const matrix dx = affine_back(h[l - 1], dr, params[static_cast<std::size_t>(l) + 1], W, W,
                                  out.grads[static_cast<std::size_t>(l) + 1]);
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < W; ++j) dh[b][j] += dx[b][j];
  }
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < W; ++j) dh[b][j] = h[0][b][j] > 0 ? dh[b][j] : 0.0;
  const matrix dx0 = affine_back(x0, dh, params[1], in, W, out.grads[1]);
  out.grads[0].assign(params[0].size(), 0.0);
  for (int b = 0; b < B; ++b)
    for (int ci = 0; ci < C; ++ci)
      for (int k = 0; k < E; ++k) out.grads[0][static_cast<std::size_t>(tok(b, ci)) * E + k] += dx0[b][ci * E + k];
  return out;
}

}  // namespace terrace::model::testing
