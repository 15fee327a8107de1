// SPDX-License-Identifier: Apache-2.0
// terrace_gen_trace: writes the JSON-lines allocation trace of a transformer-like training job
// (tests/trace_generator.hpp), for replay, reports and tests without a GPU.
//
// tests/data/sample_trace.jsonl is this program's output with its defaults and --dynamic 2
// (tests/replay_test.cpp repeats the options and checks that the file matches them).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <fstream>
#include <iostream>

#include "terrace/error.hpp"
#include "terrace/trace.hpp"
#include "trace_generator.hpp"

int main(int argc, char** argv) {
  CLI::App app{"Generate the allocation trace of a transformer-like training job (JSON lines)"};
  terrace::tracegen::training_trace_options o;
  o.layers = 6;
  o.iterations = 6;
  std::string output = "-";
  app.add_option("--layers", o.layers, "transformer layers")->capture_default_str();
  app.add_option("--hidden", o.hidden, "hidden size")->capture_default_str();
  app.add_option("--seq-len", o.seq_len, "sequence length")->capture_default_str();
  app.add_option("--batch", o.batch, "micro-batch size")->capture_default_str();
  app.add_option("--heads", o.heads, "attention heads (0 = hidden / 64)")->capture_default_str();
  app.add_option("--vocab", o.vocab, "vocabulary size")->capture_default_str();
  app.add_option("--iterations", o.iterations, "training iterations")->capture_default_str();
  app.add_flag("--steady", o.shape_determined_scratch,
               "kernel scratch depends only on call site and shape, so equal iterations repeat "
               "exactly (as in a real job); the default draws it afresh on every call");
  app.add_option("--dynamic", o.dynamic_iterations,
                 "iterations after the first that use another sequence length")
      ->capture_default_str();
  app.add_option("--length-buckets", o.length_buckets,
                 "every iteration after the first draws its sequence length from this many "
                 "buckets (seq-len * k / N, k = 1..N); not with --dynamic")
      ->capture_default_str();
  app.add_flag("--mark-iterations", o.mark_iterations,
               "record iteration_begin / iteration_end around each iteration, as a caller of "
               "terrace_begin_iteration / terrace_end_iteration does");
  app.add_option("--seed", o.seed, "random seed (same seed, same trace)")->capture_default_str();
  app.add_option("--element-size", o.element_size, "bytes per element (2 = bf16)")
      ->capture_default_str();
  app.add_flag("!--no-free-completed", o.emit_free_completed,
               "omit the free_completed event after each free_requested");
  app.add_option("-o,--output", output, "output file ('-' = standard output)")->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }

  try {
    const auto events = terrace::tracegen::generate_training_trace(o);
    if (output == "-") {
      terrace::write_trace_jsonl(std::cout, events);
      std::cout.flush();
    } else {
      std::ofstream out(output);
      if (!out) {
        fmt::print(stderr, "terrace_gen_trace: cannot open '{}': {}\n", output, std::strerror(errno));
        return 1;
      }
      terrace::write_trace_jsonl(out, events);
      out.close();
      if (!out) {
        fmt::print(stderr, "terrace_gen_trace: writing '{}' failed\n", output);
        return 1;
      }
      fmt::print(stderr, "terrace_gen_trace: {} events written to {}\n", events.size(), output);
    }
  } catch (const terrace::logic_error& e) {
    fmt::print(stderr, "terrace_gen_trace: error: {}\n", terrace::message_without_origin(e));
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "terrace_gen_trace: error: {}\n", terrace::message_without_origin(e));
    return 1;
  }
  return 0;
}
