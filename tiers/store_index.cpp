// SPDX-License-Identifier: Apache-2.0
#include "tiers/store_index.hpp"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "terrace/error.hpp"
#include "tiers/crc32c.hpp"

namespace terrace::detail {
namespace {

// Version 1: no identity (stores created before 2026-11-25); written again only for such a store.
constexpr std::uint32_t kVersionWithoutIdentity = 1;
constexpr std::uint32_t kVersion = 2;
constexpr std::size_t kHeaderBytes = 40;
constexpr char kSwapMagic[8] = {'T', 'R', 'C', 'S', 'T', 'S', 'W', 'P'};
constexpr std::uint32_t kRecordVersion = 1;  // of the swap trailer and the create marker
constexpr std::size_t kTrailerFields = 52;   // up to and with its CRC
constexpr std::size_t kMarkerBytes = 36;

template <class T>
void put_le(std::vector<unsigned char>& out, T v) {
  // resize + memcpy rather than insert: GCC 12 warns falsely on small vector inserts.
  const std::size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &v, sizeof(T));  // hosts are little-endian (see the header comment)
}

void put_bytes(std::vector<unsigned char>& out, const void* p, std::size_t n) {
  const std::size_t at = out.size();
  out.resize(at + n);
  if (n) std::memcpy(out.data() + at, p, n);
}

class reader {
 public:
  reader(const unsigned char* p, std::size_t n, const std::string& where) : p_(p), n_(n), where_(where) {}
  template <class T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_ + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  std::string bytes(std::size_t n) {
    need(n);
    std::string s(reinterpret_cast<const char*>(p_ + at_), n);
    at_ += n;
    return s;
  }
  std::size_t left() const { return n_ - at_; }
  void skip(std::size_t n) {
    need(n);
    at_ += n;
  }

 private:
  void need(std::size_t n) const {
    if (n > n_ - at_) throw io_error("terrace: index " + where_ + " is malformed: an entry runs past its end");
  }
  const unsigned char* p_;
  std::size_t n_;
  std::size_t at_ = 0;
  const std::string& where_;
};

std::string sys(const std::string& what, int e) {
  return "terrace: " + what + ": " + std::strerror(e) + " (errno " + std::to_string(e) + ")";
}

void write_all(int fd, const unsigned char* p, std::size_t n, const std::string& what) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw io_error(sys(what, errno), errno);
    }
    if (w == 0) throw io_error(sys(what, ENOSPC), ENOSPC);
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

}  // namespace

std::vector<unsigned char> encode_index(const store_index& index) {
  std::vector<unsigned char> payload;
  put_le<std::uint64_t>(payload, index.block_size);
  put_le<std::uint32_t>(payload, index.files);
  put_le<std::uint32_t>(payload, 0);
  put_le<std::uint64_t>(payload, index.file_size);
  if (index.identity) put_bytes(payload, index.identity->data(), index.identity->size());
  put_le<std::uint64_t>(payload, index.entries.size());
  for (const auto& e : index.entries) {
    put_le<std::uint32_t>(payload, static_cast<std::uint32_t>(e.id.size()));
    put_bytes(payload, e.id.data(), e.id.size());
    put_le<std::uint64_t>(payload, e.offset);
    put_le<std::uint64_t>(payload, e.size);
    put_le<std::uint32_t>(payload, static_cast<std::uint32_t>(e.crcs.size()));
    for (std::uint32_t c : e.crcs) put_le<std::uint32_t>(payload, c);
  }
  std::vector<unsigned char> out;
  out.reserve(kHeaderBytes + payload.size());
  put_bytes(out, kIndexMagic, 8);
  put_le<std::uint32_t>(out, index.identity ? kVersion : kVersionWithoutIdentity);
  put_le<std::uint32_t>(out, 0);
  put_le<std::uint64_t>(out, index.generation);
  put_le<std::uint64_t>(out, payload.size());
  put_le<std::uint32_t>(out, crc32c(0, payload.data(), payload.size()));
  put_le<std::uint32_t>(out, crc32c(0, out.data(), out.size()));
  put_bytes(out, payload.data(), payload.size());
  return out;
}

