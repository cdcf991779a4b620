/* SPDX-License-Identifier: (GPL-2.0 OR MIT) */
/*
 * tmem_core_internal.h - what the files of the guest core share; not an
 * API (tmem_core.h is). The core is one mechanism in several files, each
 * one concept, and one policy file:
 *
 *   tmem_core.c         entry points, pools, the put and get paths
 *   tmem_core_ring.c    attach to the host's rings, post SQEs, reap CQEs
 *   tmem_core_window.c  read-ahead windows (batched gets, prefetched pages)
 *   tmem_core_sent.c    the sent-keys filter: could the host hold a key?
 *   tmem_core_flush.c   invalidates that are never lost: deferred
 *                       invalidates, the flush barrier, guest reset
 *   tmem_core_admit.c   admission by readahead block under the host's hint
 *   tmem_core_aside.c   policy: stand aside when tmem costs more than it
 *                       saves, probe, resume
 *
 * Contract: every function declared here runs under the core lock
 * (ops->lock), with the core bound, unless its comment says otherwise;
 * none sleeps but tmem_wait_for, which is called without the lock. Those
 * named *_unlocked read only words that the locked paths write with
 * WRITE_ONCE. Cross-file functions are named tmem_*, so that in the
 * userspace library and the module they do not collide with anybody
 * else's symbols; the public ones are tmem_core_*. The one-line accessors
 * are static inline here, so that splitting the core into files changed
 * no call on its paths.
 */
#ifndef TMEMD_GUEST_DRIVER_CORE_TMEM_CORE_INTERNAL_H_
#define TMEMD_GUEST_DRIVER_CORE_TMEM_CORE_INTERNAL_H_

#include "tmem_core.h"

/* A tag: a serial above TAG_INDEX_BITS, its pending entry's index below. */
#define TAG_INDEX_BITS 16
#define TAG_INDEX_MASK ((1ull << TAG_INDEX_BITS) - 1)
#define MAX_PENDING (1u << TAG_INDEX_BITS)
#define NO_SLOT U32_MAX

enum pool_state { POOL_UNUSED, POOL_NONE, POOL_CREATING, POOL_READY, POOL_FAILED };
/*
 * WIN_FETCHING: its GET_BATCH is in flight (the host owns the slots).
 * WIN_DELIVERING: completed, its waiter has yet to copy the first page.
 */
enum window_state { WIN_FREE, WIN_FETCHING, WIN_DELIVERING, WIN_READY };
enum waiter_state { WAIT_NONE, WAITING, DONE_HIT, DONE_MISS, ABANDONED };
enum need { NEED_PUT, NEED_GET, NEED_CONTROL, NEED_INVALIDATE };

/* --- platform ------------------------------------------------------------ */

static inline u64 now(struct tmem_core *c)
{
	return c->ops->now_ns(c->ops_ctx);
}

static inline u64 coarse_now(struct tmem_core *c)
{
	if (!c->ops->coarse_now_ns)
		return now(c);
	return c->ops->coarse_now_ns(c->ops_ctx);
}

static inline void lock(struct tmem_core *c, unsigned long *flags)
{
	c->ops->lock(c->ops_ctx, flags);
}

static inline void unlock(struct tmem_core *c, unsigned long flags)
{
	c->ops->unlock(c->ops_ctx, flags);
}

/* --- shared memory accessors ---------------------------------------------
 *
 * Memory ordering (proto/tmem_abi.h): an acquire load of a host-written
 * index or state pairs with the host's release store, so the entries, slots
 * and header fields it wrote before are visible; a release store of a guest
 * index publishes the entries and slot bytes written before it.
 */
/* Acquire: pairs with the host's release store (see above). */
#define ld_acquire(p) smp_load_acquire(p)
/* Release: publishes what was written before (see above). */
#define st_release(p, v) smp_store_release(p, v)

static inline struct tmem_shm_header *hdr(struct tmem_core *c)
{
	return (struct tmem_shm_header *)c->shm;
}

static inline u32 host_state(struct tmem_core *c)
{
	return ld_acquire(&hdr(c)->host_state);
}

static inline u64 host_gen(struct tmem_core *c)
{
	return ld_acquire(&hdr(c)->host_generation);
}

