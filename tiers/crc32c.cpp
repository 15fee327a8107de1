// SPDX-License-Identifier: Apache-2.0
// CRC32C in two implementations chosen once at run time. The hardware path runs three independent
// `crc32` streams over thirds of each large chunk and folds them together: the instruction has a
// latency of three cycles but a throughput of one, so a single stream leaves two thirds of the unit
// idle. Folding a CRC forward over n zero bytes is a multiplication by x^(8n) mod P, done here with
// a 32x32 carry-less multiply in software on precomputed powers (no PCLMUL dependency).
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

__attribute__((target("sse4.2"))) std::uint32_t crc_hw(std::uint32_t crc, const void* data,
                                                       std::size_t size) {
  static const std::uint32_t shift = x_pow_8n(kStripe);
  auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
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

bool crc32c_hardware() noexcept {
  static const bool hw = detect_hardware();
  return hw;
}

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t size) noexcept {
#if defined(__x86_64__)
  if (crc32c_hardware()) return crc_hw(crc, data, size);
#endif
  return crc32c_portable(crc, data, size);
}

}  // namespace terrace::detail