store_index decode_index(const unsigned char* data, std::size_t size, const std::string& where) {
  if (size < kHeaderBytes) {
    throw io_error("terrace: index " + where + " is truncated: " + std::to_string(size) +
                   " bytes, shorter than its 40-byte header");
  }
  if (std::memcmp(data, kIndexMagic, 8) != 0) throw io_error("terrace: " + where + " is not a terrace tensor store index");
  reader h(data + 8, kHeaderBytes - 8, where);
  const auto version = h.get<std::uint32_t>();
  h.get<std::uint32_t>();
  store_index index;
  index.generation = h.get<std::uint64_t>();
  const auto payload_bytes = h.get<std::uint64_t>();
  const auto payload_crc = h.get<std::uint32_t>();
  const auto header_crc = h.get<std::uint32_t>();
  if (crc32c(0, data, kHeaderBytes - 4) != header_crc) {
    throw checksum_error("terrace: index " + where + " is corrupt: its header fails its CRC32C", EBADMSG);
  }
  if (version != kVersion && version != kVersionWithoutIdentity) {
    throw io_error("terrace: index " + where + " has format version " + std::to_string(version) +
                   "; this build reads versions " + std::to_string(kVersionWithoutIdentity) + " to " +
                   std::to_string(kVersion));
  }
  if (size - kHeaderBytes != payload_bytes) {
    throw io_error("terrace: index " + where + " is truncated: its header announces " +
                   std::to_string(payload_bytes) + " payload bytes, the file holds " +
                   std::to_string(size - kHeaderBytes));
  }
  const unsigned char* payload = data + kHeaderBytes;
  if (crc32c(0, payload, payload_bytes) != payload_crc) {
    throw checksum_error("terrace: index " + where + " is corrupt: its entries fail their CRC32C", EBADMSG);
  }
  reader r(payload, payload_bytes, where);
  index.block_size = r.get<std::uint64_t>();
  index.files = r.get<std::uint32_t>();
  r.get<std::uint32_t>();
  index.file_size = r.get<std::uint64_t>();
  if (version >= 2) {
    store_identity id;
    for (auto& b : id) b = r.get<unsigned char>();
    index.identity = id;
  }
  // The CRCs vouch for the bytes, not for their writer (a bug, an edited file): every length
  // field is held against the bytes left before anything is read or allocated for it, and a
  // refusal says which field, so that a damaged index is told from a truncated one.
  const auto malformed = [&](const std::string& why) {
    return io_error("terrace: index " + where + " is malformed: " + why);
  };
  constexpr std::uint64_t kLeastEntryBytes = 4 + 8 + 8 + 4;  // an empty id, no block checksums
  const auto count = r.get<std::uint64_t>();
  if (count > r.left() / kLeastEntryBytes) {
    throw malformed("its entry count is " + std::to_string(count) + ", but the " +
                    std::to_string(r.left()) + " bytes after it hold at most " +
                    std::to_string(r.left() / kLeastEntryBytes) + " entries");
  }
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::string entry = "entry " + std::to_string(i + 1) + " of " + std::to_string(count);
    index_entry e;
    const auto id_bytes = r.get<std::uint32_t>();
    if (id_bytes > r.left()) {
      throw malformed(entry + " has an id length of " + std::to_string(id_bytes) +
                      " bytes, past the " + std::to_string(r.left()) + " bytes left");
    }
    e.id = r.bytes(id_bytes);
    e.offset = r.get<std::uint64_t>();
    e.size = r.get<std::uint64_t>();
    const auto n = r.get<std::uint32_t>();
    if (n > r.left() / 4) {
      throw malformed(entry + " has a block checksum count of " + std::to_string(n) + " (" +
                      std::to_string(std::uint64_t{n} * 4) + " bytes), past the " +
                      std::to_string(r.left()) + " bytes left");
    }
    e.crcs.resize(n);
    for (auto& c : e.crcs) c = r.get<std::uint32_t>();
    index.entries.push_back(std::move(e));
  }
  if (r.left() != 0) throw malformed("bytes after its last entry");
  return index;
}

