#include "guest-driver/userspace/workloads.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tmem {
namespace {

constexpr uint64_t kPagesPerObject = 64;     // a "file" of 256 KiB
constexpr uint32_t kOidMagic = 0x746d656d;   // "tmem"
constexpr uint32_t kPageMagic = 0x53474d54;  // "TMGS"
constexpr uint64_t kProgressBatch = 64;
// How long reread waits for the host to take its warm-up (see
// LetTheHostCatchUp): far more than any host that works needs.
constexpr std::chrono::seconds kCatchUpLimit{10};

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return Mix(state_++); }
  uint64_t Below(uint64_t n) { return n == 0 ? 0 : Next() % n; }

 private:
  uint64_t state_;
};

// Text-like bytes: LZ4 finds the repeats, roughly like real file data.
constexpr std::string_view kText =
    "the quick brown fox jumps over the lazy dog; page cache pages are "
    "evicted clean and read back later, or never. int main(void) { return "
    "0; } /usr/lib/x86_64-linux-gnu/libc.so.6 ELF 64-bit LSB shared object ";

struct PageHeader {
  uint32_t magic;
  uint32_t guest;
  uint64_t key;
  uint64_t version;
  uint64_t check;
};
static_assert(sizeof(PageHeader) == 32);

TmemGuest::ObjectId ObjectOf(uint32_t guest, uint64_t object) {
  return {kOidMagic,
          guest,
          static_cast<uint32_t>(object),
          static_cast<uint32_t>(object >> 32),
          0,
          0};
}

class Runner {
 public:
  Runner(TmemGuest& guest, TmemGuest::PoolHandle pool,
         const WorkloadConfig& config, WorkloadResult* result,
         std::atomic<uint64_t>* progress, const std::atomic<bool>* stop)
      : guest_(guest),
        pool_(pool),
        config_(config),
        r_(*result),
        progress_(progress),
        stop_(stop),
        rng_(Mix(config.seed) ^ Mix(config.guest_index + 1)),
        shared_(config.shared_uuid.has_value()),
        verify_(config.kind == WorkloadKind::kCoherency ||
                config.kind == WorkloadKind::kReread),
        latest_(config.pages, 0),
        valid_(config.pages, false) {}

  void Run() {
    const uint64_t n = config_.pages;
    switch (config_.kind) {
      case WorkloadKind::kSeq:
        for (uint64_t k = 0; k < n && !Stopped(); ++k) {
          Put(k);
          Tick();
        }
        break;
      case WorkloadKind::kReread:
        for (uint64_t k = 0; k < n && !Stopped(); ++k) {
          Put(k);
          Tick();
        }
        LetTheHostCatchUp();
        for (uint64_t i = 0; i < config_.ops && n > 0 && !Stopped(); ++i) {
          // Read it back (hit, or miss and "read from disk"), and evict it
          // again later: put.
          const uint64_t k = rng_.Below(n);
          Get(k);
          Put(k);
          Tick();
        }
        break;
      case WorkloadKind::kRandom:
      case WorkloadKind::kCoherency:
        for (uint64_t i = 0; i < config_.ops && n > 0 && !Stopped(); ++i) {
          Mixed();
          Tick();
        }
        break;
    }
    if (progress_ != nullptr) progress_->fetch_add(unreported_);
    unreported_ = 0;
  }

 private:
  bool Stopped() const {
    return failed_ ||
           (stop_ != nullptr && stop_->load(std::memory_order_relaxed));
  }

