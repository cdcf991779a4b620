// GuestMemory: memory-table validation and address translation against
// hostile tables and addresses (overflow, overlap, short files).
#include "host-agent/swap/guest_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace tmem::swap {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

MemoryRegionDesc R(uint64_t gpa, uint64_t size, uint64_t uva,
                   uint64_t off = 0) {
  return MemoryRegionDesc{gpa, size, uva, off};
}

TEST(GuestMemoryValidate, AcceptsDisjointRegions) {
  std::vector<MemoryRegionDesc> t{R(0, 0xa0000, 0x7f0000000000),
                                  R(0x100000, 0x1000000, 0x7f0000100000)};
  EXPECT_TRUE(GuestMemory::ValidateRegions(t).ok());
}

TEST(GuestMemoryValidate, RefusesEmptyZeroSizedAndTooMany) {
  EXPECT_FALSE(GuestMemory::ValidateRegions({}).ok());
  std::vector<MemoryRegionDesc> zero{R(0, 0, 0)};
  EXPECT_FALSE(GuestMemory::ValidateRegions(zero).ok());
  std::vector<MemoryRegionDesc> many;
  for (uint64_t i = 0; i < 9; ++i) many.push_back(R(i << 20, 4096, i << 20));
  EXPECT_FALSE(GuestMemory::ValidateRegions(many).ok());
}

TEST(GuestMemoryValidate, RefusesWrapAround) {
  std::vector<MemoryRegionDesc> gpa{R(kMax - 0xfff, 0x2000, 0)};
  EXPECT_FALSE(GuestMemory::ValidateRegions(gpa).ok());
  std::vector<MemoryRegionDesc> uva{R(0, 0x2000, kMax - 0xfff)};
  EXPECT_FALSE(GuestMemory::ValidateRegions(uva).ok());
  std::vector<MemoryRegionDesc> off{R(0, 0x2000, 0, kMax - 0xfff)};
  EXPECT_FALSE(GuestMemory::ValidateRegions(off).ok());
  std::vector<MemoryRegionDesc> huge{R(0, kMax, 0)};
  EXPECT_FALSE(GuestMemory::ValidateRegions(huge).ok());
  // The very top of the address space, exactly: allowed by arithmetic.
  std::vector<MemoryRegionDesc> top{R(kMax - 0xfff, 0x1000, 0x1000)};
  EXPECT_TRUE(GuestMemory::ValidateRegions(top).ok());
}

TEST(GuestMemoryValidate, RefusesOverlaps) {
  std::vector<MemoryRegionDesc> gpa{R(0, 0x2000, 0x10000),
                                    R(0x1fff, 0x1000, 0x20000)};
  EXPECT_FALSE(GuestMemory::ValidateRegions(gpa).ok());
  std::vector<MemoryRegionDesc> uva{R(0, 0x2000, 0x10000),
                                    R(0x4000, 0x1000, 0x11000)};
  EXPECT_FALSE(GuestMemory::ValidateRegions(uva).ok());
  std::vector<MemoryRegionDesc> inside{R(0, 0x10000, 0x10000),
                                       R(0x1000, 0x1000, 0x80000)};
  EXPECT_FALSE(GuestMemory::ValidateRegions(inside).ok());
  std::vector<MemoryRegionDesc> adjacent{R(0, 0x2000, 0x10000),
                                         R(0x2000, 0x1000, 0x12000)};
  EXPECT_TRUE(GuestMemory::ValidateRegions(adjacent).ok());
}

