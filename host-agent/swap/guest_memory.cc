#include "host-agent/swap/guest_memory.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tmem::swap {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

// [base, base + size) with size > 0 stays below 2^64.
bool RangeFits(uint64_t base, uint64_t size) { return size - 1 <= kMax - base; }

// Both ranges valid (RangeFits); last bytes compared, so no overflow.
bool Overlap(uint64_t a, uint64_t a_size, uint64_t b, uint64_t b_size) {
  const uint64_t a_last = a + (a_size - 1);
  const uint64_t b_last = b + (b_size - 1);
  return a <= b_last && b <= a_last;
}

absl::Status RegionError(size_t i, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("memory table region ", i, ": ", why));
}

void CloseAll(std::span<const int> fds) {
  for (int fd : fds) {
    if (fd >= 0) close(fd);
  }
}

}  // namespace

uint64_t SpansLength(std::span<const GuestSpan> spans) {
  uint64_t total = 0;
  for (const GuestSpan& s : spans) total += s.len;
  return total;
}

bool SliceSpans(std::span<const GuestSpan> spans, uint64_t offset, uint64_t len,
                std::vector<GuestSpan>* out) {
  const size_t start = out->size();
  for (const GuestSpan& s : spans) {
    if (len == 0) break;
    if (offset >= s.len) {
      offset -= s.len;
      continue;
    }
    const uint64_t take = std::min<uint64_t>(len, s.len - offset);
    out->push_back(GuestSpan{s.data + offset, static_cast<size_t>(take)});
    len -= take;
    offset = 0;
  }
  if (len != 0) {
    out->resize(start);
    return false;
  }
  return true;
}

bool CopyFromSpans(std::span<const GuestSpan> spans, uint8_t* dst, size_t n) {
  if (SpansLength(spans) < n) return false;
  for (const GuestSpan& s : spans) {
    if (n == 0) break;
    const size_t take = std::min(n, s.len);
    std::memcpy(dst, s.data, take);
    dst += take;
    n -= take;
  }
  return true;
}

bool CopyToSpans(std::span<const GuestSpan> spans, const uint8_t* src,
                 size_t n) {
  if (SpansLength(spans) < n) return false;
  for (const GuestSpan& s : spans) {
    if (n == 0) break;
    const size_t take = std::min(n, s.len);
    std::memcpy(s.data, src, take);
    src += take;
    n -= take;
  }
  return true;
}