  // A working set is re-read some time after it was evicted, not in the
  // same microsecond: give the host the time to take the warm-up's puts.
  // Without it a host slower than the guest (a sanitizer build on a busy
  // machine) made every warm-up put a ring-full drop and its flush barrier
  // outlast the whole run, so nothing was ever re-read from tmem. Bounded:
  // a vanished host ends the wait (health check, detach) or the deadline.
  void LetTheHostCatchUp() {
    using Clock = std::chrono::steady_clock;
    const Clock::time_point deadline = Clock::now() + kCatchUpLimit;
    Clock::time_point next_check = Clock::now();
    while (!Stopped() && guest_.attached() && Clock::now() < deadline) {
      guest_.Poll();
      if (guest_.in_flight() == 0 && !guest_.flush_pending()) return;
      if (config_.health_check && Clock::now() >= next_check) {
        absl::Status s = config_.health_check();
        if (!s.ok()) {
          r_.status = s;
          failed_ = true;
          return;
        }
        next_check = Clock::now() + std::chrono::milliseconds(100);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  void Tick() {
    ++r_.ops;
    if (config_.health_check && config_.check_every_ops != 0 &&
        r_.ops % config_.check_every_ops == 0) {
      absl::Status s = config_.health_check();
      if (!s.ok()) {
        r_.status = s;
        failed_ = true;
      }
    }
    if (++unreported_ == kProgressBatch) {
      if (progress_ != nullptr) {
        progress_->fetch_add(unreported_, std::memory_order_relaxed);
      }
      unreported_ = 0;
    }
  }

  // Per 10000 ops: 4800 puts, 4000 gets, 1178 page invalidates, 20 object
  // and 2 pool invalidates. The wide invalidates are rare because each one
  // kills many keys: any more and few keys would live long enough to be
  // read back, and hits are what the coherency check verifies.
  void Mixed() {
    const uint64_t k = rng_.Below(config_.pages);
    const uint64_t dice = rng_.Below(10'000);
    if (dice < 4800) {
      Put(k);
    } else if (dice < 8800) {
      Get(k);
    } else if (dice < 9978) {
      ++r_.invalidates;
      valid_[k] = false;
      guest_.InvalidatePage(pool_, ObjectOf(config_.guest_index, Object(k)),
                            Index(k));
    } else if (dice < 9998) {
      ++r_.invalidates;
      const uint64_t object = Object(k);
      const uint64_t first = object * kPagesPerObject;
      const uint64_t last = std::min(config_.pages, first + kPagesPerObject);
      std::fill(valid_.begin() + static_cast<std::ptrdiff_t>(first),
                valid_.begin() + static_cast<std::ptrdiff_t>(last), false);
      guest_.InvalidateObject(pool_, ObjectOf(config_.guest_index, object));
    } else {
      ++r_.invalidates;
      std::fill(valid_.begin(), valid_.end(), false);
      guest_.InvalidatePool(pool_);
    }
  }

  static uint64_t Object(uint64_t key) { return key / kPagesPerObject; }
  static uint64_t Index(uint64_t key) { return key % kPagesPerObject; }

  void Put(uint64_t k) {
    ++r_.puts;
    const uint64_t version = ++latest_[k];
    FillPage(config_.guest_index, k, version, page_.data());
    guest_.Put(pool_, ObjectOf(config_.guest_index, Object(k)), Index(k),
               page_);
    // Whether or not the put was sent, it is the latest: an older version
    // must never come back.
    valid_[k] = true;
  }

  void Get(uint64_t k) {
    ++r_.gets;
    if (!guest_.Get(pool_, ObjectOf(config_.guest_index, Object(k)), Index(k),
                    got_)) {
      return;
    }
    ++r_.hits;
    if (verify_) Verify(k);
    // A private pool's hit is exclusive: the host forgot the page.
    if (!shared_) valid_[k] = false;
  }

  void Verify(uint64_t k) {
    ++r_.verified_hits;
    if (valid_[k]) {
      FillPage(config_.guest_index, k, latest_[k], expected_.data());
      if (got_ == expected_) return;
    }
    ++r_.mismatches;
    if (r_.mismatches > static_cast<uint64_t>(config_.max_reported_mismatches))
      return;
    absl::StrAppend(&r_.mismatch_report, "guest ", config_.guest_index, " key ",
                    k, " (object ", Object(k), " index ", Index(k), ", op ",
                    r_.ops, "): hit returned ", Describe(k), "; expected ",
                    valid_[k] ? absl::StrCat("version ", latest_[k])
                              : std::string("a miss (invalidated or already "
                                            "got since the last put)"),
                    "\n");
  }

  // What a wrong page is: an older version of this key, another key's page,
  // or garbage.
  std::string Describe(uint64_t k) {
    for (uint64_t v = latest_[k]; v >= 1; --v) {
      FillPage(config_.guest_index, k, v, expected_.data());
      if (got_ == expected_) {
        return v == latest_[k]
                   ? absl::StrCat("version ", v, " (the latest put)")
                   : absl::StrCat("STALE version ", v, " of ", latest_[k]);
      }
    }
    PageHeader h{};
    std::memcpy(&h, got_.data(), sizeof(h));
    if (h.magic == kPageMagic) {
      return absl::StrCat("the page of guest ", h.guest, " key ", h.key,
                          " version ", h.version, " (wrong key)");
    }
    return "bytes that match no page this guest ever put";
  }

  TmemGuest& guest_;
  TmemGuest::PoolHandle pool_;
  const WorkloadConfig& config_;
  WorkloadResult& r_;
  std::atomic<uint64_t>* progress_;
  const std::atomic<bool>* stop_;
  Rng rng_;
  bool shared_;
  bool verify_;
  uint64_t unreported_ = 0;
  bool failed_ = false;           // the health check failed: stop
  std::vector<uint64_t> latest_;  // version of the latest put, 0: none yet
  std::vector<bool> valid_;       // the host may hold latest_ now
  std::array<uint8_t, TMEM_PAGE_SIZE> page_{};
  std::array<uint8_t, TMEM_PAGE_SIZE> got_{};
  std::array<uint8_t, TMEM_PAGE_SIZE> expected_{};
};

}  // namespace

std::optional<WorkloadKind> ParseWorkloadKind(std::string_view name) {
  for (WorkloadKind k : {WorkloadKind::kSeq, WorkloadKind::kReread,
                         WorkloadKind::kRandom, WorkloadKind::kCoherency}) {
    if (name == WorkloadKindName(k)) return k;
  }
  return std::nullopt;
}

std::string_view WorkloadKindName(WorkloadKind kind) {
  switch (kind) {
    case WorkloadKind::kSeq:
      return "seq";
    case WorkloadKind::kReread:
      return "reread";
    case WorkloadKind::kRandom:
      return "random";
    case WorkloadKind::kCoherency:
      return "coherency";
  }
  return "?";
}

uint64_t ExpectedOps(const WorkloadConfig& config) {
  switch (config.kind) {
    case WorkloadKind::kSeq:
      return config.pages;
    case WorkloadKind::kReread:
      return config.pages + (config.pages > 0 ? config.ops : 0);
    case WorkloadKind::kRandom:
    case WorkloadKind::kCoherency:
      return config.pages > 0 ? config.ops : 0;
  }
  return 0;
}

void FillPage(uint32_t guest, uint64_t key, uint64_t version, uint8_t* page) {
  const uint64_t seed =
      Mix(Mix(key) ^ Mix(version * 0x2545f4914f6cdd1dULL) ^ guest);
  const uint64_t kind = seed % 8;
  if (kind == 0) {
    // Same-filled (one repeated word, never zero so versions differ): the
    // host stores these as metadata only.
    const uint64_t word = seed | 1;
    for (size_t i = 0; i < TMEM_PAGE_SIZE; i += sizeof(word)) {
      std::memcpy(page + i, &word, sizeof(word));
    }
    return;
  }
  const PageHeader h{kPageMagic, guest, key, version, seed};
  std::memcpy(page, &h, sizeof(h));
  if (kind <= 4) {
    // Compressible: text with a version-dependent word every 128 bytes.
    const size_t shift = seed % kText.size();
    for (size_t i = sizeof(h); i < TMEM_PAGE_SIZE; ++i) {
      page[i] = static_cast<uint8_t>(kText[(i + shift) % kText.size()]);
    }
    for (size_t i = 128; i < TMEM_PAGE_SIZE; i += 128) {
      const uint64_t w = Mix(seed + i);
      std::memcpy(page + i, &w, sizeof(w));
    }
    return;
  }
  // Incompressible.
  for (size_t i = sizeof(h); i < TMEM_PAGE_SIZE; i += sizeof(uint64_t)) {
    const uint64_t w = Mix(seed + i);
    std::memcpy(page + i, &w, sizeof(w));
  }
}

WorkloadResult RunWorkload(TmemGuest& guest, const WorkloadConfig& config,
                           std::atomic<uint64_t>* progress,
                           const std::atomic<bool>* stop) {
  WorkloadResult result;
  absl::StatusOr<TmemGuest::PoolHandle> pool =
      config.shared_uuid.has_value() ? guest.InitSharedFs(*config.shared_uuid)
                                     : guest.InitFs();
  if (!pool.ok()) {
    result.status = pool.status();
    return result;
  }
  const auto start = std::chrono::steady_clock::now();
  Runner(guest, *pool, config, &result, progress, stop).Run();
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  return result;
}

}  // namespace tmem
