// TmemSwapBacking over a real TmemStore (a persistent pool) and a real
// spill image in a private temp directory: every line of SwapBacking's
// contract, spilling at the VM's quota with the charge inside it throughout,
// the valve's spill, discard freeing store charge and image blocks, the
// graceful stop (WriteBackAll, then a fresh backing reads every page back),
// a store that went away, several threads on disjoint pages (TSan), and
// relief: a lowered quota, swap quota or host cap moving store pages into
// the image (never dropping one), into a full disk too, while the guest
// reads and writes (TSan).
#include "host-agent/swap/tmem_swap_backing.h"

#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/temp_dir.h"

namespace tmem::swap {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kPages = 1024;  // 4 MiB device

// Incompressible-looking but reproducible bytes for (page, version).
void FillPattern(uint64_t page, uint32_t version, uint8_t* out) {
  uint64_t x = (page + 1) * 0x9e3779b97f4a7c15ull ^ (uint64_t{version} << 40);
  for (size_t i = 0; i < kSwapPageSize; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(out + i, &x, 8);
  }
}

std::vector<uint8_t> Pattern(uint64_t page, uint32_t version) {
  std::vector<uint8_t> p(kSwapPageSize);
  FillPattern(page, version, p.data());
  return p;
}

class FixedAdvisor final : public PutAdvisor {
 public:
  PutMode Advise(uint32_t, uint64_t, bool) override {
    advised.fetch_add(1);
    return mode.load();
  }
  void OnGet(uint32_t, uint64_t, bool hit) override {
    (hit ? hits : misses).fetch_add(1);
  }
  std::atomic<PutMode> mode{PutMode::kCompress};
  std::atomic<uint64_t> advised{0}, hits{0}, misses{0};
};

// Splits a buffer into spans at the given byte offsets (guest buffers that
// split pages anywhere).
std::vector<GuestSpan> Split(std::vector<uint8_t>& buf,
                             std::vector<size_t> cuts = {}) {
  std::vector<GuestSpan> spans;
  size_t at = 0;
  cuts.push_back(buf.size());
  for (size_t c : cuts) {
    if (c > at) spans.push_back({buf.data() + at, c - at});
    at = c;
  }
  return spans;
}

class TmemSwapBackingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = std::make_unique<tmem::testing::TempDir>("tmem-swap-backing-test");
    ASSERT_FALSE(tmp_->path().empty());
    dir_ = tmp_->path();
    StoreOptions so;
    so.memory_cap_bytes = 64ull << 20;
    so.num_shards = 8;
    auto store = TmemStore::Create(so);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    auto vm = store_->AddVm("vm1", VmPolicy{});
    ASSERT_TRUE(vm.ok());
    vm_ = *vm;
    auto pool = store_->NewPool(vm_, nullptr, PoolKind::kPersistent);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;
    Reopen();
  }
  void TearDown() override {
    backing_.reset();
    other_.reset();
    // Lazy: a test that failed half-way may still hold a file open there.
    if (!mounted_.empty()) ::umount2(mounted_.c_str(), MNT_DETACH);
    tmp_.reset();
  }

  // A tmpfs of `bytes` at dir_/small for the image (callers skip first
  // unless root); unmounted by TearDown whatever the test did.
  void MountSmallImageDir(uint64_t bytes) {
    backing_.reset();
    image_dir_ = dir_ + "/small";
    ASSERT_EQ(::mkdir(image_dir_.c_str(), 0700), 0);
    const std::string opts = "size=" + std::to_string(bytes) + ",mode=0700";
    ASSERT_EQ(::mount("tmpfs", image_dir_.c_str(), "tmpfs", 0, opts.c_str()), 0)
        << "mount tmpfs at " << image_dir_ << ": "
        << std::strerror(errno);  // NOLINT(concurrency-mt-unsafe)
    mounted_ = image_dir_;
    Reopen();
  }

  // Steps relief until a step moves nothing; every step within `batch`.
  uint64_t RelieveAll(TmemSwapBacking& b, uint64_t batch) {
    uint64_t moved = 0;
    for (int i = 0; i < 10000; ++i) {
      const ReliefStep step = b.RelieveStep(batch);
      EXPECT_LE(step.moved, batch);
      EXPECT_TRUE(step.error.ok()) << step.error;
      moved += step.moved;
      if (step.moved == 0) break;
    }
    return moved;
  }
  uint64_t Excess(VmId vm) {
    auto e = store_->PersistentExcessBytes(vm);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? e->bytes : 0;
  }
  uint64_t PersistentBytes(VmId vm) {
    auto vs = store_->GetVmStats(vm);
    EXPECT_TRUE(vs.ok());
    return vs->persistent_bytes;
  }

  void Reopen() {
    backing_.reset();
    SpillImageOptions io;
    io.path = image_dir_.empty() ? dir_ + "/vm1.swap.img"
                                 : image_dir_ + "/vm1.swap.img";
    io.page_count = kPages;
    auto img = SpillImage::Open(io);
    ASSERT_TRUE(img.ok()) << img.status();
    TmemSwapBackingOptions o;
    o.store = store_.get();
    o.vm = vm_;
    o.pool = pool_;
    o.advisor = &advisor_;
    auto b = TmemSwapBacking::Open(o, std::move(*img));
    ASSERT_TRUE(b.ok()) << b.status();
    backing_ = std::move(*b);
  }

  absl::Status Write(uint64_t first, uint64_t count, uint32_t version,
                     std::vector<size_t> cuts = {}) {
    std::vector<uint8_t> buf(count * kSwapPageSize);
    for (uint64_t i = 0; i < count; ++i) {
      FillPattern(first + i, version, buf.data() + i * kSwapPageSize);
    }
    return backing_->WritePages(first, count, Split(buf, std::move(cuts)));
  }
  absl::Status WriteBytes(uint64_t page, const std::vector<uint8_t>& bytes) {
    std::vector<uint8_t> buf = bytes;
    return backing_->WritePages(page, 1, Split(buf));
  }
  absl::StatusOr<std::vector<uint8_t>> Read(uint64_t first, uint64_t count,
                                            std::vector<size_t> cuts = {}) {
    std::vector<uint8_t> buf(count * kSwapPageSize, 0xee);
    absl::Status s =
        backing_->ReadPages(first, count, Split(buf, std::move(cuts)));
    if (!s.ok()) return s;
    return buf;
  }
  // Every page [first, first+count) holds `version`'s pattern.
  void ExpectPages(uint64_t first, uint64_t count, uint32_t version) {
    auto got = Read(first, count);
    ASSERT_TRUE(got.ok()) << got.status();
    for (uint64_t i = 0; i < count; ++i) {
      ASSERT_EQ(0,
                std::memcmp(got->data() + i * kSwapPageSize,
                            Pattern(first + i, version).data(), kSwapPageSize))
          << "page " << first + i;
    }
  }
  void ExpectZeros(uint64_t first, uint64_t count) {
    auto got = Read(first, count);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(
        std::all_of(got->begin(), got->end(), [](uint8_t b) { return b == 0; }))
        << "pages [" << first << ", +" << count << ")";
  }
  uint64_t PoolCounter(Counter c) {
    auto vs = store_->GetVmStats(vm_);
    EXPECT_TRUE(vs.ok());
    for (const PoolStats& p : vs->pools) {
      if (p.id == pool_) return CounterValueOf(p.counters, c);
    }
    return 0;
  }
  uint64_t VmCharged() {
    auto vs = store_->GetVmStats(vm_);
    EXPECT_TRUE(vs.ok());
    return CounterValueOf(vs->counters, Counter::kChargedBytes);
  }
  uint64_t ImageBytes() {
    auto a = backing_->image().AllocatedBytes();
    EXPECT_TRUE(a.ok());
    return *a;
  }
  std::vector<uint64_t> ImagePages() {
    std::vector<uint64_t> pages;
    EXPECT_TRUE(backing_->image()
                    .ForEachPresentRun([&](uint64_t f, uint64_t n) {
                      for (uint64_t p = f; p < f + n; ++p) pages.push_back(p);
                    })
                    .ok());
    return pages;
  }

  std::unique_ptr<tmem::testing::TempDir> tmp_;
  std::string dir_;        // tmp_'s path
  std::string image_dir_;  // "": dir_
  std::string mounted_;    // a tmpfs to unmount
  std::unique_ptr<TmemStore> store_;
  VmId vm_ = 0;
  PoolId pool_ = -1;
  FixedAdvisor advisor_;
  std::unique_ptr<TmemSwapBacking> backing_;
  std::unique_ptr<TmemSwapBacking>
      other_;  // a second VM's, when a test needs one
};

