// SPDX-License-Identifier: Apache-2.0
// Internal to tiers/: the tensor store's index, its on-disk format and its atomic replacement.
//
// Why a binary format with its own checksum rather than JSON: recovery must tell a good index from
// a damaged one with certainty. A CRC32C over the header and one over the payload catch a truncated
// file and any flipped bit; a flipped digit inside a JSON number still parses. It is also compact
// (an entry carries one CRC per block: thousands for a large tensor) and needs no parser on the
// recovery path. Layout, little-endian (x86-64 and aarch64 hosts):
//
//   header, 40 bytes: magic "TRCSTIDX" | u32 version (1 or 2) | u32 0 | u64 generation |
//                     u64 payload_bytes | u32 payload_crc32c | u32 header_crc32c (of the 36 before)
//   payload: u64 block_size | u32 files | u32 0 | u64 file_size | [version 2: u8 identity[16]] |
//            u64 entry_count, then per entry
//            u32 id_bytes | id | u64 offset | u64 size | u32 crc_count | u32 crc[crc_count]
//
// Version 2 (2026-11-25) adds the store's identity, which every swap file also carries in its
// trailer (encode_swap_trailer), so that open() refuses another store's swap file. A store created
// before it has no identity: it goes on writing version 1 and its swap files are not checked.
//
// The store's other records, each a magic, a CRC32C and fixed fields:
//   swap-file trailer, kSwapTrailerBytes at offset file_size of each swap file (see
//     tensor_store.cpp for why at the end): magic "TRCSTSWP" | u32 version (1) | u32 file |
//     u32 files | u32 0 | u64 file_size | u8 identity[16] | u32 crc32c (of the 48 before) | zeros
//   create marker, the file kCreatingName while create() runs: magic "TRCSTNEW" | u32 version (1) |
//     u32 0 | u8 identity[16] | u32 crc32c (of the 32 before)
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace terrace::detail {

struct index_entry {
  std::string id;
  std::uint64_t offset = 0;  // logical, in the striped range
  std::uint64_t size = 0;    // caller bytes
  std::vector<std::uint32_t> crcs;  // CRC32C of each block_size block of the tensor
};

/// 128 random bits naming one store; its swap files carry it too.
using store_identity = std::array<unsigned char, 16>;

struct store_index {
  std::uint64_t generation = 0;
  std::uint64_t block_size = 0;
  std::uint32_t files = 0;
  std::uint64_t file_size = 0;
  std::optional<store_identity> identity;  // absent in a store created before format version 2
  std::vector<index_entry> entries;
};

inline constexpr const char* kIndexName = "index";
inline constexpr const char* kIndexTempName = "index.tmp";
/// Present from the start of a create() until its generation-0 index has committed.
inline constexpr const char* kCreatingName = "creating";
inline constexpr std::size_t kSwapTrailerBytes = 4096;  // one O_DIRECT unit

/// A fresh random identity (getrandom). @throws io_error when the kernel gives none.
store_identity new_store_identity();
/// 32 hex digits, for messages.
std::string to_hex(const store_identity& id);

/// Which swap file of which store a swap file is.
struct swap_trailer {
  store_identity identity{};
  std::uint32_t file = 0;
  std::uint32_t files = 0;
  std::uint64_t file_size = 0;
};
std::vector<unsigned char> encode_swap_trailer(const swap_trailer& t);  // kSwapTrailerBytes
/// nullopt when `data` is not a trailer (wrong size, magic, version or CRC).
std::optional<swap_trailer> decode_swap_trailer(const unsigned char* data, std::size_t size);

std::vector<unsigned char> encode_create_marker(const store_identity& id);
/// nullopt when `data` is not a create marker.
std::optional<store_identity> decode_create_marker(const unsigned char* data, std::size_t size);

/// Whether a file in a store's directory is one the store wrote, by its first bytes.
enum class file_origin {
  absent,
  ours,     ///< a regular file that begins with the magic, or is empty (a crash between its
            ///< creation, O_EXCL, and its first write)
  foreign,  ///< anything else: never removed or overwritten
};
/// Looks at `name` in `dirfd` without following a symlink or blocking on a FIFO.
/// @throws io_error when it cannot be read.
file_origin origin_of(int dirfd, const char* name, const std::string& dir, const char (&magic)[8]);
inline constexpr char kIndexMagic[8] = {'T', 'R', 'C', 'S', 'T', 'I', 'D', 'X'};
inline constexpr char kCreateMarkerMagic[8] = {'T', 'R', 'C', 'S', 'T', 'N', 'E', 'W'};

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
/// the directory. A stale kIndexTempName is removed first only if it is the store's (origin_of);
/// another file of that name is refused. On a failure before the rename the previous index is
/// intact and the temporary file removed; after it (the directory fsync), the new index may or
/// may not survive a crash, and `w->renamed` says so.
/// @throws io_error naming `dir` and the failed step.
void write_index_atomically(int dirfd, const std::string& dir, const store_index& index,
                            index_write* w = nullptr);

/// Reads and decodes kIndexName from `dirfd`. @throws io_error (ENOENT when absent) / checksum_error.
store_index read_index(int dirfd, const std::string& dir);

}  // namespace terrace::detail
