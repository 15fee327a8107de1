// SPDX-License-Identifier: Apache-2.0
// A transformer training step written as the allocations PyTorch's eager mode makes for it.
//
// Sections: random numbers and addresses / model shape / forward / loss and backward / optimizer.
#include "trace_generator.hpp"

#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <utility>

#include "terrace/error.hpp"

namespace terrace::tracegen {

namespace {

constexpr std::size_t kRound = 512;  // the caching allocator's rounding, so size = what it would hand out

std::size_t round_up(std::size_t n) noexcept { return (n + kRound - 1) / kRound * kRound; }

// ------------------------------------------------------------ random numbers and addresses

// splitmix64: the same stream on every platform and standard library, unlike std distributions.
class rng {
 public:
  explicit rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi]; the modulo bias is irrelevant at these ranges.
  std::uint64_t between(std::uint64_t lo, std::uint64_t hi) noexcept {
    return lo + next() % (hi - lo + 1);
  }

 private:
  std::uint64_t state_;
};

struct block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;
  std::uintptr_t stream = 0;
};

// Emits events and hands out addresses. A freed address serves the next request of the same rounded
// size (most recently freed first), as a caching allocator's exact-fit reuse would; otherwise fresh
// addresses come from a bump pointer, so two live blocks never overlap.
class recorder {
 public:
  explicit recorder(bool emit_free_completed) : emit_free_completed_(emit_free_completed) {}

  block alloc(std::size_t bytes, std::uintptr_t stream, std::string tag) {
    block b;
    b.requested = bytes;
    b.size = round_up(bytes);
    b.stream = stream;
    auto& reusable = free_addrs_[{stream, b.size}];
    if (!reusable.empty()) {
      b.addr = reusable.back();
      reusable.pop_back();
    } else {
      b.addr = next_addr_;
      next_addr_ += b.size;
    }
    emit(trace_action::alloc, b, std::move(tag));
    return b;
  }

  void free(const block& b) {
    emit(trace_action::free_requested, b, {});
    if (emit_free_completed_) emit(trace_action::free_completed, b, {});
    free_addrs_[{b.stream, b.size}].push_back(b.addr);
  }

  // A temporary that dies right away (reduction scratch, casts).
  void scratch(std::size_t bytes, std::uintptr_t stream, std::string tag) {
    free(alloc(bytes, stream, std::move(tag)));
  }

  // The caller's iteration mark (no block). It takes no time, so that a marked trace is the
  // unmarked one with the marks added.
  void mark(trace_action action) {
    trace_event e;
    e.action = action;
    e.time_ns = time_ns_;
    events_.push_back(std::move(e));
  }

  std::vector<trace_event> take() { return std::move(events_); }

 private:
  void emit(trace_action action, const block& b, std::string tag) {
    // A plausible clock: a fixed launch cost plus time proportional to the bytes produced.
    time_ns_ += 700 + b.size / 256;
    trace_event e;
    e.action = action;
    e.time_ns = time_ns_;
    e.stream = b.stream;
    e.addr = b.addr;
    e.size = b.size;
    e.requested = b.requested;
    e.tag = std::move(tag);
    events_.push_back(std::move(e));
  }

  bool emit_free_completed_;
  std::uint64_t time_ns_ = 0;
  std::uintptr_t next_addr_ = 0x7f0000000000;
  std::map<std::pair<std::uintptr_t, std::size_t>, std::vector<std::uintptr_t>> free_addrs_;
  std::vector<trace_event> events_;
};

// ------------------------------------------------------------------------------ model shape

struct param {
  std::string name;
  std::size_t numel = 0;
  int layer = -1;  // -1: embeddings and the final layer norm
};