// The most one page is charged: relief stops within this of the limit.
constexpr uint64_t kMaxPageCharge =
    BlobCharge(kPageSize) + kMaxPageMetadataCharge;

TEST_F(TmemSwapBackingTest, NeverWrittenPagesReadZeros) {
  EXPECT_EQ(backing_->page_count(), kPages);
  ExpectZeros(0, 1);
  ExpectZeros(500, 3);
  ExpectZeros(kPages - 1, 1);
  EXPECT_EQ(backing_->Stats().Get(TmemSwapCounter::kReadsZero), 5u);
}

TEST_F(TmemSwapBackingTest, WrittenPagesReadBackWhateverTheSpanSplit) {
  // Writes whose spans split pages anywhere; reads split differently.
  ASSERT_TRUE(Write(10, 8, 1, {1, 4095, 4097, 9000, 20000}).ok());
  ASSERT_TRUE(Write(100, 1, 1).ok());
  ExpectPages(10, 8, 1);
  auto got = Read(10, 8, {3, 5000, 12288, 12289});
  ASSERT_TRUE(got.ok());
  for (uint64_t i = 0; i < 8; ++i) {
    EXPECT_EQ(0, std::memcmp(got->data() + i * kSwapPageSize,
                             Pattern(10 + i, 1).data(), kSwapPageSize));
  }
  ExpectPages(100, 1, 1);
  ExpectZeros(18, 1);
  const TmemSwapStats st = backing_->Stats();
  EXPECT_EQ(st.pages_in_store, 9u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kWritesStored), 9u);
  // Contiguous destinations are decoded straight into them, split ones
  // through a buffer: the first read (8 pages) and the single page were
  // contiguous; of the split read, pages 0, 1 and 3 straddle spans.
  EXPECT_EQ(st.Get(TmemSwapCounter::kReadsStore), 17u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kReadsStoreDirect), 8u + 5u + 1u);
  // A persistent pool's get is not exclusive: reading again still hits.
  ExpectPages(10, 8, 1);
  EXPECT_EQ(advisor_.misses.load(), 0u);
}

