// SPDX-License-Identifier: Apache-2.0
// Internal to tiers/: CRC32C (Castagnoli, the polynomial of iSCSI, ext4 metadata and NVMe), the
// checksum of every stored extent and of the store's index. Carry-less multiply folding
// (VPCLMULQDQ) or the SSE4.2 `crc32` instruction is used when CPUID reports it; otherwise a
// byte-wise table, slower but bit-identical.
#pragma once

#include <cstddef>
#include <cstdint>

namespace terrace::detail {

/// Extends `crc` (0 for a fresh checksum) over `size` bytes at `data`. Any alignment.
std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t size) noexcept;

/// The table implementation alone, so tests can compare it with the hardware path.
std::uint32_t crc32c_portable(std::uint32_t crc, const void* data, std::size_t size) noexcept;

/// The `crc32` instruction streams alone, never folding (the table without SSE4.2): for tests
/// and the benchmark, which compare the paths.
std::uint32_t crc32c_streams(std::uint32_t crc, const void* data, std::size_t size) noexcept;

/// Whether crc32c() uses the CPU instruction on this machine.
bool crc32c_hardware() noexcept;

/// Whether crc32c() folds large buffers with VPCLMULQDQ (AVX-512) on this machine.
bool crc32c_folding() noexcept;

}  // namespace terrace::detail