std::vector<param> model_params(const training_trace_options& o) {
  const std::size_t h = o.hidden;
  std::vector<param> ps;
  ps.push_back({"embed.w", o.vocab * h, -1});  // tied with the LM head
  ps.push_back({"pos.w", 2 * o.seq_len * h, -1});
  for (int l = 0; l < o.layers; ++l) {
    const std::string p = "L" + std::to_string(l) + ".";
    ps.push_back({p + "ln1.w", h, l});
    ps.push_back({p + "ln1.b", h, l});
    ps.push_back({p + "qkv.w", 3 * h * h, l});
    ps.push_back({p + "qkv.b", 3 * h, l});
    ps.push_back({p + "proj.w", h * h, l});
    ps.push_back({p + "proj.b", h, l});
    ps.push_back({p + "ln2.w", h, l});
    ps.push_back({p + "ln2.b", h, l});
    ps.push_back({p + "fc1.w", 4 * h * h, l});
    ps.push_back({p + "fc1.b", 4 * h, l});
    ps.push_back({p + "fc2.w", 4 * h * h, l});
    ps.push_back({p + "fc2.b", h, l});
  }
  ps.push_back({"lnf.w", h, -1});
  ps.push_back({"lnf.b", h, -1});
  return ps;
}

// What one layer's forward keeps for its backward.
struct layer_saved {
  block x;  // the layer's input: the previous layer's output, owned from here on
  block ln1_out, ln1_stats, qkv, probs, attn_mask, dprobs, ctx, h1, proj_mask, ln2_out, ln2_stats,
      fc1, gelu, fc2_mask;
};

class training_job {
 public:
  explicit training_job(const training_trace_options& o)
      : o_(o), rec_(o.emit_free_completed), rng_(o.seed), params_(model_params(o)) {
    heads_ = o.heads != 0 ? o.heads : std::max<std::size_t>(1, o.hidden / 64);
  }

  std::vector<trace_event> run() {
    const std::vector<std::size_t> seq_lens = plan_sequence_lengths();
    for (const param& p : params_) param_blocks_.push_back(alloc_c(p.numel * o_.element_size, p.name));
    for (int it = 0; it < o_.iterations; ++it) {
      if (o_.mark_iterations) rec_.mark(trace_action::iteration_begin);
      iteration(seq_lens[static_cast<std::size_t>(it)]);
      if (o_.mark_iterations) rec_.mark(trace_action::iteration_end);
    }
    return rec_.take();
  }

 private:
  // Iteration 0 always has the nominal length: the warm-up that a planner would learn from.
  std::vector<std::size_t> plan_sequence_lengths() {
    std::vector<std::size_t> lens(static_cast<std::size_t>(o_.iterations), o_.seq_len);
    if (o_.length_buckets > 0) {
      const auto n = static_cast<std::size_t>(o_.length_buckets);
      for (std::size_t it = 1; it < lens.size(); ++it) {
        const std::size_t k = rng_.between(1, n);
        lens[it] = std::max<std::size_t>(8, o_.seq_len * k / n / 8 * 8);
      }
      return lens;
    }
    std::vector<std::size_t> candidates;
    for (int it = 1; it < o_.iterations; ++it) candidates.push_back(static_cast<std::size_t>(it));
    for (std::size_t k = 0; k < static_cast<std::size_t>(o_.dynamic_iterations); ++k) {
      const std::size_t pick = k + rng_.between(0, candidates.size() - 1 - k);
      std::swap(candidates[k], candidates[pick]);
      const std::size_t lo = std::max<std::size_t>(8, o_.seq_len / 2 / 8 * 8);
      const std::size_t hi = std::max<std::size_t>(lo, o_.seq_len * 3 / 2 / 8 * 8);
      std::size_t s = rng_.between(lo / 8, hi / 8) * 8;
      if (s == o_.seq_len) s += 8;
      lens[candidates[k]] = s;
    }
    return lens;
  }

  block alloc_c(std::size_t bytes, std::string tag) {
    return rec_.alloc(bytes, o_.compute_stream, std::move(tag));
  }
  void free(const block& b) { rec_.free(b); }

  // Kernels' small workspaces: reductions, index buffers, cuBLAS scratch.
  // With shape_determined_scratch, the workspace depends only on the call site and the shapes,
  // as a real kernel's does: every iteration of the same shape then repeats it exactly.
  void small_scratch(const std::string& where) {
    rng site(o_.seed ^ std::hash<std::string>{}(where) ^ (seq_ * 0x9e3779b97f4a7c15ull));
    rng& r = o_.shape_determined_scratch ? site : rng_;
    const auto n = r.between(1, 3);
    for (std::uint64_t i = 0; i < n; ++i) {
      rec_.scratch(r.between(64, 64 << 10), o_.compute_stream, where + ".scratch");
    }
  }

