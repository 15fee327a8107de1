// SPDX-License-Identifier: Apache-2.0
// Internal to tiers/: the tensor store's index, its on-disk format and its atomic replacement.
//
// Why a binary format with its own checksum rather than JSON: recovery must tell a good index from
// a damaged one with certainty. A CRC32C over the header and one over the payload catch a truncated
// file and any flipped bit; a flipped digit inside a JSON number still parses. It is also compact
// (an entry carries one CRC per block: thousands for a large tensor) and needs no parser on the
// recovery path. Layout, little-endian (x86-64 and aarch64 hosts):
//
//   header, 40 bytes: magic "TRCSTIDX" | u32 version (1) | u32 0 | u64 generation |
//                     u64 payload_bytes | u32 payload_crc32c | u32 header_crc32c (of the 36 before)
//   payload: u64 block_size | u32 files | u32 0 | u64 file_size | u64 entry_count, then per entry
//            u32 id_bytes | id | u64 offset | u64 size | u32 crc_count | u32 crc[crc_count]
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace terrace::detail {

struct index_entry {
  std::string id;
  std::uint64_t offset = 0;  // logical, in the striped range
  std::uint64_t size = 0;    // caller bytes
  std::vector<std::uint32_t> crcs;  // CRC32C of each block_size block of the tensor
};

struct store_index {
  std::uint64_t generation = 0;
  std::uint64_t block_size = 0;
  std::uint32_t files = 0;
  std::uint64_t file_size = 0;
  std::vector<index_entry> entries;
};

inline constexpr const char* kIndexName = "index";
inline constexpr const char* kIndexTempName = "index.tmp";

std::vector<unsigned char> encode_index(const store_index& index);

/// @throws io_error (truncated, wrong magic or version, malformed entries) or checksum_error
/// (a CRC mismatch); `where` names the file in the message.
store_index decode_index(const unsigned char* data, std::size_t size, const std::string& where);

/// How write_index_atomically went, for a caller that must not reuse a generation.
struct index_write {
  bool fake_dir_sync_failure = false;  ///< in: the directory fsync fails with EIO (a test seam)
  bool renamed = false;                ///< out: the new index took the old one's name
};

/// Writes `index` as kIndexTempName in `dirfd`, fsyncs it, renames it over kIndexName and fsyncs
/// the directory. On a failure before the rename the previous index is intact and the temporary
/// file removed; after it (the directory fsync), the new index may or may not survive a crash,
/// and `w->renamed` says so.
/// @throws io_error naming `dir` and the failed step.
void write_index_atomically(int dirfd, const std::string& dir, const store_index& index,
                            index_write* w = nullptr);

/// Reads and decodes kIndexName from `dirfd`. @throws io_error (ENOENT when absent) / checksum_error.
store_index read_index(int dirfd, const std::string& dir);

}  // namespace terrace::detail
