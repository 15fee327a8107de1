// SPDX-License-Identifier: Apache-2.0
// The NVMe tensor store, single-threaded: round trips of odd sizes and alignments, hole reuse,
// copy-on-write across checkpoints, recovery, checksum detection, every error path the engine's
// fault seam can produce, real file-size and file-system limits, striping and SQPOLL.
#include <fcntl.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <thread>
#include <utility>
#include <vector>

#include "scratch_dir.hpp"
#include "terrace/error.hpp"
#include "terrace/tensor_store.hpp"
#include "tiers/io_engine.hpp"
#include "tiers/crc32c.hpp"
#include "tiers/store_index.hpp"

namespace terrace {
namespace {

using testing::flip_byte;
using testing::scratch_dir;
constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

std::vector<unsigned char> pattern(std::size_t n, std::uint64_t seed) {
  std::vector<unsigned char> v(n);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<unsigned char>(x);
  }
  return v;
}

tensor_store_options small(std::uint64_t capacity = 64 * MiB, std::size_t block = 64 * KiB) {
  tensor_store_options o;
  o.capacity = capacity;
  o.block_size = block;
  o.queue_depth = 8;
  return o;
}

void expect_tensor(tensor_store& s, const std::string& id, const std::vector<unsigned char>& want) {
  ASSERT_EQ(s.size_of(id), want.size()) << id;
  std::vector<unsigned char> got(want.size() + 1);
  s.get(id, got.data() + 1, want.size()).wait();  // +1: deliberately unaligned
  ASSERT_TRUE(want.empty() || std::memcmp(got.data() + 1, want.data(), want.size()) == 0) << id;
}

TEST(TensorStore, RoundTripsOddSizesAndAlignments) {
  scratch_dir dir("roundtrip");
  auto s = tensor_store::create(dir.path(), small());
  EXPECT_TRUE(s.direct()) << s.describe();
  std::mt19937 rng(1);
  std::map<std::string, std::vector<unsigned char>> want;
  std::vector<io_handle> handles;
  // Sizes around block and page boundaries, plus random ones; sources at odd addresses too.
  std::vector<std::size_t> sizes = {0, 1, 4095, 4096, 4097, 64 * KiB - 1, 64 * KiB, 64 * KiB + 1, 3 * 64 * KiB + 77};
  for (int i = 0; i < 120; ++i) sizes.push_back(rng() % (300 * KiB));
  std::vector<std::vector<unsigned char>> sources;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const std::string id = "t" + std::to_string(i);
    want[id] = pattern(sizes[i], i);
    sources.emplace_back(sizes[i] + 3);
    unsigned char* src = sources.back().data() + i % 4;
    if (sizes[i]) std::memcpy(src, want[id].data(), sizes[i]);
    handles.push_back(s.put(id, src, sizes[i]));
  }
  for (auto& h : handles) h.wait();
  for (auto& [id, v] : want) expect_tensor(s, id, v);
  EXPECT_EQ(s.checkpoint(), 1u);
  EXPECT_EQ(s.ids().size(), want.size());
}

TEST(TensorStore, AlignedLargeTensorRoundTrip) {
  scratch_dir dir("aligned");
  auto s = tensor_store::create(dir.path(), small(64 * MiB, 1 * MiB));
  auto* src = static_cast<unsigned char*>(std::aligned_alloc(4096, 8 * MiB));
  auto* dst = static_cast<unsigned char*>(std::aligned_alloc(4096, 8 * MiB));
  auto v = pattern(8 * MiB, 99);
  std::memcpy(src, v.data(), v.size());
  s.put("big", src, 8 * MiB).wait();
  auto h = s.get("big", dst, 8 * MiB);
  while (!h.ready()) {
  }  // the poll path
  h.wait();
  EXPECT_EQ(std::memcmp(dst, v.data(), v.size()), 0);
  std::free(src);
  std::free(dst);
}

TEST(TensorStore, InterleavedPutGetEraseReusesHoles) {
  scratch_dir dir("interleave");
  // 4 MiB of room for up to 20 live tensors of up to 128 KiB: thousands of puts only fit if holes
  // are reused.
  auto s = tensor_store::create(dir.path(), small(4 * MiB, 64 * KiB));
  std::mt19937 rng(3);
  std::map<std::string, std::vector<unsigned char>> live;
  for (int step = 0; step < 1500; ++step) {
    const std::string id = "x" + std::to_string(rng() % 20);
    const int op = static_cast<int>(rng() % 3);
    if (op == 0 || !live.count(id)) {
      auto v = pattern(rng() % (128 * KiB) + 1, static_cast<std::uint64_t>(step));
      s.put(id, v.data(), v.size()).wait();
      live[id] = std::move(v);
    } else if (op == 1) {
      expect_tensor(s, id, live[id]);
    } else {
      s.erase(id);
      live.erase(id);
      EXPECT_FALSE(s.contains(id));
    }
  }
  for (auto& [id, v] : live) expect_tensor(s, id, v);
  EXPECT_LE(s.used_bytes(), 20 * (128 * KiB + 4 * KiB));
}

TEST(TensorStore, ReopenRecoversTheLastCheckpointOnly) {
  scratch_dir dir("reopen");
  auto a = pattern(100 * KiB + 3, 1), b = pattern(5, 2), c = pattern(70 * KiB, 3);
  {
    auto s = tensor_store::create(dir.path(), small());
    s.put("a", a.data(), a.size());
    s.put("b", b.data(), b.size());
    EXPECT_EQ(s.checkpoint(), 1u);
    s.put("c", c.data(), c.size()).wait();
    s.erase("a");
    auto b2 = pattern(9000, 4);
    s.put("b", b2.data(), b2.size()).wait();  // overwrite: the committed b stays on disk
  }  // closed without a checkpoint: as if the process died here
  auto s = tensor_store::open(dir.path(), small());
  EXPECT_EQ(s.generation(), 1u);
  EXPECT_FALSE(s.contains("c"));
  expect_tensor(s, "a", a);
  expect_tensor(s, "b", b);
  // The space of the forgotten writes is free again.
  EXPECT_EQ(s.used_bytes(), (100 * KiB + 4 * KiB) + 4 * KiB);
}

TEST(TensorStore, ExtentsOfTheCommittedIndexAreNotReusedBeforeTheNextCheckpoint) {
  scratch_dir dir("cow");
  auto s = tensor_store::create(dir.path(), small(2 * MiB, 64 * KiB));
  auto a = pattern(MiB, 1);
  s.put("a", a.data(), a.size()).wait();
  s.checkpoint();
  s.erase("a");
  EXPECT_EQ(s.used_bytes(), MiB);  // held for generation 1
  auto b = pattern(MiB, 2);
  s.put("b", b.data(), b.size()).wait();
  EXPECT_THROW(s.put("c", b.data(), b.size()), out_of_memory);
  // Until generation 2 commits, generation 1's "a" must still be readable from disk.
  s.checkpoint();
  EXPECT_NO_THROW(s.put("c", b.data(), b.size()).wait());
}

TEST(TensorStore, FullStoreIsReportedBeforeAnyWrite) {
  scratch_dir dir("full");
  auto s = tensor_store::create(dir.path(), small(MiB, 64 * KiB));
  auto v = pattern(2 * MiB, 1);
  io_fault f;
  f.what = io_fault::kind::eio;
  f.reads = false;
  s.inject_fault(f);
  try {
    s.put("huge", v.data(), v.size());
    FAIL() << "a put past capacity must throw";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("huge"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("is full"), std::string::npos) << e.what();
  }
  EXPECT_EQ(s.used_bytes(), 0u);
  EXPECT_FALSE(s.contains("huge"));
  // The armed fault was not consumed: no write was issued for the refused put.
  EXPECT_THROW(s.put("small", v.data(), 10).wait(), io_error);
  s.put("small", v.data(), 10).wait();
}


