// SPDX-License-Identifier: Apache-2.0
// CRC32C in three implementations chosen once at run time.
// - Folding (AVX-512 with VPCLMULQDQ): 256 bytes at a time in four 512-bit registers, each 128-bit
//   lane multiplied forward by x^2048 mod P with carry-less multiplies and XORed into the lane
//   256 bytes on; at the end the sixteen lanes are folded into the last one, whose CRC the
//   `crc32` instruction takes. 2.1-2.4x the `crc32` streams on cached data (tools/bench_crc32c on
//   this project's Zen 5 machine: ~61 against 26-29 GB/s on 256 KiB-1 MiB buffers), the same once
//   memory is the limit (docs/nvme.md); the store checksums every block it moves, on cores the
//   optimizer also wants.
// - `crc32` streams (SSE4.2): three independent streams over thirds of each large chunk, folded
//   together: the instruction has a latency of three cycles but a throughput of one, so a single
//   stream leaves two thirds of the unit idle. Folding a CRC forward over n zero bytes is a
//   multiplication by x^(8n) mod P, done here with a 32x32 carry-less multiply in software.
// - A byte-wise table, for CPUs with neither.
// Why folding works (reflected bit order, as the CRC is defined): a 16-byte lane X at some
// distance F bits before the end of the data contributes X * x^F mod P to the CRC's remainder, and
// X = U * x^64 + V for its two 64-bit halves, so X * x^F = U * x^(F+64) + V * x^F (mod P): two
// carry-less multiplies by constants of 32 bits. A carry-less multiply of two reflected 64-bit
// operands yields the reflected product times x, hence the constants x^(F+63) and x^(F-1).
#include "tiers/crc32c.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace terrace::detail {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

constexpr std::array<std::uint32_t, 256> make_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr auto kTable = make_table();

// Multiplies two polynomials modulo P in the reflected domain (bit 31 is x^0).
std::uint32_t gf_multiply(std::uint32_t a, std::uint32_t b) {
  std::uint32_t product = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & 0x80000000u) product ^= b;
    a <<= 1;
    b = (b & 1u) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^(8n) mod P for shifting a CRC over n zero bytes (reflected: x^0 is 0x80000000).
std::uint32_t x_pow_8n(std::size_t n) {
  std::uint32_t result = 0x80000000u;  // 1
  std::uint32_t square = 0x00800000u;  // x^8
  while (n) {
    if (n & 1) result = gf_multiply(result, square);
    square = gf_multiply(square, square);
    n >>= 1;
  }
  return result;
}

#if defined(__x86_64__)
constexpr std::size_t kStripe = 8 * 1024;  // bytes per stream per round
// Below this the folding path's final reduction (15 lane folds) costs more than it saves.
constexpr std::size_t kFoldMin = 1024;

__attribute__((target("sse4.2"))) std::uint32_t crc_hw_serial(std::uint32_t crc,
                                                               const unsigned char* p,
                                                               std::size_t n) {
  std::uint64_t c = crc;
  while (n >= 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

// x^n mod P as the reflected 64-bit operand of a carry-less multiply (x^d at bit 63 - d).
std::uint64_t fold_constant(unsigned n) {
  std::uint64_t r = 1;  // normal bit order: bit d is x^d
  for (unsigned i = 0; i < n; ++i) {
    r <<= 1;
    if (r & (std::uint64_t{1} << 32)) r ^= 0x11EDC6F41ull;  // the Castagnoli polynomial
  }
  std::uint64_t out = 0;
  for (int d = 0; d < 32; ++d) {
    if ((r >> d) & 1u) out |= std::uint64_t{1} << (63 - d);
  }
  return out;
}

// The multipliers that move a 16-byte lane forward by `bits`: low half for U, high half for V.
__m128i fold_by(unsigned bits) {
  return _mm_set_epi64x(static_cast<long long>(fold_constant(bits - 1)),
                        static_cast<long long>(fold_constant(bits + 63)));
}

struct fold_constants {
  std::uint64_t block_u = fold_constant(2048 + 63), block_v = fold_constant(2048 - 1);  // 256 bytes
  __m128i lanes[16];  // [d]: d lanes of 16 bytes (d >= 1)
  fold_constants() {
    lanes[0] = _mm_setzero_si128();
    for (unsigned d = 1; d < 16; ++d) lanes[d] = fold_by(128 * d);
  }
};

#define TERRACE_FOLD_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))

TERRACE_FOLD_TARGET inline __m512i fold_into(__m512i x, __m512i k, const unsigned char* next) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                   _mm512_clmulepi64_epi128(x, k, 0x11),
                                   _mm512_loadu_si512(next), 0x96);  // a ^ b ^ c
}