TEST_F(TmemSwapBackingTest, OverwriteReturnsTheLatestBytes) {
  ASSERT_TRUE(Write(5, 4, 1).ok());
  ASSERT_TRUE(Write(6, 2, 2).ok());
  ExpectPages(5, 1, 1);
  ExpectPages(6, 2, 2);
  ExpectPages(8, 1, 1);
  EXPECT_EQ(backing_->Stats().pages_in_store, 4u);
}

TEST_F(TmemSwapBackingTest, RangesAndSpanSizesAreChecked) {
  std::vector<uint8_t> page(kSwapPageSize);
  auto one = Split(page);
  EXPECT_EQ(backing_->WritePages(kPages, 1, one).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(backing_->ReadPages(kPages - 1, 2, one).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(backing_->DiscardPages(UINT64_MAX, 2).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(backing_->WriteZeroPages(kPages, 1, true).code(),
            absl::StatusCode::kOutOfRange);
  // Spans holding other than count * 4096 bytes.
  EXPECT_EQ(backing_->WritePages(0, 2, one).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backing_->ReadPages(0, 2, one).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backing_->Stats().Get(TmemSwapCounter::kPageWrites), 0u);
}

TEST_F(TmemSwapBackingTest, ZeroAndSameFilledPagesCostNoData) {
  std::vector<uint8_t> zero(kSwapPageSize, 0);
  std::vector<uint8_t> same(kSwapPageSize);
  for (size_t i = 0; i < kSwapPageSize; i += 8) {
    const uint64_t w = 0x0123456789abcdefull;
    std::memcpy(same.data() + i, &w, 8);
  }
  ASSERT_TRUE(Write(3, 1, 1).ok());
  ASSERT_TRUE(WriteBytes(3, zero).ok());  // over a stored page
  ASSERT_TRUE(WriteBytes(4, zero).ok());
  ASSERT_TRUE(WriteBytes(5, same).ok());
  ExpectZeros(3, 2);
  auto got = Read(5, 1);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, same);
  const TmemSwapStats st = backing_->Stats();
  EXPECT_EQ(st.Get(TmemSwapCounter::kWritesZero), 2u);
  EXPECT_EQ(st.pages_in_store, 1u);  // the same-filled page
  EXPECT_EQ(CounterValueOf(st.pool, Counter::kPutsSameFilled), 1u);
  EXPECT_EQ(PoolCounter(Counter::kStoredBytes), 0u);
  EXPECT_EQ(PoolCounter(Counter::kPagesHeld), 1u);
  EXPECT_EQ(ImageBytes(), 0u);
}

TEST_F(TmemSwapBackingTest, DiscardAndWriteZeroesFreeStoreChargeAtOnce) {
  ASSERT_TRUE(Write(0, 64, 1).ok());
  ASSERT_TRUE(Write(200, 64, 1).ok());
  const uint64_t charged = PoolCounter(Counter::kChargedBytes);
  EXPECT_GE(charged, 128 * 1024u) << "64+64 incompressible pages";
  ASSERT_TRUE(backing_->DiscardPages(0, 64).ok());
  ASSERT_TRUE(backing_->WriteZeroPages(200, 64, /*may_unmap=*/false).ok());
  EXPECT_EQ(PoolCounter(Counter::kPagesHeld), 0u);
  EXPECT_EQ(PoolCounter(Counter::kChargedBytes), 0u);
  ExpectZeros(0, 64);
  ExpectZeros(200, 64);
  const TmemSwapStats st = backing_->Stats();
  EXPECT_EQ(st.pages_in_store, 0u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kDiscarded), 64u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kZeroed), 64u);
}

TEST_F(TmemSwapBackingTest, DiscardFreesImageBlocks) {
  advisor_.mode = PutMode::kDrop;  // the valve says spill
  ASSERT_TRUE(Write(0, 128, 1).ok());
  ASSERT_TRUE(backing_->Flush().ok());
  EXPECT_EQ(backing_->image().counters().syncs.load(), 1u) << "fdatasync";
  const uint64_t before = ImageBytes();
  EXPECT_GE(before, 128 * kSwapPageSize);
  EXPECT_EQ(PoolCounter(Counter::kPagesHeld), 0u) << "kDrop never stores";
  ASSERT_TRUE(backing_->DiscardPages(0, 64).ok());
  ASSERT_TRUE(backing_->WriteZeroPages(100, 8, true).ok());
  EXPECT_LE(ImageBytes(), before - 72 * kSwapPageSize);
  ExpectZeros(0, 64);
  ExpectPages(64, 36, 1);
  ExpectZeros(100, 8);
  ExpectPages(108, 20, 1);
  const TmemSwapStats st = backing_->Stats();
  EXPECT_EQ(st.Get(TmemSwapCounter::kSpilledValve), 128u);
  EXPECT_EQ(st.pages_in_image, 56u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kReadsImage), 56u);
  EXPECT_TRUE(st.image_direct_io);
  EXPECT_EQ(st.image_page_writes, 128u);
  EXPECT_EQ(st.image_page_reads, 56u);
  EXPECT_EQ(st.image_punches, 2u);  // one run per request
  EXPECT_EQ(st.image_syncs, 1u);
  EXPECT_EQ(st.image_io_errors, 0u);
}