// Found in review: create() rounded the capacity up to whole blocks per file in 64-bit arithmetic
// that wrapped near 2^64, and made a store of 0 bytes (capacity() == 0, every put full) for a
// capacity of 2^64 - 1. Such a capacity is refused as a bad option, and nothing is left behind.
TEST(TensorStore, ACapacityThatNoSwapFileCanHoldIsRefusedNotWrappedToZero) {
  for (unsigned files : {1u, 2u}) {
    SCOPED_TRACE(std::to_string(files) + " files");
    scratch_dir dir("capacity-wrap");
    tensor_store_options o = small(UINT64_MAX);
    o.files = files;
    try {
      auto s = tensor_store::create(dir.path(), o);
      ADD_FAILURE() << "created a store of capacity " << s.capacity();
    } catch (const logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("capacity"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(std::filesystem::exists(dir.path() / "index"));
    EXPECT_FALSE(std::filesystem::exists(dir.path() / "swap.0"));
  }
}
// Found in review: the index keeps an id's length and a tensor's block count in 32 bits, and the
// writer truncated larger ones without a word: the checkpoint wrote an index that passed its
// checksums, read back wrong, and replaced the good one. A store that could hold a tensor of 2^32
// blocks is now refused at create(), and put() refuses an id longer than max_id_bytes.
TEST(TensorStore, NothingTheIndexCannotRecordIsAccepted) {
  scratch_dir dir("index-bounds");
  const tensor_store_options o = small(std::uint64_t{1} << 44, 4 * KiB);  // 2^32 blocks of 4 KiB
  try {
    auto s = tensor_store::create(dir.path(), o);
    ADD_FAILURE() << "created a store of capacity " << s.capacity();
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("index"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "index"));

  const std::string longest(tensor_store::max_id_bytes, 'n');
  {
    auto s = tensor_store::create(dir.path(), small(MiB));
    auto v = pattern(1000, 7);
    s.put(longest, v.data(), v.size()).wait();
    EXPECT_THROW(s.put(longest + "x", v.data(), v.size()), logic_error);
    s.checkpoint();
  }
  auto s = tensor_store::open(dir.path());
  EXPECT_TRUE(s.contains(longest));
  EXPECT_FALSE(s.contains(longest + "x"));
}

TEST(TensorStore, APutNear2To64BytesIsFullAndKeepsTheOldVersion) {
  // The extent size wrapped to 0 bytes: the put reached the engine, failed there with another
  // error, and had already dropped the tensor's old version.
  scratch_dir dir("huge-put");
  auto s = tensor_store::create(dir.path(), small(MiB, 64 * KiB));
  auto v = pattern(10000, 3);
  s.put("w", v.data(), v.size()).wait();
  EXPECT_THROW(s.put("w", v.data(), SIZE_MAX - 100), out_of_memory);
  ASSERT_TRUE(s.contains("w"));
  std::vector<unsigned char> back(v.size());
  s.get("w", back.data(), back.size()).wait();
  EXPECT_EQ(back, v);
}

TEST(TensorStore, FlippedByteOnDiskIsACheckumErrorNamingTheTensor) {
  scratch_dir dir("flip");
  auto good = pattern(200 * KiB, 2);
  auto victim = pattern(150 * KiB, 1);
  {
    auto s = tensor_store::create(dir.path(), small());
    s.put("layer0.weight", victim.data(), victim.size()).wait();  // first extent: offset 0
    s.put("other", good.data(), good.size()).wait();
    s.checkpoint();
  }
  flip_byte(dir.path() / "swap.0", 100 * KiB + 17);
  auto s = tensor_store::open(dir.path(), small());
  std::vector<unsigned char> out(victim.size());
  try {
    s.get("layer0.weight", out.data(), out.size()).wait();
    FAIL() << "corrupt data returned silently";
  } catch (const checksum_error& e) {
    EXPECT_NE(std::string(e.what()).find("layer0.weight"), std::string::npos) << e.what();
    EXPECT_EQ(e.code(), EBADMSG);
  }
  expect_tensor(s, "other", good);  // still usable
  s.put("layer0.weight", victim.data(), victim.size()).wait();
  expect_tensor(s, "layer0.weight", victim);
}

// Checksums run on the engine's hook thread, beside the transfers: a handle must never turn ready
// without error before the last block's CRC has been checked, and the CRCs a put computed
// asynchronously must be the ones its checkpoint commits.
TEST(TensorStore, CorruptLastBlockOfAManyBlockTensorFailsEveryGetEvenWhenPolled) {
  scratch_dir dir("flip-last");
  constexpr std::size_t kSize = 4 * MiB;  // 64 blocks of 64 KiB
  auto victim = pattern(kSize, 7);
  auto good = pattern(kSize + 5 * KiB, 8);  // an odd tail: the last block goes through a bounce slot
  {
    auto s = tensor_store::create(dir.path(), small());
    auto h1 = s.put("victim", victim.data(), victim.size());  // first extent: offset 0
    auto h2 = s.put("good", good.data(), good.size());
    h1.wait();
    h2.wait();
    s.checkpoint();
  }
  flip_byte(dir.path() / "swap.0", kSize - 3);  // in the victim's last block
  auto s = tensor_store::open(dir.path(), small());
  expect_tensor(s, "good", good);
  std::vector<unsigned char> out(kSize);
  for (int i = 0; i < 20; ++i) {
    auto h = s.get("victim", out.data(), out.size());
    while (!h.ready()) {
    }
    EXPECT_THROW(h.wait(), checksum_error) << "iteration " << i;
  }
  // Gets of the corrupt and the good tensor in flight together: only the corrupt one fails.
  std::vector<unsigned char> other(good.size());
  auto bad = s.get("victim", out.data(), out.size());
  auto ok = s.get("good", other.data(), other.size());
  EXPECT_THROW(bad.wait(), checksum_error);
  ok.wait();
  EXPECT_EQ(std::memcmp(other.data(), good.data(), good.size()), 0);
}

io_fault fault(io_fault::kind k, bool reads, bool writes, int count = 1, int skip = 0) {
  io_fault f;
  f.what = k;
  f.reads = reads;
  f.writes = writes;
  f.count = count;
  f.skip = skip;
  return f;
}

TEST(TensorStore, InjectedWriteErrorsFailThePutAndLeaveTheStoreUsable) {
  for (auto k : {io_fault::kind::eio, io_fault::kind::enospc}) {
    scratch_dir dir("werr");
    auto s = tensor_store::create(dir.path(), small());
    auto v = pattern(300 * KiB, 5);
    s.put("kept", v.data(), v.size()).wait();
    s.inject_fault(fault(k, false, true, 1, 2));  // the third block of the next put
    auto h = s.put("w", v.data(), v.size());
    try {
      h.wait();
      FAIL() << "the injected fault was not reported";
    } catch (const io_error& e) {
      EXPECT_EQ(e.code(), k == io_fault::kind::eio ? EIO : ENOSPC) << e.what();
      EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
    }
    EXPECT_THROW(h.wait(), io_error);  // every wait reports it
    EXPECT_FALSE(s.contains("w"));
    std::vector<unsigned char> out(v.size());
    EXPECT_THROW(s.get("w", out.data(), out.size()), io_error);
    EXPECT_EQ(s.checkpoint(), 1u);
    s.put("w", v.data(), v.size()).wait();
    expect_tensor(s, "w", v);
    expect_tensor(s, "kept", v);
    EXPECT_EQ(s.used_bytes(), 2 * (300 * KiB));
  }
}

// Found by tensor_store_fuzz_test (seed 14): erase of a failed put's id succeeded while
// contains() already called it absent.
TEST(TensorStore, EraseOfAFailedPutIsAnUnknownIdAndLetsItsSpaceGo) {
  scratch_dir dir("erase_failed");
  auto s = tensor_store::create(dir.path(), small());
  auto v = pattern(100 * KiB, 8);
  s.inject_fault(fault(io_fault::kind::eio, false, true));
  auto h = s.put("w", v.data(), v.size());
  EXPECT_THROW(h.wait(), io_error);
  ASSERT_FALSE(s.contains("w"));
  EXPECT_EQ(s.used_bytes(), 100 * KiB);  // not yet settled
  try {
    s.erase("w");
    FAIL() << "erase of a failed put's id succeeded";
  } catch (const io_error& e) {
    EXPECT_EQ(e.code(), ENOENT) << e.what();
  }
  EXPECT_EQ(s.used_bytes(), 0u);
  EXPECT_THROW(s.erase("w"), io_error);  // and it stays unknown
}

// Found in review: a failed put kept its extent until a get, erase or checkpoint of its id settled
// it, so a later put that needed the space reported the store full ("0 B is held ...") while ids()
// was empty.
TEST(TensorStore, AFailedPutsSpaceGoesToTheNextPutThatNeedsIt) {
  scratch_dir dir("failed-put-space");
  auto s = tensor_store::create(dir.path(), small(8 * MiB));
  auto v = pattern(6 * MiB, 4);
  s.inject_fault(fault(io_fault::kind::eio, false, true));
  EXPECT_THROW(s.put("a", v.data(), v.size()).wait(), io_error);
  ASSERT_TRUE(s.ids().empty());
  s.put("b", v.data(), v.size()).wait();  // threw out_of_memory before the fix
  expect_tensor(s, "b", v);
  EXPECT_FALSE(s.contains("a"));
  EXPECT_EQ(s.used_bytes(), 6 * MiB);
}

// The full store's message accounts for all the space in use: live tensors and what the committed
// checkpoint holds, each with its figure, adding up to what is not free.
TEST(TensorStore, AFullStoresMessageAccountsForTheSpaceInUse) {
  scratch_dir dir("full-message");
  auto s = tensor_store::create(dir.path(), small(MiB));
  auto v = pattern(512 * KiB, 5);
  s.put("committed", v.data(), v.size()).wait();
  s.checkpoint();
  s.erase("committed");  // held until the next checkpoint
  s.put("live", v.data(), 256 * KiB).wait();
  try {
    s.put("big", v.data(), v.size());
    FAIL() << "a put past the free space must throw";
  } catch (const out_of_memory& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("in use: 256.00 KiB by 1 tensor,"), std::string::npos) << m;
    EXPECT_NE(m.find("512.00 KiB held for the committed checkpoint"), std::string::npos) << m;
  }
  s.checkpoint();
  s.put("big", v.data(), v.size()).wait();
}

TEST(TensorStore, InjectedReadErrorFailsTheGetOnly) {
  scratch_dir dir("rerr");
  auto s = tensor_store::create(dir.path(), small());
  auto v = pattern(200 * KiB, 6);
  s.put("r", v.data(), v.size()).wait();
  s.inject_fault(fault(io_fault::kind::eio, true, false));
  std::vector<unsigned char> out(v.size());
  try {
    s.get("r", out.data(), out.size()).wait();
    FAIL();
  } catch (const checksum_error&) {
    FAIL() << "an EIO must not be reported as corruption";
  } catch (const io_error& e) {
    EXPECT_EQ(e.code(), EIO);
  }
  expect_tensor(s, "r", v);
}

TEST(TensorStore, ShortTransfersAndEagainAreCompleted) {
  for (auto k : {io_fault::kind::short_io, io_fault::kind::eagain, io_fault::kind::eintr}) {
    scratch_dir dir("short");
    auto s = tensor_store::create(dir.path(), small());
    auto v = pattern(1 * MiB + 12345, 7);
    s.inject_fault(fault(k, true, true, 12));
    s.put("s", v.data(), v.size()).wait();
    expect_tensor(s, "s", v);
    s.checkpoint();
  }
}

// Found in review: the test above arms its faults for reads and writes, but the put's 17 blocks
// (and the rests of its short ones) spend every one of them, so no get ever met a short read or an
// EAGAIN. Here the faults are armed for reads only, after the put, on an aligned buffer (pieces
// go straight to the caller's memory) and on an unaligned one (through the bounce buffers); the
// gets must deliver every byte, CRC-checked, rather than a checksum_error or a short tensor.
TEST(TensorStore, ShortReadsAndEagainOnReadsAreCompleted) {
  for (auto k : {io_fault::kind::short_io, io_fault::kind::eagain, io_fault::kind::eintr}) {
    SCOPED_TRACE(k == io_fault::kind::short_io ? "short_io" : k == io_fault::kind::eagain ? "eagain" : "eintr");
    scratch_dir dir("short-reads");
    auto s = tensor_store::create(dir.path(), small());
    auto v = pattern(1 * MiB, 11);
    s.put("r", v.data(), v.size()).wait();
    auto* aligned = static_cast<unsigned char*>(std::aligned_alloc(4096, v.size()));
    ASSERT_NE(aligned, nullptr);
    s.inject_fault(fault(k, true, false, 12));
    EXPECT_NO_THROW(s.get("r", aligned, v.size()).wait());
    EXPECT_EQ(std::memcmp(aligned, v.data(), v.size()), 0);
    std::free(aligned);
    s.inject_fault(fault(k, true, false, 12));
    expect_tensor(s, "r", v);  // into memory at an odd address: bounced
  }
}

// A failed request's error: an io_error with errno `code` whose message says each of `says`.
void expect_io_error(const std::exception_ptr& error, int code, std::initializer_list<const char*> says) {
  ASSERT_NE(error, nullptr);
  try {
    std::rethrow_exception(error);
  } catch (const io_error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const char* s : says) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not an io_error: " << e.what();
  }
}