static inline u32 sq_head(struct tmem_core *c)
{
	return ld_acquire(&hdr(c)->sq_head.value);
}

static inline u32 cq_tail(struct tmem_core *c)
{
	return ld_acquire(&hdr(c)->cq_tail.value);
}

static inline u64 flush_done_seq(struct tmem_core *c)
{
	return ld_acquire(&hdr(c)->flush_done_seq);
}

/* Inside the region: slot < g.slot_count, validated to fit. */
static inline void *slot_addr(struct tmem_core *c, u32 slot)
{
	return c->shm + c->g.slots_offset + (u64)slot * TMEM_PAGE_SIZE;
}

static inline void store_guest_generation(struct tmem_core *c)
{
	st_release(&hdr(c)->guest_generation, c->guest_generation);
}

/* --- ring (tmem_core_ring.c) -------------------------------------------- */

/* The host reset or went away since we attached. */
static inline bool host_changed(struct tmem_core *c)
{
	return host_state(c) != TMEM_HOST_STATE_READY ||
	       host_gen(c) != c->host_generation;
}

/* A random guest generation, never 0 nor @previous. */
u64 tmem_new_generation(struct tmem_core *c, u64 previous);
/*
 * The host forgot every pool (a reset, a fault, a new generation): bumps the
 * epoch; a shared pool whose invalidates may be lost is wiped on rejoining.
 */
void tmem_void_pools(struct tmem_core *c, bool shared_lost_invalidates);
void tmem_detach(struct tmem_core *c);
/* Attached and usable: 0; else -ENODEV, -EAGAIN (not READY) or -EPROTO. */
int tmem_ensure_attached_err(struct tmem_core *c);

static inline bool ensure_attached(struct tmem_core *c)
{
	return tmem_ensure_attached_err(c) == 0;
}

static inline u32 in_flight(struct tmem_core *c)
{
	return c->pending_cap - c->nfree_pending;
}

/* Room in the ring (and a free entry, and a slot for a put or get)? */
bool tmem_have_room(struct tmem_core *c, enum need need);
/* Rings the host's doorbell if it sleeps (it said so in host_flags). */
void tmem_maybe_doorbell(struct tmem_core *c);

static inline void free_entry(struct tmem_core *c, u32 index)
{
	c->pending[index].tag = 0;
	c->free_pending[c->nfree_pending++] = index;
}

/*
 * Writes and publishes @sqe (room checked by the caller); returns its tag,
 * or 0 if not published (the host reset: slot and entry are free again).
 */
u64 tmem_post(struct tmem_core *c, struct tmem_sqe *sqe, u32 slot, int pool);
/* An operation the host failed: a forgotten pool is made again. */
void tmem_op_failed(struct tmem_core *c, const struct tmem_core_pending *p,
		    s32 status);
/* Takes in every completion, then what waited for them (flush, deferred). */
void tmem_reap(struct tmem_core *c);
/*
 * Without the lock: spins, then sleeps, until done(arg) (false) or the
 * get's timeout (true); counts in *interrupt_waits the sleeps it woke from.
 */
bool tmem_wait_for(struct tmem_core *c, bool (*done)(void *arg), void *arg,
		   u32 pages, u32 *interrupt_waits);

/* --- pools (tmem_core.c) -------------------------------------------------- */

static inline bool valid_handle(struct tmem_core *c, int h)
{
	return h >= 0 && h < (int)TMEM_MAX_POOLS && c->pools[h].state != POOL_UNUSED;
}

/* The host pool id of a usable pool, or -1 (then maybe starts creating it). */
int tmem_resolve(struct tmem_core *c, int h, bool create);

/* --- read-ahead windows (tmem_core_window.c) ------------------------------ */

static inline u32 window_slot(struct tmem_core *c, u32 w)
{
	return c->area_base + w * TMEM_GET_BATCH_MAX;
}

void tmem_windows_reset(struct tmem_core *c);
void tmem_windows_kill(struct tmem_core *c, int h, const u32 *oid, u64 index);
void tmem_windows_kill_host_ids(struct tmem_core *c, u64 host_id_bits);
void tmem_batch_completed(struct tmem_core *c, struct tmem_core_pending *p,
			  s32 status, u32 result);
int tmem_window_serve(struct tmem_core *c, int h, const u32 *oid, u64 index,
		      void *page, int *win);