  // ------------------------------------------------------------------------------ forward

  layer_saved layer_forward(int l, block x) {
    const std::string p = "L" + std::to_string(l) + ".";
    const std::size_t e = o_.element_size;
    const std::size_t th = tokens_ * o_.hidden;
    const std::size_t att = o_.batch * heads_ * seq_ * seq_;
    layer_saved s;
    s.x = x;
    s.ln1_out = alloc_c(th * e, p + "ln1.out");
    s.ln1_stats = alloc_c(tokens_ * 2 * 4, p + "ln1.stats");
    small_scratch(p + "ln1");
    s.qkv = alloc_c(3 * th * e, p + "qkv.out");
    const block scores = alloc_c(att * e, p + "attn.scores");
    s.probs = alloc_c(att * e, p + "attn.probs");
    free(scores);
    s.attn_mask = alloc_c(att, p + "attn.dropmask");
    s.dprobs = alloc_c(att * e, p + "attn.dprobs");
    s.ctx = alloc_c(th * e, p + "attn.ctx");
    const block proj = alloc_c(th * e, p + "proj.out");
    s.proj_mask = alloc_c(th, p + "proj.dropmask");
    s.h1 = alloc_c(th * e, p + "resid1");
    free(proj);
    s.ln2_out = alloc_c(th * e, p + "ln2.out");
    s.ln2_stats = alloc_c(tokens_ * 2 * 4, p + "ln2.stats");
    s.fc1 = alloc_c(4 * th * e, p + "fc1.out");
    s.gelu = alloc_c(4 * th * e, p + "gelu.out");
    const block fc2 = alloc_c(th * e, p + "fc2.out");
    s.fc2_mask = alloc_c(th, p + "fc2.dropmask");
    small_scratch(p + "mlp");
    free(fc2);
    return s;
  }

  // ------------------------------------------------------------------- loss and backward

