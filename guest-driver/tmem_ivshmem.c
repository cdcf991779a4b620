// SPDX-License-Identifier: GPL-2.0
/*
 * tmem_ivshmem - cleancache frontend for tmemd over ivshmem-doorbell.
 *
 * Binds to the QEMU ivshmem-doorbell PCI device (1af4:1110) that tmemd
 * serves, and implements cleancache on top of the shared-memory ring ABI
 * in proto/tmem_abi.h (the same protocol as the userspace reference,
 * guest-driver/userspace/tmem_guest.cc).
 *
 * Contexts and locking: one spinlock (irqsave) guards the whole ring state.
 * put_page and the invalidates run with IRQs off under the page-cache
 * xarray lock: they only copy into a free slot, post an SQE and ring the
 * doorbell when the host asked for it; nothing sleeps or allocates. Only
 * get_page (process context, page locked) waits for its completion: it
 * spins briefly, then sleeps on a wait queue woken by the MSI-X interrupt,
 * bounded by get_timeout_ms (a timeout is a miss).
 *
 * Coherency: ring order is op order (the host executes SQEs in order), so
 * an op posted after an invalidate sees it. A put that is not sent still
 * invalidates its key (INVAL_PAGE), and an invalidate that finds the ring
 * full falls back to the pool's flush barrier; while the barrier is
 * pending, gets of that pool miss and its puts are dropped.
 *
 * Host restart or device removal: a host_state other than READY or a new
 * host_generation voids every host pool id; ops become safe no-ops (get =
 * miss) until the host is READY again, then pools are re-created lazily.
 * cleancache has no unregister: once the ops are registered, the module
 * holds a reference on itself and can never be unloaded.
 *
 * Frontswap is not implemented.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/bitops.h>
#include <linux/cleancache.h>
#include <linux/debugfs.h>
#include <linux/delay.h>
#include <linux/highmem.h>
#include <linux/interrupt.h>
#include <linux/io.h>
#include <linux/ktime.h>
#include <linux/log2.h>
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/random.h>
#include <linux/seq_file.h>
#include <linux/slab.h>
#include <linux/spinlock.h>
#include <linux/string.h>
#include <linux/uuid.h>
#include <linux/wait.h>

#include "tmem_abi.h"

#ifdef __BIG_ENDIAN
#error "the tmem ABI is little-endian; this driver does not byte-swap"
#endif

#define TMEM_PCI_VENDOR 0x1af4
#define TMEM_PCI_DEVICE 0x1110
#define TMEM_REG_IVPOSITION 8
#define TMEM_REG_DOORBELL 12
#define TMEM_HOST_PEER 0u

#define TAG_INDEX_BITS 16
#define TAG_INDEX_MASK ((1ull << TAG_INDEX_BITS) - 1)
#define MAX_PENDING 8192u /* tmemd rings: at most 4096 + 4096 entries */
#define NO_SLOT U32_MAX
#define FEATURES_UNDERSTOOD \
	(TMEM_FEAT_SHARED_POOLS | TMEM_FEAT_ADMISSION_HINT | TMEM_FEAT_FLUSH_BARRIER)

static unsigned int get_spin_us = 20;
module_param(get_spin_us, uint, 0644);
MODULE_PARM_DESC(get_spin_us, "a get spins this long before sleeping on the interrupt");
static unsigned int get_timeout_ms = 50;
module_param(get_timeout_ms, uint, 0644);
MODULE_PARM_DESC(get_timeout_ms, "a get without a completion after this long is a miss");
static unsigned int attach_timeout_ms = 2000;
module_param(attach_timeout_ms, uint, 0644);
MODULE_PARM_DESC(attach_timeout_ms, "probe waits this long for the host to be READY");
static unsigned int pool_create_timeout_ms = 1000;
module_param(pool_create_timeout_ms, uint, 0644);
MODULE_PARM_DESC(pool_create_timeout_ms, "init_fs waits this long for NEW_POOL");
static unsigned int pool_retry_ms = 1000;
module_param(pool_retry_ms, uint, 0644);
MODULE_PARM_DESC(pool_retry_ms, "after a refused NEW_POOL, ask again after this long");
static unsigned int invalidate_reserve;
module_param(invalidate_reserve, uint, 0444);
MODULE_PARM_DESC(invalidate_reserve, "SQ entries only invalidates may use (0: sq_entries/8)");
static unsigned int stall_after_timeouts = 3;
module_param(stall_after_timeouts, uint, 0644);
MODULE_PARM_DESC(stall_after_timeouts,
		 "gets in a row timing out without host progress before gets miss at once (0: off)");
static unsigned int stall_probe_ms = 1000;
module_param(stall_probe_ms, uint, 0644);
MODULE_PARM_DESC(stall_probe_ms, "a stalled host is probed by one get this often");
static unsigned int sent_filter_bits = 1u << 20;
module_param(sent_filter_bits, uint, 0444);
MODULE_PARM_DESC(sent_filter_bits,
		 "bits of each private pool's sent-keys filter, a power of two (0: none)");
static unsigned int ring_full_spin_us = 20;
module_param(ring_full_spin_us, uint, 0644);
MODULE_PARM_DESC(ring_full_spin_us,
		 "an invalidate facing a full ring waits this long for room before the flush barrier");
static unsigned int doorbell_batch;
module_param(doorbell_batch, uint, 0444);
MODULE_PARM_DESC(doorbell_batch,
		 "puts/invalidates posted to a sleeping host before one doorbell (0: min(sq, slots)/16)");
static bool use_irq = true;
module_param(use_irq, bool, 0444);
MODULE_PARM_DESC(use_irq, "use the MSI-X completion interrupt (else gets poll)");

/* Every put lands in exactly one of the first five. */
struct tmem_counters {
	u64 puts_sent;
	u64 puts_skipped_by_hint;
	u64 puts_dropped_ring_full;
	u64 puts_dropped_no_pool;
	u64 puts_dropped_flush_pending;
	u64 puts_dropped_by_host;
	u64 gets_hit;
	u64 gets_miss;
	u64 gets_timeout;
	u64 gets_miss_local;
	u64 gets_skipped_stalled;
	u64 host_stalls;
	u64 invalidates;
	u64 invalidates_for_dropped_puts;
	u64 invalidates_skipped_never_sent;
	u64 gets_skipped_never_sent;
	u64 flush_fallbacks;
	u64 guest_resets;
	u64 resets;
	u64 pools_created;
	u64 doorbells;
	u64 doorbells_deferred;
	u64 interrupts;
	u64 interrupt_waits;
	u64 stale_completions;
	u64 errors;
	u64 put_ns; /* time spent in put_page, all calls */
	u64 get_ns; /* time spent in get_page (waits included) */
};

enum pool_state { POOL_UNUSED, POOL_NONE, POOL_CREATING, POOL_READY, POOL_FAILED };

struct tmem_pool {
	enum pool_state state;
	bool shared;
	bool inval_on_ready;
	u8 uuid[16];
	u16 host_id;
	u64 incarnation;
	u64 create_tag;
	s32 refusal;
	u64 retry_after_ns;
	/*
	 * Private pools: Bloom filter of the keys (and objects) put since the
	 * host last held nothing of this pool. No false negatives, so a key it
	 * has never seen needs no invalidate and its get is a local miss.
	 * NULL: no filter (every key "maybe sent"). Allocated at init_fs.
	 */
	unsigned long *sent;
	u32 sent_bits;
};