// The engine alone over one 1 MiB file: writes of `data`'s first bytes, waited for, and refusals
// (EAGAIN) injected on the next writes.
class engine_rig {
 public:
  explicit engine_rig(const char* tag) : dir_(tag), name_((dir_.path() / "file").string()) {
    fd_ = ::open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd_ < 0 || ::ftruncate(fd_, static_cast<off_t>(MiB)) != 0) {
      throw std::runtime_error("cannot make " + name_ + ": " + std::strerror(errno));
    }
    options.block_size = 64 * KiB;
    options.file_size = MiB;
  }
  ~engine_rig() {
    engine.reset();
    ::close(fd_);
  }
  engine_rig(const engine_rig&) = delete;
  engine_rig& operator=(const engine_rig&) = delete;

  detail::engine_options options;
  std::unique_ptr<detail::io_engine> engine;
  std::vector<std::byte> data = std::vector<std::byte>(MiB, std::byte{7});

  void start() { engine = detail::make_io_uring_engine(options, {{fd_, false, name_}}); }
  void refuse(int count) {
    io_fault f;
    f.what = io_fault::kind::eagain;
    f.reads = false;
    f.count = count;
    engine->inject(f);
  }
  // The write's error (null when it succeeded) and how long it took.
  std::pair<std::exception_ptr, std::chrono::steady_clock::duration> write(std::size_t size,
                                                                             detail::block_hook hook = {}) {
    detail::io_request r;
    r.op = detail::io_op::write;
    r.buffer = data.data();
    r.size = size;
    r.what = "a write of " + std::to_string(size) + " bytes";
    r.hook = std::move(hook);
    const auto start = std::chrono::steady_clock::now();
    auto c = engine->submit(std::move(r));
    std::unique_lock lock(c->mutex);
    c->cv.wait(lock, [&] { return c->done.load(); });
    return {c->error, std::chrono::steady_clock::now() - start};
  }

 private:
  scratch_dir dir_;
  std::string name_;
  int fd_ = -1;
};

// The engine itself: a refused piece (EAGAIN) is tried again after pauses doubling from 50 us, so
// a refusal that lasts neither spins the ring thread nor fails at once; one that outlasts
// max_refusals fails the transfer with EAGAIN and says so. The pauses are lower bounds: this
// checks only that they happened.
TEST(IoUringEngine, RefusedTransfersBackOffThenFailWithTheirError) {
  engine_rig rig("refusals");
  rig.options.max_refusals = 6;
  rig.start();
  // 6 refusals: tried a 7th time, after 50 + 100 + ... + 1600 us of pauses.
  rig.refuse(6);
  const auto [ok, ok_took] = rig.write(64 * KiB);
  EXPECT_EQ(ok, nullptr);
  EXPECT_GE(ok_took, std::chrono::microseconds(3150));
  // 7 refusals: the 7th fails it, with EAGAIN and the count.
  rig.refuse(7);
  const auto [failed, failed_took] = rig.write(64 * KiB);
  expect_io_error(failed, EAGAIN, {"7 times in a row"});
  EXPECT_GE(failed_took, std::chrono::microseconds(3150));
}

// An interrupted transfer (EINTR) is resubmitted at once, as often as it takes up to 10,000 times
// in a row for one piece; the 10,001st fails it with EINTR and says so, and the engine goes on.
// (EINTR had no fault kind: the issue asks for it to be handled, and nothing showed it was.)
TEST(IoUringEngine, InterruptedTransfersAreResubmittedThenFailWithEintr) {
  engine_rig rig("interrupted");
  rig.start();
  io_fault f;
  f.what = io_fault::kind::eintr;
  f.reads = false;
  f.count = 10'000;
  rig.engine->inject(f);
  EXPECT_EQ(rig.write(4 * KiB).first, nullptr);
  f.count = 10'001;
  rig.engine->inject(f);
  expect_io_error(rig.write(4 * KiB).first, EINTR, {"10001 times in a row"});
  EXPECT_EQ(rig.write(64 * KiB).first, nullptr);  // the seam is spent; the engine goes on
}

// Found in review: an io_uring_submit error other than EINTR, EAGAIN and EBUSY aborted the
// process. ENOMEM (the kernel allocates a context for a ring's first user) is waited out like a
// refusal; one that outlasts max_refusals fails the requests whose transfers were not taken, and
// the engine goes on.
TEST(IoUringEngine, RefusedSubmissionsAreRetriedThenFailTheirRequestsNotTheProcess) {
  engine_rig rig("submit-enomem");
  rig.options.max_refusals = 3;
  rig.start();
  io_fault f;
  f.what = io_fault::kind::submit_enomem;
  f.count = 3;
  rig.engine->inject(f);
  EXPECT_EQ(rig.write(256 * KiB).first, nullptr);  // 3 refusals, then taken
  f.count = 1000;
  rig.engine->inject(f);
  const auto [failed, took] = rig.write(256 * KiB);
  expect_io_error(failed, ENOMEM, {"the kernel refused to take it"});
  rig.engine->inject(io_fault{});  // the kernel has memory again
  EXPECT_EQ(rig.write(256 * KiB).first, nullptr);
  EXPECT_EQ(rig.write(MiB).first, nullptr);
}

// Found in review (2nd): a submission refused past max_refusals withdrew its entries and failed
// their requests, but the ring thread then went to sleep on the ring without starting the
// requests waiting behind them for queue depth: with the wake read already in the kernel and
// nothing else in flight, nothing woke it, and their handles never completed.
TEST(IoUringEngine, RequestsQueuedBehindAWithdrawnSubmissionStillRun) {
  // File 1 of the stripe is a pipe: a read of it stays in flight until the test writes to the
  // pipe, holding the queue's one place while `a` and `b` wait behind it.
  scratch_dir dir("withdrawn-queue");
  const std::string name = (dir.path() / "file").string();
  const int fd = ::open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(MiB)), 0);
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  detail::engine_options options;
  options.block_size = 4 * KiB;  // one atomic pipe write (PIPE_BUF) completes the read at once
  options.file_size = MiB;
  options.queue_depth = 1;
  options.max_refusals = 2;
  auto engine = detail::make_io_uring_engine(options, {{fd, false, name}, {pipe_fds[0], false, "the pipe"}});
  std::vector<std::byte> held(4 * KiB), data(4 * KiB, std::byte{7});
  const auto submit = [&](detail::io_op op, std::uint64_t offset, std::byte* buffer) {
    detail::io_request r;
    r.op = op;
    r.offset = offset;
    r.buffer = buffer;
    r.size = 4 * KiB;
    r.what = "a transfer at " + std::to_string(offset);
    return engine->submit(std::move(r));
  };
  const auto done_within = [](const std::shared_ptr<detail::io_completion>& c, std::chrono::seconds limit) {
    std::unique_lock lock(c->mutex);
    return c->cv.wait_for(lock, limit, [&] { return c->done.load(); });
  };
  auto held_read = submit(detail::io_op::read, 4 * KiB, held.data());  // stripe 1: the pipe
  auto a = submit(detail::io_op::write, 0, data.data());                // stripe 0
  auto b = submit(detail::io_op::write, 8 * KiB, data.data());          // stripe 2
  std::this_thread::sleep_for(std::chrono::milliseconds(20));           // both queued behind it
  io_fault f;
  f.what = io_fault::kind::submit_enomem;
  f.count = 3;  // a's submission refused 3 times: past max_refusals, withdrawn
  engine->inject(f);
  ASSERT_EQ(::write(pipe_fds[1], data.data(), data.size()), static_cast<ssize_t>(data.size()));
  ASSERT_TRUE(done_within(held_read, std::chrono::seconds(10)));
  EXPECT_EQ(held_read->error, nullptr);
  EXPECT_EQ(held, data);
  ASSERT_TRUE(done_within(a, std::chrono::seconds(10)));
  expect_io_error(a->error, ENOMEM, {"the kernel refused to take it"});
  const bool b_done = done_within(b, std::chrono::seconds(10));
  EXPECT_TRUE(b_done) << "the request queued behind the withdrawn one never ran";
  if (b_done) {
    EXPECT_EQ(b->error, nullptr);
  }
  engine.reset();  // stopping pokes the ring thread, which then runs b
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  ::close(fd);
}

// Found in review: a wait that reported EBADR (completions the kernel dropped for want of memory)
// aborted the process. The request whose completion was lost fails with EBADR once everything
// submitted before it has finished (so no transfer of it can still be running), and the engine
// goes on.
TEST(IoUringEngine, ALostCompletionFailsItsRequestAndTheEngineGoesOn) {
  engine_rig rig("lost-completion");
  rig.options.queue_depth = 4;
  rig.start();
  io_fault f;
  f.what = io_fault::kind::lost_completion;
  f.reads = false;
  f.skip = 2;
  rig.engine->inject(f);
  const auto [failed, took] = rig.write(MiB);  // 16 blocks, the third one's completion lost
  expect_io_error(failed, EBADR, {"completion was lost"});
  for (int i = 0; i < 3; ++i) EXPECT_EQ(rig.write(MiB).first, nullptr);
}