TEST_F(TmemSwapBackingTest, ImageNeverHoldsAPageTheStoreHolds) {
  advisor_.mode = PutMode::kDrop;
  ASSERT_TRUE(Write(7, 3, 1).ok());
  EXPECT_EQ(ImagePages(), (std::vector<uint64_t>{7, 8, 9}));
  advisor_.mode = PutMode::kCompress;
  ASSERT_TRUE(Write(8, 1, 2).ok());  // moves into the store: hole punched
  EXPECT_EQ(ImagePages(), (std::vector<uint64_t>{7, 9}));
  EXPECT_EQ(PoolCounter(Counter::kPagesHeld), 1u);
  advisor_.mode = PutMode::kDrop;
  ASSERT_TRUE(Write(8, 1, 3).ok());  // back to the image: store copy gone
  EXPECT_EQ(PoolCounter(Counter::kPagesHeld), 0u);
  EXPECT_EQ(ImagePages(), (std::vector<uint64_t>{7, 8, 9}));
  std::vector<uint8_t> zero(kSwapPageSize, 0);
  ASSERT_TRUE(WriteBytes(9, zero).ok());  // zeros: hole punched
  EXPECT_EQ(ImagePages(), (std::vector<uint64_t>{7, 8}));
  ExpectPages(7, 1, 1);
  ExpectPages(8, 1, 3);
  ExpectZeros(9, 1);
}

TEST_F(TmemSwapBackingTest, ValveModesReachTheStore) {
  advisor_.mode = PutMode::kRaw;
  ASSERT_TRUE(Write(0, 4, 1).ok());
  EXPECT_EQ(PoolCounter(Counter::kPutsRaw), 4u);
  advisor_.mode = PutMode::kDefer;  // no compaction queue: compressed now
  ASSERT_TRUE(Write(4, 4, 1).ok());
  ExpectPages(0, 8, 1);
  EXPECT_EQ(advisor_.advised.load(), 8u);
}

// The VM's quota holds a quarter of what the guest writes: the rest spills
// to the image, every page reads back exactly, and the VM's store charge
// stays within its quota after every write.
TEST_F(TmemSwapBackingTest, QuotaSpillKeepsEveryPageAndTheQuota) {
  constexpr uint64_t kWritten = 512;
  VmPolicy policy;
  policy.quota_bytes = kWritten / 4 * kSwapPageSize;
  ASSERT_TRUE(store_->SetVmPolicy(vm_, policy).ok());
  for (uint64_t p = 0; p < kWritten; p += 4) {
    ASSERT_TRUE(Write(p, 4, 1).ok()) << "page " << p;
    ASSERT_LE(VmCharged(), policy.quota_bytes) << "after page " << p;
  }
  ExpectPages(0, kWritten, 1);
  // Overwrite half in another order: still exact, still within quota.
  for (uint64_t p = kWritten; p > 0; p -= 8) {
    ASSERT_TRUE(Write(p - 8, 4, 2).ok());
    ASSERT_LE(VmCharged(), policy.quota_bytes);
  }
  for (uint64_t p = 0; p < kWritten; p += 8) {
    ExpectPages(p, 4, 2);
    ExpectPages(p + 4, 4, 1);
  }
  const TmemSwapStats st = backing_->Stats();
  EXPECT_GT(st.Get(TmemSwapCounter::kSpilledQuota), 0u);
  EXPECT_GT(st.pages_in_store, 0u);
  EXPECT_GT(st.pages_in_image, 0u);
  EXPECT_EQ(st.pages_in_store + st.pages_in_image, kWritten);
  EXPECT_EQ(st.pages_lost, 0u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kImageWriteErrors), 0u);
  EXPECT_EQ(PoolCounter(Counter::kPagesHeld), st.pages_in_store);
  EXPECT_EQ(ImagePages().size(), st.pages_in_image);
}

// The host at its cap (no quota): the pages the store has no room for
// spill, every page reads back, and the store stays within its cap.
TEST_F(TmemSwapBackingTest, HostCapSpillKeepsEveryPage) {
  ASSERT_TRUE(store_->SetMemoryCap(2ull << 20).ok());
  ASSERT_TRUE(Write(0, kPages, 1).ok());
  ExpectPages(0, kPages, 1);
  const TmemSwapStats st = backing_->Stats();
  EXPECT_GT(st.Get(TmemSwapCounter::kSpilledNoMemory), 0u);
  EXPECT_GT(st.pages_in_store, 0u);
  EXPECT_EQ(st.pages_in_store + st.pages_in_image, kPages);
  const HostStats hs = store_->GetHostStats();
  EXPECT_LE(hs.memory_used_bytes, hs.memory_cap_bytes);
}

