// SPDX-License-Identifier: Apache-2.0
// bench_crc32c: the store's checksum against the memory-read bound, measured in the same run.
//
// For buffers that live in L2, that are one store block (1 MiB), and that only DRAM holds, it
// times (median of --reps) a plain read of the buffer (the bound: a checksum must read every
// byte; AVX-512 or AVX2 loads), the `crc32` instruction streams, and what crc32c() dispatches to on this CPU (folding
// with VPCLMULQDQ where AVX-512 has it), and prints GB/s and the ratios.
//
//   bench_crc32c [--reps R] [--bytes-per-rep N]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <immintrin.h>

#include <CLI/CLI.hpp>

#include "tiers/crc32c.hpp"
#include "tools/bench_stats.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

// Reads every byte with the widest loads the CPU has (XOR into four registers, so neither the
// arithmetic nor a dependency chain is the limit): the bound of any checksum.
__attribute__((target("avx512f"), noinline)) std::uint64_t read_all_avx512(const unsigned char* p,
                                                                           std::size_t n) {
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  for (std::size_t i = 0; i + 256 <= n; i += 256) {
    a = _mm512_xor_si512(a, _mm512_loadu_si512(p + i));
    b = _mm512_xor_si512(b, _mm512_loadu_si512(p + i + 64));
    c = _mm512_xor_si512(c, _mm512_loadu_si512(p + i + 128));
    d = _mm512_xor_si512(d, _mm512_loadu_si512(p + i + 192));
  }
  alignas(64) std::uint64_t w[8];
  _mm512_store_si512(w, _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d)));
  return w[0] ^ w[3] ^ w[7];
}

__attribute__((target("avx2"), noinline)) std::uint64_t read_all_avx2(const unsigned char* p,
                                                                     std::size_t n) {
  const auto* q = reinterpret_cast<const __m256i*>(p);
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (std::size_t i = 0; i + 4 <= n / 32; i += 4) {
    a = _mm256_xor_si256(a, _mm256_loadu_si256(q + i));
    b = _mm256_xor_si256(b, _mm256_loadu_si256(q + i + 1));
    c = _mm256_xor_si256(c, _mm256_loadu_si256(q + i + 2));
    d = _mm256_xor_si256(d, _mm256_loadu_si256(q + i + 3));
  }
  alignas(32) std::uint64_t w[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(w), _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d)));
  return w[0] ^ w[3];
}

std::uint64_t read_all(const unsigned char* p, std::size_t n) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  return avx512 ? read_all_avx512(p, n) : read_all_avx2(p, n);
}

template <class F>
double median_gbps(F&& pass, std::size_t buffer, std::size_t bytes_per_rep, int reps) {
  const std::size_t passes = std::max<std::size_t>(1, bytes_per_rep / buffer);
  std::vector<double> gbps;
  pass();  // warm: pages touched, caches as they will be
  for (int r = 0; r < reps; ++r) {
    const auto t0 = clock_type::now();
    for (std::size_t i = 0; i < passes; ++i) pass();
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    gbps.push_back(static_cast<double>(passes * buffer) / s / 1e9);
  }
  return terrace::tools::median(gbps);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"CRC32C (the store's checksum) against the memory-read bound"};
  int reps = 7;
  std::size_t bytes_per_rep = std::size_t{1} << 30;
  app.add_option("--reps", reps, "repetitions (medians are printed)")->check(CLI::PositiveNumber);
  app.add_option("--bytes-per-rep", bytes_per_rep, "bytes checksummed per repetition")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  using namespace terrace::detail;
  std::printf("crc32c on this CPU: %s\n",
              crc32c_folding()    ? "folding (AVX-512 VPCLMULQDQ)"
              : crc32c_hardware() ? "crc32 instruction streams (SSE4.2)"
                                  : "table");
  std::printf("%-12s %12s %14s %14s %12s %12s\n", "buffer", "read GB/s", "streams GB/s",
              "crc32c GB/s", "crc/streams", "crc/read");
  volatile std::uint64_t sink = 0;
  for (std::size_t buffer : {std::size_t{256} << 10, std::size_t{1} << 20, std::size_t{256} << 20}) {
    std::vector<unsigned char> data(buffer);
    for (std::size_t i = 0; i < buffer; ++i) data[i] = static_cast<unsigned char>(i * 131 + 7);
    const unsigned char* p = data.data();
    const double read = median_gbps([&] { sink = sink + read_all(p, buffer); }, buffer, bytes_per_rep, reps);
    const double streams =
        median_gbps([&] { sink = sink + crc32c_streams(0, p, buffer); }, buffer, bytes_per_rep, reps);
    const double crc = median_gbps([&] { sink = sink + crc32c(0, p, buffer); }, buffer, bytes_per_rep, reps);
    const std::string name = buffer >= (std::size_t{1} << 20) ? std::to_string(buffer >> 20) + " MiB"
                                                              : std::to_string(buffer >> 10) + " KiB";
    std::printf("%-12s %12.1f %14.1f %14.1f %12.2f %12.2f\n", name.c_str(), read, streams, crc,
                crc / streams, crc / read);
  }
  return 0;
}