TEST(TensorStore, ALostCompletionFailsThePutOnlyAndTheStoreGoesOn) {
  scratch_dir dir("lost-completion-store");
  auto s = tensor_store::create(dir.path(), small());
  auto v = pattern(300 * KiB + 5, 3);
  s.put("kept", v.data(), v.size()).wait();
  s.inject_fault(fault(io_fault::kind::lost_completion, false, true));
  try {
    s.put("w", v.data(), v.size()).wait();
    FAIL() << "the lost completion was not reported";
  } catch (const io_error& e) {
    EXPECT_EQ(e.code(), EBADR) << e.what();
  }
  EXPECT_FALSE(s.contains("w"));
  s.put("w", v.data(), v.size()).wait();
  expect_tensor(s, "w", v);
  expect_tensor(s, "kept", v);
  EXPECT_EQ(s.checkpoint(), 1u);
}

// Found in review: a refused piece waiting out its pause did not count in the queue depth, so
// the engine sent the next blocks meanwhile, and the refusals were spread over all of them
// instead of failing the one piece refused too often. And a request that had failed kept
// retrying its refused pieces for the whole backoff (about 10 s) before it completed.
TEST(IoUringEngine, RefusedPiecesHoldTheirPlaceAndAFailedRequestDropsThem) {
  {
    // One piece at a time: the first block takes all 7 refusals, and the 7th fails the write.
    engine_rig rig("refused-depth");
    rig.options.queue_depth = 1;
    rig.options.max_refusals = 6;
    rig.start();
    rig.refuse(7);
    const auto [error, took] = rig.write(MiB);
    expect_io_error(error, EAGAIN, {"at offset 0 ", "7 times in a row"});
  }
  {
    // The checksum hook fails the request at once; its refused pieces are then dropped, not
    // retried for the 200 refusals (about 10 s) they would otherwise be allowed.
    engine_rig rig("refused-failed");
    rig.options.queue_depth = 4;
    rig.options.max_refusals = 200;
    rig.start();
    rig.refuse(1'000'000);
    const auto [error, took] = rig.write(2 * 64 * KiB, [](std::size_t offset, const std::byte*, std::size_t) {
      if (offset == 0) throw logic_error("the hook refuses block 0");
    });
    ASSERT_NE(error, nullptr);
    EXPECT_THROW(std::rethrow_exception(error), logic_error);
    EXPECT_LT(took, std::chrono::seconds(5));
    rig.refuse(0);
  }
}

// What `f` threw, or null.
template <class F>
std::exception_ptr thrown_by(F f) {
  try {
    f();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

// The issue asks for a clear message, not only an exception: each says what is missing, by name,
// with ENOENT (found in review: this test checked only the exceptions' types).
TEST(TensorStore, ErrorsForMissingDirectoryUnknownIdsAndMisuse) {
  scratch_dir dir("errors");
  const std::string missing = (dir.path() / "nope").string();
  expect_io_error(thrown_by([&] { tensor_store::create(missing, small()); }), ENOENT, {missing.c_str(), "does not exist"});
  expect_io_error(thrown_by([&] { tensor_store::open(missing, small()); }), ENOENT, {missing.c_str(), "does not exist"});
  expect_io_error(thrown_by([&] { tensor_store::open(dir.path(), small()); }), ENOENT, {"holds no tensor store"});
  EXPECT_FALSE(std::filesystem::exists(missing));  // neither made it
  auto s = tensor_store::create(dir.path(), small());
  EXPECT_THROW(tensor_store::create(dir.path(), small()), io_error);  // locked / exists
  EXPECT_THROW(tensor_store::open(dir.path(), small()), io_error);    // locked by `s`
  std::vector<unsigned char> out(10);
  expect_io_error(thrown_by([&] { s.get("ghost", out.data(), out.size()); }), ENOENT, {"'ghost'"});
  expect_io_error(thrown_by([&] { s.erase("ghost"); }), ENOENT, {"'ghost'"});
  auto v = pattern(100, 1);
  s.put("v", v.data(), v.size()).wait();  // still usable
  EXPECT_EQ(s.ids(), std::vector<std::string>{"v"});
  EXPECT_THROW(s.get("v", out.data(), out.size()), logic_error);  // buffer too small
  tensor_store_options bad = small();
  bad.block_size = 1000;
  scratch_dir dir2("errors2");
  EXPECT_THROW(tensor_store::create(dir2.path(), bad), logic_error);
}

TEST(TensorStore, CreatesOnlyPrivateFilesInItsDirectory) {
  scratch_dir dir("perm");
  tensor_store_options o = small();
  o.files = 2;
  { auto s = tensor_store::create(dir.path(), o); s.checkpoint(); }
  std::vector<std::string> names;
  for (auto& e : std::filesystem::directory_iterator(dir.path())) {
    names.push_back(e.path().filename());
    struct stat st {};
    ASSERT_EQ(::lstat(e.path().c_str(), &st), 0);
    EXPECT_TRUE(S_ISREG(st.st_mode)) << e.path();
    EXPECT_EQ(st.st_mode & 0777, 0600u) << e.path();
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"index", "lock", "swap.0", "swap.1"}));
}

TEST(TensorStore, RefusesSymlinkedFiles) {
  scratch_dir dir("symlink");
  scratch_dir elsewhere("symlink-target");
  std::filesystem::create_symlink(elsewhere.path() / "victim", dir.path() / "swap.0");
  EXPECT_THROW(tensor_store::create(dir.path(), small()), io_error);
  EXPECT_FALSE(std::filesystem::exists(elsewhere.path() / "victim"));
}

// Makes a store in `dir` holding tensor "a" = `v`, checkpointed and closed; returns its index.
std::filesystem::path checkpointed_index(const scratch_dir& dir, const std::vector<unsigned char>& v) {
  auto s = tensor_store::create(dir.path(), small());
  s.put("a", v.data(), v.size()).wait();
  s.checkpoint();
  return dir.path() / "index";
}