// The disk under the image fills up (a 64 KiB tmpfs): a write that cannot
// be stored anywhere fails with RESOURCE_EXHAUSTED and never reads back as
// anything else: a page with nothing before reads zeros, a page whose store
// copy a refused put removed is "lost" (DATA_LOSS), and freeing space makes
// pages writable again.
TEST_F(TmemSwapBackingTest, FullDiskFailsWritesNeverSilently) {
  if (::geteuid() != 0) GTEST_SKIP() << "mounting a small tmpfs needs root";
  ASSERT_NO_FATAL_FAILURE(MountSmallImageDir(65536));
  ASSERT_TRUE(Write(0, 4, 1).ok());  // in the store
  advisor_.mode = PutMode::kDrop;
  uint64_t p = 100;
  absl::Status s;
  for (; p < 200; ++p) {
    s = Write(p, 1, 1);
    if (!s.ok()) break;
  }
  ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  ASSERT_GE(p, 110u) << "a 64 KiB tmpfs holds about 16 pages";
  const uint64_t full_at = p;
  ExpectZeros(full_at, 1);
  ExpectPages(100, full_at - 100, 1);
  // The store refuses the overwrite (quota below what it holds); the image
  // has no room: the old bytes are gone from the store, so the page is lost.
  VmPolicy policy;
  policy.quota_bytes = 1;
  ASSERT_TRUE(store_->SetVmPolicy(vm_, policy).ok());
  advisor_.mode = PutMode::kCompress;
  EXPECT_EQ(Write(0, 1, 2).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Read(0, 1).status().code(), absl::StatusCode::kDataLoss);
  ExpectPages(1, 3, 1);  // untouched neighbours
  TmemSwapStats st = backing_->Stats();
  EXPECT_EQ(st.pages_lost, 1u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kPagesLost), 1u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kReadsLost), 1u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kImageWriteErrors), 2u);
  EXPECT_EQ(st.image_io_errors, 2u);
  // The valve's spill keeps the store's copy until the image has the page.
  advisor_.mode = PutMode::kDrop;
  EXPECT_EQ(Write(1, 1, 2).code(), absl::StatusCode::kResourceExhausted);
  ExpectPages(1, 1, 1);
  // Freeing image pages makes room again.
  ASSERT_TRUE(backing_->DiscardPages(100, full_at - 100).ok());
  ASSERT_TRUE(Write(0, 2, 3).ok());
  ExpectPages(0, 2, 3);
  st = backing_->Stats();
  EXPECT_EQ(st.pages_lost, 0u);
  EXPECT_EQ(st.pages_in_store, 2u);  // pages 2, 3
  EXPECT_EQ(st.pages_in_image, 2u);
}

// Graceful stop: what the store holds goes into the image; a fresh backing
// over that image (a restarted tmemd) reads every page back exactly.
TEST_F(TmemSwapBackingTest, WriteBackAllThenReopenReadsEveryPage) {
  VmPolicy policy;
  policy.quota_bytes = 100 * kSwapPageSize;  // some pages spill
  ASSERT_TRUE(store_->SetVmPolicy(vm_, policy).ok());
  ASSERT_TRUE(Write(0, 300, 1).ok());
  ASSERT_TRUE(Write(400, 10, 1).ok());
  ASSERT_TRUE(backing_->DiscardPages(50, 10).ok());
  std::vector<uint8_t> zero(kSwapPageSize, 0);
  ASSERT_TRUE(WriteBytes(500, zero).ok());
  const TmemSwapStats before = backing_->Stats();
  ASSERT_GT(before.pages_in_store, 0u);
  ASSERT_GT(before.pages_in_image, 0u);

  std::atomic<uint64_t> progress{0};
  auto n = backing_->WriteBackAll(&progress);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, before.pages_in_store);
  EXPECT_EQ(progress.load(), *n);
  EXPECT_EQ(backing_->Stats().pages_in_store, 0u);
  EXPECT_EQ(PoolCounter(Counter::kPagesHeld), 0u);
  EXPECT_EQ(backing_->Stats().pages_in_image, 300u + 10u - 10u);
  // The running device still serves them, now from the image.
  ExpectPages(0, 50, 1);

  Reopen();
  const TmemSwapStats after = backing_->Stats();
  EXPECT_EQ(after.pages_in_image, 300u);
  EXPECT_EQ(after.pages_in_store, 0u);
  ExpectPages(0, 50, 1);
  ExpectZeros(50, 10);
  ExpectPages(60, 240, 1);
  ExpectZeros(300, 100);
  ExpectPages(400, 10, 1);
  ExpectZeros(500, 1);
}

// Without WriteBackAll, a reopen finds only what was spilled: the store
// is memory. This is the negative control for the test above.
TEST_F(TmemSwapBackingTest, ReopenWithoutWriteBackFindsOnlySpilledPages) {
  ASSERT_TRUE(Write(0, 10, 1).ok());  // all in the store
  EXPECT_EQ(PoolCounter(Counter::kPagesHeld), 10u);
  Reopen();  // also empties the pool: its pages are no device page now
  EXPECT_EQ(PoolCounter(Counter::kPagesHeld), 0u);
  EXPECT_EQ(PoolCounter(Counter::kChargedBytes), 0u);
  ExpectZeros(0, 10);
}

// The VM was forgotten under the device (an operator's call): new writes
// still land in the image; pages the store held fail as DATA_LOSS, counted.
TEST_F(TmemSwapBackingTest, StoreGoneWritesSpillReadsOfLostPagesFail) {
  ASSERT_TRUE(Write(0, 2, 1).ok());
  ASSERT_TRUE(store_->ForgetVm(vm_).ok());
  ASSERT_TRUE(Write(10, 2, 1).ok());
  ExpectPages(10, 2, 1);
  auto got = Read(0, 1);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss);
  const TmemSwapStats st = backing_->Stats();
  EXPECT_EQ(st.Get(TmemSwapCounter::kSpilledOther), 2u);
  EXPECT_GE(st.Get(TmemSwapCounter::kStoreErrors), 3u);
  // Writing the page again makes it whole.
  ASSERT_TRUE(Write(0, 1, 2).ok());
  ExpectPages(0, 1, 2);
}