enum waiter_state { WAIT_NONE, WAITING, DONE_HIT, DONE_MISS, ABANDONED };

struct tmem_pending {
	u64 tag; /* 0: free */
	u64 incarnation;
	u64 epoch;
	u32 slot;
	s16 pool;
	u8 opcode;
	u8 waiter;
};

struct tmem_geometry {
	u32 features_host;
	u64 host_generation;
	u32 sq_offset, sq_entries;
	u32 cq_offset, cq_entries;
	u32 slots_offset, slot_count;
};

struct tmem_state {
	spinlock_t lock; /* guards everything below */
	struct pci_dev *pdev;
	void __iomem *regs;
	u8 *shm;
	u64 shm_size;
	bool present;
	bool have_irq;

	bool attached;
	bool broken;
	bool have_rings;
	u64 rings_generation;
	u64 rings_gen; /* bumped whenever the pending table is reset */
	u64 host_generation;
	u64 guest_generation;
	u32 features;
	u64 epoch;
	struct tmem_geometry g;

	u32 sq_tail;
	u32 cq_head;
	u32 reserve;
	u32 doorbell_batch;	/* posted entries per doorbell to a sleeping host */
	u32 unrung;		/* entries posted since the host last knew */
	struct tmem_pending *pending;
	u32 pending_cap;
	u32 *free_pending;
	u32 nfree_pending;
	u32 *free_slots;
	u32 slots_cap;
	u32 nfree_slots;
	u32 slots_usable;
	u64 next_serial;
	u64 next_incarnation;

	struct tmem_pool pools[TMEM_MAX_POOLS];
	u64 flush_bits;
	u64 flush_seq;
	u64 wanted_bits;
	u32 hint_credit;

	u32 consecutive_timeouts;
	u32 stall_sq_head;
	u64 stalled_until_ns;

	struct tmem_counters c;
};

static struct tmem_state st = {
	.lock = __SPIN_LOCK_UNLOCKED(st.lock),
	.next_incarnation = 1,
};
static DECLARE_WAIT_QUEUE_HEAD(tmem_wq);
static DEFINE_MUTEX(probe_mutex);
static bool ops_registered;
static struct dentry *debug_dir;

/* --- shared memory accessors (header fields and ring entries) --------- */

/*
 * Memory ordering on shared fields (proto/tmem_abi.h): an acquire load of a
 * host-written index or state pairs with the host's release store, so the
 * entries, slots and header fields it wrote before are visible; a release
 * store of a guest index publishes the entries and slot bytes written
 * before it.
 */
#define ld_acquire(p) smp_load_acquire(p)
/* Release: publishes what was written before (see above). */
#define st_release(p, v) smp_store_release(p, v)

static inline struct tmem_shm_header *hdr(void)
{
	return (struct tmem_shm_header *)st.shm;
}

static u32 host_state(void)
{
	return ld_acquire(&hdr()->host_state);
}

static u64 host_gen(void)
{
	return ld_acquire(&hdr()->host_generation);
}

static u32 sq_head(void)
{
	return ld_acquire(&hdr()->sq_head.value);
}

static u32 cq_tail(void)
{
	return ld_acquire(&hdr()->cq_tail.value);
}

static u64 flush_done_seq(void)
{
	return ld_acquire(&hdr()->flush_done_seq);
}

static void *slot_addr(u32 slot)
{
	return st.shm + st.g.slots_offset + (u64)slot * TMEM_PAGE_SIZE;
}

static int read_geometry(struct tmem_geometry *g)
{
	struct tmem_shm_header *h = hdr();
	u32 magic, version, header_size;
	u64 region_size, sq_end, cq_end, slots_end;

	if (ld_acquire(&h->host_state) != TMEM_HOST_STATE_READY)
		return -EAGAIN;
	magic = READ_ONCE(h->magic);
	version = READ_ONCE(h->version);
	header_size = READ_ONCE(h->header_size);
	region_size = READ_ONCE(h->region_size);
	g->features_host = READ_ONCE(h->features_host);
	g->host_generation = READ_ONCE(h->host_generation);
	g->sq_offset = READ_ONCE(h->sq_offset);
	g->sq_entries = READ_ONCE(h->sq_entries);
	g->cq_offset = READ_ONCE(h->cq_offset);
	g->cq_entries = READ_ONCE(h->cq_entries);
	g->slots_offset = READ_ONCE(h->slots_offset);
	g->slot_count = READ_ONCE(h->slot_count);
	/* Seqlock-style: order the reads above before the re-check. */
	smp_rmb();
	if (READ_ONCE(h->host_state) != TMEM_HOST_STATE_READY ||
	    READ_ONCE(h->host_generation) != g->host_generation)
		return -EAGAIN;
	if (magic != TMEM_ABI_MAGIC || version != TMEM_ABI_VERSION)
		return -EPROTO;
	if (header_size != sizeof(struct tmem_shm_header) || region_size != st.shm_size)
		return -EPROTO;
	sq_end = (u64)g->sq_offset + (u64)g->sq_entries * sizeof(struct tmem_sqe);
	cq_end = (u64)g->cq_offset + (u64)g->cq_entries * sizeof(struct tmem_cqe);
	slots_end = (u64)g->slots_offset + (u64)g->slot_count * TMEM_PAGE_SIZE;
	if (!is_power_of_2(g->sq_entries) || !is_power_of_2(g->cq_entries) ||
	    g->slot_count == 0 || g->sq_offset < sizeof(struct tmem_shm_header) ||
	    g->sq_offset % 8 || g->cq_offset < sq_end || g->cq_offset % 8 ||
	    g->slots_offset < cq_end || slots_end > st.shm_size ||
	    g->sq_entries + g->cq_entries > MAX_PENDING)
		return -EPROTO;
	return 0;
}

/* --- channel state ------------------------------------------------------ */

static bool host_changed(void)
{
	return host_state() != TMEM_HOST_STATE_READY || host_gen() != st.host_generation;
}

static u64 new_generation(u64 previous)
{
	u64 g;

	do {
		g = get_random_u64();
	} while (g == 0 || g == previous);
	return g;
}

static void void_pools(bool shared_lost_invalidates)
{
	int i;

	st.epoch++;
	for (i = 0; i < TMEM_MAX_POOLS; i++) {
		struct tmem_pool *p = &st.pools[i];

		if (p->state == POOL_UNUSED)
			continue;
		if (shared_lost_invalidates && p->shared && p->state != POOL_NONE)
			p->inval_on_ready = true;
		p->state = POOL_NONE;
	}
}

static void reset_pending(void)
{
	u32 i;

	st.rings_gen++;
	for (i = 0; i < st.pending_cap; i++)
		st.pending[i].tag = 0;
	st.nfree_pending = 0;
	for (i = st.pending_cap; i > 0; i--)
		st.free_pending[st.nfree_pending++] = i - 1;
	st.nfree_slots = 0;
	for (i = st.slots_usable; i > 0; i--)
		st.free_slots[st.nfree_slots++] = i - 1;
}

