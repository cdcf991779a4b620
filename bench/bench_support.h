// Shared pieces of the backend micro-benchmarks: a store with its VMs and
// pools set up, a cyclic key space, and the results table (text, markdown,
// CSV) with targets and PASS/FAIL.
//
// A benchmark that cannot set up its store is broken, not slow, so setup
// failures abort with a message instead of producing numbers.
#ifndef TMEMD_BENCH_BENCH_SUPPORT_H_
#define TMEMD_BENCH_BENCH_SUPPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/tmem_store.h"
#include "backend/types.h"
#include "bench/method.h"
#include "bench/page_corpus.h"
#include "bench/results_file.h"

namespace tmem::bench {

// Pages per object in the benchmark key spaces: a 256 KiB file, so the
// object table is exercised but amortized like a real page cache's.
inline constexpr uint64_t kPagesPerObject = 64;

// Keys put in steady-state put benchmarks. Prime and unrelated to the page
// set sizes, so a key receives a different page each time round (a put then
// replaces a blob of another size class, as in real use) and the store's
// footprint stays bounded (a put replaces that key's previous page).
inline constexpr uint64_t kSteadyStateKeys = 4093;

// Key number `k` of a VM's key space, as (object, index).
inline ObjectId KeyObject(uint64_t k) {
  return ObjectId::FromInode(1 + k / kPagesPerObject);
}
inline PageIndex KeyIndex(uint64_t k) { return k % kPagesPerObject; }

// A store capped at `cap_bytes` that reserves only the address space the
// cap can use (mapping the machine's whole memory per store would make its
// creation dominate a benchmark's setup). Exits with the reason if it fails.
std::unique_ptr<TmemStore> NewBenchStore(uint64_t cap_bytes);

// One store, `num_vms` VMs each with one private pool. The memory cap is
// large enough that the benchmarks never evict.
class BenchStore {
 public:
  explicit BenchStore(int num_vms, uint64_t cap_bytes = uint64_t{2} << 30);

  TmemStore& store() { return *store_; }
  VmId vm(int i) const { return vms_[i]; }
  PoolId pool(int i) const { return pools_[i]; }

  // Put/Get of key `k` in VM `i`'s pool. Put returns the result kind as a
  // small integer (StorageKind) or -1 on refusal/error, so hot loops need
  // no StatusOr handling of their own.
  int Put(int i, uint64_t k, ConstPage page,
          PutMode mode = PutMode::kCompress) {
    absl::StatusOr<PutResult> r =
        store_->Put(vms_[i], pools_[i], KeyObject(k), KeyIndex(k), page, mode);
    if (!r.ok() || !r->stored) return -1;
    return static_cast<int>(r->kind);
  }
  bool Get(int i, uint64_t k, MutablePage out) {
    absl::StatusOr<bool> r =
        store_->Get(vms_[i], pools_[i], KeyObject(k), KeyIndex(k), out);
    return r.ok() && *r;
  }

 private:
  std::unique_ptr<TmemStore> store_;
  std::vector<VmId> vms_;
  std::vector<PoolId> pools_;
};

// Keys of the resident population: far above any benchmark's own keys.
inline constexpr uint64_t kResidentKeyBase = uint64_t{1} << 32;

// Gives VM `vm` a resident population with holes, the state a store is in
// after running a while: `pages` pages of `set` are put, then a deterministic
// half of them is invalidated. Without it, a get benchmark that empties the
// store every batch empties every slab too, and measures returning slabs to
// the OS (madvise) and faulting them back on the next put, which a store
// holding other pages rarely does.
void AddResidentPopulation(BenchStore& s, int vm, const PageSet& set,
                           uint64_t pages);

// ----------------------------------------------------------------------------
// Results table (verdicts: bench/method.h).

struct ResultRow {
  std::string what;        // e.g. "put LZ4 path / LZ4_compress_default"
  std::string pages;       // page set, e.g. "text+binary (4096)"
  double measured = 0;     // the measured path, in `unit`
  double baseline = 0;     // its baseline, in `unit` (0: none)
  std::string unit;        // "ns/page", "B/page", "Mpages/s"
  double value = 0;        // the figure the target applies to
  std::string value_unit;  // "x" or "B/page"
  Goal goal = Goal::kInfo;
  double target = 0;
  std::string note;  // spread, caveats
  // The run could not measure this (e.g. no two free cores for a scaling
  // row): shown as INCONCLUSIVE, neither a pass nor a miss.
  bool inconclusive = false;

  bool has_target() const { return goal != Goal::kInfo; }
  bool Passed() const { return Meets(goal, value, target); }
  // The method's rule: measured without enough undisturbed rounds, a miss
  // is inconclusive.
  void JudgeOn(bool disturbed) {
    inconclusive =
        VerdictOf(goal, value, target, disturbed) == Verdict::kInconclusive;
  }
  std::string TargetText() const;  // "<= 1.15x"
  // PASS / FAIL / INCONCLUSIVE / N/A / info
  std::string VerdictText() const {
    return VerdictName(VerdictOf(goal, value, target, inconclusive));
  }
};

struct ResultTable {
  std::string title;
  std::string context;  // machine, load, method: printed under the title
  std::vector<ResultRow> rows;

  std::string ToText() const;
  std::string ToMarkdown() const;
  std::string ToCsv() const;
  int failures() const;      // rows with a target that missed it
  int inconclusive() const;  // rows with a target this run could not measure
};

// Writes `text` to `path`; prints an error and returns false on failure.
bool WriteFile(const std::string& path, const std::string& text);

// Prints `table` as text on stdout and, where a path is given, writes its
// Markdown and CSV forms (saying so on stderr).
void EmitTable(const ResultTable& table, const std::string& markdown_path,
               const std::string& csv_path);

// The table as benchmark `benchmark`'s section of the results file
// (bench/results_file.h): per row its printed name, figure, unit, target
// and verdict; its note leads with the page set and the measured and
// baseline figures (the table's other columns). The "WARNING: ..." parts of
// the notes are also the section's warnings, by row.
BenchmarkSection TableSection(const ResultTable& table,
                              const std::string& benchmark,
                              const std::string& command);

// "model name", 1-minute load average and online CPUs, for the table context.
std::string MachineDescription();

}  // namespace tmem::bench

#endif  // TMEMD_BENCH_BENCH_SUPPORT_H_