void write_index_atomically(int dirfd, const std::string& dir, const store_index& index,
                            index_write* w) {
  const auto bytes = encode_index(index);
  const std::string tmp = dir + "/" + kIndexTempName;
  // A stale temporary of ours is what a crash mid-checkpoint leaves; it was never committed.
  switch (origin_of(dirfd, kIndexTempName, dir, kIndexMagic)) {
    case file_origin::absent: break;
    case file_origin::ours:
      if (::unlinkat(dirfd, kIndexTempName, 0) != 0 && errno != ENOENT)
        throw io_error(sys("cannot remove " + tmp, errno), errno);
      break;
    case file_origin::foreign:
      throw io_error("terrace: " + tmp + " is not a tensor store index; refusing to remove it (move it away)",
                     EEXIST);
  }
  const int fd = ::openat(dirfd, kIndexTempName, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) throw io_error(sys("cannot create " + tmp, errno), errno);
  try {
    write_all(fd, bytes.data(), bytes.size(), "cannot write " + tmp);
    if (::fsync(fd) != 0) throw io_error(sys("cannot fsync " + tmp, errno), errno);
  } catch (...) {
    ::close(fd);
    ::unlinkat(dirfd, kIndexTempName, 0);
    throw;
  }
  ::close(fd);
  if (::renameat(dirfd, kIndexTempName, dirfd, kIndexName) != 0) {
    const int e = errno;
    ::unlinkat(dirfd, kIndexTempName, 0);
    throw io_error(sys("cannot rename " + tmp + " over the index", e), e);
  }
  if (w != nullptr) w->renamed = true;
  // The rename is durable only once the directory is.
  const int rc = w != nullptr && w->fake_dir_sync_failure ? (errno = EIO, -1) : ::fsync(dirfd);
  if (rc != 0) throw io_error(sys("cannot fsync directory " + dir, errno), errno);
}

namespace {

// The payload length a header announces, or nullopt when `header` is no intact index header (too
// short, another magic, a failing CRC: decode_index says which).
std::optional<std::uint64_t> announced_payload(const std::vector<unsigned char>& header) {
  if (header.size() < kHeaderBytes || std::memcmp(header.data(), kIndexMagic, 8) != 0) return std::nullopt;
  std::uint64_t payload_bytes;
  std::uint32_t header_crc;
  std::memcpy(&payload_bytes, header.data() + 24, sizeof payload_bytes);
  std::memcpy(&header_crc, header.data() + kHeaderBytes - 4, sizeof header_crc);
  if (crc32c(0, header.data(), kHeaderBytes - 4) != header_crc) return std::nullopt;
  return payload_bytes;
}

// Appends up to `n` bytes of `fd` to `out`; fewer only at the end of the file.
void read_up_to(int fd, std::vector<unsigned char>& out, std::uint64_t n, const std::string& path) {
  unsigned char buf[1 << 16];
  while (n > 0) {
    const ssize_t got = ::read(fd, buf, static_cast<std::size_t>(std::min<std::uint64_t>(n, sizeof buf)));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw io_error(sys("cannot read " + path, errno), errno);
    }
    if (got == 0) return;
    out.insert(out.end(), buf, buf + got);
    n -= static_cast<std::uint64_t>(got);
  }
}

}  // namespace

store_index read_index(int dirfd, const std::string& dir) {
  const std::string path = dir + "/" + kIndexName;
  // O_NONBLOCK: a FIFO of that name must not hang open() (it is refused below).
  const int fd = ::openat(dirfd, kIndexName, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) throw io_error("terrace: " + dir + " holds no tensor store (no file 'index')", e);
    throw io_error(sys("cannot open " + path, e), e);
  }
  std::vector<unsigned char> bytes;
  try {
    struct ::stat st {};
    if (::fstat(fd, &st) != 0) throw io_error(sys("cannot stat " + path, errno), errno);
    if (!S_ISREG(st.st_mode)) {
      throw io_error("terrace: " + path + " is not a regular file, so not a tensor store index; " +
                         "refusing to read it (move it away)",
                     EINVAL);
    }
    // The header first, and then only as much as it announces: the file's own size is not
    // trusted (a damaged inode or a stray file could make it any size, and reading it whole
    // could exhaust memory before its header was even looked at).
    read_up_to(fd, bytes, kHeaderBytes, path);
    if (const auto payload = announced_payload(bytes)) {
      read_up_to(fd, bytes, *payload, path);
      if (unsigned char extra; ::read(fd, &extra, 1) == 1) {
        throw io_error("terrace: index " + path + " is " + std::to_string(st.st_size) +
                           " bytes, more than the " + std::to_string(kHeaderBytes + *payload) +
                           " its header announces: not the index the store wrote",
                       EINVAL);
      }
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return decode_index(bytes.data(), bytes.size(), path);
}

store_identity new_store_identity() {
  store_identity id;
  std::size_t got = 0;
  while (got < id.size()) {
    const ssize_t n = ::getrandom(id.data() + got, id.size() - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw io_error(sys("cannot draw a random identity for the store (getrandom)", errno), errno);
    }
    got += static_cast<std::size_t>(n);
  }
  return id;
}

std::string to_hex(const store_identity& id) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : id) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

