// FakeHost: a tiny in-test tmem host for TmemGuest's unit tests, written
// from proto/tmem_abi.h alone (it does not use ring_consumer.cc), plus the
// GuestDevice the guest sees.
//
// The region is a memfd laid out like tmemd's (header page, SQ, CQ, slots);
// the "store" is a std::map. Step() executes SQEs in ring order, one CQE
// each, applies the flush barrier when sq_head reaches its seq, honours a
// guest_generation change by dropping all pools, and raises the interrupt
// eventfd for TMEM_SQE_F_IRQ entries.
//
// Two ways to run it:
//  * inline (default): Doorbell() runs Step() in the caller's thread unless
//    paused, so single-threaded tests are deterministic;
//  * threaded: Start() runs Step() in a background thread until Stop();
//    Reset() may be called meanwhile.
// Test knobs (paused, drop_puts, ...) are atomics; everything else belongs
// to whichever thread runs Step().
#ifndef TMEMD_TESTS_GUEST_FAKE_HOST_H_
#define TMEMD_TESTS_GUEST_FAKE_HOST_H_

#include <array>
#include <atomic>
#include <bitset>
#include <cstdint>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "guest-driver/userspace/guest_device.h"
#include "proto/tmem_abi.h"

namespace tmem::testing {

struct FakeHostOptions {
  uint64_t region_bytes = 256 << 10;  // power of two
  uint32_t sq_entries = 16;
  uint32_t cq_entries = 16;
  uint32_t slot_count = 48;
  uint32_t features = TMEM_FEAT_SHARED_POOLS | TMEM_FEAT_ADMISSION_HINT |
                      TMEM_FEAT_FLUSH_BARRIER;
  uint64_t host_generation = 100;
  bool needs_doorbell = true;
  bool publish_ready = true;  // false: host_state stays INIT
  uint32_t host_peer_id = 0;  // the ivshmem peer the guest must ring
};

class FakeHost final : public GuestDevice {
 public:
  explicit FakeHost(const FakeHostOptions& options = {});
  ~FakeHost() override;
  FakeHost(const FakeHost&) = delete;
  FakeHost& operator=(const FakeHost&) = delete;

  // GuestDevice.
  uint8_t* shm_base() const override { return base_; }
  uint64_t shm_size() const override { return options_.region_bytes; }
  void Doorbell(int vector) override;
  // Only doorbells to options().host_peer_id reach this host; others are
  // counted in wrong_peer_doorbells() (QEMU would send them elsewhere).
  void DoorbellPeer(uint32_t peer, int vector) override;
  int interrupt_fd(int vector) const override {
    return vector == 0 ? interrupt_fd_ : -1;
  }

  // Executes up to `max` SQEs (and due flushes); returns how many.
  uint32_t Step(uint32_t max = UINT32_MAX);
  void Start();  // background Step() loop
  void Stop();

  // SharedRegion::Reset's sequence: RESET, new generation, zeroed indices
  // and flush fields, pools and pages dropped, READY. Not while Start()ed.
  void Reset();
  void SetState(uint32_t state);

  // Knobs.
  std::atomic<bool> paused{false};
  std::atomic<bool> drop_puts{false};     // complete puts with ERR_DROPPED
  std::atomic<bool> refuse_pools{false};  // NEW_POOL -> ERR_PERM
  // Broken hosts, to prove the coherency check catches them.
  std::atomic<bool> ignore_invalidates{false};
  std::atomic<bool> keep_first_put{false};  // a put never replaces
  void SetNeedsDoorbell(bool needs);
  void SetAdmissionHint(uint32_t hint);

  // Observations (stable while no thread runs Step()).
  tmem_shm_header* header() const {
    return reinterpret_cast<tmem_shm_header*>(base_);
  }
  const tmem_sqe& sqe_at(uint32_t index) const;
  uint64_t doorbells() const { return doorbells_.load(); }
  // Pages asked for by GET_BATCH entries (TMEM_FEAT_GET_BATCH offered).
  uint64_t batch_pages() const { return batch_pages_.load(); }
  uint64_t wrong_peer_doorbells() const { return wrong_peer_doorbells_.load(); }
  uint64_t op_count(uint8_t opcode) const { return op_counts_[opcode]; }
  uint64_t flushes_applied() const { return flushes_applied_; }
  uint64_t guest_generation_changes() const { return generation_changes_; }
  size_t page_count() const { return pages_.size(); }
  bool HasPage(uint16_t pool, const std::array<uint32_t, 6>& oid,
               uint64_t index) const;
  uint32_t sq_head() const { return sq_head_; }
  const FakeHostOptions& options() const { return options_; }
  uint32_t sq_offset() const { return sq_offset_; }
  uint32_t cq_offset() const { return cq_offset_; }
  uint32_t slots_offset() const { return slots_offset_; }

 private:
  using Key = std::tuple<uint16_t, std::array<uint32_t, 6>, uint64_t>;
  void WriteHeader();
  void DropAll();
  void ApplyFlushIfReached();
  tmem_cqe Execute(const tmem_sqe& sqe);
  uint8_t* Slot(uint32_t slot) const {
    return base_ + slots_offset_ + uint64_t{slot} * TMEM_PAGE_SIZE;
  }

  FakeHostOptions options_;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  int interrupt_fd_ = -1;
  uint32_t sq_offset_ = 0;
  uint32_t cq_offset_ = 0;
  uint32_t slots_offset_ = 0;
  uint64_t generation_ = 0;

  uint32_t sq_head_ = 0;
  uint32_t cq_tail_ = 0;
  uint64_t flush_done_ = 0;
  uint64_t guest_generation_ = 0;
  std::bitset<TMEM_MAX_POOLS> pools_;
  std::bitset<TMEM_MAX_POOLS> shared_;
  std::map<std::array<uint8_t, 16>, uint16_t> shared_by_uuid_;
  std::map<Key, std::vector<uint8_t>> pages_;

  std::atomic<uint64_t> doorbells_{0};
  std::atomic<uint64_t> batch_pages_{0};
  std::atomic<uint64_t> wrong_peer_doorbells_{0};
  std::array<uint64_t, TMEM_OP_MAX> op_counts_{};
  uint64_t flushes_applied_ = 0;
  uint64_t generation_changes_ = 0;

  std::mutex step_mu_;  // Step() from Doorbell and the thread never overlap
  std::thread thread_;
  std::atomic<bool> running_{false};
};

}  // namespace tmem::testing

#endif  // TMEMD_TESTS_GUEST_FAKE_HOST_H_