  void param_grad(const std::string& name) {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].name != name) continue;
      grads_.push_back(alloc_c(params_[i].numel * o_.element_size, name + ".grad"));
      bucket_fill_ += params_[i].numel * o_.element_size;
      if (bucket_fill_ >= o_.bucket_bytes) flush_bucket();
      return;
    }
  }

  // DDP: gradients are copied into a bucket (made on first use, then kept) and all-reduced on the
  // communication stream, whose scratch dies with the collective.
  void flush_bucket() {
    if (bucket_fill_ == 0) return;
    if (bucket_index_ == buckets_.size()) {
      buckets_.push_back(alloc_c(bucket_fill_, "ddp.bucket" + std::to_string(bucket_index_)));
    }
    rec_.scratch(std::max<std::size_t>(bucket_fill_ / 8, 1), o_.comm_stream,
                 "ddp.allreduce" + std::to_string(bucket_index_));
    ++bucket_index_;
    bucket_fill_ = 0;
  }

  // `g` is the gradient of the layer's output; returns the gradient of its input. Frees everything
  // the forward saved, the layer's input included.
  block layer_backward(int l, const layer_saved& s, block g) {
    const std::string p = "L" + std::to_string(l) + ".";
    const std::size_t e = o_.element_size;
    const std::size_t th = tokens_ * o_.hidden;
    const std::size_t att = o_.batch * heads_ * seq_ * seq_;
    const std::size_t partial = (tokens_ + 63) / 64 * o_.hidden * 4;  // per-block LN partial sums

    // MLP: h2 = h1 + dropout(fc2(gelu(fc1(ln2(h1)))))
    const block g_fc2 = alloc_c(th * e, p + "fc2.gin");
    free(s.fc2_mask);
    param_grad(p + "fc2.w");
    param_grad(p + "fc2.b");
    const block g_gelu = alloc_c(4 * th * e, p + "gelu.gin");
    free(g_fc2);
    free(s.gelu);
    const block g_fc1 = alloc_c(4 * th * e, p + "fc1.gin");
    free(g_gelu);
    free(s.fc1);
    param_grad(p + "fc1.w");
    param_grad(p + "fc1.b");
    const block g_ln2 = alloc_c(th * e, p + "ln2.gin");
    free(g_fc1);
    free(s.ln2_out);
    rec_.scratch(partial, o_.compute_stream, p + "ln2.partial");
    param_grad(p + "ln2.w");
    param_grad(p + "ln2.b");
    const block g_h1 = alloc_c(th * e, p + "resid1.gin");  // += g in place (the residual)
    free(g_ln2);
    free(s.ln2_stats);
    free(g);

    // Attention: h1 = x + dropout(proj(softmax(q k^T) v))
    const block g_proj = alloc_c(th * e, p + "proj.gin");
    free(s.proj_mask);
    param_grad(p + "proj.w");
    param_grad(p + "proj.b");
    const block g_ctx = alloc_c(th * e, p + "attn.ctx.gin");
    free(g_proj);
    free(s.ctx);
    const block g_dprobs = alloc_c(att * e, p + "attn.dprobs.gin");
    const block g_v = alloc_c(th * e, p + "attn.v.gin");
    free(s.dprobs);
    const block g_probs = alloc_c(att * e, p + "attn.probs.gin");
    free(g_dprobs);
    free(s.attn_mask);
    const block g_scores = alloc_c(att * e, p + "attn.scores.gin");
    free(g_probs);
    free(s.probs);
    const block g_q = alloc_c(th * e, p + "attn.q.gin");
    const block g_k = alloc_c(th * e, p + "attn.k.gin");
    free(g_scores);
    small_scratch(p + "attn.bwd");
    const block g_qkv = alloc_c(3 * th * e, p + "qkv.gin");
    free(g_q);
    free(g_k);
    free(g_v);
    free(g_ctx);
    param_grad(p + "qkv.w");
    param_grad(p + "qkv.b");
    const block g_ln1 = alloc_c(th * e, p + "ln1.gin");
    free(g_qkv);
    free(s.qkv);
    rec_.scratch(partial, o_.compute_stream, p + "ln1.partial");
    param_grad(p + "ln1.w");
    param_grad(p + "ln1.b");
    const block g_x = alloc_c(th * e, p + "x.gin");  // += g_h1 in place (the residual)
    free(g_ln1);
    free(s.ln1_out);
    free(s.ln1_stats);
    free(s.h1);
    free(g_h1);
    free(s.x);
    return g_x;
  }

  void iteration(std::size_t seq) {
    seq_ = seq;
    tokens_ = o_.batch * seq;
    const std::size_t e = o_.element_size;
    const std::size_t th = tokens_ * o_.hidden;
    const std::size_t tv = tokens_ * o_.vocab;

    // Forward.
    const block ids = alloc_c(tokens_ * 8, "input_ids");
    rec_.scratch(seq * 8, o_.compute_stream, "pos_ids");
    block x = alloc_c(th * e, "embed.out");
    std::vector<layer_saved> saved;
    for (int l = 0; l < o_.layers; ++l) {
      saved.push_back(layer_forward(l, x));
      x = alloc_c(th * e, "L" + std::to_string(l) + ".out");
    }
    const block lnf_out = alloc_c(th * e, "lnf.out");
    const block lnf_stats = alloc_c(tokens_ * 2 * 4, "lnf.stats");
    const block logits = alloc_c(tv * e, "logits");
    const block logp = alloc_c(tv * 4, "log_softmax");  // computed in fp32
    const block loss = alloc_c(4, "loss");

    // Backward, deepest first.
    const block g_loss = alloc_c(4, "loss.grad");
    const block g_logp = alloc_c(tv * 4, "log_softmax.gin");
    const block g_logits32 = alloc_c(tv * 4, "logits.gin.fp32");
    free(g_logp);
    free(logp);
    const block g_logits = alloc_c(tv * e, "logits.gin");
    free(g_logits32);
    free(logits);
    param_grad("embed.w");  // the tied LM head's gradient lands in the embedding's
    const block g_lnf = alloc_c(th * e, "lnf.gin");
    free(g_logits);
    free(lnf_out);
    param_grad("lnf.w");
    param_grad("lnf.b");
    block g = alloc_c(th * e, "L" + std::to_string(o_.layers - 1) + ".out.gin");
    free(g_lnf);
    free(lnf_stats);
    free(x);  // the last layer's output, kept for the final layer norm
    for (int l = o_.layers - 1; l >= 0; --l) {
      g = layer_backward(l, saved[static_cast<std::size_t>(l)], g);
    }
    rec_.scratch(th * 4, o_.compute_stream, "embed.index_add");
    param_grad("pos.w");
    free(g);
    free(ids);
    flush_bucket();
    bucket_index_ = 0;

    optimizer_step();
    free(loss);
    free(g_loss);
  }

  // ---------------------------------------------------------------------------- optimizer

  // torch.optim.AdamW with fp32 master weights: state on the first step, then per layer group a
  // clip-norm partial, an fp32 unscaled-gradient temporary, and zero_grad(set_to_none).
  void optimizer_step() {
    if (!optimizer_ready_) {
      for (const param& p : params_) optimizer_state_.push_back(alloc_c(p.numel * 4, p.name + ".master"));
      for (const param& p : params_) optimizer_state_.push_back(alloc_c(p.numel * 4, p.name + ".exp_avg"));
      for (const param& p : params_) optimizer_state_.push_back(alloc_c(p.numel * 4, p.name + ".exp_avg_sq"));
      optimizer_ready_ = true;
    }
    const block norm = alloc_c(4 * params_.size(), "clip.norms");
    for (int l = -1; l < o_.layers; ++l) {
      std::size_t numel = 0;
      for (const param& p : params_) {
        if (p.layer == l) numel += p.numel;
      }
      const std::string group = l < 0 ? "embed" : "L" + std::to_string(l);
      rec_.scratch(numel * 4, o_.compute_stream, group + ".grad.fp32");
      small_scratch(group + ".adam");
    }
    free(norm);
    for (const block& gr : grads_) free(gr);
    grads_.clear();
  }

  const training_trace_options o_;
  recorder rec_;
  rng rng_;
  std::vector<param> params_;
  std::size_t heads_ = 1;
  std::size_t seq_ = 0;
  std::size_t tokens_ = 0;
  std::vector<block> param_blocks_;
  std::vector<block> optimizer_state_;
  bool optimizer_ready_ = false;
  std::vector<block> grads_;
  std::vector<block> buckets_;
  std::size_t bucket_index_ = 0;
  std::size_t bucket_fill_ = 0;
};