// The raw CRC register after `n` bytes (a multiple of 256, at least 256) from register `state`.
TERRACE_FOLD_TARGET std::uint32_t crc_fold(std::uint32_t state, const unsigned char* p,
                                            std::size_t n) {
  static const fold_constants kc;
  const __m512i k = _mm512_set4_epi64(static_cast<long long>(kc.block_v), static_cast<long long>(kc.block_u),
                                      static_cast<long long>(kc.block_v), static_cast<long long>(kc.block_u));
  // The register enters as the first four bytes' XOR (what the `crc32` instruction does).
  __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p),
                                _mm512_castsi128_si512(_mm_cvtsi32_si128(static_cast<int>(state))));
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
    x0 = fold_into(x0, k, p);
    x1 = fold_into(x1, k, p + 64);
    x2 = fold_into(x2, k, p + 128);
    x3 = fold_into(x3, k, p + 192);
  }
  alignas(64) __m128i lane[16];
  _mm512_store_si512(lane, x0);
  _mm512_store_si512(lane + 4, x1);
  _mm512_store_si512(lane + 8, x2);
  _mm512_store_si512(lane + 12, x3);
  __m128i last = lane[15];
  for (int i = 0; i < 15; ++i) {
    const __m128i c = kc.lanes[15 - i];
    last = _mm_xor_si128(last, _mm_xor_si128(_mm_clmulepi64_si128(lane[i], c, 0x00),
                                             _mm_clmulepi64_si128(lane[i], c, 0x11)));
  }
  std::uint64_t c = _mm_crc32_u64(0, static_cast<std::uint64_t>(_mm_cvtsi128_si64(last)));
  c = _mm_crc32_u64(c, static_cast<std::uint64_t>(_mm_extract_epi64(last, 1)));
  return static_cast<std::uint32_t>(c);
}

bool detect_folding() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
         __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.2");
}

__attribute__((target("sse4.2"))) std::uint32_t crc_hw(std::uint32_t crc, const void* data,
                                                       std::size_t size, bool folding) {
  static const std::uint32_t shift = x_pow_8n(kStripe);
  auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
  if (folding && size >= kFoldMin) {
    const std::size_t bulk = size & ~std::size_t{255};
    c = crc_fold(c, p, bulk);
    return ~crc_hw_serial(c, p + bulk, size - bulk);
  }
  while (size >= 3 * kStripe) {
    std::uint64_t a = c, b = 0, d = 0;
    for (std::size_t i = 0; i < kStripe; i += 8) {
      std::uint64_t va, vb, vd;
      std::memcpy(&va, p + i, 8);
      std::memcpy(&vb, p + kStripe + i, 8);
      std::memcpy(&vd, p + 2 * kStripe + i, 8);
      a = _mm_crc32_u64(a, va);
      b = _mm_crc32_u64(b, vb);
      d = _mm_crc32_u64(d, vd);
    }
    // crc(A|B|D) = shift(shift(crc(A)) ^ crc(B)) ^ crc(D), with the raw (un-inverted) registers.
    std::uint32_t ab = gf_multiply(static_cast<std::uint32_t>(a), shift) ^ static_cast<std::uint32_t>(b);
    c = gf_multiply(ab, shift) ^ static_cast<std::uint32_t>(d);
    p += 3 * kStripe;
    size -= 3 * kStripe;
  }
  return ~crc_hw_serial(c, p, size);
}
#endif

bool detect_hardware() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

}  // namespace

std::uint32_t crc32c_portable(std::uint32_t crc, const void* data, std::size_t size) noexcept {
  auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
  while (size--) c = kTable[(c ^ *p++) & 0xFFu] ^ (c >> 8);
  return ~c;
}

bool crc32c_folding() noexcept {
#if defined(__x86_64__)
  static const bool folding = crc32c_hardware() && detect_folding();
  return folding;
#else
  return false;
#endif
}

bool crc32c_hardware() noexcept {
  static const bool hw = detect_hardware();
  return hw;
}

std::uint32_t crc32c_streams(std::uint32_t crc, const void* data, std::size_t size) noexcept {
#if defined(__x86_64__)
  if (crc32c_hardware()) return crc_hw(crc, data, size, /*folding=*/false);
#endif
  return crc32c_portable(crc, data, size);
}

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t size) noexcept {
#if defined(__x86_64__)
  if (crc32c_hardware()) return crc_hw(crc, data, size, crc32c_folding());
#endif
  return crc32c_portable(crc, data, size);
}

}  // namespace terrace::detail