TEST(TensorStore, TruncatedOrCorruptIndexIsAClearError) {
  scratch_dir dir("index");
  const auto v = pattern(5000, 1);
  const auto index = checkpointed_index(dir, v);
  const auto size = std::filesystem::file_size(index);
  std::vector<char> bytes(size);
  std::ifstream(index, std::ios::binary).read(bytes.data(), static_cast<std::streamsize>(size));
  std::filesystem::resize_file(index, size - 3);
  try {
    tensor_store::open(dir.path(), small());
    FAIL();
  } catch (const checksum_error& e) {
    FAIL() << "truncation should say truncated: " << e.what();
  } catch (const io_error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
  std::ofstream(index, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(size));
  flip_byte(index, size - 6);
  EXPECT_THROW(tensor_store::open(dir.path(), small()), checksum_error);
  flip_byte(index, size - 6);
  auto s = tensor_store::open(dir.path(), small());  // restored: fine again
  expect_tensor(s, "a", v);
}

// An index whose checksums are good but whose contents are impossible: a bug in another writer, or
// an edited file. Built with the store's own encoder, so that only the open's checks stand between
// it and the store. (A tensor size near 2^64 wraps the block count to 0, which an empty checksum
// list matches: the extent's saturating size is what refuses it.) Each is refused naming the
// store's directory; the store is then intact for the true index.
TEST(TensorStore, AnIndexWithGoodChecksumsButImpossibleContentsIsRefused) {
  using terrace::detail::store_index;
  scratch_dir dir("crafted");
  const auto a = pattern(100 * KiB + 7, 1), b = pattern(3 * KiB, 2);
  {
    auto s = tensor_store::create(dir.path(), small(MiB, 64 * KiB));
    s.put("a", a.data(), a.size()).wait();
    s.put("b", b.data(), b.size()).wait();
    s.checkpoint();
  }
  const store_index good = [&] {
    const int fd = ::open(dir.path().c_str(), O_RDONLY | O_DIRECTORY);
    store_index i = terrace::detail::read_index(fd, dir.path().string());
    ::close(fd);
    return i;
  }();
  ASSERT_EQ(good.entries.size(), 2u);
  auto write_index = [&](const store_index& i) {
    const auto bytes = terrace::detail::encode_index(i);
    std::ofstream(dir.path() / "index", std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  };
  const std::size_t ia = good.entries[0].id == "a" ? 0 : 1;
  const std::vector<std::pair<std::string, std::function<void(store_index&)>>> damage{
      {"a size near 2^64", [&](store_index& i) { i.entries[ia].size = UINT64_MAX; i.entries[ia].crcs.clear(); }},
      {"a size past the capacity", [&](store_index& i) { i.entries[ia].size = 4 * MiB; i.entries[ia].crcs.assign(64, 0); }},
      {"an offset past the end", [&](store_index& i) { i.entries[ia].offset = UINT64_MAX - 4095; }},
      {"an unaligned offset", [&](store_index& i) { i.entries[ia].offset += 512; }},
      {"two entries overlapping", [&](store_index& i) { i.entries[1 - ia].offset = i.entries[ia].offset; }},
      {"an id twice", [&](store_index& i) { i.entries[1 - ia].id = "a"; }},
      {"too few block checksums", [&](store_index& i) { i.entries[ia].crcs.pop_back(); }},
      {"too many block checksums", [&](store_index& i) { i.entries[ia].crcs.push_back(0); }},
      {"a block size that is no multiple of 4 KiB", [&](store_index& i) { i.block_size = 6000; }},
      {"a block size beyond 256 MiB", [&](store_index& i) { i.block_size = std::uint64_t{1} << 40; i.file_size = i.block_size; }},
      {"no files", [&](store_index& i) { i.files = 0; }},
      {"more files than a store has", [&](store_index& i) { i.files = 100000; }},
      {"a file size that is no multiple of the block", [&](store_index& i) { i.file_size += 4096; }},
  };
  for (const auto& [what, change] : damage) {
    store_index bad = good;
    change(bad);
    write_index(bad);
    try {
      tensor_store::open(dir.path(), small(MiB, 64 * KiB));
      ADD_FAILURE() << what << ": opened";
    } catch (const io_error& e) {
      EXPECT_NE(std::string(e.what()).find(dir.path().string()), std::string::npos) << what << ": " << e.what();
    }
  }
  write_index(good);
  auto s = tensor_store::open(dir.path(), small(MiB, 64 * KiB));
  expect_tensor(s, "a", a);
  expect_tensor(s, "b", b);
}

// Found in review: the index's own length fields (the entry count, each entry's u32 id length and
// u32 checksum count) must be bounded by the bytes left before anything is read or allocated for
// them. Each is corrupted here in the file's bytes, both CRC32Cs then made good, so that only the
// decoder's bounds stand between the field and the reader: each is refused as a malformed index
// naming the file and the field, and the store opens as before once the true index is back.
TEST(TensorStore, AnIndexWhoseLengthFieldsRunPastItsEndIsRefusedNamingTheField) {
  scratch_dir dir("lengths");
  const auto a = pattern(100 * KiB + 7, 1), b = pattern(3 * KiB, 2);
  {
    auto s = tensor_store::create(dir.path(), small(MiB, 64 * KiB));
    s.put("a", a.data(), a.size()).wait();
    s.put("b", b.data(), b.size()).wait();
    s.checkpoint();
  }
  const auto index = dir.path() / "index";
  std::vector<unsigned char> good(std::filesystem::file_size(index));
  std::ifstream(index, std::ios::binary)
      .read(reinterpret_cast<char*>(good.data()), static_cast<std::streamsize>(good.size()));
  // Payload (version 2) from byte 40: block_size u64 | files u32 | u32 | file_size u64 | identity
  // 16 | entry_count u64 (40 + 40), then the first entry: id_bytes u32 | id | offset u64 |
  // size u64 | crc_count u32 | crcs.
  constexpr std::size_t kHeader = 40, kCount = kHeader + 40, kIdBytes = kCount + 8;
  std::uint32_t id_bytes = 0;
  std::memcpy(&id_bytes, good.data() + kIdBytes, 4);
  ASSERT_EQ(id_bytes, 1u);
  const std::size_t crc_count = kIdBytes + 4 + id_bytes + 16;
  const auto seal = [](std::vector<unsigned char> bytes) {
    const std::uint64_t payload = bytes.size() - kHeader;
    std::memcpy(bytes.data() + 24, &payload, 8);
    const std::uint32_t payload_crc = terrace::detail::crc32c(0, bytes.data() + kHeader, payload);
    std::memcpy(bytes.data() + 32, &payload_crc, 4);
    const std::uint32_t header_crc = terrace::detail::crc32c(0, bytes.data(), 36);
    std::memcpy(bytes.data() + 36, &header_crc, 4);
    return bytes;
  };
  ASSERT_EQ(seal(good), good);
  const auto with = [&](std::size_t at, auto value) {
    auto bytes = good;
    std::memcpy(bytes.data() + at, &value, sizeof value);
    return seal(bytes);
  };
  const std::size_t left_after_count = good.size() - kIdBytes;
  const std::vector<std::tuple<std::string, std::vector<unsigned char>, std::string>> damage{
      {"an entry count of 2^64 - 1", with(kCount, UINT64_MAX), "entry count"},
      {"one entry more than it holds", with(kCount, std::uint64_t{3}), "entry"},
      {"an id length of 2^32 - 1", with(kIdBytes, UINT32_MAX), "id length"},
      {"an id length one past the end",
       with(kIdBytes, static_cast<std::uint32_t>(left_after_count - 4 + 1)), "id length"},
      {"a checksum count of 2^32 - 1", with(crc_count, UINT32_MAX), "checksum count"},
      {"a checksum count one past the end",
       with(crc_count, static_cast<std::uint32_t>((good.size() - crc_count - 4) / 4 + 1)),
       "checksum count"},
      {"the last entry cut short", seal({good.begin(), good.end() - 2}), "checksum count"},
  };
  for (const auto& [what, bytes, field] : damage) {
    std::ofstream(index, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    try {
      tensor_store::open(dir.path(), small(MiB, 64 * KiB));
      ADD_FAILURE() << what << ": opened";
    } catch (const checksum_error& e) {
      ADD_FAILURE() << what << ": the CRCs are good, the field is what is wrong: " << e.what();
    } catch (const io_error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(index.string() + " is malformed"), std::string::npos) << what << ": " << m;
      EXPECT_NE(m.find(field), std::string::npos) << what << ": " << m;
    }
  }
  std::ofstream(index, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(good.data()), static_cast<std::streamsize>(good.size()));
  auto s = tensor_store::open(dir.path(), small(MiB, 64 * KiB));
  expect_tensor(s, "a", a);
  expect_tensor(s, "b", b);
}

// The index header's own refusals, each for its reason (the test above only sees the directory
// named): another file's magic, a format version this build does not read (header CRC made good,
// so only the version is wrong), a header CRC that fails, a payload shorter than announced.
TEST(TensorStore, AnIndexHeaderIsRefusedForWhatIsWrongWithIt) {
  using terrace::detail::decode_index;
  terrace::detail::store_index index;
  index.generation = 7;
  const std::vector<unsigned char> good = terrace::detail::encode_index(index);
  ASSERT_EQ(decode_index(good.data(), good.size(), "'idx'").generation, 7u);
  const auto refusal = [&](std::vector<unsigned char> bytes) -> std::string {
    try {
      decode_index(bytes.data(), bytes.size(), "'idx'");
    } catch (const terrace::io_error& e) {
      return e.what();
    }
    return "accepted";
  };
  auto magic = good;
  magic[0] = 'X';
  EXPECT_NE(refusal(magic).find("'idx' is not a terrace tensor store index"), std::string::npos) << refusal(magic);
  // Bytes 8..11 are the version; bytes 36..39 the CRC32C of bytes 0..35.
  auto version = good;
  version[8] = 99;
  version[9] = version[10] = version[11] = 0;
  const std::uint32_t crc = terrace::detail::crc32c(0, version.data(), 36);
  for (int k = 0; k < 4; ++k) version[36 + k] = static_cast<unsigned char>(crc >> (8 * k));
  EXPECT_NE(refusal(version).find("has format version 99; this build reads versions"), std::string::npos)
      << refusal(version);
  auto header = good;
  header[16] ^= 1;  // the generation, under the header's CRC
  EXPECT_NE(refusal(header).find("its header fails its CRC32C"), std::string::npos) << refusal(header);
  auto truncated = good;
  truncated.resize(20);
  EXPECT_NE(refusal(truncated).find("shorter than its 40-byte header"), std::string::npos) << refusal(truncated);
}

TEST(TensorStore, StripesAcrossSeveralFiles) {
  scratch_dir dir("stripe");
  tensor_store_options o = small(12 * MiB, 64 * KiB);
  o.files = 3;
  auto v = pattern(2 * MiB + 5, 8);
  {
    auto s = tensor_store::create(dir.path(), o);
    s.put("wide", v.data(), v.size()).wait();
    expect_tensor(s, "wide", v);
    s.checkpoint();
  }
  for (int i = 0; i < 3; ++i) {
    // 4 MiB of data, then the 4 KiB trailer naming the store and the file's place in the stripe.
    EXPECT_EQ(std::filesystem::file_size(dir.path() / ("swap." + std::to_string(i))), 4 * MiB + 4 * KiB);
    std::ifstream f(dir.path() / ("swap." + std::to_string(i)), std::ios::binary);
    std::vector<char> head(64 * KiB);
    f.read(head.data(), static_cast<std::streamsize>(head.size()));
    EXPECT_TRUE(std::any_of(head.begin(), head.end(), [](char c) { return c != 0; })) << "file " << i << " unused";
  }
  auto s = tensor_store::open(dir.path(), o);
  expect_tensor(s, "wide", v);
}

TEST(TensorStore, SqpollMode) {
  scratch_dir dir("sqpoll");
  tensor_store_options o = small();
  o.sqpoll = true;
  std::optional<tensor_store> s;
  try {
    s.emplace(tensor_store::create(dir.path(), o));
  } catch (const io_error& e) {
    if (e.code() == EPERM || e.code() == EINVAL || e.code() == ENOMEM)
      GTEST_SKIP() << "SQPOLL is not available here: " << e.what();
    throw;
  }
  EXPECT_NE(s->describe().find("sqpoll"), std::string::npos);
  auto v = pattern(700 * KiB + 1, 9);
  s->put("p", v.data(), v.size()).wait();
  expect_tensor(*s, "p", v);
}

// Runs `body` in a child process (for process-wide limits) and returns its exit status.
template <class F>
int in_child(F body) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
}

// Makes this (child) process root of a private user+mount namespace, so that it may mount a file
// system of its own without privilege. False where unprivileged user namespaces are not allowed.
bool enter_private_mount_namespace() {
  const uid_t uid = ::getuid();
  const gid_t gid = ::getgid();
  if (::unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return false;
  auto write_file = [](const char* path, const std::string& s) {
    const int fd = ::open(path, O_WRONLY);
    if (fd < 0) return;
    [[maybe_unused]] auto n = ::write(fd, s.data(), s.size());
    ::close(fd);
  };
  write_file("/proc/self/setgroups", "deny");
  write_file("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1");
  write_file("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1");
  return true;
}

TEST(TensorStore, FileSizeLimitIsReportedAtCreate) {
  scratch_dir dir("fsize");
  const int rc = in_child([&] {
    // RLIMIT_FSIZE would kill with SIGXFSZ; ignored, the call fails with EFBIG instead.
    std::signal(SIGXFSZ, SIG_IGN);
    rlimit lim{2 * MiB, 2 * MiB};
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return 3;
    try {
      tensor_store::create(dir.path(), small(8 * MiB));
      return 1;
    } catch (const io_error& e) {
      if (e.code() != EFBIG) return 2;
    }
    // Nothing left behind but the lock file, and a smaller store works.
    if (std::filesystem::exists(dir.path() / "swap.0") || std::filesystem::exists(dir.path() / "index")) return 4;
    auto s = tensor_store::create(dir.path(), small(MiB));
    auto v = pattern(MiB, 1);
    s.put("v", v.data(), v.size()).wait();
    std::vector<unsigned char> out(v.size());
    s.get("v", out.data(), out.size()).wait();
    return out == v ? 0 : 5;
  });
  EXPECT_EQ(rc, 0);
}

// Found in review: open() read the whole file named 'index' into memory before looking at its
// header, so a damaged index whose size is wrong (here a sparse 64 GiB, as a corrupted inode or a
// stray file may show) meant a 64 GiB allocation, not a clear error. The header (40 bytes, with
// its own CRC) says how long the payload is; only that much is read, and a file of another size
// is refused for it. Run under a 1 GiB address-space limit, where the old read threw bad_alloc.
TEST(TensorStore, AnIndexFileLongerThanItsHeaderSaysIsRefusedWithoutReadingItAll) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizers' runtimes cannot start under a 1 GiB address-space limit (their "
                  "shadow memory alone is larger)";
#endif
  scratch_dir dir("index-long");
  const auto v = pattern(5000, 1);
  const auto index = checkpointed_index(dir, v);
  const auto size = std::filesystem::file_size(index);
  std::filesystem::resize_file(index, std::uintmax_t{64} << 30);
  const int rc = in_child([&] {
    rlimit lim{std::uint64_t{1} << 30, std::uint64_t{1} << 30};
    if (::setrlimit(RLIMIT_AS, &lim) != 0) return 3;
    try {
      tensor_store::open(dir.path(), small());
      return 1;
    } catch (const checksum_error&) {
      return 4;  // the header is intact: its length, not its CRC, is what is wrong
    } catch (const io_error& e) {
      const std::string what = e.what();
      return what.find("index") != std::string::npos && what.find("68719476736 bytes") != std::string::npos ? 0 : 5;
    } catch (const std::bad_alloc&) {
      return 6;
    }
  });
  EXPECT_EQ(rc, 0) << "1: opened, 4: a checksum error, 5: a message without the file's size, 6: bad_alloc";
  std::filesystem::resize_file(index, size);
  auto s = tensor_store::open(dir.path(), small());  // restored: fine again
  expect_tensor(s, "a", v);
}

// Found in review: a FIFO named 'index' (not a file the store wrote) hung open() for good in
// open(2), waiting for a writer. It is refused as not being an index, and left where it is.
TEST(TensorStore, AFifoNamedIndexIsRefusedNotWaitedOn) {
  scratch_dir dir("index-fifo");
  ASSERT_EQ(::mkfifo((dir.path() / "index").c_str(), 0600), 0);
  const int rc = in_child([&] {
    ::alarm(10);  // the old open() never returned
    try {
      tensor_store::open(dir.path(), small());
      return 1;
    } catch (const io_error& e) {
      return std::string(e.what()).find("not a regular file") != std::string::npos ? 0 : 2;
    }
  });
  EXPECT_EQ(rc, 0) << "1: opened, 2: another message, 114: hung in open()";
  struct ::stat st {};
  ASSERT_EQ(::lstat((dir.path() / "index").c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}
TEST(TensorStore, FullFileSystemIsReportedAtCreate) {
  // A genuinely small file system: tmpfs of 4 MiB, mounted in a private user+mount namespace
  // (needs no privilege where unprivileged user namespaces are allowed).
  scratch_dir dir("enospc");
  const int rc = in_child([&] {
    if (!enter_private_mount_namespace()) return 77;
    if (::mount("none", dir.path().c_str(), "tmpfs", 0, "size=4m,mode=0700") != 0) return 77;
    int result = 0;
    try {
      tensor_store::create(dir.path(), small(16 * MiB));
      result = 1;
    } catch (const io_error& e) {
      if (e.code() != ENOSPC) result = 2;
    }
    if (result == 0) {
      try {
        auto s = tensor_store::create(dir.path(), small(MiB));
        auto v = pattern(MiB - 7, 1);
        s.put("v", v.data(), v.size()).wait();
        std::vector<unsigned char> out(v.size());
        s.get("v", out.data(), out.size()).wait();
        result = out == v ? 0 : 5;
      } catch (...) {
        result = 6;
      }
    }
    ::umount(dir.path().c_str());
    return result;
  });
  if (rc == 77) GTEST_SKIP() << "cannot mount a small tmpfs here (no user namespaces); the ENOSPC path is covered through the fault seam";
  EXPECT_EQ(rc, 0);
}

// Fills the file system under `dir` to its last byte with a file named `name`.
void fill_file_system(const std::filesystem::path& dir, const char* name) {
  const int fd = ::open((dir / name).c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (fd < 0) throw std::runtime_error(std::string("cannot create the filler: ") + std::strerror(errno));
  const std::vector<char> chunk(64 * KiB, 1);
  for (std::size_t n = chunk.size(); n > 0; n /= 2) {
    while (::write(fd, chunk.data(), n) > 0) {
    }
  }
  ::close(fd);
}

// Found missing in review: the swap files are preallocated, so the one write a full file system
// can refuse once a store is open is a checkpoint's index, and no test made it. It must fail with
// ENOSPC naming the index, leave the last committed generation and no temporary behind, keep every
// tensor readable, and commit once there is room again. A real 4 MiB tmpfs, as above.
TEST(TensorStore, ACheckpointOnAFullFileSystemFailsWithEnospcAndCommitsOnceThereIsRoom) {
  scratch_dir dir("enospc-index");
  const int rc = in_child([&] {
    if (!enter_private_mount_namespace()) return 77;
    if (::mount("none", dir.path().c_str(), "tmpfs", 0, "size=4m,mode=0700") != 0) return 77;
    int result = 0;
    const auto v = pattern(100 * KiB + 3, 1);
    try {
      auto s = tensor_store::create(dir.path(), small(2 * MiB));
      s.put("a", v.data(), v.size()).wait();
      fill_file_system(dir.path(), "filler");
      try {
        s.checkpoint();
        result = 1;
      } catch (const io_error& e) {
        std::fprintf(stderr, "checkpoint on a full file system: %s\n", e.what());
        if (e.code() != ENOSPC) result = 2;
        else if (std::string(e.what()).find("index") == std::string::npos) result = 3;
      }
      if (result == 0 && s.generation() != 0) result = 4;
      if (result == 0 && std::filesystem::exists(dir.path() / "index.tmp")) result = 5;
      if (result == 0) {
        std::vector<unsigned char> out(v.size());
        s.get("a", out.data(), out.size()).wait();
        if (out != v) result = 6;
      }
      if (result == 0) {
        std::filesystem::remove(dir.path() / "filler");
        if (s.checkpoint() != 1) result = 7;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "unexpected: %s\n", e.what());
      result = 8;
    }
    if (result == 0) {
      try {
        auto s = tensor_store::open(dir.path(), small(2 * MiB));
        std::vector<unsigned char> out(v.size());
        s.get("a", out.data(), out.size()).wait();
        if (s.generation() != 1 || out != v) result = 9;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "reopen: %s\n", e.what());
        result = 10;
      }
    }
    ::umount(dir.path().c_str());
    return result;
  });
  if (rc == 77) GTEST_SKIP() << "cannot mount a small tmpfs here (no user namespaces)";
  EXPECT_EQ(rc, 0) << "1: committed on a full file system, 2: not ENOSPC, 3: a message without 'index', "
                      "4: the generation moved, 5: index.tmp left, 6: a tensor unreadable, 7: no commit "
                      "once there was room, 8: another error, 9/10: the reopen";
}


TEST(TensorStore, FileSystemWithoutODirectFallsBackToBufferedIoWithOneWarning) {
  // ramfs has no O_DIRECT (tmpfs has it since Linux 6.6, so tmpfs no longer exercises this
  // path); mounted in a private user+mount namespace as above. The store must say so in one
  // line, then work: round trip, checksums, checkpoint and reopen.
  scratch_dir dir("buffered");
  const std::filesystem::path log = dir.path().string() + ".stderr";
  const int rc = in_child([&] {
    if (!enter_private_mount_namespace()) return 77;
    if (::mount("none", dir.path().c_str(), "ramfs", 0, "mode=0700") != 0) return 77;
    const int err = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (err < 0 || ::dup2(err, STDERR_FILENO) < 0) return 3;
    int result = 0;
    try {
      auto v = pattern(3 * MiB + 123, 7);
      {
        auto s = tensor_store::create(dir.path(), small(8 * MiB));
        if (s.direct()) return 4;
        if (s.describe().find("buffered") == std::string::npos) return 5;
        s.put("v", v.data(), v.size()).wait();
        s.checkpoint();
      }
      auto s = tensor_store::open(dir.path(), small(8 * MiB));
      std::vector<unsigned char> out(v.size());
      s.get("v", out.data(), out.size()).wait();
      if (out != v) result = 6;
    } catch (...) {
      result = 7;
    }
    ::umount(dir.path().c_str());
    return result;
  });
  if (rc == 77) GTEST_SKIP() << "cannot mount ramfs here (no user namespaces)";
  ASSERT_EQ(rc, 0);
  std::ifstream in(log);
  std::string line;
  int warnings = 0;
  while (std::getline(in, line)) {
    if (line.find("does not support O_DIRECT") != std::string::npos) ++warnings;
  }
  std::filesystem::remove(log);
  // One line per store opened (create, then open), each naming its swap file.
  EXPECT_EQ(warnings, 2);
}

}  // namespace
}  // namespace terrace

namespace terrace {
namespace {

std::size_t open_descriptors() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

TEST(TensorStore, AFailedCreateClosesItsFilesAndLeavesNothingThatBlocksARetry) {
  // The engine refuses queue_depth 0 after the swap file was created and preallocated: the
  // constructor throws past the point where it had opened files.
  scratch_dir dir("failedcreate");
  tensor_store_options bad = small(MiB);
  bad.queue_depth = 0;
  const std::size_t before = open_descriptors();
  EXPECT_THROW(tensor_store::create(dir.path(), bad), logic_error);
  EXPECT_EQ(open_descriptors(), before);  // the swap file's descriptor was closed
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "swap.0"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "index"));
  EXPECT_THROW(tensor_store::open(dir.path(), small(MiB)), io_error);  // nothing to open
  auto s = tensor_store::create(dir.path(), small(MiB));                // the retry works
  auto v = pattern(MiB - 5, 3);
  s.put("v", v.data(), v.size()).wait();
  expect_tensor(s, "v", v);
}

TEST(TensorStore, QueueDepthOneWorks) {
  // One transfer in flight and one bounce buffer (an unaligned put needs it).
  scratch_dir dir("qd1");
  tensor_store_options o = small(4 * MiB);
  o.queue_depth = 1;
  auto s = tensor_store::create(dir.path(), o);
  auto v = pattern(MiB + 333, 9);
  std::vector<unsigned char> unaligned(v.size() + 1);
  std::memcpy(unaligned.data() + 1, v.data(), v.size());
  s.put("v", unaligned.data() + 1, v.size()).wait();
  expect_tensor(s, "v", v);
}

TEST(TensorStore, AFailedFdatasyncRefusesEveryLaterCheckpointAndReopeningRecoversTheLastCommit) {
  scratch_dir dir("syncfail");
  auto a = pattern(300 * KiB + 1, 1);
  auto b = pattern(200 * KiB + 3, 2);
  {
    auto s = tensor_store::create(dir.path(), small());
    s.put("a", a.data(), a.size()).wait();
    ASSERT_EQ(s.checkpoint(), 1u);
    s.put("b", b.data(), b.size()).wait();
    s.inject_fault({io_fault::kind::sync_eio});
    try {
      s.checkpoint();
      FAIL() << "expected io_error";
    } catch (const io_error& e) {
      EXPECT_EQ(e.code(), EIO);
    }
    // The next fdatasync would succeed; the store still refuses, naming the last commit.
    try {
      s.checkpoint();
      FAIL() << "expected io_error";
    } catch (const io_error& e) {
      EXPECT_EQ(e.code(), EIO);
      EXPECT_NE(std::string(e.what()).find("generation 1"), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.generation(), 1u);
    expect_tensor(s, "a", a);  // reads go on
    expect_tensor(s, "b", b);
  }
  auto s = tensor_store::open(dir.path(), small());
  EXPECT_EQ(s.generation(), 1u);
  expect_tensor(s, "a", a);
  EXPECT_FALSE(s.contains("b"));
  s.put("b", b.data(), b.size()).wait();
  EXPECT_EQ(s.checkpoint(), 2u);  // a fresh open commits again
}

// Found in review: a checkpoint whose index was renamed into place but whose directory fsync
// failed threw with the generation unchanged, and the next checkpoint wrote other contents under
// the same number; after a crash, open() could report a generation that meant two states.
TEST(TensorStore, AGenerationWhoseIndexWasRenamedIsNeverReused) {
  scratch_dir dir("index-sync-fail");
  auto a = pattern(300 * KiB + 1, 1);
  auto b = pattern(200 * KiB + 3, 2);
  auto c = pattern(100 * KiB + 5, 3);
  {
    auto s = tensor_store::create(dir.path(), small());
    s.put("a", a.data(), a.size()).wait();
    ASSERT_EQ(s.checkpoint(), 1u);
    s.put("b", b.data(), b.size()).wait();
    s.inject_fault({io_fault::kind::index_sync_eio});
    try {
      s.checkpoint();
      FAIL() << "expected io_error";
    } catch (const io_error& e) {
      EXPECT_EQ(e.code(), EIO);
      EXPECT_NE(std::string(e.what()).find("fsync directory"), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.generation(), 1u);  // not known committed
    s.put("c", c.data(), c.size()).wait();
    EXPECT_EQ(s.checkpoint(), 3u);  // 2 may be on disk with a and b only
    expect_tensor(s, "b", b);
  }
  auto s = tensor_store::open(dir.path(), small());
  EXPECT_EQ(s.generation(), 3u);
  expect_tensor(s, "a", a);
  expect_tensor(s, "b", b);
  expect_tensor(s, "c", c);
}

// One process per store (its lock file); and each swap file is locked on the descriptor the
// engine writes through, so that the writes a killed owner left in flight, which hold that
// descriptor until they complete, hold its lock too and a new opener waits for them.
TEST(TensorStore, AnOpenStoreLocksItsSwapFilesAndRefusesASecondOpener) {
  scratch_dir dir("locks");
  auto s = std::make_unique<tensor_store>(tensor_store::create(dir.path(), small()));
  try {
    tensor_store::open(dir.path(), small());
    FAIL() << "a second opener was let in";
  } catch (const io_error& e) {
    EXPECT_NE(std::string(e.what()).find("is open in another process"), std::string::npos) << e.what();
  }
  const std::string swap = (dir.path() / "swap.0").string();
  const int fd = ::open(swap.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_NE(::flock(fd, LOCK_EX | LOCK_NB), 0);
  EXPECT_EQ(errno, EWOULDBLOCK);
  s.reset();
  // Closed: the engine's last reference goes once its ring is torn down, maybe a moment later.
  bool locked = false;
  for (int i = 0; i < 1000 && !locked; ++i) {
    locked = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    if (!locked) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(locked);
  ::flock(fd, LOCK_UN);
  ::close(fd);
  EXPECT_NO_THROW(tensor_store::open(dir.path(), small()));
}

std::map<std::string, std::string> files_in(const std::filesystem::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(e.path(), std::ios::binary);
    out[e.path().filename()] = std::string(std::istreambuf_iterator<char>(in), {});
  }
  return out;
}

void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// Found in review: open() of a directory holding no store created a `lock` file there and
// removed a file of the user's named index.tmp before finding no index; create() removed such a
// file too, when it committed generation 0.
TEST(TensorStore, OpenAndCreateLeaveFilesThatAreNotTheStoresAlone) {
  scratch_dir dir("not-a-store");
  write_file(dir.path() / "index.tmp", "the user's own notes\n");
  const auto before = files_in(dir.path());
  try {
    tensor_store::open(dir.path(), small());
    FAIL() << "opened a directory without a store";
  } catch (const io_error& e) {
    EXPECT_EQ(e.code(), ENOENT) << e.what();
    EXPECT_NE(std::string(e.what()).find("no file 'index'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(files_in(dir.path()), before);  // no lock made, index.tmp kept
  // An index that is no store's: refused, and the lock open() made for it removed again.
  write_file(dir.path() / "index", "not an index");
  EXPECT_THROW(tensor_store::open(dir.path(), small()), io_error);
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "lock"));
  std::filesystem::remove(dir.path() / "index");
  // create() refuses to remove it, before making anything.
  try {
    tensor_store::create(dir.path(), small());
    FAIL() << "create went ahead over the user's index.tmp";
  } catch (const io_error& e) {
    EXPECT_EQ(e.code(), EEXIST) << e.what();
    EXPECT_NE(std::string(e.what()).find("index.tmp is not a tensor store index"), std::string::npos) << e.what();
  }
  EXPECT_EQ(files_in(dir.path()), before);
  // Moved away, the create works; an index.tmp of the store's own (a crash mid-checkpoint) is
  // removed by open(), while one of the user's, put there since, is refused and kept.
  std::filesystem::remove(dir.path() / "index.tmp");
  auto v = pattern(5000, 3);
  {
    auto s = tensor_store::create(dir.path(), small());
    s.put("v", v.data(), v.size()).wait();
    s.checkpoint();
  }
  std::filesystem::copy_file(dir.path() / "index", dir.path() / "index.tmp");
  { auto s = tensor_store::open(dir.path(), small()); }
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "index.tmp"));
  write_file(dir.path() / "index.tmp", "the user's own notes\n");
  EXPECT_THROW(tensor_store::open(dir.path(), small()), io_error);
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "index.tmp"));
  std::filesystem::remove(dir.path() / "index.tmp");
  auto s = tensor_store::open(dir.path(), small());
  expect_tensor(s, "v", v);
}

// The states a create killed before its index committed can leave, rebuilt from a real store:
// its marker, swap files carrying the marker's identity (or empty: killed between a file's
// creation and its first write), maybe an index.tmp. Found in review: such a directory was
// refused by both create() (EEXIST on swap.0) and open() ("no file 'index'").
TEST(TensorStore, ACreateInterruptedBeforeItsIndexCommittedIsExplainedAndCleanedUpByTheNextCreate) {
  tensor_store_options o = small(4 * MiB);
  o.files = 2;
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    scratch_dir dir("interrupted-create");
    { auto s = tensor_store::create(dir.path(), o); }
    const int dfd = ::open(dir.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ASSERT_GE(dfd, 0);
    const auto index = detail::read_index(dfd, dir.path().string());
    ::close(dfd);
    ASSERT_TRUE(index.identity.has_value());
    const auto marker = detail::encode_create_marker(*index.identity);
    if (variant == 2) {
      write_file(dir.path() / "creating", "");  // killed right after creating the marker
      std::filesystem::remove(dir.path() / "swap.0");
      std::filesystem::remove(dir.path() / "swap.1");
    } else {
      std::ofstream(dir.path() / "creating", std::ios::binary)
          .write(reinterpret_cast<const char*>(marker.data()), static_cast<std::streamsize>(marker.size()));
      if (variant == 1) std::filesystem::resize_file(dir.path() / "swap.1", 0);
    }
    std::filesystem::rename(dir.path() / "index", dir.path() / "index.tmp");
    write_file(dir.path() / "swap.9", "a file of the user's, named like a swap file");
    try {
      tensor_store::open(dir.path(), o);
      FAIL() << "opened a store whose create was interrupted";
    } catch (const io_error& e) {
      EXPECT_NE(std::string(e.what()).find("create() was interrupted"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("call create() again"), std::string::npos) << e.what();
    }
    auto v = pattern(3 * MiB, 1);
    {
      auto s = tensor_store::create(dir.path(), o);  // EEXIST on swap.0 before the fix
      s.put("v", v.data(), v.size()).wait();
      s.checkpoint();
    }
    auto s = tensor_store::open(dir.path(), o);
    expect_tensor(s, "v", v);
    EXPECT_EQ(files_in(dir.path())["swap.9"], "a file of the user's, named like a swap file");
    EXPECT_FALSE(std::filesystem::exists(dir.path() / "creating"));
    EXPECT_FALSE(std::filesystem::exists(dir.path() / "index.tmp"));
  }
  // A swap file of another create (another identity) is not removed: the create refuses it.
  scratch_dir dir("interrupted-create-foreign");
  scratch_dir other("interrupted-create-other");
  { auto s = tensor_store::create(other.path(), small(MiB)); }
  const auto marker = detail::encode_create_marker(detail::new_store_identity());
  std::ofstream(dir.path() / "creating", std::ios::binary)
      .write(reinterpret_cast<const char*>(marker.data()), static_cast<std::streamsize>(marker.size()));
  std::filesystem::copy_file(other.path() / "swap.0", dir.path() / "swap.0");
  EXPECT_THROW(tensor_store::create(dir.path(), small(MiB)), io_error);
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "swap.0"));
  // A file named like the marker that is not one is left alone too.
  scratch_dir dir2("interrupted-create-not-a-marker");
  write_file(dir2.path() / "creating", "the user's");
  EXPECT_THROW(tensor_store::create(dir2.path(), small(MiB)), io_error);
  EXPECT_EQ(files_in(dir2.path()), (std::map<std::string, std::string>{{"creating", "the user's"}}));
}