std::vector<unsigned char> encode_swap_trailer(const swap_trailer& t) {
  std::vector<unsigned char> out;
  put_bytes(out, kSwapMagic, 8);
  put_le<std::uint32_t>(out, kRecordVersion);
  put_le<std::uint32_t>(out, t.file);
  put_le<std::uint32_t>(out, t.files);
  put_le<std::uint32_t>(out, 0);
  put_le<std::uint64_t>(out, t.file_size);
  put_bytes(out, t.identity.data(), t.identity.size());
  put_le<std::uint32_t>(out, crc32c(0, out.data(), out.size()));
  out.resize(kSwapTrailerBytes, 0);
  return out;
}

std::optional<swap_trailer> decode_swap_trailer(const unsigned char* data, std::size_t size) {
  if (size < kTrailerFields || std::memcmp(data, kSwapMagic, 8) != 0) return std::nullopt;
  const std::string where = "swap-file trailer";
  reader r(data + 8, kTrailerFields - 8, where);
  if (r.get<std::uint32_t>() != kRecordVersion) return std::nullopt;
  swap_trailer t;
  t.file = r.get<std::uint32_t>();
  t.files = r.get<std::uint32_t>();
  r.skip(4);
  t.file_size = r.get<std::uint64_t>();
  for (auto& b : t.identity) b = r.get<unsigned char>();
  if (r.get<std::uint32_t>() != crc32c(0, data, kTrailerFields - 4)) return std::nullopt;
  return t;
}

std::vector<unsigned char> encode_create_marker(const store_identity& id) {
  std::vector<unsigned char> out;
  put_bytes(out, kCreateMarkerMagic, 8);
  put_le<std::uint32_t>(out, kRecordVersion);
  put_le<std::uint32_t>(out, 0);
  put_bytes(out, id.data(), id.size());
  put_le<std::uint32_t>(out, crc32c(0, out.data(), out.size()));
  return out;
}

std::optional<store_identity> decode_create_marker(const unsigned char* data, std::size_t size) {
  if (size != kMarkerBytes || std::memcmp(data, kCreateMarkerMagic, 8) != 0) return std::nullopt;
  const std::string where = "create marker";
  reader r(data + 8, kMarkerBytes - 8, where);
  if (r.get<std::uint32_t>() != kRecordVersion) return std::nullopt;
  r.skip(4);
  store_identity id;
  for (auto& b : id) b = r.get<unsigned char>();
  if (r.get<std::uint32_t>() != crc32c(0, data, kMarkerBytes - 4)) return std::nullopt;
  return id;
}

file_origin origin_of(int dirfd, const char* name, const std::string& dir, const char (&magic)[8]) {
  const std::string path = dir + "/" + name;
  // O_NONBLOCK: a FIFO of that name must not hang the store; O_NOFOLLOW: a symlink is foreign.
  const int fd = ::openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) return file_origin::absent;
    if (e == ELOOP) return file_origin::foreign;
    throw io_error(sys("cannot open " + path, e), e);
  }
  struct ::stat st {};
  file_origin origin = file_origin::foreign;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    char head[8];
    const ssize_t n = st.st_size == 0 ? 0 : ::pread(fd, head, sizeof head, 0);
    if (st.st_size == 0 || (n == static_cast<ssize_t>(sizeof head) && std::memcmp(head, magic, 8) == 0))
      origin = file_origin::ours;
  }
  ::close(fd);
  return origin;
}

}  // namespace terrace::detail
