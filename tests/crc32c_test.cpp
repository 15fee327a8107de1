// SPDX-License-Identifier: Apache-2.0
// CRC32C: the published check value, hardware against table on every length and alignment around
// the three-stream split and the folding path's edges, and incremental use.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "tiers/crc32c.hpp"

namespace terrace::detail {
namespace {

TEST(Crc32c, CheckValue) {
  const char* s = "123456789";
  EXPECT_EQ(crc32c(0, s, 9), 0xE3069283u);
  EXPECT_EQ(crc32c_portable(0, s, 9), 0xE3069283u);
  EXPECT_EQ(crc32c(0, s, 0), 0u);
}

TEST(Crc32c, HardwareMatchesTable) {
  if (!crc32c_hardware()) GTEST_SKIP() << "this CPU has no SSE4.2: only the table path exists";
  std::vector<unsigned char> data(3 * 8192 * 3 + 100);
  std::mt19937 rng(7);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  for (std::size_t len : {0ul, 1ul, 7ul, 8ul, 9ul, 24575ul, 24576ul, 24577ul, 49152ul, 73828ul}) {
    for (std::size_t start : {0ul, 1ul, 3ul}) {
      if (start + len > data.size()) continue;
      EXPECT_EQ(crc32c_streams(0, data.data() + start, len),
                crc32c_portable(0, data.data() + start, len))
          << "len " << len << " start " << start;
      EXPECT_EQ(crc32c(0, data.data() + start, len), crc32c_portable(0, data.data() + start, len))
          << "len " << len << " start " << start;
    }
  }
}

// The folding path (AVX-512 VPCLMULQDQ) takes buffers of 1 KiB and more, 256 bytes at a time, and
// leaves the rest to the `crc32` instruction: lengths around both edges, any alignment, and a
// running CRC carried in.
TEST(Crc32c, FoldingMatchesTable) {
  if (!crc32c_folding()) GTEST_SKIP() << "this CPU has no AVX-512 VPCLMULQDQ: no folding path";
  std::vector<unsigned char> data((1u << 20) + 600);
  std::mt19937 rng(11);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  for (std::size_t len : {1023ul, 1024ul, 1025ul, 1279ul, 1280ul, 1281ul, 4096ul + 17,
                          65536ul, (1ul << 20) - 1, (1ul << 20) + 255, (1ul << 20) + 256}) {
    for (std::size_t start : {0ul, 1ul, 7ul, 63ul}) {
      for (std::uint32_t running : {0u, 0xDEADBEEFu}) {
        EXPECT_EQ(crc32c(running, data.data() + start, len),
                  crc32c_portable(running, data.data() + start, len))
            << "len " << len << " start " << start << " crc " << running;
      }
    }
  }
  // All zeros and all ones: folding carries no state of its own between blocks.
  for (unsigned char fill : {0x00, 0xFF}) {
    std::vector<unsigned char> same(8192, fill);
    EXPECT_EQ(crc32c(0, same.data(), same.size()), crc32c_portable(0, same.data(), same.size()));
  }
}

TEST(Crc32c, Incremental) {
  std::vector<unsigned char> data(100000);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 31 + 7);
  const std::uint32_t whole = crc32c(0, data.data(), data.size());
  const std::uint32_t a = crc32c(0, data.data(), 30001);
  EXPECT_EQ(crc32c(a, data.data() + 30001, data.size() - 30001), whole);
  EXPECT_EQ(crc32c_portable(0, data.data(), data.size()), whole);
}

}  // namespace
}  // namespace terrace::detail
