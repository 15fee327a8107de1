// SPDX-License-Identifier: Apache-2.0
// The fused GPU Adam step (kernels/adam.hpp) on N parameters, against the device's own copy
// bandwidth measured in the same run (a device-to-device cudaMemcpy: every byte read once and
// written once, as the step reads p, m, v, grad and writes p, m, v and the copy), and against
// torch.optim.AdamW(fused=True) where a CUDA torch is importable (tools/bench_adam_torch.py).
//
//   bench_adam_gpu [--params N] [--reps R] [--no-python]
//
// Without a CUDA device it says so and exits 0: a benchmark, not a test (the kernel's tests are
// tests/adam_gpu_test.cpp, labelled gpu). The values stepped are zeros: the kernel's time does not
// depend on them.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/adam.hpp"
#include "tools/bench_python.hpp"
#include "tools/bench_stats.hpp"

namespace {

using terrace::kernels::adam_gpu_bf16;
using terrace::kernels::adam_gpu_f16;
using terrace::kernels::adam_gpu_f32;

bool ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "bench_adam_gpu: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

using terrace::tools::median;

// Median milliseconds of `reps` runs of `fn` on `stream`, after two warm-up runs.
template <class F>
double time_ms(cudaStream_t stream, int reps, F fn) {
  cudaEvent_t a, b;
  if (!ok(cudaEventCreate(&a), "cudaEventCreate") || !ok(cudaEventCreate(&b), "cudaEventCreate")) {
    std::exit(1);
  }
  for (int i = 0; i < 2; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    // A time that was not measured is not printed as one.
    if (!ok(cudaEventRecord(a, stream), "cudaEventRecord")) std::exit(1);
    fn();
    float t = 0;
    if (!ok(cudaEventRecord(b, stream), "cudaEventRecord") ||
        !ok(cudaEventSynchronize(b), "cudaEventSynchronize") ||
        !ok(cudaEventElapsedTime(&t, a, b), "cudaEventElapsedTime")) {
      std::exit(1);
    }
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(ms);
}

// tools/bench_adam_torch.py --impl torch-cuda: torch's fused AdamW on the GPU; median seconds per
// step, or a negative value and a note. The Python is $TERRACE_PYTHON, else python3 on the PATH
// (the GPU machines' torch is a pip one, not Debian's).
double torch_step(std::size_t n, int reps, std::string& note) {
  const char* py = std::getenv("TERRACE_PYTHON");
  // The sources may sit elsewhere on the machine that runs this (a GPU machine's copy of the
  // repository): $TERRACE_SOURCE_DIR, else where this was built from.
  const char* source = std::getenv("TERRACE_SOURCE_DIR");
  return terrace::tools::python_result(
      std::string(py != nullptr ? py : "python3") + " " +
          (source != nullptr && *source != '\0' ? source : TERRACE_SOURCE_DIR) +
          "/tools/bench_adam_torch.py --impl torch-cuda --params " + std::to_string(n) + " --reps " +
          std::to_string(reps) + " 2>/dev/null",
      note);
}

// A whole number in [lo, hi], all of `text`: strtoull read "abc" as 0 and "-5" as 2^64 - 5, and
// a run over 0 parameters printed a table of NaN ratios.
bool parse_whole(const char* text, std::size_t lo, std::size_t hi, std::size_t& out) {
  const char* const end = text + std::strlen(text);
  std::size_t v = 0;
  const auto [at, ec] = std::from_chars(text, end, v);
  if (at == text || ec != std::errc() || at != end || v < lo || v > hi) return false;
  out = v;
  return true;
}

struct config {
  const char* name;
  int grad_dtype;
  int copy_dtype;  // -1: no copy written
};

std::size_t element_size(int dtype) { return dtype == adam_gpu_f32 ? 4 : 2; }

}  // namespace

int main(int argc, char** argv) {
  std::size_t n = 100'000'000;
  std::size_t reps_arg = 20;
  bool python = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--params" && i + 1 < argc) {
      if (!parse_whole(argv[++i], 1, std::size_t{1} << 34, n)) {
        std::fprintf(stderr, "bench_adam_gpu: --params '%s': expected a whole number in [1, 2^34]\n", argv[i]);
        return 2;
      }
    } else if (a == "--reps" && i + 1 < argc) {
      if (!parse_whole(argv[++i], 1, 1000, reps_arg)) {
        std::fprintf(stderr, "bench_adam_gpu: --reps '%s': expected a whole number in [1, 1000]\n", argv[i]);
        return 2;
      }
    } else if (a == "--no-python") {
      python = false;
    } else {
      std::fprintf(stderr, "usage: bench_adam_gpu [--params N] [--reps R] [--no-python]\n");
      return 2;
    }
  }
  const int reps = static_cast<int>(reps_arg);
  int devices = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0) {
    std::printf("bench_adam_gpu: no CUDA device (%s): not measured\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    return 0;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  cudaStream_t stream;
  if (!ok(cudaStreamCreate(&stream), "cudaStreamCreate")) return 1;

  float *p = nullptr, *m = nullptr, *v = nullptr;
  void *grad = nullptr, *copy = nullptr;
  const std::size_t fp32 = n * sizeof(float);
  const auto allocate = [](float** f, std::size_t bytes) {
    return ok(cudaMalloc(reinterpret_cast<void**>(f), bytes), "cudaMalloc");
  };
  if (!allocate(&p, fp32) || !allocate(&m, fp32) || !allocate(&v, fp32) ||
      !ok(cudaMalloc(&grad, fp32), "cudaMalloc") || !ok(cudaMalloc(&copy, n * 2), "cudaMalloc")) {
    return 1;
  }
  for (void* b : {static_cast<void*>(p), static_cast<void*>(m), static_cast<void*>(v), grad}) {
    if (!ok(cudaMemsetAsync(b, 0, fp32, stream), "cudaMemsetAsync")) return 1;
  }
  if (!ok(cudaMemsetAsync(copy, 0, n * 2, stream), "cudaMemsetAsync")) return 1;

  // The bound: a device-to-device copy of the same size as the three fp32 states, read once and
  // written once.
  // A failed copy would time as nothing, and every "of copy" ratio below would be meaningless.
  cudaError_t copied = cudaSuccess;
  const double copy_ms = time_ms(stream, reps, [&] {
    if (const cudaError_t e = cudaMemcpyAsync(m, p, fp32, cudaMemcpyDeviceToDevice, stream); e != cudaSuccess) copied = e;
  });
  if (!ok(copied, "cudaMemcpyAsync") || !ok(cudaStreamSynchronize(stream), "the copy")) return 1;
  const double copy_gbs = 2.0 * static_cast<double>(fp32) / (copy_ms * 1e6);

  // AdamW with typical hyper-parameters, step 10 (the scalars a host would compute).
  terrace::kernels::adam_gpu_scalars s{};
  s.beta1 = 0.9f;
  s.beta2 = 0.999f;
  s.one_minus_beta1 = 0.1f;
  s.one_minus_beta2 = 0.001f;
  s.eps = 1e-8f;
  s.step_size = 1e-3f / (1.0f - 0.3487f);
  s.inv_bc2_sqrt = 1.0f / 0.0998f;
  s.coupled_wd = 0.0f;
  s.decay = 1.0f - 1e-3f * 0.01f;
  s.grad_mul = 1.0f;

  const std::vector<config> configs = {
      {"fp32 grads", adam_gpu_f32, -1},
      {"bf16 grads", adam_gpu_bf16, -1},
      {"bf16 grads + bf16 params out", adam_gpu_bf16, adam_gpu_bf16},
      {"fp16 grads + fp16 params out", adam_gpu_f16, adam_gpu_f16},
  };
  std::printf("fused Adam step on %s, %zu parameters, median of %d\n", prop.name, n, reps);
  std::printf("device copy (read + write): %.0f GB/s\n\n", copy_gbs);
  std::printf("%-30s %10s %12s %10s %8s %10s\n", "configuration", "ms", "Gparams/s", "B/param",
              "GB/s", "of copy");
  double fp32_ms = 0;
  for (const config& c : configs) {
    const std::size_t bytes = 24 + element_size(c.grad_dtype) + (c.copy_dtype >= 0 ? 2 : 0);
    cudaError_t launch = cudaSuccess;
    const double ms = time_ms(stream, reps, [&] {
      const cudaError_t e = terrace::kernels::adam_step(p, m, v, grad, c.grad_dtype,
                                                        c.copy_dtype >= 0 ? copy : nullptr,
                                                        c.copy_dtype >= 0 ? c.copy_dtype : 0, n, s,
                                                        nullptr, stream);
      if (e != cudaSuccess) launch = e;
    });
    if (!ok(launch, c.name) || !ok(cudaStreamSynchronize(stream), c.name)) return 1;
    const double gbs = static_cast<double>(bytes) * static_cast<double>(n) / (ms * 1e6);
    std::printf("%-30s %10.3f %12.2f %10zu %8.0f %9.2fx\n", c.name, ms,
                static_cast<double>(n) / (ms * 1e6), bytes, gbs, gbs / copy_gbs);
    if (c.grad_dtype == adam_gpu_f32) fp32_ms = ms;
  }
  if (python) {
    std::string note;
    const double t = torch_step(n, std::max(3, reps / 2), note);
    if (t > 0) {
      std::printf("\ntorch.optim.AdamW(fused=True), fp32: %.3f ms; terrace fp32 / torch: %.2fx faster\n",
                  t * 1e3, t * 1e3 / fp32_ms);
    } else {
      std::printf("\ntorch.optim.AdamW(fused=True): not measured: %s\n", note.c_str());
    }
  }
  for (void* b : {static_cast<void*>(p), static_cast<void*>(m), static_cast<void*>(v), grad, copy}) {
    cudaFree(b);
  }
  cudaStreamDestroy(stream);
  return 0;
}
