// PutAdvisor: who decides what happens to each put, as the data plane sees
// it. The valve (backend/valve.h) is the real one; tests plug in fixed
// answers.
#ifndef TMEMD_BACKEND_PUT_ADVISOR_H_
#define TMEMD_BACKEND_PUT_ADVISOR_H_

#include <cstdint>

#include "backend/types.h"

namespace tmem {

class PutAdvisor {
 public:
  virtual ~PutAdvisor() = default;
  // `vm` is the store's VmId; `key_hash` is KeyHash(oid, index);
  // `guest_applies_hint`: the guest advertised TMEM_FEAT_ADMISSION_HINT.
  virtual PutMode Advise(uint32_t vm, uint64_t key_hash,
                         bool guest_applies_hint) = 0;
  // Every get's outcome (for reuse tracking).
  virtual void OnGet(uint32_t /*vm*/, uint64_t /*key_hash*/, bool /*hit*/) {}
  // CPU the host spent on this VM's ring entries (measured per batch).
  virtual void ChargeCpu(uint32_t /*vm*/, int64_t /*nanos*/) {}
  // The guest says (TMEM_GUEST_STANDING_ASIDE) it sends nothing because
  // tmem costs it more than it saves. Untrusted: it only ever makes the VM
  // admit less. Called when the flag changes.
  virtual void OnGuestStandingAside(uint32_t /*vm*/, bool /*aside*/) {}
  // The guest's RAM in pages, as it says (guest_ram_pages; 0: not said).
  // Untrusted: it only delays when the VM's reuse is judged, by at most
  // what the VM's share of the cap holds. Called when it changes.
  virtual void OnGuestRamPages(uint32_t /*vm*/, uint64_t /*pages*/) {}
  // The admission rate to publish in the VM's shared header, out of 65536
  // (TMEM_ADMIT_ALL).
  virtual uint32_t AdmissionHint(uint32_t /*vm*/) const { return 65536; }
  // How many of the VM's evictions a page it puts can stay (its share of
  // the cap in pages), published beside the hint; 0: not known.
  virtual uint64_t ReachPages(uint32_t /*vm*/) const { return 0; }
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_PUT_ADVISOR_H_