int tmem_window_wait_serve(struct tmem_core *c, unsigned long *flags, int h,
			   const u32 *oid, u64 index, void *page, int *win);
int tmem_window_pick(struct tmem_core *c, bool take_unread);
u32 tmem_batch_size(struct tmem_core *c, int h, const u32 *oid, u64 index,
		    u32 max_pages, bool sequential);
u64 tmem_post_batch(struct tmem_core *c, int h, int id, const u32 *oid,
		    u64 index, u32 count, int win, u64 end);
void tmem_read_ahead(struct tmem_core *c, int h, const u32 *oid, u32 wi);
void tmem_publish_prefetch_counts(struct tmem_core *c);

/* --- sent-keys filter (tmem_core_sent.c) ---------------------------------- */

static inline u64 mix64(u64 x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* Hash of an object id; of a page when @index is not U64_MAX. */
static inline u64 key_hash_of(u64 oid_h, u64 index)
{
	return mix64(oid_h ^ (index * 0x9e3779b97f4a7c15ull));
}

/* Hash of an object id (no lock needed). */
u64 tmem_oid_mix(const u32 *oid);
/* The same, remembered for the next call (under the lock). */
u64 tmem_oid_hash(struct tmem_core *c, const u32 *oid);
void tmem_mark_sent(struct tmem_core *c, struct tmem_core_pool *p,
		    const u32 *oid, u64 index);
/* No lock needed: the filter's words are written with WRITE_ONCE. */
bool tmem_sent_maybe_of(const struct tmem_core_pool *p, u64 oid_h, u64 index);
void tmem_sent_clear(struct tmem_core_pool *p);
bool tmem_host_may_hold(struct tmem_core *c, int h, const u32 *oid, u64 index);
void tmem_forget_sent(struct tmem_core *c, u64 host_id_bits);
bool tmem_holds_nothing_private(struct tmem_core *c, int h);

/* --- flush barrier and invalidates (tmem_core_flush.c) -------------------- */

/* A flush of this host pool is pending or wanted: nothing of it is posted. */
static inline bool flagged(struct tmem_core *c, int host_id)
{
	return ((c->flush_bits | c->wanted_bits) >> host_id) & 1;
}

void tmem_flush_wanted(struct tmem_core *c);
void tmem_check_flush_done(struct tmem_core *c);
void tmem_post_deferred(struct tmem_core *c);
u32 tmem_deferred_clip(struct tmem_core *c, int h, const u32 *oid, u64 index,
		       u32 count);
void tmem_deferred_superseded(struct tmem_core *c, int h, const u32 *oid,
			      u64 index);
/* Never lost: posted, deferred, or covered by a flush barrier. */
void tmem_issue_invalidate(struct tmem_core *c, u8 opcode, int h,
			   int host_id, const u32 *oid, u64 index);
void tmem_drop_put(struct tmem_core *c, int h, int host_id, const u32 *oid,
		   u64 index);
void tmem_invalidate(struct tmem_core *c, u8 opcode, int h, const u32 *oid,
		     u64 index);

/* --- admission (tmem_core_admit.c) ---------------------------------------- */

/* The epoch clock: puts that asked admit(), with or without the lock. */
static inline u64 admit_clock(struct tmem_core *c)
{
	return READ_ONCE(c->admit_puts) +
	       tmem_core_counter_read(&c->puts_refused_unlocked);
}

u32 tmem_read_hint(struct tmem_core *c);
bool tmem_admit(struct tmem_core *c, const u32 *oid, u64 index);
/* Without the lock: see its comment. */
bool tmem_put_refused_unlocked(struct tmem_core *c, int h, const u32 *oid,
			       u64 index);

/* --- stand-aside policy (tmem_core_aside.c) ------------------------------- */

void tmem_sample_reset(struct tmem_core *c);
bool tmem_standing_aside(struct tmem_core *c);
u64 tmem_miss_cost(struct tmem_core *c);
void tmem_account_get(struct tmem_core *c, u64 ns, bool hit, bool single);
bool tmem_sampled_for_nothing(struct tmem_core *c, int h);
void tmem_stand_aside_unused(struct tmem_core *c);

#endif /* TMEMD_GUEST_DRIVER_CORE_TMEM_CORE_INTERNAL_H_ */