absl::Status GuestMemory::ValidateRegions(
    std::span<const MemoryRegionDesc> regions) {
  if (regions.empty() || regions.size() > kVhostUserMaxRegions) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory table has ", regions.size(),
                     " regions, must be 1 to ", kVhostUserMaxRegions));
  }
  for (size_t i = 0; i < regions.size(); ++i) {
    const MemoryRegionDesc& r = regions[i];
    if (r.memory_size == 0) return RegionError(i, "size 0");
    if (!RangeFits(r.guest_phys_addr, r.memory_size)) {
      return RegionError(i, "guest-physical range wraps");
    }
    if (!RangeFits(r.userspace_addr, r.memory_size)) {
      return RegionError(i, "user address range wraps");
    }
    if (!RangeFits(r.mmap_offset, r.memory_size) ||
        r.mmap_offset + r.memory_size >
            static_cast<uint64_t>(std::numeric_limits<size_t>::max()) ||
        r.mmap_offset + r.memory_size >
            static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
      return RegionError(i, "file range too large");
    }
    for (size_t j = 0; j < i; ++j) {
      const MemoryRegionDesc& o = regions[j];
      if (Overlap(r.guest_phys_addr, r.memory_size, o.guest_phys_addr,
                  o.memory_size)) {
        return RegionError(i, absl::StrCat("guest-physical range overlaps "
                                           "region ",
                                           j));
      }
      if (Overlap(r.userspace_addr, r.memory_size, o.userspace_addr,
                  o.memory_size)) {
        return RegionError(
            i, absl::StrCat("user address range overlaps region ", j));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<GuestMemory> GuestMemory::Map(
    std::span<const MemoryRegionDesc> regions, std::span<const int> fds) {
  if (fds.size() != regions.size()) {
    CloseAll(fds);
    return absl::InvalidArgumentError(
        absl::StrCat("memory table: ", regions.size(), " regions but ",
                     fds.size(), " file descriptors"));
  }
  if (absl::Status s = ValidateRegions(regions); !s.ok()) {
    CloseAll(fds);
    return s;
  }
  GuestMemory mem;
  for (size_t i = 0; i < regions.size(); ++i) {
    const MemoryRegionDesc& r = regions[i];
    const uint64_t file_len = r.mmap_offset + r.memory_size;  // validated
    struct stat st {};
    if (fstat(fds[i], &st) != 0) {
      const int err = errno;
      CloseAll(fds);
      return absl::ErrnoToStatus(
          err, absl::StrCat("memory table region ", i, ": fstat"));
    }
    if (st.st_size < 0 || static_cast<uint64_t>(st.st_size) < file_len) {
      CloseAll(fds);
      return RegionError(i, absl::StrCat("file has ", st.st_size,
                                         " bytes, region needs ", file_len));
    }
    void* base = mmap(nullptr, static_cast<size_t>(file_len),
                      PROT_READ | PROT_WRITE, MAP_SHARED, fds[i], 0);
    if (base == MAP_FAILED) {
      const int err = errno;
      CloseAll(fds);
      return absl::ErrnoToStatus(
          err, absl::StrCat("memory table region ", i, ": mmap"));
    }
    Region reg;
    reg.gpa = r.guest_phys_addr;
    reg.uva = r.userspace_addr;
    reg.size = r.memory_size;
    reg.host = static_cast<uint8_t*>(base) + r.mmap_offset;
    reg.map_base = base;
    reg.map_len = static_cast<size_t>(file_len);
    mem.regions_.push_back(reg);
  }
  // The mappings keep the memory; the descriptors are no longer needed.
  CloseAll(fds);
  return mem;
}

absl::StatusOr<GuestMemory> GuestMemory::FromBuffers(
    std::span<const MemoryRegionDesc> regions,
    std::span<uint8_t* const> bases) {
  if (bases.size() != regions.size()) {
    return absl::InvalidArgumentError("one buffer per region");
  }
  if (absl::Status s = ValidateRegions(regions); !s.ok()) return s;
  GuestMemory mem;
  for (size_t i = 0; i < regions.size(); ++i) {
    Region reg;
    reg.gpa = regions[i].guest_phys_addr;
    reg.uva = regions[i].userspace_addr;
    reg.size = regions[i].memory_size;
    reg.host = bases[i];
    mem.regions_.push_back(reg);
  }
  return mem;
}

GuestMemory::GuestMemory(GuestMemory&& other) noexcept
    : regions_(std::move(other.regions_)) {
  other.regions_.clear();
}

GuestMemory& GuestMemory::operator=(GuestMemory&& other) noexcept {
  if (this != &other) {
    Release();
    regions_ = std::move(other.regions_);
    other.regions_.clear();
  }
  return *this;
}

GuestMemory::~GuestMemory() { Release(); }

void GuestMemory::Release() {
  for (const Region& r : regions_) {
    if (r.map_base != nullptr) munmap(r.map_base, r.map_len);
  }
  regions_.clear();
}

uint8_t* GuestMemory::TranslateGuest(uint64_t gpa, uint64_t len) const {
  for (const Region& r : regions_) {
    if (gpa < r.gpa) continue;
    const uint64_t off = gpa - r.gpa;
    if (off >= r.size) continue;
    if (len > r.size - off) return nullptr;
    return r.host + off;
  }
  return nullptr;
}

uint8_t* GuestMemory::TranslateUser(uint64_t uva, uint64_t len) const {
  for (const Region& r : regions_) {
    if (uva < r.uva) continue;
    const uint64_t off = uva - r.uva;
    if (off >= r.size) continue;
    if (len > r.size - off) return nullptr;
    return r.host + off;
  }
  return nullptr;
}

bool GuestMemory::TranslateGuestSpans(uint64_t gpa, uint64_t len,
                                      size_t max_spans,
                                      std::vector<GuestSpan>* out) const {
  const size_t start = out->size();
  uint64_t addr = gpa;
  uint64_t left = len;
  while (left > 0) {
    const Region* hit = nullptr;
    uint64_t off = 0;
    for (const Region& r : regions_) {
      if (addr >= r.gpa && addr - r.gpa < r.size) {
        hit = &r;
        off = addr - r.gpa;
        break;
      }
    }
    if (hit == nullptr || out->size() - start >= max_spans) {
      out->resize(start);
      return false;
    }
    const uint64_t take = std::min(left, hit->size - off);
    out->push_back(GuestSpan{hit->host + off, static_cast<size_t>(take)});
    left -= take;
    // Regions never wrap (validated), so addr + take <= 2^64 - 1 + 1 only
    // when this was the last byte of the address space and left is now 0.
    if (left > 0) addr += take;
  }
  return true;
}

}  // namespace tmem::swap
