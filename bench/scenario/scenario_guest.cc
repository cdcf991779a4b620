// tmem-scenario-guest: one simulated VM of the scenario benchmark (the 2011
// report). It plays a guest's page cache and disk and the application that
// reads files through them, and connects to a tmemd socket exactly as
// tmem-guestsim (and QEMU) do.
//
// Model, per page the application reads:
//  1. page cache: an LRU of --cache-pages pages (keys). A hit costs only the
//     application's own work.
//  2. a miss asks tmem first (TmemGuest::Get, cleancache's get_page); a hit
//     is checked against the page's known contents (any other bytes are a
//     coherency mismatch) and costs no disk read.
//  3. a tmem miss reads the disk. Sequential reads (the next page of the
//     last one read) stream: a token bucket of --disk-mbps with a burst of
//     --readahead-pages (the disk works ahead of the application, as
//     readahead does). A read elsewhere waits --disk-latency-us plus its
//     transfer time (a synchronous random read: readahead cannot help).
//     The guest sleeps while the disk has no page ready (I/O wait is idle
//     time, not CPU).
//  4. the page enters the cache; the cache's least recently used page is
//     evicted and put into tmem (cleancache's put_page of a clean page),
//     with its real contents: a realistic page from the corpus file.
//  5. the application "parses" the page: --app-passes checksum passes over
//     its 4 KiB (CPU per page; the driver calibrates the passes so that
//     contention for CPU shows in application throughput).
//
// Workloads: "stream" reads files sequentially, each page once (never
// reused: the report's file server); "reread" first reads a working set of
// --working-set pages once (the warm-up, not measured), then reads random
// pages of it for --duration seconds.
//
// Output on stdout, line by line: "progress {json}" every --progress-ms,
// then one "result {json}" line. Exit status 0, or 1 on a coherency
// mismatch, 2 on bad arguments or when tmemd cannot be reached.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "bench/method.h"
#include "bench/scenario/app_work.h"
#include "guest-driver/userspace/ivshmem_client.h"
#include "guest-driver/userspace/tmem_guest.h"

namespace tmem {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kPage = TMEM_PAGE_SIZE;
// Pages per simulated file (an object in tmem): 4 MiB files.
constexpr uint64_t kPagesPerFile = 1024;

struct Options {
  std::string socket;
  std::string corpus;
  std::string workload = "stream";
  uint64_t cache_pages = 4096;
  uint64_t working_set = 12288;
  double disk_mbps = 300;
  uint64_t readahead_pages = 32;
  double disk_latency_us = 100;
  int app_passes = 4;
  double duration = 5;
  uint64_t seed = 1;
  int progress_ms = 1000;
  int get_timeout_us = 50'000;
  uint32_t sent_filter_bits = TmemGuestOptions{}.sent_filter_bits;
};

// The page contents: pages of the corpus file (written by the driver from
// bench/page_corpus), mapped read-only.
class Corpus {
 public:
  bool Load(const std::string& path) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    struct stat st {};
    if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(kPage)) {
      close(fd);
      return false;
    }
    void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ,
                   MAP_PRIVATE | MAP_POPULATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return false;
    base_ = static_cast<const uint8_t*>(p);
    pages_ = static_cast<uint64_t>(st.st_size) / kPage;
    return true;
  }
  // The contents of page `key`: deterministic, spread over the corpus.
  const uint8_t* PageOf(uint64_t key) const {
    return base_ + ((key * 0x9e3779b97f4a7c15ull) >> 20) % pages_ * kPage;
  }
  uint64_t pages() const { return pages_; }

 private:
  const uint8_t* base_ = nullptr;
  uint64_t pages_ = 0;
};

// LRU of page keys with a fixed capacity (array-backed list + index).
class LruCache {
 public:
  explicit LruCache(uint64_t capacity) : nodes_(capacity) {
    index_.reserve(capacity);
  }
  // true on a hit (the key becomes most recently used).
  bool Touch(uint64_t key) {
    auto it = index_.find(key);
    if (it == index_.end()) return false;
    Unlink(it->second);
    PushFront(it->second);
    return true;
  }
  // Inserts a key known to be absent; returns true and the evicted key in
  // `*evicted` when the cache was full.
  bool Insert(uint64_t key, uint64_t* evicted) {
    uint32_t n;
    bool full = false;
    if (used_ < nodes_.size()) {
      n = static_cast<uint32_t>(used_++);
    } else {
      n = tail_;
      Unlink(n);
      *evicted = nodes_[n].key;
      index_.erase(nodes_[n].key);
      full = true;
    }
    nodes_[n].key = key;
    PushFront(n);
    index_[key] = n;
    return full;
  }