static int attach(void)
{
	struct tmem_geometry g;
	bool same_rings;
	int err;

	err = read_geometry(&g);
	if (err)
		return err;
	same_rings = st.have_rings && g.host_generation == st.rings_generation &&
		     g.sq_entries == st.g.sq_entries && g.cq_entries == st.g.cq_entries &&
		     g.slot_count == st.g.slot_count;
	if (same_rings && st.broken)
		return -EAGAIN; /* the host has not reset the rings it corrupted */
	if (!same_rings) {
		st.g = g;
		st.pending_cap = min(g.sq_entries + g.cq_entries, MAX_PENDING);
		st.slots_usable = min3(g.slot_count, st.pending_cap, st.slots_cap);
		reset_pending();
		st.reserve = invalidate_reserve ? invalidate_reserve : max(1u, g.sq_entries / 8);
		st.reserve = min(st.reserve, g.sq_entries - 1);
		st.doorbell_batch = doorbell_batch ? doorbell_batch :
				    max(1u, min(g.sq_entries, st.slots_usable) / 16);
		st.unrung = 0;
		st.sq_tail = READ_ONCE(hdr()->sq_tail.value);
		if (st.sq_tail - sq_head() > g.sq_entries) {
			st.sq_tail = sq_head();
			st_release(&hdr()->sq_tail.value, st.sq_tail);
		}
		st.cq_head = cq_tail();
		st_release(&hdr()->cq_head.value, st.cq_head);
		st.next_serial = (get_random_u64() >> 32) | 1;
		st.flush_bits = 0;
		st.wanted_bits = 0;
		st.flush_seq = 0;
		st.consecutive_timeouts = 0;
		st.stalled_until_ns = 0;
		st.have_rings = true;
		st.rings_generation = g.host_generation;
		pr_info("attached: host generation %llu, sq %u, cq %u, %u slots (%u usable), features 0x%x\n",
			g.host_generation, g.sq_entries, g.cq_entries, g.slot_count,
			st.slots_usable, g.features_host);
	}
	st.features = g.features_host & FEATURES_UNDERSTOOD;
	st_release(&hdr()->features_guest, st.features);
	st.guest_generation = new_generation(st.guest_generation);
	st_release(&hdr()->guest_generation, st.guest_generation);
	st.host_generation = g.host_generation;
	st.attached = true;
	st.broken = false;
	void_pools(false);
	return 0;
}

static void detach(void)
{
	st.attached = false;
	st.c.resets++;
	void_pools(true);
	st.wanted_bits = 0;
	pr_info_ratelimited("host left READY or changed generation (state %u): ops are no-ops until it is READY again\n",
			    host_state());
}

static bool ensure_attached(void)
{
	if (!st.present)
		return false;
	if (st.attached) {
		if (!host_changed())
			return !st.broken;
		detach();
	}
	if (host_state() != TMEM_HOST_STATE_READY)
		return false;
	if (attach() == -EPROTO) {
		st.c.errors++;
		return false;
	}
	return st.attached;
}

static void host_fault(void)
{
	if (host_changed()) {
		detach();
		return;
	}
	st.c.errors++;
	st.broken = true;
	void_pools(true);
	pr_warn_ratelimited("host ring indices are corrupt: waiting for a host reset\n");
}

/* --- ring ---------------------------------------------------------------- */

enum need { NEED_PUT, NEED_GET, NEED_CONTROL, NEED_INVALIDATE };

static u32 in_flight(void)
{
	return st.pending_cap - st.nfree_pending;
}

static bool have_room(enum need need)
{
	u32 used, limit;

	if (!st.attached || st.broken || st.nfree_pending == 0)
		return false;
	if ((need == NEED_PUT || need == NEED_GET) && st.nfree_slots == 0)
		return false;
	used = st.sq_tail - sq_head();
	if (used > st.g.sq_entries) {
		host_fault();
		return false;
	}
	limit = need == NEED_INVALIDATE ? st.g.sq_entries : st.g.sq_entries - st.reserve;
	return used < limit;
}

static void maybe_doorbell(void)
{
	smp_mb(); /* publish sq_tail before reading host_flags (Dekker) */
	if (READ_ONCE(hdr()->host_flags) & TMEM_HOST_NEEDS_DOORBELL) {
		writel((TMEM_HOST_PEER << 16) | TMEM_VEC_SUBMIT, st.regs + TMEM_REG_DOORBELL);
		st.c.doorbells++;
	}
	st.unrung = 0;
}

/* Nothing waits for a put or an invalidate: a sleeping host is woken once
 * per doorbell_batch of them (a doorbell is a VM exit), and its timer
 * re-check or the next waited-on entry (ring order) takes the rest.
 */
static bool waited_on(const struct tmem_sqe *sqe)
{
	if (sqe->flags & TMEM_SQE_F_IRQ)
		return true;
	switch (sqe->opcode) {
	case TMEM_OP_PUT:
	case TMEM_OP_INVAL_PAGE:
	case TMEM_OP_INVAL_OBJECT:
	case TMEM_OP_INVAL_POOL:
		return false;
	default:
		return true;
	}
}

/* Writes and publishes @sqe; returns its tag, or 0 if not published. */
static u64 post(struct tmem_sqe *sqe, u32 slot, int pool)
{
	u32 index = st.free_pending[--st.nfree_pending];
	u64 tag = (st.next_serial++ << TAG_INDEX_BITS) | index;
	struct tmem_pending *p = &st.pending[index];
	struct tmem_sqe *at;

	p->tag = tag;
	p->opcode = sqe->opcode;
	p->slot = slot;
	p->pool = pool;
	p->incarnation = pool >= 0 ? st.pools[pool].incarnation : 0;
	p->epoch = st.epoch;
	p->waiter = WAIT_NONE;
	sqe->tag = tag;
	at = (struct tmem_sqe *)(st.shm + st.g.sq_offset) + (st.sq_tail & (st.g.sq_entries - 1));
	memcpy(at, sqe, sizeof(*sqe));
	if (host_changed()) {
		/* A reset rewrote sq_tail: never store an old-based tail over it. */
		p->tag = 0;
		st.free_pending[st.nfree_pending++] = index;
		if (slot != NO_SLOT)
			st.free_slots[st.nfree_slots++] = slot;
		return 0;
	}
	st.sq_tail++;
	st_release(&hdr()->sq_tail.value, st.sq_tail);
	if (waited_on(sqe) || ++st.unrung >= st.doorbell_batch) {
		maybe_doorbell();
	} else {
		/* Only a counter hangs on this read: no Dekker barrier needed. */
		if (READ_ONCE(hdr()->host_flags) & TMEM_HOST_NEEDS_DOORBELL)
			st.c.doorbells_deferred++;
		else
			st.unrung = 0; /* the host is polling: it sees them */
	}
	return tag;
}

static void free_entry(u32 index)
{
	st.pending[index].tag = 0;
	st.free_pending[st.nfree_pending++] = index;
}

static void op_failed(const struct tmem_pending *p, s32 status)
{
	struct tmem_pool *pool;

	if (p->epoch != st.epoch)
		return; /* from before a reset: the host forgot those pools */
	st.c.errors++;
	if (status == TMEM_ERR_NOENT && p->pool >= 0) {
		pool = &st.pools[p->pool];
		if (pool->state == POOL_READY && pool->incarnation == p->incarnation)
			pool->state = POOL_NONE;
	}
}