// Found in review: a store opened with another store's stripe directory was accepted (the file's
// size was all that was checked), and its puts overwrote the other store's committed tensors.
TEST(TensorStore, AnotherStoresSwapFileIsRefusedNamingIt) {
  scratch_dir base("identity");
  for (const char* d : {"a", "b", "na", "nb"}) std::filesystem::create_directories(base.path() / d);
  tensor_store_options oa = small(4 * MiB);
  oa.stripe_directories = {base.path() / "na"};
  tensor_store_options ob = oa;
  ob.stripe_directories = {base.path() / "nb"};
  auto va = pattern(MiB, 1);
  {
    auto a = tensor_store::create(base.path() / "a", oa);
    a.put("weights", va.data(), va.size()).wait();
    a.checkpoint();
  }
  { auto b = tensor_store::create(base.path() / "b", ob); }
  try {
    tensor_store::open(base.path() / "b", oa);  // A's stripe directory
    FAIL() << "store b opened store a's swap file";
  } catch (const io_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find((base.path() / "na" / "swap.0").string()), std::string::npos) << m;
    EXPECT_NE(m.find("another tensor store"), std::string::npos) << m;
  }
  auto a = tensor_store::open(base.path() / "a", oa);
  expect_tensor(a, "weights", va);
  auto b = tensor_store::open(base.path() / "b", ob);  // its own: fine
}