 private:
  static constexpr uint32_t kNil = UINT32_MAX;
  struct Node {
    uint64_t key = 0;
    uint32_t prev = kNil;
    uint32_t next = kNil;
  };
  void Unlink(uint32_t n) {
    Node& x = nodes_[n];
    if (x.prev != kNil) nodes_[x.prev].next = x.next;
    if (x.next != kNil) nodes_[x.next].prev = x.prev;
    if (head_ == n) head_ = x.next;
    if (tail_ == n) tail_ = x.prev;
    x.prev = x.next = kNil;
  }
  void PushFront(uint32_t n) {
    nodes_[n].prev = kNil;
    nodes_[n].next = head_;
    if (head_ != kNil) nodes_[head_].prev = n;
    head_ = n;
    if (tail_ == kNil) tail_ = n;
  }
  std::vector<Node> nodes_;
  absl::flat_hash_map<uint64_t, uint32_t> index_;
  uint64_t used_ = 0;
  uint32_t head_ = kNil;
  uint32_t tail_ = kNil;
};

// A disk with a bandwidth limit; the burst is the readahead window.
class Disk {
 public:
  Disk(double mbps, uint64_t burst_pages, double latency_us)
      : page_ns_(static_cast<double>(kPage) * 1e3 / mbps),
        burst_(static_cast<double>(std::max<uint64_t>(burst_pages, 1))),
        latency_ns_(latency_us * 1e3),
        last_(Clock::now()) {}

  // A random read: latency plus transfer, nothing overlapped.
  void ReadRandomPage() {
    const auto ns = static_cast<int64_t>(latency_ns_ + page_ns_);
    std::this_thread::sleep_for(std::chrono::nanoseconds(ns));
    wait_ns_ += ns;
  }

  // A sequential read: blocks (sleeping) until the disk has delivered one
  // more page.
  void ReadPage() {
    Refill();
    if (tokens_ < 1) {
      // Wait for half the window (at least one page), as readahead issues
      // its reads in batches; a sleep shorter than that costs more in
      // wake-ups than it models.
      const double want = std::max(1.0, burst_ / 2);
      const auto ns = static_cast<int64_t>((want - tokens_) * page_ns_);
      std::this_thread::sleep_for(std::chrono::nanoseconds(ns));
      wait_ns_ += ns;
      Refill();
    }
    tokens_ -= 1;
  }
  int64_t wait_ns() const { return wait_ns_; }

 private:
  void Refill() {
    const Clock::time_point now = Clock::now();
    const double dt =
        static_cast<double>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_)
                .count()) /
        page_ns_;
    last_ = now;
    tokens_ = std::min(burst_, tokens_ + dt);
  }
  double page_ns_;
  double burst_;
  double latency_ns_;
  double tokens_ = 0;
  Clock::time_point last_;
  int64_t wait_ns_ = 0;
};

struct Stats {
  uint64_t pages_read = 0;  // by the application (measured phase)
  uint64_t cache_hits = 0;
  uint64_t tmem_gets = 0;
  uint64_t tmem_hits = 0;
  uint64_t disk_reads = 0;
  uint64_t puts = 0;
  uint64_t mismatches = 0;
};

class Guest {
 public:
  Guest(const Options& o, const Corpus& corpus, TmemGuest* tmem,
        TmemGuest::PoolHandle pool)
      : o_(o),
        corpus_(corpus),
        tmem_(tmem),
        pool_(pool),
        cache_(o.cache_pages),
        disk_(o.disk_mbps, o.readahead_pages, o.disk_latency_us) {}

  void Read(uint64_t key) {
    ++s_.pages_read;
    const uint8_t* data = corpus_.PageOf(key);
    if (cache_.Touch(key)) {
      ++s_.cache_hits;
    } else {
      bool hit = false;
      if (tmem_ != nullptr) {
        ++s_.tmem_gets;
        hit = tmem_->Get(pool_, Oid(key), key % kPagesPerFile,
                         TmemGuest::MutablePage(buf_.data(), kPage));
      }
      if (hit) {
        ++s_.tmem_hits;
        if (std::memcmp(buf_.data(), data, kPage) != 0) ++s_.mismatches;
        data = buf_.data();
      } else {
        if (key == last_disk_key_ + 1) {
          disk_.ReadPage();
        } else {
          disk_.ReadRandomPage();
        }
        last_disk_key_ = key;
        ++s_.disk_reads;
      }
      uint64_t evicted = 0;
      if (cache_.Insert(key, &evicted) && tmem_ != nullptr) {
        ++s_.puts;
        tmem_->Put(pool_, Oid(evicted), evicted % kPagesPerFile,
                   TmemGuest::Page(corpus_.PageOf(evicted), kPage));
      }
    }
    sink_ ^= scenario::ParsePage(data, o_.app_passes);
  }