// A quota lowered below what the VM's swap pages are charged: relief moves
// pages into the image until the charge is within it, in bounded steps, and
// stops there; every page reads back, each from one place; nothing is lost.
TEST_F(TmemSwapBackingTest, ReliefMovesPagesOverALoweredQuotaToTheImage) {
  constexpr uint64_t kWritten = 256;
  ASSERT_TRUE(Write(0, kWritten, 1).ok());
  ASSERT_EQ(backing_->Stats().pages_in_store, kWritten);
  // Within every limit: a step moves nothing (the control).
  EXPECT_EQ(Excess(vm_), 0u);
  ReliefStep idle = backing_->RelieveStep(64);
  EXPECT_EQ(idle.moved, 0u);
  EXPECT_EQ(backing_->Stats().Get(TmemSwapCounter::kReliefSteps), 0u);

  const uint64_t charged = VmCharged();
  VmPolicy policy;
  policy.quota_bytes = charged / 2;
  ASSERT_TRUE(store_->SetVmPolicy(vm_, policy).ok());
  auto excess = store_->PersistentExcessBytes(vm_);
  ASSERT_TRUE(excess.ok());
  EXPECT_EQ(excess->over_quota, charged - policy.quota_bytes);
  EXPECT_EQ(excess->bytes, excess->over_quota);
  EXPECT_EQ(excess->host_cap_share, 0u);
  // Nothing was evicted: persistent pages stay until moved.
  EXPECT_EQ(VmCharged(), charged);

  const ReliefStep first = backing_->RelieveStep(16);
  EXPECT_EQ(first.moved, 16u);
  EXPECT_EQ(first.before.bytes, charged - policy.quota_bytes);
  EXPECT_LT(first.excess_after, first.before.bytes);
  const uint64_t moved = 16 + RelieveAll(*backing_, 16);
  EXPECT_EQ(Excess(vm_), 0u);
  EXPECT_LE(VmCharged(), policy.quota_bytes);
  // It stops as soon as the VM is within: one page fewer would not be.
  EXPECT_GT(VmCharged() + kMaxPageCharge, policy.quota_bytes);

  const TmemSwapStats st = backing_->Stats();
  EXPECT_EQ(st.Get(TmemSwapCounter::kRelievedToImage), moved);
  EXPECT_GE(st.Get(TmemSwapCounter::kReliefSteps), moved / 16);
  EXPECT_EQ(st.pages_in_image, moved);
  EXPECT_EQ(st.pages_in_store, kWritten - moved);
  EXPECT_EQ(st.pages_lost, 0u);
  EXPECT_EQ(PoolCounter(Counter::kPagesHeld), st.pages_in_store);
  EXPECT_EQ(ImagePages().size(), moved);
  ExpectPages(0, kWritten, 1);
  // The image pages survive a graceful stop like any other.
  ASSERT_TRUE(backing_->WriteBackAll().ok());
  Reopen();
  ExpectPages(0, kWritten, 1);
}

// The swap quota (VmPolicy::swap_quota_bytes) lowered below the VM's
// persistent charge: relief brings that charge within it.
TEST_F(TmemSwapBackingTest, ReliefBringsPersistentChargeWithinTheSwapQuota) {
  constexpr uint64_t kWritten = 128;
  ASSERT_TRUE(Write(0, kWritten, 1).ok());
  const uint64_t persistent = PersistentBytes(vm_);
  VmPolicy policy;
  policy.swap_quota_bytes = persistent / 4;
  ASSERT_TRUE(store_->SetVmPolicy(vm_, policy).ok());
  auto kept = store_->GetVmPolicy(vm_);
  ASSERT_TRUE(kept.ok());
  ASSERT_EQ(kept->swap_quota_bytes, policy.swap_quota_bytes);
  auto excess = store_->PersistentExcessBytes(vm_);
  ASSERT_TRUE(excess.ok());
  EXPECT_EQ(excess->over_swap_quota, persistent - policy.swap_quota_bytes);
  EXPECT_EQ(excess->over_quota, 0u);
  const uint64_t moved = RelieveAll(*backing_, 32);
  EXPECT_GT(moved, 0u);
  EXPECT_EQ(Excess(vm_), 0u);
  EXPECT_LE(PersistentBytes(vm_), policy.swap_quota_bytes);
  EXPECT_GT(PersistentBytes(vm_) + kMaxPageCharge, policy.swap_quota_bytes);
  EXPECT_EQ(backing_->Stats().pages_in_image, moved);
  ExpectPages(0, kWritten, 1);
}