TEST(TensorStore, SwapFilesInTheWrongStripeOrderAreRefused) {
  scratch_dir base("stripe-order");
  for (const char* d : {"s", "x", "y"}) std::filesystem::create_directories(base.path() / d);
  tensor_store_options o = small(4 * MiB);
  o.files = 2;
  o.stripe_directories = {base.path() / "x", base.path() / "y"};
  { auto s = tensor_store::create(base.path() / "s", o); }
  // swap.0 and swap.1 moved into each other's place: same names and sizes, different files.
  std::filesystem::rename(base.path() / "x" / "swap.0", base.path() / "s" / "tmp");
  std::filesystem::rename(base.path() / "y" / "swap.1", base.path() / "x" / "swap.0");
  std::filesystem::rename(base.path() / "s" / "tmp", base.path() / "y" / "swap.1");
  try {
    tensor_store::open(base.path() / "s", o);
    FAIL() << "opened swap files out of their order";
  } catch (const io_error& e) {
    EXPECT_NE(std::string(e.what()).find("is swap file 1 of 2"), std::string::npos) << e.what();
  }
}

// A store written before identities (index format version 1, swap files without a trailer)
// opens unchecked and stays in that format.
TEST(TensorStore, AStoreFromBeforeIdentitiesOpensAndKeepsItsFormat) {
  scratch_dir dir("v1-store");
  auto v = pattern(200 * KiB, 6);
  {
    auto s = tensor_store::create(dir.path(), small(MiB));
    s.put("v", v.data(), v.size()).wait();
    s.checkpoint();
  }
  const auto rewrite_as_v1 = [&] {
    const int dfd = ::open(dir.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    auto index = detail::read_index(dfd, dir.path().string());
    index.identity.reset();
    detail::write_index_atomically(dfd, dir.path().string(), index);
    ::close(dfd);
    std::filesystem::resize_file(dir.path() / "swap.0", index.file_size);
  };
  rewrite_as_v1();
  const auto version = [&] {
    std::ifstream in(dir.path() / "index", std::ios::binary);
    char header[12] = {};
    in.read(header, sizeof header);
    std::uint32_t v = 0;
    std::memcpy(&v, header + 8, 4);
    return v;
  };
  ASSERT_EQ(version(), 1u);
  {
    auto s = tensor_store::open(dir.path(), small(MiB));
    expect_tensor(s, "v", v);
    s.put("w", v.data(), v.size()).wait();
    s.checkpoint();
  }
  EXPECT_EQ(version(), 1u);
  auto s = tensor_store::open(dir.path(), small(MiB));
  expect_tensor(s, "w", v);
}

// Found in review: a child forked without exec (a DataLoader worker) inherited the lock's flock
// and the swap files', and open() after the parent closed the store failed with "is open in
// another process" for as long as the child lived. The child now lets go of them at the fork,
// and any use of the store in it fails clearly.
TEST(TensorStore, AChildForkedWithoutExecNeitherHoldsTheStoreNorCanUseIt) {
  scratch_dir dir("fork");
  auto v = pattern(300 * KiB, 2);
  auto s = std::make_unique<tensor_store>(tensor_store::create(dir.path(), small()));
  s->put("v", v.data(), v.size()).wait();
  s->checkpoint();
  int checked[2], release[2];
  ASSERT_EQ(::pipe(checked), 0);
  ASSERT_EQ(::pipe(release), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(20);  // a hang here must not hang the test
    int result = 0;
    try {
      s->put("x", v.data(), v.size());
      result = 1;
    } catch (const io_error& e) {
      if (e.code() != EBADF || std::string(e.what()).find("forked") == std::string::npos) result = 2;
    }
    try {
      (void)s->contains("v");
      result = 3;
    } catch (const io_error&) {
    }
    s.reset();  // left as it is: must neither hang nor touch the parent's files
    char c = static_cast<char>(result);
    if (::write(checked[1], &c, 1) != 1) ::_exit(4);
    [[maybe_unused]] auto n = ::read(release[0], &c, 1);  // alive until the parent has reopened
    ::_exit(result);
  }
  ::close(checked[1]);  // so that a child that dies early is an end of file, not a hang
  ::close(release[0]);
  char c = 0;
  ASSERT_EQ(::read(checked[0], &c, 1), 1);
  EXPECT_EQ(c, 0) << "the child's use of the store did not fail as it should";
  expect_tensor(*s, "v", v);  // the parent's store is intact
  s.reset();
  try {
    auto again = tensor_store::open(dir.path(), small());  // while the child lives
    expect_tensor(again, "v", v);
  } catch (const io_error& e) {
    ADD_FAILURE() << e.what();
  }
  ASSERT_EQ(::write(release[1], "x", 1), 1);
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  for (int fd : {checked[0], release[1]}) ::close(fd);
}

// The owner killed with a forked child alive: the child must not keep the owner's ring, and with
// it the swap files and their locks (open() would wait 30 s for them, then fail).
TEST(TensorStore, AChildForkedFromAKilledOwnerDoesNotKeepItsSwapFilesLocked) {
  scratch_dir dir("fork-killed");
  int ready[2], release[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(release), 0);
  const pid_t owner = ::fork();
  if (owner == 0) {
    auto s = tensor_store::create(dir.path(), small());
    auto v = pattern(MiB, 1);
    s.put("v", v.data(), v.size()).wait();
    s.checkpoint();
    const pid_t worker = ::fork();
    if (worker == 0) {
      ::alarm(60);
      ::close(release[1]);
      // Ready from here: the fork handlers run in the child before fork() returns in it, but the
      // parent's fork() may return (and the owner be killed, the store opened) before that.
      const pid_t both[2] = {::getppid(), ::getpid()};
      if (::write(ready[1], both, sizeof both) != sizeof both) ::_exit(1);
      char c;
      [[maybe_unused]] auto n = ::read(release[0], &c, 1);
      ::_exit(0);
    }
    ::pause();  // killed here, the store open
    ::_exit(1);
  }
  ::close(ready[1]);  // so that an owner that dies early is an end of file, not a hang
  ::close(release[0]);
  pid_t both[2] = {};
  ASSERT_EQ(::read(ready[0], both, sizeof both), static_cast<ssize_t>(sizeof both));
  ::kill(owner, SIGKILL);
  ::waitpid(owner, nullptr, 0);
  const auto start = std::chrono::steady_clock::now();
  try {
    auto s = tensor_store::open(dir.path(), small());
    expect_tensor(s, "v", pattern(MiB, 1));
  } catch (const io_error& e) {
    ADD_FAILURE() << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  ::close(release[1]);  // the worker, now an orphan, reads its end of file and exits
  ::close(ready[0]);
}

TEST(TensorStore, StripesOnFileSystemsWithAndWithoutODirectAreAllDrivenBuffered) {
  // swap.0 on the scratch file system (O_DIRECT), swap.1 on ramfs (none): the store falls back to
  // buffered I/O for both, so an unaligned put into swap.0 must not reach it with O_DIRECT set.
  scratch_dir dir("mixeddirect");
  scratch_dir ram("mixeddirect-ram");
  const int rc = in_child([&] {
    if (!enter_private_mount_namespace()) return 77;
    if (::mount("none", ram.path().c_str(), "ramfs", 0, "mode=0700") != 0) return 77;
    int result = 0;
    try {
      tensor_store_options o = small(8 * MiB);
      o.files = 2;
      o.stripe_directories = {dir.path(), ram.path()};
      auto s = tensor_store::create(dir.path(), o);
      if (s.direct()) result = 4;
      std::vector<std::vector<unsigned char>> vs;
      for (int i = 0; i < 6; ++i) vs.push_back(pattern(5000 + 977 * i, 40 + i));
      for (int i = 0; i < 6; ++i) s.put("t" + std::to_string(i), vs[i].data(), vs[i].size()).wait();
      for (int i = 0; i < 6 && result == 0; ++i) {
        std::vector<unsigned char> out(vs[i].size() + 1);
        s.get("t" + std::to_string(i), out.data() + 1, vs[i].size()).wait();
        if (std::memcmp(out.data() + 1, vs[i].data(), vs[i].size()) != 0) result = 5;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      result = 6;
    }
    ::umount(ram.path().c_str());
    return result;
  });
  if (rc == 77) GTEST_SKIP() << "cannot mount ramfs here (no user namespaces)";
  EXPECT_EQ(rc, 0);
}

}  // namespace
}  // namespace terrace