  Stats& stats() { return s_; }
  const Disk& disk() const { return disk_; }
  uint64_t sink() const { return sink_; }

 private:
  static TmemGuest::ObjectId Oid(uint64_t key) {
    TmemGuest::ObjectId oid{};
    oid[0] = static_cast<uint32_t>(key / kPagesPerFile + 1);
    oid[1] = static_cast<uint32_t>((key / kPagesPerFile) >> 32);
    return oid;
  }

  const Options& o_;
  const Corpus& corpus_;
  TmemGuest* tmem_;
  TmemGuest::PoolHandle pool_;
  LruCache cache_;
  Disk disk_;
  Stats s_;
  alignas(4096) std::array<uint8_t, kPage> buf_{};
  uint64_t sink_ = 0;
  uint64_t last_disk_key_ = UINT64_MAX;  // UINT64_MAX + 1 == 0: key 0 streams
};

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

void PrintLine(const std::string& line) {
  std::fputs(line.c_str(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"tmem-scenario-guest: one VM of the scenario benchmark"};
  app.add_option("--socket", o.socket,
                 "tmemd's socket for this VM (empty: no tmem at all)");
  app.add_option("--corpus", o.corpus, "page corpus file (4 KiB pages)")
      ->required();
  app.add_option("--workload", o.workload, "stream|reread")
      ->check(CLI::IsMember({"stream", "reread"}));
  app.add_option("--cache-pages", o.cache_pages, "guest page cache (pages)")
      ->check(CLI::PositiveNumber);
  app.add_option("--working-set", o.working_set, "reread: pages")
      ->check(CLI::PositiveNumber);
  app.add_option("--disk-mbps", o.disk_mbps, "disk bandwidth, MB/s")
      ->check(CLI::PositiveNumber);
  app.add_option("--readahead-pages", o.readahead_pages,
                 "disk burst (readahead window), pages")
      ->check(CLI::PositiveNumber);
  app.add_option("--disk-latency-us", o.disk_latency_us,
                 "latency of a random (non-sequential) disk read")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--app-passes", o.app_passes,
                 "checksum passes per page read (application CPU)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--duration", o.duration, "measured seconds")
      ->check(CLI::PositiveNumber);
  app.add_option("--seed", o.seed, "random seed (reread)");
  app.add_option("--progress-ms", o.progress_ms, "0: no progress lines")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--get-timeout-us", o.get_timeout_us, "tmem get timeout")
      ->check(CLI::PositiveNumber);
  app.add_option(
      "--sent-filter-bits", o.sent_filter_bits,
      "bits of the guest's sent-keys filter (power of two; 0: none)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  // Short disk waits are sleeps: keep the kernel from stretching them.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);

  Corpus corpus;
  if (!corpus.Load(o.corpus)) {
    std::fprintf(stderr, "tmem-scenario-guest: cannot map corpus %s\n",
                 o.corpus.c_str());
    return 2;
  }
  std::unique_ptr<IvshmemClient> client;
  std::unique_ptr<TmemGuest> tmem;
  TmemGuest::PoolHandle pool = -1;
  if (!o.socket.empty()) {
    IvshmemClientOptions co;
    co.vectors = 1;
    co.timeout = std::chrono::milliseconds(5000);
    auto c = IvshmemClient::Connect(o.socket, co);
    if (!c.ok()) {
      std::fprintf(stderr, "tmem-scenario-guest: %s\n",
                   c.status().ToString().c_str());
      return 2;
    }
    client = std::move(*c);
    TmemGuestOptions go;
    go.get_timeout = std::chrono::microseconds(o.get_timeout_us);
    go.sent_filter_bits = o.sent_filter_bits;
    // Its page cache is all the RAM it has, and it says so as the kernel
    // module does (totalram_pages): tmemd judges its reuse after twice that
    // many evictions.
    go.ram_pages = o.cache_pages;
    auto g = TmemGuest::Create(client.get(), go);
    if (!g.ok()) {
      std::fprintf(stderr, "tmem-scenario-guest: %s\n",
                   g.status().ToString().c_str());
      return 2;
    }
    tmem = std::move(*g);
    auto p = tmem->InitFs();
    if (!p.ok()) {
      std::fprintf(stderr, "tmem-scenario-guest: %s\n",
                   p.status().ToString().c_str());
      return 2;
    }
    pool = *p;
  }

  Guest guest(o, corpus, tmem.get(), pool);
  const bool stream = o.workload == "stream";
  const Clock::time_point warm_start = Clock::now();
  uint64_t next_key = 0;
  if (!stream) {
    for (uint64_t k = 0; k < o.working_set; ++k) guest.Read(k);
  }
  const double warmup_seconds = Seconds(Clock::now() - warm_start);
  const Stats warm = guest.stats();
  guest.stats() = Stats{};
  const int64_t warm_disk_wait = guest.disk().wait_ns();
  uint64_t rng = o.seed * 0x9e3779b97f4a7c15ull + 1;

  // With the host saturated a page's CPU is what its throughput is made of.
  const int64_t cpu_start_ns = bench::ProcessCpuNs();
  const Clock::time_point start = Clock::now();
  const Clock::time_point end =
      start + std::chrono::duration_cast<Clock::duration>(
                  std::chrono::duration<double>(o.duration));
  Clock::time_point next_progress =
      start + std::chrono::milliseconds(o.progress_ms);
  Clock::time_point now = start;
  while (now < end) {
    for (int i = 0; i < 64; ++i) {
      uint64_t key;
      if (stream) {
        key = next_key++;
      } else {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        key = rng % o.working_set;
      }
      guest.Read(key);
    }
    now = Clock::now();
    if (o.progress_ms > 0 && now >= next_progress) {
      next_progress += std::chrono::milliseconds(o.progress_ms);
      const double t = Seconds(now - start);
      PrintLine(absl::StrCat(
          "progress {\"elapsed\": ", t, ", \"mb_per_s\": ",
          static_cast<double>(guest.stats().pages_read * kPage) / 1e6 / t,
          "}"));
    }
  }
  const double seconds = Seconds(Clock::now() - start);
  const double cpu_seconds =
      static_cast<double>(bench::ProcessCpuNs() - cpu_start_ns) / 1e9;
  // Let in-flight completions land so the counters are final.
  for (int i = 0; tmem != nullptr && i < 100 && tmem->in_flight() > 0; ++i) {
    tmem->Poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }

  const Stats& s = guest.stats();
  std::string out = absl::StrCat(
      R"(result {"workload": ")", o.workload, R"(", "seconds": )", seconds,
      ", \"warmup_seconds\": ", warmup_seconds, ", \"mb_per_s\": ",
      static_cast<double>(s.pages_read * kPage) / 1e6 / seconds,
      ", \"cpu_s\": ", cpu_seconds, ", \"cpu_us_per_page\": ",
      s.pages_read == 0 ? 0.0
                        : cpu_seconds * 1e6 / static_cast<double>(s.pages_read),
      ", \"pages_read\": ", s.pages_read, ", \"cache_hits\": ", s.cache_hits,
      ", \"tmem_gets\": ", s.tmem_gets, ", \"tmem_hits\": ", s.tmem_hits,
      ", \"hit_ratio\": ",
      s.tmem_gets == 0
          ? 0.0
          : static_cast<double>(s.tmem_hits) / static_cast<double>(s.tmem_gets),
      ", \"disk_reads\": ", s.disk_reads, ", \"puts\": ", s.puts,
      ", \"mismatches\": ", s.mismatches + warm.mismatches,
      ", \"disk_wait_s\": ",
      static_cast<double>(guest.disk().wait_ns() - warm_disk_wait) / 1e9,
      ", \"warmup_disk_reads\": ", warm.disk_reads,
      ", \"sink\": ", guest.sink() & 0xff);
  if (tmem != nullptr) {
    for (const auto& [name, value] : CounterList(tmem->counters())) {
      absl::StrAppend(&out, ", \"guest_", std::string(name), "\": ", value);
    }
  }
  PrintLine(out + "}");
  return s.mismatches + warm.mismatches > 0 ? 1 : 0;
}

}  // namespace
}  // namespace tmem

int main(int argc, char** argv) {
  try {
    return tmem::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tmem-scenario-guest: %s\n", e.what());
    return 2;
  }
}