static void complete_cqe(const struct tmem_cqe *cqe)
{
	u64 index = cqe->tag & TAG_INDEX_MASK;
	struct tmem_pending *p;
	struct tmem_pool *pool;
	s32 status = cqe->status;
	u32 result = cqe->result;

	if (cqe->tag == 0 || index >= st.pending_cap || st.pending[index].tag != cqe->tag) {
		st.c.stale_completions++;
		return;
	}
	p = &st.pending[index];
	switch (p->opcode) {
	case TMEM_OP_PUT:
		st.free_slots[st.nfree_slots++] = p->slot;
		if (status == TMEM_ERR_DROPPED)
			st.c.puts_dropped_by_host++;
		else if (status != TMEM_OK)
			op_failed(p, status);
		free_entry(index);
		break;
	case TMEM_OP_GET:
		if (status == TMEM_OK && result > 1)
			st.c.errors++;
		else if (status != TMEM_OK)
			op_failed(p, status);
		if (p->waiter == WAITING) {
			/* The waiter copies the page and frees slot and entry. */
			p->waiter = (status == TMEM_OK && result == 1) ? DONE_HIT : DONE_MISS;
			break;
		}
		st.free_slots[st.nfree_slots++] = p->slot;
		free_entry(index);
		break;
	case TMEM_OP_NEW_POOL:
		pool = &st.pools[p->pool];
		if (pool->state == POOL_CREATING && pool->create_tag == cqe->tag) {
			if (status == TMEM_OK && result < TMEM_MAX_POOLS) {
				pool->state = POOL_READY;
				pool->host_id = result;
				pool->incarnation = st.next_incarnation++;
				if (pool->sent)
					bitmap_zero(pool->sent, pool->sent_bits);
				st.c.pools_created++;
			} else {
				pool->state = POOL_FAILED;
				pool->refusal = status == TMEM_OK ? TMEM_ERR_INVAL : status;
				pool->retry_after_ns = ktime_get_ns() +
						       (u64)pool_retry_ms * NSEC_PER_MSEC;
				st.c.errors++;
			}
		}
		free_entry(index);
		break;
	default:
		if (status != TMEM_OK)
			op_failed(p, status);
		free_entry(index);
		break;
	}
}

static void flush_wanted(void);

static void reap(void)
{
	u32 tail;
	struct tmem_cqe cqe;
	const struct tmem_cqe *ring;

	if (!st.attached || st.broken)
		return;
	tail = cq_tail();
	if (tail - st.cq_head > st.g.cq_entries) {
		host_fault();
		return;
	}
	if (tail != st.cq_head) {
		ring = (const struct tmem_cqe *)(st.shm + st.g.cq_offset);
		while (st.cq_head != tail) {
			memcpy(&cqe, &ring[st.cq_head & (st.g.cq_entries - 1)], sizeof(cqe));
			st.cq_head++;
			complete_cqe(&cqe);
		}
		if (host_changed())
			return;
		st_release(&hdr()->cq_head.value, st.cq_head);
	}
	if (st.flush_bits && flush_done_seq() == st.flush_seq) {
		WRITE_ONCE(hdr()->flush_request, 0);
		st.flush_bits = 0;
	}
	flush_wanted();
}

/* --- pools ---------------------------------------------------------------- */

static void start_create(int h)
{
	struct tmem_pool *p = &st.pools[h];
	struct tmem_sqe sqe = {};
	u64 tag;

	if (p->shared && !(st.features & TMEM_FEAT_SHARED_POOLS)) {
		p->state = POOL_FAILED;
		p->refusal = TMEM_ERR_PERM;
		p->retry_after_ns = ktime_get_ns() + (u64)pool_retry_ms * NSEC_PER_MSEC;
		return;
	}
	if (!have_room(NEED_CONTROL)) {
		reap();
		if (!have_room(NEED_CONTROL))
			return;
	}
	sqe.opcode = TMEM_OP_NEW_POOL;
	sqe.flags = TMEM_SQE_F_IRQ | (p->shared ? TMEM_SQE_F_SHARED : 0);
	if (p->shared)
		memcpy(sqe.oid, p->uuid, sizeof(p->uuid));
	tag = post(&sqe, NO_SLOT, h);
	if (!tag)
		return;
	p->state = POOL_CREATING;
	p->create_tag = tag;
}

static void issue_invalidate(u8 opcode, int h, int host_id, const u32 *oid, u64 index);

/* The host pool id of a usable pool, or -1 (then maybe starts creating it). */
static int resolve(int h, bool create)
{
	struct tmem_pool *p;

	if (h < 0 || h >= TMEM_MAX_POOLS || st.pools[h].state == POOL_UNUSED) {
		st.c.errors++;
		return -1;
	}
	p = &st.pools[h];
	switch (p->state) {
	case POOL_READY:
		if (p->inval_on_ready) {
			p->inval_on_ready = false;
			issue_invalidate(TMEM_OP_INVAL_POOL, h, p->host_id, NULL, 0);
			if (p->state != POOL_READY)
				return -1;
		}
		return p->host_id;
	case POOL_NONE:
		if (create)
			start_create(h);
		return -1;
	case POOL_FAILED:
		if (create && ktime_get_ns() >= p->retry_after_ns)
			start_create(h);
		return -1;
	default:
		return -1;
	}
}

/* --- sent-keys filter ------------------------------------------------------ */

