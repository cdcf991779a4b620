// TmemSwapStoreFactory's in-use mark: a device whose last tmemd did not
// write its pages back is refused, never served from an image that lacks
// them; one written back opens again with every page.
#include "host-agent/swap/swap_store.h"

#include <sys/stat.h>

#include <array>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "tests/temp_dir.h"

namespace tmem::swap {
namespace {

constexpr uint64_t kPages = 64;

class SwapStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(tmp_.path().empty());
    StoreOptions so;
    so.memory_cap_bytes = uint64_t{16} << 20;
    so.num_shards = 2;
    auto store = TmemStore::Create(so);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    auto vm = store_->AddVm("vm1", VmPolicy{});
    ASSERT_TRUE(vm.ok()) << vm.status();
    vm_ = *vm;
  }
  absl::StatusOr<std::unique_ptr<SwapStore>> Open() {
    SwapStoreRequest r;
    r.vm_name = "vm1";
    r.vm = vm_;
    r.page_count = kPages;
    r.store = store_.get();
    r.state_dir = tmp_.path() + "/state";
    return factory_(r);
  }
  std::string Mark() const { return tmp_.path() + "/state/swap/vm1.img.inuse"; }
  static bool Exists(const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0;
  }
  static void WritePage(SwapStore& s, uint64_t page, uint8_t fill) {
    std::array<uint8_t, kSwapPageSize> buf{};
    buf.fill(fill);
    const GuestSpan span{buf.data(), buf.size()};
    ASSERT_TRUE(s.backing().WritePages(page, 1, {&span, 1}).ok());
  }
  static uint8_t ReadPage(SwapStore& s, uint64_t page) {
    std::array<uint8_t, kSwapPageSize> buf{};
    const GuestSpan span{buf.data(), buf.size()};
    EXPECT_TRUE(s.backing().ReadPages(page, 1, {&span, 1}).ok());
    return buf[kSwapPageSize - 1];
  }

  tmem::testing::TempDir tmp_{"swap-store-test"};
  SpillOpenRefusals refusals_;
  SwapStoreFactory factory_ = TmemSwapStoreFactory(&refusals_);
  std::unique_ptr<TmemStore> store_;
  VmId vm_ = 0;
};

TEST_F(SwapStoreTest, MarkIsHeldWhileOpenAndGoneAfterWriteBack) {
  auto s = Open();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(Exists(Mark()));
  WritePage(**s, 3, 0x5a);
  ASSERT_TRUE((*s)->WriteBack().ok());
  EXPECT_FALSE(Exists(Mark()));
  s->reset();

  auto again = Open();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(ReadPage(**again, 3), 0x5a);
  EXPECT_EQ(refusals_.not_written_back.load(), 0u);
}

// What a SIGKILL leaves: the store's pages gone with the process, the
// image without them, the mark still there.
TEST_F(SwapStoreTest, DeviceNotWrittenBackIsRefusedNamingTheMark) {
  auto s = Open();
  ASSERT_TRUE(s.ok()) << s.status();
  WritePage(**s, 3, 0x5a);  // held in the store only
  s->reset();               // no write-back

  auto again = Open();
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(again.status().message().find(Mark()), std::string::npos)
      << again.status();
  EXPECT_EQ(refusals_.not_written_back.load(), 1u);
  // Refused, not consumed: a second try is refused too.
  EXPECT_FALSE(Open().ok());
  EXPECT_TRUE(Exists(Mark()));
}

// A failed open leaves no mark behind to refuse the next one.
TEST_F(SwapStoreTest, RefusedImageLeavesNoMark) {
  ASSERT_EQ(::mkdir((tmp_.path() + "/state").c_str(), 0700), 0);
  ASSERT_EQ(::mkdir((tmp_.path() + "/state/swap").c_str(), 0700), 0);
  // A directory where the image should be: SpillImage refuses it.
  ASSERT_EQ(::mkdir((tmp_.path() + "/state/swap/vm1.img").c_str(), 0700), 0);
  EXPECT_FALSE(Open().ok());
  EXPECT_FALSE(Exists(Mark()));
}

}  // namespace
}  // namespace tmem::swap