// The host cap lowered below what persistent pages alone hold, two VMs of
// equal weight: the one over its fair share gives, the one within gives
// nothing, and the pages' charge ends within the cap. Every page of both
// reads back.
TEST_F(TmemSwapBackingTest, ReliefAtALoweredCapTakesFromTheVmOverItsShare) {
  auto vm2 = store_->AddVm("vm2", VmPolicy{});
  ASSERT_TRUE(vm2.ok());
  auto pool2 = store_->NewPool(*vm2, nullptr, PoolKind::kPersistent);
  ASSERT_TRUE(pool2.ok());
  SpillImageOptions io;
  io.path = dir_ + "/vm2.swap.img";
  io.page_count = kPages;
  auto img = SpillImage::Open(io);
  ASSERT_TRUE(img.ok()) << img.status();
  TmemSwapBackingOptions o;
  o.store = store_.get();
  o.vm = *vm2;
  o.pool = *pool2;
  auto b = TmemSwapBacking::Open(o, std::move(*img));
  ASSERT_TRUE(b.ok()) << b.status();
  other_ = std::move(*b);

  ASSERT_TRUE(Write(0, 300, 1).ok());  // vm1: 300 pages
  std::vector<uint8_t> buf(100 * kSwapPageSize);
  for (uint64_t i = 0; i < 100; ++i) {
    FillPattern(i, 7, buf.data() + i * kSwapPageSize);
  }
  ASSERT_TRUE(other_->WritePages(0, 100, Split(buf)).ok());  // vm2: 100
  ASSERT_EQ(backing_->Stats().pages_in_store, 300u);
  ASSERT_EQ(other_->Stats().pages_in_store, 100u);

  const uint64_t charged1 = VmCharged();
  const uint64_t charged2 = [&] {
    auto vs = store_->GetVmStats(*vm2);
    return CounterValueOf(vs->counters, Counter::kChargedBytes);
  }();
  // A cap of 300 pages' charge: the fair level is half of it each, above
  // vm2's charge, so vm1 gives the whole excess.
  const uint64_t cap = (charged1 + charged2) * 3 / 4;
  ASSERT_LT(cap, store_->GetHostStats().persistent_bytes);
  ASSERT_GT(cap / 2, charged2);
  ASSERT_TRUE(store_->SetMemoryCap(cap).ok());
  EXPECT_EQ(backing_->Stats().pages_in_store, 300u);  // nothing evicted
  auto e1 = store_->PersistentExcessBytes(vm_);
  auto e2 = store_->PersistentExcessBytes(*vm2);
  ASSERT_TRUE(e1.ok() && e2.ok());
  EXPECT_GT(e1->host_cap_share, 0u);
  EXPECT_EQ(e2->bytes, 0u);

  // Both devices step, as the agent's tick does.
  uint64_t moved1 = 0;
  uint64_t moved2 = 0;
  for (int i = 0; i < 1000; ++i) {
    const uint64_t m1 = backing_->RelieveStep(32).moved;
    const uint64_t m2 = other_->RelieveStep(32).moved;
    moved1 += m1;
    moved2 += m2;
    if (m1 + m2 == 0) break;
  }
  EXPECT_GT(moved1, 0u);
  EXPECT_EQ(moved2, 0u);
  EXPECT_EQ(Excess(vm_), 0u);
  const HostStats hs = store_->GetHostStats();
  EXPECT_LE(std::min(hs.memory_used_bytes, hs.vm_charged_bytes), cap);
  EXPECT_GT(hs.vm_charged_bytes + kMaxPageCharge, cap);
  EXPECT_EQ(backing_->Stats().pages_in_image, moved1);
  ExpectPages(0, 300, 1);
  std::vector<uint8_t> got(100 * kSwapPageSize);
  ASSERT_TRUE(other_->ReadPages(0, 100, Split(got)).ok());
  EXPECT_EQ(got, buf);
}

// Relief into a full disk: the page whose image write failed stays in the
// store (nothing lost, counted), the step stops there, later steps go on
// once there is room, and every page reads back throughout.
TEST_F(TmemSwapBackingTest, ReliefIntoAFullDiskLeavesPagesInTheStore) {
  if (::geteuid() != 0) GTEST_SKIP() << "mounting a small tmpfs needs root";
  ASSERT_NO_FATAL_FAILURE(MountSmallImageDir(65536));
  constexpr uint64_t kWritten = 40;  // more than the 16 pages the disk holds
  ASSERT_TRUE(Write(0, kWritten, 1).ok());
  ASSERT_EQ(backing_->Stats().pages_in_store, kWritten);
  VmPolicy policy;
  policy.quota_bytes = 1;  // every swap page is over it
  ASSERT_TRUE(store_->SetVmPolicy(vm_, policy).ok());

  ReliefStep step = backing_->RelieveStep(1024);
  EXPECT_GT(step.moved, 0u);
  EXPECT_LT(step.moved, kWritten);
  EXPECT_EQ(step.failed, 1u);
  EXPECT_EQ(step.error.code(), absl::StatusCode::kResourceExhausted)
      << step.error;
  const uint64_t fit = step.moved;
  TmemSwapStats st = backing_->Stats();
  EXPECT_EQ(st.Get(TmemSwapCounter::kReliefImageWriteErrors), 1u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kRelievedToImage), fit);
  EXPECT_EQ(st.pages_in_image, fit);
  EXPECT_EQ(st.pages_in_store, kWritten - fit);
  EXPECT_EQ(st.pages_lost, 0u);
  EXPECT_EQ(PoolCounter(Counter::kPagesHeld), kWritten - fit);
  // The failed write left nothing in the image.
  EXPECT_EQ(ImagePages().size(), fit);
  ExpectPages(0, kWritten, 1);

  // Still full: the next step fails at once, moves nothing, loses nothing.
  step = backing_->RelieveStep(1024);
  EXPECT_EQ(step.moved, 0u);
  EXPECT_EQ(step.failed, 1u);
  EXPECT_EQ(backing_->Stats().Get(TmemSwapCounter::kReliefImageWriteErrors),
            2u);
  ExpectPages(0, kWritten, 1);

  // Room again (the guest discards what relief moved first): relief goes on.
  ASSERT_TRUE(backing_->DiscardPages(0, 8).ok());
  step = backing_->RelieveStep(1024);
  EXPECT_GT(step.moved, 0u);
  st = backing_->Stats();
  EXPECT_EQ(st.pages_in_store + st.pages_in_image, kWritten - 8);
  EXPECT_EQ(st.pages_lost, 0u);
  ExpectZeros(0, 8);
  ExpectPages(8, kWritten - 8, 1);
}

