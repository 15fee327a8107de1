// SPDX-License-Identifier: Apache-2.0
/// @file trace_generator.hpp
/// @brief Generates the allocation trace of a transformer-like training job, deterministically.
///
/// The trace has the shape that real training traces have, so that replay, fragmentation reports and
/// (later) lifetime-aware placement can be exercised without a GPU or PyTorch:
///   - long-lived state: bf16 parameters (before the first iteration) and fp32 master weights and
///     Adam moments (at the first optimizer step, as torch.optim allocates them), never freed;
///   - each iteration: input tokens; per layer a forward pass that keeps activations for backward
///     (layer-norm outputs and statistics, QKV, attention probabilities and dropout masks, MLP
///     hidden states) and frees short-lived temporaries (attention scores, projections, small
///     reduction scratch) at once; the loss over the vocabulary; a backward pass in reverse layer
///     order that frees each layer's activations while allocating activation gradients and
///     parameter gradients; gradient buckets (created during the first backward, then kept) whose
///     all-reduce scratch lives on a separate communication stream; optimizer temporaries; and
///     zero_grad(set_to_none) freeing the parameter gradients.
///   - optionally a few dynamic-shape iterations with another sequence length, or every iteration's
///     length drawn from a few buckets; optionally the caller's iteration marks.
/// Addresses are reused the way a caching allocator reuses them (a freed block's address serves the
/// next request of the same rounded size), so live blocks never overlap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "terrace/trace.hpp"

namespace terrace::tracegen {

struct training_trace_options {
  int layers = 4;
  std::size_t hidden = 512;
  std::size_t seq_len = 256;
  std::size_t batch = 4;
  std::size_t heads = 0;           ///< 0 = hidden / 64 (at least 1)
  std::size_t vocab = 8192;
  int iterations = 3;
  /// How many iterations after the first use another sequence length (between half and 1.5 times
  /// seq_len, a multiple of 8), chosen by the seed.
  int dynamic_iterations = 0;
  /// When > 0, every iteration after the first draws its sequence length from this many buckets,
  /// seq_len * k / length_buckets for k = 1 .. length_buckets (multiples of 8), as a job that
  /// batches text by length does. Not with dynamic_iterations.
  int length_buckets = 0;
  /// Wraps each iteration in iteration_begin / iteration_end events, as a framework that calls
  /// terrace_begin_iteration / terrace_end_iteration records them.
  bool mark_iterations = false;
  std::uint64_t seed = 1;
  std::size_t element_size = 2;    ///< bytes per activation / parameter element (bf16)
  std::size_t bucket_bytes = 25u << 20;  ///< gradient bucket capacity (DDP's default 25 MiB)
  bool emit_free_completed = true; ///< follow each free_requested with a free_completed
  /// Kernel scratch sizes and counts depend only on the call site and shapes (as in a real job),
  /// so that iterations of the same shape repeat exactly; false draws them afresh on every call.
  bool shape_determined_scratch = false;
  std::uintptr_t compute_stream = 0;
  std::uintptr_t comm_stream = 0x5c0;  ///< all-reduce scratch lives here
};

/// @brief The whole trace, oldest event first. Every alloc has size = requested rounded up to
/// 512 B. Parameters, optimizer state and gradient buckets stay live at the end.
/// @throws terrace::logic_error for non-positive layers / iterations / sizes, dynamic_iterations
/// outside [0, iterations - 1], negative length_buckets or both options, element_size 0, or equal
/// compute and comm streams.
std::vector<trace_event> generate_training_trace(const training_trace_options& options);

}  // namespace terrace::tracegen