TEST(GuestMemoryTranslate, BoundsCannotOverflow) {
  std::vector<uint8_t> a(0x2000);
  std::vector<uint8_t> b(0x1000);
  uint8_t* bases[] = {a.data(), b.data()};
  std::vector<MemoryRegionDesc> t{R(0x10000, 0x2000, 0x7000000),
                                  R(0x12000, 0x1000, 0x9000000)};
  auto mem = GuestMemory::FromBuffers(t, bases);
  ASSERT_TRUE(mem.ok()) << mem.status();
  EXPECT_EQ(mem->TranslateGuest(0x10000, 0x2000), a.data());
  EXPECT_EQ(mem->TranslateGuest(0x11fff, 1), a.data() + 0x1fff);
  EXPECT_EQ(mem->TranslateGuest(0x11fff, 2), nullptr);  // crosses regions
  EXPECT_EQ(mem->TranslateGuest(0xffff, 1), nullptr);
  EXPECT_EQ(mem->TranslateGuest(0x13000, 1), nullptr);
  EXPECT_EQ(mem->TranslateGuest(0x10000, kMax), nullptr);
  EXPECT_EQ(mem->TranslateGuest(0x10001, kMax), nullptr);
  EXPECT_EQ(mem->TranslateGuest(kMax, 2), nullptr);
  EXPECT_EQ(mem->TranslateUser(0x9000000, 0x1000), b.data());
  EXPECT_EQ(mem->TranslateUser(0x9000001, 0x1000), nullptr);
  EXPECT_EQ(mem->TranslateUser(0x10000, 1), nullptr);  // a gpa, not a uva

  std::vector<GuestSpan> spans;
  EXPECT_TRUE(mem->TranslateGuestSpans(0x11ff0, 0x20, 4, &spans));
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].data, a.data() + 0x1ff0);
  EXPECT_EQ(spans[0].len, 0x10u);
  EXPECT_EQ(spans[1].data, b.data());
  EXPECT_EQ(spans[1].len, 0x10u);
  spans.clear();
  EXPECT_FALSE(mem->TranslateGuestSpans(0x11ff0, 0x20, 1, &spans));
  EXPECT_FALSE(mem->TranslateGuestSpans(0x12ff0, 0x20, 4, &spans));
  EXPECT_FALSE(mem->TranslateGuestSpans(0x10000, kMax, 64, &spans));
  EXPECT_TRUE(spans.empty());
}

int MakeMemfd(off_t size) {
  int fd = memfd_create("guest", MFD_CLOEXEC);
  if (fd >= 0 && ftruncate(fd, size) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

TEST(GuestMemoryMap, MapsAtOffsetAndSharesWithTheFile) {
  const int fd = MakeMemfd(0x3000);
  ASSERT_GE(fd, 0);
  const int mine = dup(fd);
  std::vector<MemoryRegionDesc> t{R(0, 0x2000, 0x7f0000000000, 0x1000)};
  int fds[] = {fd};
  auto mem = GuestMemory::Map(t, fds);
  ASSERT_TRUE(mem.ok()) << mem.status();
  uint8_t* p = mem->TranslateGuest(0x10, 1);
  ASSERT_NE(p, nullptr);
  *p = 0x42;
  uint8_t got = 0;
  ASSERT_EQ(pread(mine, &got, 1, 0x1010), 1);
  EXPECT_EQ(got, 0x42);
  close(mine);
}

TEST(GuestMemoryMap, RefusesAFileShorterThanTheRegion) {
  const int fd = MakeMemfd(0x1000);
  ASSERT_GE(fd, 0);
  std::vector<MemoryRegionDesc> t{R(0, 0x1000, 0x1000, 0x1000)};
  int fds[] = {fd};
  auto mem = GuestMemory::Map(t, fds);
  EXPECT_FALSE(mem.ok());
  // Map closed the descriptor it was given.
  EXPECT_EQ(fcntl(fd, F_GETFD), -1);
}

TEST(GuestMemoryMap, RefusesANonMappableFd) {
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  close(p[1]);
  std::vector<MemoryRegionDesc> t{R(0, 0x1000, 0x1000)};
  int fds[] = {p[0]};
  EXPECT_FALSE(GuestMemory::Map(t, fds).ok());
}

TEST(GuestMemoryMap, RefusesFdCountMismatchAndClosesThem) {
  const int fd = MakeMemfd(0x1000);
  std::vector<MemoryRegionDesc> t{R(0, 0x1000, 0x1000),
                                  R(0x1000, 0x1000, 0x2000)};
  int fds[] = {fd};
  EXPECT_FALSE(GuestMemory::Map(t, fds).ok());
  EXPECT_EQ(fcntl(fd, F_GETFD), -1);
}

TEST(GuestSpans, SliceAndCopyStayInside) {
  uint8_t a[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  uint8_t b[4] = {8, 9, 10, 11};
  std::vector<GuestSpan> spans{{a, 8}, {b, 4}};
  std::vector<GuestSpan> out;
  ASSERT_TRUE(SliceSpans(spans, 6, 4, &out));
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].data, a + 6);
  EXPECT_EQ(out[1].len, 2u);
  EXPECT_FALSE(SliceSpans(spans, 6, 7, &out));
  EXPECT_FALSE(SliceSpans(spans, kMax, 1, &out));
  uint8_t buf[12];
  EXPECT_TRUE(CopyFromSpans(spans, buf, 12));
  EXPECT_EQ(buf[9], 9);
  EXPECT_FALSE(CopyFromSpans(spans, buf, 13));
}

}  // namespace
}  // namespace tmem::swap