static u64 mix64(u64 x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* Hash of an object id; of a page when @index is not U64_MAX. */
static u64 key_hash(const u32 *oid, u64 index)
{
	u64 h = mix64(index);
	int i;

	for (i = 0; i < TMEM_OBJECT_WORDS; i += 2)
		h = mix64(h ^ (oid[i] | (u64)oid[i + 1] << 32));
	return h;
}

static void mark_sent(struct tmem_pool *p, u64 hash)
{
	if (!p->sent)
		return;
	__set_bit(hash & (p->sent_bits - 1), p->sent);
	__set_bit((hash >> 32) & (p->sent_bits - 1), p->sent);
}

static bool maybe_sent(const struct tmem_pool *p, u64 hash)
{
	if (!p->sent)
		return true;
	return test_bit(hash & (p->sent_bits - 1), p->sent) &&
	       test_bit((hash >> 32) & (p->sent_bits - 1), p->sent);
}

/* Could the host hold this page (index) or object (index U64_MAX)? */
static bool host_may_hold(int h, const u32 *oid, u64 index)
{
	struct tmem_pool *p = &st.pools[h];

	return p->shared || maybe_sent(p, key_hash(oid, index));
}

/* The host holds nothing of these pools any more (or will not, before any
 * later op reaches them): their filters start empty.
 */
static void forget_sent(u64 host_id_bits)
{
	int i;

	for (i = 0; i < TMEM_MAX_POOLS; i++) {
		struct tmem_pool *p = &st.pools[i];

		if (p->state == POOL_READY && p->sent && ((host_id_bits >> p->host_id) & 1))
			bitmap_zero(p->sent, p->sent_bits);
	}
}

/* --- flush barrier and invalidates ---------------------------------------- */

static bool flagged(int host_id)
{
	return ((st.flush_bits | st.wanted_bits) >> host_id) & 1;
}

static void guest_reset(u64 lost_bits)
{
	int i;

	/* Last resort: a new guest generation makes the host forget us. */
	lost_bits |= st.wanted_bits;
	for (i = 0; i < TMEM_MAX_POOLS; i++) {
		struct tmem_pool *p = &st.pools[i];

		if (p->shared && p->state == POOL_READY && ((lost_bits >> p->host_id) & 1))
			p->inval_on_ready = true;
	}
	st.guest_generation = new_generation(st.guest_generation);
	st_release(&hdr()->guest_generation, st.guest_generation);
	st.c.guest_resets++;
	void_pools(false);
	st.wanted_bits = 0;
	maybe_doorbell();
}

static void request_flush(u64 bits)
{
	u64 seq;

	if (!(st.features & TMEM_FEAT_FLUSH_BARRIER)) {
		guest_reset(bits);
		return;
	}
	/* Flagged from now on: nothing of these pools is posted until a
	 * barrier or INVAL_POOL ahead in ring order has wiped them.
	 */
	forget_sent(bits);
	if (st.flush_bits) {
		/* One barrier at a time: the host acks a seq, not bits. */
		st.wanted_bits |= bits;
		return;
	}
	seq = st.sq_tail;
	if (seq == flush_done_seq()) {
		guest_reset(bits);
		return;
	}
	WRITE_ONCE(hdr()->flush_request, READ_ONCE(hdr()->flush_request) | bits);
	st_release(&hdr()->flush_request_seq, seq);
	st.flush_bits = bits;
	st.flush_seq = seq;
	maybe_doorbell();
}

static void flush_wanted(void)
{
	u64 bits;
	struct tmem_sqe sqe;

	if (st.flush_bits || !st.wanted_bits || !st.attached || st.broken)
		return;
	bits = st.wanted_bits;
	st.wanted_bits = 0;
	while (bits) {
		int id = __ffs64(bits);

		if (!have_room(NEED_INVALIDATE)) {
			if (st.attached && !st.broken)
				request_flush(bits);
			return;
		}
		memset(&sqe, 0, sizeof(sqe));
		sqe.opcode = TMEM_OP_INVAL_POOL;
		sqe.pool = id;
		post(&sqe, NO_SLOT, -1);
		forget_sent(1ull << id);
		bits &= bits - 1;
	}
}

static void check_flush_done(void)
{
	if (st.flush_bits && flush_done_seq() == st.flush_seq) {
		WRITE_ONCE(hdr()->flush_request, 0);
		st.flush_bits = 0;
	}
	if (!st.flush_bits && st.wanted_bits)
		reap();
}

/* Ring full: give a busy host a few microseconds (IRQs are off here). */
static bool wait_for_room(void)
{
	u64 deadline = ktime_get_ns() + (u64)ring_full_spin_us * NSEC_PER_USEC;

	while (ktime_get_ns() < deadline) {
		cpu_relax();
		reap();
		if (!st.attached || st.broken)
			return false;
		if (have_room(NEED_INVALIDATE))
			return true;
	}
	return false;
}

static void issue_invalidate(u8 opcode, int h, int host_id, const u32 *oid, u64 index)
{
	struct tmem_sqe sqe = {};

	if (flagged(host_id))
		return; /* the pending flush covers it */
	if (!have_room(NEED_INVALIDATE)) {
		reap();
		if (!st.attached || st.broken || flagged(host_id))
			return;
		if (!have_room(NEED_INVALIDATE) && !wait_for_room()) {
			if (!st.attached || st.broken || flagged(host_id))
				return;
			st.c.flush_fallbacks++;
			request_flush(1ull << host_id);
			return;
		}
	}
	sqe.opcode = opcode;
	sqe.pool = host_id;
	sqe.index = index;
	if (oid)
		memcpy(sqe.oid, oid, sizeof(sqe.oid));
	post(&sqe, NO_SLOT, h);
	if (opcode == TMEM_OP_INVAL_POOL)
		forget_sent(1ull << host_id);
}

/* An unsent put must still kill the host's older page of its key. */
static void drop_put(int h, int host_id, const u32 *oid, u64 index)
{
	if (!host_may_hold(h, oid, index)) {
		st.c.invalidates_skipped_never_sent++;
		return;
	}
	st.c.invalidates_for_dropped_puts++;
	issue_invalidate(TMEM_OP_INVAL_PAGE, h, host_id, oid, index);
}

static bool valid_handle(int h)
{
	return h >= 0 && h < TMEM_MAX_POOLS && st.pools[h].state != POOL_UNUSED;
}

static void invalidate(u8 opcode, int h, const u32 *oid, u64 index)
{
	int id;

	st.c.invalidates++;
	if (!ensure_attached()) {
		/* The next attach writes a new guest generation: the host drops
		 * this VM's pages. Shared pools hold other VMs' pages too.
		 */
		if (valid_handle(h) && st.pools[h].shared)
			st.pools[h].inval_on_ready = true;
		return;
	}
	id = resolve(h, false);
	if (id < 0) {
		if (valid_handle(h) && st.pools[h].shared)
			st.pools[h].inval_on_ready = true;
		return;
	}
	if (oid && !host_may_hold(h, oid, opcode == TMEM_OP_INVAL_PAGE ? index : U64_MAX)) {
		st.c.invalidates_skipped_never_sent++;
		return;
	}
	check_flush_done();
	issue_invalidate(opcode, h, id, oid, index);
}

static bool admit(void)
{
	u32 hint;

	if (!(st.features & TMEM_FEAT_ADMISSION_HINT))
		return true;
	hint = min(READ_ONCE(hdr()->admission_hint), TMEM_ADMIT_ALL);
	if (hint == TMEM_ADMIT_ALL)
		return true;
	st.hint_credit += hint; /* Bresenham: exactly hint of TMEM_ADMIT_ALL */
	if (st.hint_credit >= TMEM_ADMIT_ALL) {
		st.hint_credit -= TMEM_ADMIT_ALL;
		return true;
	}
	return false;
}

/* --- cleancache ops ------------------------------------------------------- */

static int new_handle(bool shared, const u8 *uuid)
{
	unsigned long flags;
	struct tmem_pool *p;
	unsigned long *sent = NULL;
	u64 deadline;
	int h, ret;

	if (!shared && sent_filter_bits >= BITS_PER_LONG && is_power_of_2(sent_filter_bits))
		sent = bitmap_zalloc(sent_filter_bits, GFP_KERNEL);
	spin_lock_irqsave(&st.lock, flags);
	for (h = 0; h < TMEM_MAX_POOLS; h++)
		if (st.pools[h].state == POOL_UNUSED)
			break;
	if (h == TMEM_MAX_POOLS) {
		spin_unlock_irqrestore(&st.lock, flags);
		bitmap_free(sent);
		pr_warn("out of pool handles (%u)\n", TMEM_MAX_POOLS);
		return -1;
	}
	p = &st.pools[h];
	/* A handle's old filter (after invalidate_fs) is freed below. */
	swap(sent, p->sent);
	memset(p, 0, offsetof(struct tmem_pool, sent));
	if (p->sent)
		p->sent_bits = sent_filter_bits;
	p->state = POOL_NONE;
	p->shared = shared;
	if (shared)
		memcpy(p->uuid, uuid, sizeof(p->uuid));
	if (!ensure_attached()) {
		spin_unlock_irqrestore(&st.lock, flags);
		bitmap_free(sent);
		return h; /* made on first use */
	}
	if (shared && !(st.features & TMEM_FEAT_SHARED_POOLS)) {
		p->state = POOL_UNUSED;
		spin_unlock_irqrestore(&st.lock, flags);
		bitmap_free(sent);
		pr_info("host offers no shared pools\n");
		return -1;
	}
	start_create(h);
	spin_unlock_irqrestore(&st.lock, flags);
	bitmap_free(sent);

	deadline = ktime_get_ns() + (u64)pool_create_timeout_ms * NSEC_PER_MSEC;
	for (;;) {
		spin_lock_irqsave(&st.lock, flags);
		if (st.attached)
			reap();
		if (p->state != POOL_CREATING || ktime_get_ns() >= deadline)
			break;
		spin_unlock_irqrestore(&st.lock, flags);
		usleep_range(100, 200);
	}
	ret = h;
	if (p->state == POOL_FAILED) {
		pr_warn("host refused %s pool (status %d)\n", shared ? "a shared" : "a",
			p->refusal);
		p->state = POOL_UNUSED;
		ret = -1;
	}
	spin_unlock_irqrestore(&st.lock, flags);
	return ret;
}

static int tmem_init_fs(size_t pagesize)
{
	if (pagesize != TMEM_PAGE_SIZE)
		return -1;
	return new_handle(false, NULL);
}

static int tmem_init_shared_fs(uuid_t *uuid, size_t pagesize)
{
	if (pagesize != TMEM_PAGE_SIZE)
		return -1;
	return new_handle(true, uuid->b);
}

static void tmem_put_page(int h, struct cleancache_filekey key, pgoff_t index,
			  struct page *page)
{
	unsigned long flags;
	struct tmem_sqe sqe = {};
	u64 t0 = ktime_get_ns();
	void *src;
	u32 slot;
	int id;

	spin_lock_irqsave(&st.lock, flags);
	if (!ensure_attached()) {
		st.c.puts_dropped_no_pool++;
		goto out;
	}
	if (in_flight() >= st.g.cq_entries / 2)
		reap();
	id = resolve(h, true);
	if (id < 0 && valid_handle(h) && st.pools[h].state == POOL_CREATING) {
		reap();
		id = resolve(h, false);
	}
	if (id < 0) {
		/* No host pool in this generation: the host holds nothing of it. */
		st.c.puts_dropped_no_pool++;
		goto out;
	}
	check_flush_done();
	if (flagged(id)) {
		st.c.puts_dropped_flush_pending++;
		goto out;
	}
	if (!admit()) {
		st.c.puts_skipped_by_hint++;
		drop_put(h, id, key.u.key, index);
		goto out;
	}
	if (!have_room(NEED_PUT)) {
		reap();
		id = resolve(h, false);
		if (id < 0 || !have_room(NEED_PUT) || flagged(id)) {
			st.c.puts_dropped_ring_full++;
			if (id >= 0)
				drop_put(h, id, key.u.key, index);
			goto out;
		}
	}
	slot = st.free_slots[--st.nfree_slots];
	src = kmap_atomic(page);
	memcpy(slot_addr(slot), src, TMEM_PAGE_SIZE);
	kunmap_atomic(src);
	sqe.opcode = TMEM_OP_PUT;
	sqe.pool = id;
	sqe.slot = slot;
	sqe.index = index;
	memcpy(sqe.oid, key.u.key, sizeof(sqe.oid));
	if (!post(&sqe, slot, h)) {
		st.c.puts_dropped_no_pool++;
		goto out;
	}
	mark_sent(&st.pools[h], key_hash(key.u.key, index));
	mark_sent(&st.pools[h], key_hash(key.u.key, U64_MAX));
	st.c.puts_sent++;
out:
	st.c.put_ns += ktime_get_ns() - t0;
	spin_unlock_irqrestore(&st.lock, flags);
}

static void note_get_timeout(void)
{
	u32 head = sq_head();

	if (!stall_after_timeouts)
		return;
	if (st.consecutive_timeouts > 0 && head != st.stall_sq_head)
		st.consecutive_timeouts = 0;
	st.stall_sq_head = head;
	if (++st.consecutive_timeouts < stall_after_timeouts)
		return;
	if (st.consecutive_timeouts == stall_after_timeouts) {
		st.c.host_stalls++;
		pr_warn_ratelimited("host stalled: gets miss at once until it moves\n");
	}
	st.stalled_until_ns = ktime_get_ns() + (u64)stall_probe_ms * NSEC_PER_MSEC;
}

struct get_ticket {
	u64 tag;
	u64 rings_gen;
	u32 index;
};

/* Under the lock: reaps, then tells whether the get's CQE is in. */
static bool get_done(const struct get_ticket *t, bool *lost)
{
	struct tmem_pending *p;

	if (st.rings_gen != t->rings_gen || !st.attached || st.broken) {
		*lost = true;
		return true;
	}
	reap();
	if (st.rings_gen != t->rings_gen || !st.attached || st.broken || host_changed()) {
		*lost = true;
		return true;
	}
	p = &st.pending[t->index];
	if (p->tag != t->tag) {
		*lost = true;
		return true;
	}
	return p->waiter == DONE_HIT || p->waiter == DONE_MISS;
}

static bool get_done_locked(const struct get_ticket *t, bool *lost)
{
	unsigned long flags;
	bool done;

	spin_lock_irqsave(&st.lock, flags);
	done = get_done(t, lost);
	spin_unlock_irqrestore(&st.lock, flags);
	return done;
}

static int tmem_get_page(int h, struct cleancache_filekey key, pgoff_t index,
			 struct page *page)
{
	unsigned long flags;
	struct tmem_sqe sqe = {};
	struct get_ticket t;
	struct tmem_pending *p;
	u64 t0 = ktime_get_ns(), now, spin_until, deadline;
	bool lost = false, hit = false, timed_out = false;
	void *dst;
	u32 slot;
	int id;

	spin_lock_irqsave(&st.lock, flags);
	if (!ensure_attached())
		goto miss_local;
	reap();
	if (st.stalled_until_ns && ktime_get_ns() < st.stalled_until_ns) {
		if (sq_head() == st.stall_sq_head) {
			st.c.gets_skipped_stalled++;
			goto miss_local;
		}
		st.stalled_until_ns = 0;
		st.consecutive_timeouts = 0;
	}
	id = resolve(h, true);
	if (id < 0 || flagged(id) || !have_room(NEED_GET))
		goto miss_local;
	if (!host_may_hold(h, key.u.key, index)) {
		st.c.gets_skipped_never_sent++;
		goto miss_local;
	}
	slot = st.free_slots[--st.nfree_slots];
	sqe.opcode = TMEM_OP_GET;
	sqe.flags = TMEM_SQE_F_IRQ;
	sqe.pool = id;
	sqe.slot = slot;
	sqe.index = index;
	memcpy(sqe.oid, key.u.key, sizeof(sqe.oid));
	t.tag = post(&sqe, slot, h);
	if (!t.tag)
		goto miss_local;
	t.index = t.tag & TAG_INDEX_MASK;
	t.rings_gen = st.rings_gen;
	st.pending[t.index].waiter = WAITING;
	spin_unlock_irqrestore(&st.lock, flags);

	now = ktime_get_ns();
	spin_until = now + (u64)get_spin_us * NSEC_PER_USEC;
	deadline = now + (u64)get_timeout_ms * NSEC_PER_MSEC;
	for (;;) {
		if (get_done_locked(&t, &lost))
			break;
		now = ktime_get_ns();
		if (now >= deadline) {
			timed_out = true;
			break;
		}
		if (now < spin_until) {
			cpu_relax();
			continue;
		}
		if (st.have_irq) {
			/* Re-check at least every jiffy: interrupts can be lost. */
			st.c.interrupt_waits++;
			wait_event_timeout(tmem_wq, get_done_locked(&t, &lost), 1);
		} else {
			usleep_range(50, 100);
		}
	}

	spin_lock_irqsave(&st.lock, flags);
	if (st.rings_gen == t.rings_gen && st.pending[t.index].tag == t.tag) {
		p = &st.pending[t.index];
		if (p->waiter == DONE_HIT || p->waiter == DONE_MISS) {
			/* A reset noticed meanwhile makes it a miss, to be safe. */
			hit = !lost && p->waiter == DONE_HIT;
			if (hit) {
				dst = kmap_atomic(page);
				memcpy(dst, slot_addr(p->slot), TMEM_PAGE_SIZE);
				kunmap_atomic(dst);
			}
			st.free_slots[st.nfree_slots++] = p->slot;
			free_entry(t.index);
			timed_out = false;
		} else {
			/* Timed out: the completion frees slot and entry later. */
			p->waiter = ABANDONED;
		}
	}
	if (timed_out) {
		note_get_timeout();
		st.c.gets_timeout++;
	} else if (!lost) {
		st.consecutive_timeouts = 0;
	}
	if (hit)
		st.c.gets_hit++;
	else
		st.c.gets_miss++;
	if (lost)
		st.c.gets_miss_local++;
	st.c.get_ns += ktime_get_ns() - t0;
	spin_unlock_irqrestore(&st.lock, flags);
	return hit ? 0 : -1;

miss_local:
	st.c.gets_miss++;
	st.c.gets_miss_local++;
	st.c.get_ns += ktime_get_ns() - t0;
	spin_unlock_irqrestore(&st.lock, flags);
	return -1;
}

static void tmem_invalidate_page(int h, struct cleancache_filekey key, pgoff_t index)
{
	unsigned long flags;

	spin_lock_irqsave(&st.lock, flags);
	invalidate(TMEM_OP_INVAL_PAGE, h, key.u.key, index);
	spin_unlock_irqrestore(&st.lock, flags);
}

static void tmem_invalidate_inode(int h, struct cleancache_filekey key)
{
	unsigned long flags;

	spin_lock_irqsave(&st.lock, flags);
	invalidate(TMEM_OP_INVAL_OBJECT, h, key.u.key, 0);
	spin_unlock_irqrestore(&st.lock, flags);
}

/* Unmount: the pool goes away; its handle may be handed out again. */
static void tmem_invalidate_fs(int h)
{
	unsigned long flags;
	struct tmem_sqe sqe = {};
	struct tmem_pool *p;

	spin_lock_irqsave(&st.lock, flags);
	st.c.invalidates++;
	if (!valid_handle(h))
		goto out;
	p = &st.pools[h];
	if (ensure_attached() && p->state == POOL_READY) {
		check_flush_done();
		if (!p->shared && !flagged(p->host_id) && have_room(NEED_CONTROL)) {
			sqe.opcode = TMEM_OP_DESTROY_POOL;
			sqe.pool = p->host_id;
			post(&sqe, NO_SLOT, -1);
		} else {
			/* Shared pools outlive us; a full ring gets the barrier. */
			issue_invalidate(TMEM_OP_INVAL_POOL, h, p->host_id, NULL, 0);
		}
	}
	p->state = POOL_UNUSED;
out:
	spin_unlock_irqrestore(&st.lock, flags);
}

static const struct cleancache_ops tmem_cleancache_ops = {
	.init_fs = tmem_init_fs,
	.init_shared_fs = tmem_init_shared_fs,
	.get_page = tmem_get_page,
	.put_page = tmem_put_page,
	.invalidate_page = tmem_invalidate_page,
	.invalidate_inode = tmem_invalidate_inode,
	.invalidate_fs = tmem_invalidate_fs,
};

/* --- debugfs --------------------------------------------------------------- */

static int state_show(struct seq_file *m, void *v)
{
	unsigned long flags;
	bool present, attached, broken;
	u64 hgen, ggen;
	u32 hstate = 0, hint = 0, inflight, free_slots;

	spin_lock_irqsave(&st.lock, flags);
	present = st.present;
	attached = st.attached;
	broken = st.broken;
	hgen = st.host_generation;
	ggen = st.guest_generation;
	if (present) {
		hstate = host_state();
		hint = READ_ONCE(hdr()->admission_hint);
	}
	inflight = st.attached ? in_flight() : 0;
	free_slots = st.nfree_slots;
	spin_unlock_irqrestore(&st.lock, flags);
	seq_printf(m, "present %d\nattached %d\nbroken %d\nhost_state %u\n",
		   present, attached, broken, hstate);
	seq_printf(m, "host_generation %llu\nguest_generation %llu\n", hgen, ggen);
	seq_printf(m, "admission_hint %u\nin_flight %u\nfree_slots %u\nregistered %d\n",
		   hint, inflight, free_slots, ops_registered);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(state);

#define COUNTER(name) debugfs_create_u64(#name, 0444, debug_dir, &st.c.name)

static void debugfs_setup(void)
{
	debug_dir = debugfs_create_dir(KBUILD_MODNAME, NULL);
	COUNTER(puts_sent);
	COUNTER(puts_skipped_by_hint);
	COUNTER(puts_dropped_ring_full);
	COUNTER(puts_dropped_no_pool);
	COUNTER(puts_dropped_flush_pending);
	COUNTER(puts_dropped_by_host);
	COUNTER(gets_hit);
	COUNTER(gets_miss);
	COUNTER(gets_timeout);
	COUNTER(gets_miss_local);
	COUNTER(gets_skipped_stalled);
	COUNTER(host_stalls);
	COUNTER(invalidates);
	COUNTER(invalidates_for_dropped_puts);
	COUNTER(invalidates_skipped_never_sent);
	COUNTER(gets_skipped_never_sent);
	COUNTER(flush_fallbacks);
	COUNTER(guest_resets);
	COUNTER(resets);
	COUNTER(pools_created);
	COUNTER(doorbells);
	COUNTER(doorbells_deferred);
	COUNTER(interrupts);
	COUNTER(interrupt_waits);
	COUNTER(stale_completions);
	COUNTER(errors);
	COUNTER(put_ns);
	COUNTER(get_ns);
	debugfs_create_file("state", 0444, debug_dir, NULL, &state_fops);
}

/* --- PCI ------------------------------------------------------------------- */

static irqreturn_t tmem_irq(int irq, void *data)
{
	spin_lock(&st.lock);
	st.c.interrupts++;
	if (st.present && st.attached)
		reap();
	spin_unlock(&st.lock);
	wake_up_all(&tmem_wq);
	return IRQ_HANDLED;
}

static int tmem_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	unsigned long flags;
	resource_size_t start, len;
	u32 *free_pending = NULL, *free_slots = NULL;
	struct tmem_pending *pending = NULL;
	u32 slots_cap;
	u64 deadline;
	int err, ready;
	void __iomem *regs;
	u8 *shm;

	mutex_lock(&probe_mutex);
	if (st.pdev) {
		dev_err(&pdev->dev, "only one tmem device is supported\n");
		err = -EBUSY;
		goto out_unlock;
	}
	err = pcim_enable_device(pdev);
	if (err)
		goto out_unlock;
	err = pcim_iomap_regions(pdev, BIT(0), KBUILD_MODNAME);
	if (err)
		goto out_unlock;
	regs = pcim_iomap_table(pdev)[0];
	start = pci_resource_start(pdev, 2);
	len = pci_resource_len(pdev, 2);
	if (!start || len < TMEM_PAGE_SIZE) {
		dev_err(&pdev->dev, "BAR2 (shared memory) is missing or too small\n");
		err = -ENODEV;
		goto out_unlock;
	}
	if (!devm_request_mem_region(&pdev->dev, start, len, KBUILD_MODNAME)) {
		err = -EBUSY;
		goto out_unlock;
	}
	shm = devm_memremap(&pdev->dev, start, len, MEMREMAP_WB);
	if (IS_ERR(shm)) {
		err = PTR_ERR(shm);
		goto out_unlock;
	}
	slots_cap = min_t(u64, len / TMEM_PAGE_SIZE, MAX_PENDING);
	pending = kvcalloc(MAX_PENDING, sizeof(*pending), GFP_KERNEL);
	free_pending = kvcalloc(MAX_PENDING, sizeof(u32), GFP_KERNEL);
	free_slots = kvcalloc(slots_cap, sizeof(u32), GFP_KERNEL);
	if (!pending || !free_pending || !free_slots) {
		err = -ENOMEM;
		goto out_free;
	}

	/* The header is the host's; wait for READY, then check magic/version. */
	deadline = ktime_get_ns() + (u64)attach_timeout_ms * NSEC_PER_MSEC;
	while (ld_acquire(&((struct tmem_shm_header *)shm)->host_state) !=
	       TMEM_HOST_STATE_READY) {
		if (ktime_get_ns() >= deadline)
			break;
		usleep_range(5000, 10000);
	}
	if (READ_ONCE(((struct tmem_shm_header *)shm)->magic) != TMEM_ABI_MAGIC ||
	    READ_ONCE(((struct tmem_shm_header *)shm)->version) != TMEM_ABI_VERSION) {
		dev_err(&pdev->dev, "BAR2 is not a tmem ABI v%u region (magic 0x%x, version %u)\n",
			TMEM_ABI_VERSION, READ_ONCE(((struct tmem_shm_header *)shm)->magic),
			READ_ONCE(((struct tmem_shm_header *)shm)->version));
		err = -ENODEV;
		goto out_free;
	}

	pci_set_master(pdev);
	st.have_irq = false;
	if (use_irq) {
		err = pci_alloc_irq_vectors(pdev, TMEM_MIN_VECTORS, TMEM_MIN_VECTORS,
					    PCI_IRQ_MSIX);
		if (err < 0) {
			dev_warn(&pdev->dev, "no MSI-X (%d): gets poll instead of sleeping on the interrupt\n",
				 err);
		} else {
			err = request_irq(pci_irq_vector(pdev, TMEM_VEC_COMPLETE), tmem_irq, 0,
					  KBUILD_MODNAME, &st);
			if (err) {
				pci_free_irq_vectors(pdev);
				dev_warn(&pdev->dev, "request_irq failed (%d): gets poll\n", err);
			} else {
				st.have_irq = true;
			}
		}
	}

	spin_lock_irqsave(&st.lock, flags);
	st.pdev = pdev;
	st.regs = regs;
	st.shm = shm;
	st.shm_size = len;
	st.pending = pending;
	st.free_pending = free_pending;
	st.free_slots = free_slots;
	st.slots_cap = slots_cap;
	st.have_rings = false;
	st.attached = false;
	st.broken = false;
	st.present = true;
	ready = ensure_attached();
	spin_unlock_irqrestore(&st.lock, flags);

	dev_info(&pdev->dev, "tmem region %llu KiB, peer id %u, %s, host %s\n",
		 (u64)len >> 10, readl(regs + TMEM_REG_IVPOSITION),
		 st.have_irq ? "MSI-X" : "polling", ready ? "READY" : "not ready yet");

	if (!ops_registered) {
		err = cleancache_register_ops(&tmem_cleancache_ops);
		if (err) {
			dev_err(&pdev->dev, "cleancache_register_ops failed (%d): another backend?\n",
				err);
		} else {
			ops_registered = true;
			__module_get(THIS_MODULE);
			pr_info("cleancache ops registered; cleancache has no unregister, so this module can no longer be unloaded\n");
		}
	}
	mutex_unlock(&probe_mutex);
	return 0;

out_free:
	kvfree(pending);
	kvfree(free_pending);
	kvfree(free_slots);
out_unlock:
	mutex_unlock(&probe_mutex);
	return err;
}

static void tmem_remove(struct pci_dev *pdev)
{
	unsigned long flags;
	struct tmem_pending *pending;
	u32 *free_pending, *free_slots;

	mutex_lock(&probe_mutex);
	spin_lock_irqsave(&st.lock, flags);
	st.present = false;
	if (st.attached)
		detach();
	st.have_rings = false;
	st.rings_gen++;
	pending = st.pending;
	free_pending = st.free_pending;
	free_slots = st.free_slots;
	st.pending = NULL;
	st.free_pending = NULL;
	st.free_slots = NULL;
	st.pending_cap = 0;
	st.nfree_pending = 0;
	st.nfree_slots = 0;
	st.slots_cap = 0;
	st.pdev = NULL;
	spin_unlock_irqrestore(&st.lock, flags);
	wake_up_all(&tmem_wq);
	if (st.have_irq) {
		free_irq(pci_irq_vector(pdev, TMEM_VEC_COMPLETE), &st);
		pci_free_irq_vectors(pdev);
		st.have_irq = false;
	}
	kvfree(pending);
	kvfree(free_pending);
	kvfree(free_slots);
	dev_info(&pdev->dev, "device removed: cleancache ops are no-ops until a device returns\n");
	mutex_unlock(&probe_mutex);
}

static const struct pci_device_id tmem_ids[] = {
	{ PCI_DEVICE(TMEM_PCI_VENDOR, TMEM_PCI_DEVICE) },
	{ }
};
MODULE_DEVICE_TABLE(pci, tmem_ids);

static struct pci_driver tmem_driver = {
	.name = KBUILD_MODNAME,
	.id_table = tmem_ids,
	.probe = tmem_probe,
	.remove = tmem_remove,
};

static int __init tmem_init(void)
{
	int err;

	debugfs_setup();
	err = pci_register_driver(&tmem_driver);
	if (err)
		debugfs_remove_recursive(debug_dir);
	return err;
}

/* Only reachable while the cleancache ops were never registered. */
static void __exit tmem_exit(void)
{
	pci_unregister_driver(&tmem_driver);
	debugfs_remove_recursive(debug_dir);
}

module_init(tmem_init);
module_exit(tmem_exit);

MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("cleancache frontend for the tmemd host agent over ivshmem-doorbell");