void validate(const training_trace_options& o) {
  TERRACE_EXPECTS(o.layers > 0, "trace generator: layers must be positive");
  TERRACE_EXPECTS(o.iterations > 0, "trace generator: iterations must be positive");
  TERRACE_EXPECTS(o.hidden > 0 && o.seq_len > 0 && o.batch > 0 && o.vocab > 0,
                  "trace generator: hidden, seq_len, batch and vocab must be positive");
  TERRACE_EXPECTS(o.element_size > 0, "trace generator: element_size must be positive");
  TERRACE_EXPECTS(o.bucket_bytes > 0, "trace generator: bucket_bytes must be positive");
  TERRACE_EXPECTS(o.dynamic_iterations >= 0 && o.dynamic_iterations < o.iterations,
                  "trace generator: dynamic_iterations must be in [0, iterations - 1] (iteration 0 "
                  "keeps the nominal sequence length)");
  TERRACE_EXPECTS(o.length_buckets >= 0, "trace generator: length_buckets must not be negative");
  TERRACE_EXPECTS(o.length_buckets == 0 || o.dynamic_iterations == 0,
                  "trace generator: length_buckets and dynamic_iterations exclude each other");
  TERRACE_EXPECTS(o.compute_stream != o.comm_stream,
                  "trace generator: compute_stream and comm_stream must differ");
}

}  // namespace

std::vector<trace_event> generate_training_trace(const training_trace_options& options) {
  validate(options);
  return training_job(options).run();
}

}  // namespace terrace::tracegen