// Relief while the guest's queues read and write the same pages: every
// read returns the latest write of its page, whether it was in the store,
// moving, or in the image. Threads (TSan).
TEST_F(TmemSwapBackingTest, ReliefWhileTheGuestReadsAndWrites) {
  ASSERT_TRUE(Write(0, kPages, 1).ok());
  VmPolicy policy;
  policy.quota_bytes = VmCharged() / 3;
  ASSERT_TRUE(store_->SetVmPolicy(vm_, policy).ok());
  constexpr int kThreads = 4;
  constexpr uint64_t kPer = kPages / kThreads;  // even
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::thread relief([&] {
    while (!stop.load()) {
      const ReliefStep step = backing_->RelieveStep(8);
      if (!step.error.ok()) failures.fetch_add(1);
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const uint64_t base = t * kPer;
      for (uint32_t round = 2; round <= 4; ++round) {
        for (uint64_t p = base; p < base + kPer; p += 2) {
          if (!Write(p, 1, round).ok()) failures.fetch_add(1);
          auto got = Read(p, 2);
          if (!got.ok() ||
              std::memcmp(got->data(), Pattern(p, round).data(),
                          kSwapPageSize) != 0 ||
              std::memcmp(got->data() + kSwapPageSize, Pattern(p + 1, 1).data(),
                          kSwapPageSize) != 0) {
            failures.fetch_add(1);
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  stop = true;
  relief.join();
  EXPECT_EQ(failures.load(), 0);
  RelieveAll(*backing_, 64);
  EXPECT_LE(VmCharged(), policy.quota_bytes);
  for (uint64_t p = 0; p < kThreads * kPer; p += 2) {
    ExpectPages(p, 1, 4);
    ExpectPages(p + 1, 1, 1);
  }
  const TmemSwapStats st = backing_->Stats();
  EXPECT_EQ(st.pages_lost, 0u);
  EXPECT_EQ(st.pages_in_store + st.pages_in_image, kPages);
}

TEST_F(TmemSwapBackingTest, OpenRefusesHostileImage) {
  backing_.reset();
  const std::string path = dir_ + "/vm1.swap.img";
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  SpillImageOptions io;
  io.path = path;
  io.page_count = kPages;
  SpillOpenRefusals refusals;
  io.refusals = &refusals;
  auto img = SpillImage::Open(io);
  ASSERT_FALSE(img.ok());
  EXPECT_THAT(img.status().message(), HasSubstr(path));
  EXPECT_EQ(refusals.too_permissive.load(), 1u);
}

// Several queues at once on disjoint pages, with spilling (quota), the
// valve switching modes, discards, a stats reader and write-backs; every
// page checked.
TEST_F(TmemSwapBackingTest, ConcurrentQueuesOnDisjointPages) {
  VmPolicy policy;
  policy.quota_bytes = 128 * kSwapPageSize;
  ASSERT_TRUE(store_->SetVmPolicy(vm_, policy).ok());
  constexpr int kThreads = 4;
  constexpr uint64_t kPer = kPages / kThreads;
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::atomic<uint64_t> written_back{0};
  std::thread stats([&] {
    for (int i = 0; !stop.load(); ++i) {
      (void)backing_->Stats();
      // A graceful stop's write-back while the queues still run.
      if (i % 64 == 63 && !backing_->WriteBackAll(&written_back).ok()) {
        failures.fetch_add(1);
      }
      advisor_.mode = advisor_.mode.load() == PutMode::kDrop
                          ? PutMode::kCompress
                          : PutMode::kDrop;
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const uint64_t base = t * kPer;
      for (uint32_t round = 1; round <= 3; ++round) {
        for (uint64_t p = base; p < base + kPer; p += 4) {
          if (!Write(p, 4, round).ok()) failures.fetch_add(1);
        }
        for (uint64_t p = base; p < base + kPer; p += 4) {
          auto got = Read(p, 4);
          if (!got.ok()) {
            failures.fetch_add(1);
            continue;
          }
          for (uint64_t i = 0; i < 4; ++i) {
            if (std::memcmp(got->data() + i * kSwapPageSize,
                            Pattern(p + i, round).data(), kSwapPageSize) != 0) {
              failures.fetch_add(1);
            }
          }
        }
        if (!backing_->DiscardPages(base, kPer / 2).ok()) {
          failures.fetch_add(1);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  stop = true;
  stats.join();
  EXPECT_EQ(failures.load(), 0);
  for (int t = 0; t < kThreads; ++t) {
    ExpectZeros(t * kPer, kPer / 2);
    ExpectPages(t * kPer + kPer / 2, kPer / 2, 3);
  }
  const TmemSwapStats st = backing_->Stats();
  EXPECT_EQ(st.pages_in_store + st.pages_in_image, kPages / 2);
  EXPECT_LE(VmCharged(), policy.quota_bytes);
}

}  // namespace
}  // namespace tmem::swap
