// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * tmem_core.c - the guest ring protocol of proto/tmem_abi.h (see
 * tmem_core.h for the contract). Built into tmem_ivshmem.ko and into the
 * userspace guest library; nothing here allocates or sleeps except through
 * ops->wait in get and new_handle, with the lock released.
 */
#include "tmem_core.h"

#define TAG_INDEX_BITS 16
#define TAG_INDEX_MASK ((1ull << TAG_INDEX_BITS) - 1)
#define MAX_PENDING (1u << TAG_INDEX_BITS)
#define NO_SLOT U32_MAX
#define FEATURES_UNDERSTOOD \
	(TMEM_FEAT_SHARED_POOLS | TMEM_FEAT_ADMISSION_HINT | TMEM_FEAT_FLUSH_BARRIER)

enum pool_state { POOL_UNUSED, POOL_NONE, POOL_CREATING, POOL_READY, POOL_FAILED };
/*
 * WIN_FETCHING: its GET_BATCH is in flight (the host owns the slots).
 * WIN_DELIVERING: completed, its waiter has yet to copy the first page.
 */
enum window_state { WIN_FREE, WIN_FETCHING, WIN_DELIVERING, WIN_READY };
enum waiter_state { WAIT_NONE, WAITING, DONE_HIT, DONE_MISS, ABANDONED };
enum need { NEED_PUT, NEED_GET, NEED_CONTROL, NEED_INVALIDATE };

static void windows_reset(struct tmem_core *c);
static void sample_reset(struct tmem_core *c);
static bool sampled_for_nothing(struct tmem_core *c, int h);
static void stand_aside_unused(struct tmem_core *c);
static void batch_completed(struct tmem_core *c, struct tmem_core_pending *p,
			    s32 status, u32 result);

/* --- platform ------------------------------------------------------------ */

static u64 now(struct tmem_core *c)
{
	return c->ops->now_ns(c->ops_ctx);
}

static void sent_clear(struct tmem_core_pool *p);

static u64 coarse_now(struct tmem_core *c)
{
	if (!c->ops->coarse_now_ns)
		return now(c);
	return c->ops->coarse_now_ns(c->ops_ctx);
}

static void lock(struct tmem_core *c, unsigned long *flags)
{
	c->ops->lock(c->ops_ctx, flags);
}

static void unlock(struct tmem_core *c, unsigned long flags)
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

static u32 host_state(struct tmem_core *c)
{
	return ld_acquire(&hdr(c)->host_state);
}

static u64 host_gen(struct tmem_core *c)
{
	return ld_acquire(&hdr(c)->host_generation);
}

static u32 sq_head(struct tmem_core *c)
{
	return ld_acquire(&hdr(c)->sq_head.value);
}

static u32 cq_tail(struct tmem_core *c)
{
	return ld_acquire(&hdr(c)->cq_tail.value);
}

static u64 flush_done_seq(struct tmem_core *c)
{
	return ld_acquire(&hdr(c)->flush_done_seq);
}

/* Inside the region: slot < g.slot_count, validated to fit. */
static void *slot_addr(struct tmem_core *c, u32 slot)
{
	return c->shm + c->g.slots_offset + (u64)slot * TMEM_PAGE_SIZE;
}

static int read_geometry(struct tmem_core *c, struct tmem_core_geometry *g)
{
	struct tmem_shm_header *h = hdr(c);
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
	g->host_peer_id = READ_ONCE(h->host_peer_id);
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
	if (header_size != sizeof(struct tmem_shm_header) ||
	    region_size != c->shm_size)
		return -EPROTO;
	sq_end = (u64)g->sq_offset + (u64)g->sq_entries * sizeof(struct tmem_sqe);
	cq_end = (u64)g->cq_offset + (u64)g->cq_entries * sizeof(struct tmem_cqe);
	slots_end = (u64)g->slots_offset + (u64)g->slot_count * TMEM_PAGE_SIZE;
	if (!is_power_of_2(g->sq_entries) || !is_power_of_2(g->cq_entries) ||
	    g->slot_count == 0 || g->sq_offset < sizeof(struct tmem_shm_header) ||
	    g->sq_offset % 8 || g->cq_offset < sq_end || g->cq_offset % 8 ||
	    g->slots_offset < cq_end || slots_end > c->shm_size ||
	    (u64)g->sq_entries + g->cq_entries > MAX_PENDING ||
	    g->host_peer_id > 0xffff)
		return -EPROTO;
	return 0;
}

/* --- channel state ------------------------------------------------------- */

static bool host_changed(struct tmem_core *c)
{
	return host_state(c) != TMEM_HOST_STATE_READY ||
	       host_gen(c) != c->host_generation;
}

static u64 new_generation(struct tmem_core *c, u64 previous)
{
	u64 g;

	do {
		g = c->ops->random_u64(c->ops_ctx);
	} while (g == 0 || g == previous);
	return g;
}

static void void_pools(struct tmem_core *c, bool shared_lost_invalidates)
{
	u32 i;

	c->epoch++;
	c->ndeferred = 0; /* the host forgets every pool: nothing to kill */
	for (i = 0; i < TMEM_MAX_POOLS; i++) {
		struct tmem_core_pool *p = &c->pools[i];

		if (p->state == POOL_UNUSED)
			continue;
		/*
		 * Other members keep a shared pool (and this VM's pages in it)
		 * alive: if our invalidates may have been lost with the ring,
		 * wipe the pool when we join it again.
		 */
		if (shared_lost_invalidates && p->shared && p->state != POOL_NONE)
			p->inval_on_ready = true;
		p->state = POOL_NONE;
	}
}

static void reset_pending(struct tmem_core *c)
{
	u32 i;

	c->rings_gen++;
	for (i = 0; i < c->pending_cap; i++)
		c->pending[i].tag = 0;
	c->nfree_pending = 0;
	for (i = c->pending_cap; i > 0; i--)
		c->free_pending[c->nfree_pending++] = i - 1;
	c->nfree_slots = 0;
	for (i = c->area_base; i > 0; i--)
		c->free_slots[c->nfree_slots++] = i - 1;
	windows_reset(c);
}

static void store_guest_generation(struct tmem_core *c)
{
	st_release(&hdr(c)->guest_generation, c->guest_generation);
}

static int attach(struct tmem_core *c)
{
	struct tmem_core_geometry g;
	const struct tmem_core_config *cfg = c->cfg;
	bool same_rings;
	u32 avail;
	int err;

	err = read_geometry(c, &g);
	if (err)
		return err;
	same_rings = c->have_rings && g.host_generation == c->rings_generation &&
		     g.sq_entries == c->g.sq_entries &&
		     g.cq_entries == c->g.cq_entries &&
		     g.slot_count == c->g.slot_count;
	if (same_rings && c->broken)
		return -EAGAIN; /* the host has not reset the rings it corrupted */
	if (!same_rings) {
		/*
		 * New rings: the host executes none of our old entries any
		 * more, so every slot and tag is free again.
		 */
		c->g = g;
		c->pending_cap = min(g.sq_entries + g.cq_entries, c->pending_max);
		avail = min(g.slot_count, c->slots_max);
		/*
		 * The prefetch area: whole windows above the ordinary slots,
		 * at most half of all, only if the host offers GET_BATCH.
		 * Ordinary slots: at most one per entry in flight.
		 */
		c->nwin = 0;
		if ((g.features_host & TMEM_FEAT_GET_BATCH) && cfg->batch_pages > 1)
			c->nwin = min3(cfg->prefetch_windows, TMEM_CORE_MAX_WINDOWS,
				       avail / 2 / TMEM_GET_BATCH_MAX);
		c->slots_usable = min(avail - c->nwin * TMEM_GET_BATCH_MAX, c->pending_cap);
		c->area_base = c->slots_usable;
		reset_pending(c);
		c->reserve = cfg->invalidate_reserve ? cfg->invalidate_reserve :
			     max(1u, g.sq_entries / 8);
		c->reserve = min(c->reserve, g.sq_entries - 1);
		c->doorbell_batch = cfg->doorbell_batch ? cfg->doorbell_batch :
				    max(1u, min(g.sq_entries, c->slots_usable) / 16);
		c->unrung = 0;
		/* Adopt the tail the host (re)wrote, repaired if impossible. */
		c->sq_tail = READ_ONCE(hdr(c)->sq_tail.value);
		if (c->sq_tail - sq_head(c) > g.sq_entries) {
			c->sq_tail = sq_head(c);
			st_release(&hdr(c)->sq_tail.value, c->sq_tail);
		}
		/*
		 * Completions already there belong to a previous guest; a
		 * random serial keeps later ones for its entries from matching.
		 */
		c->cq_head = cq_tail(c);
		st_release(&hdr(c)->cq_head.value, c->cq_head);
		c->next_serial = (c->ops->random_u64(c->ops_ctx) >> 32) | 1;
		c->flush_bits = 0;
		c->wanted_bits = 0;
		c->flush_seq = 0;
		c->consecutive_timeouts = 0;
		c->stalled_until_ns = 0;
		c->have_rings = true;
		c->rings_generation = g.host_generation;
	}
	c->g.host_peer_id = g.host_peer_id;
	st_release(&hdr(c)->guest_flags, c->aside ? TMEM_GUEST_STANDING_ASIDE : 0);
	c->features = g.features_host & FEATURES_UNDERSTOOD;
	if (c->nwin)
		c->features |= g.features_host & TMEM_FEAT_GET_BATCH;
	st_release(&hdr(c)->features_guest, c->features);
	WRITE_ONCE(hdr(c)->guest_ram_pages, cfg->ram_pages);
	/* A fresh generation: the host forgets whatever this VM had. */
	c->guest_generation = new_generation(c, c->guest_generation);
	store_guest_generation(c);
	c->host_generation = g.host_generation;
	/* The new generation: the host holds nothing. */
	WRITE_ONCE(c->private_sent, false);
	c->attached = true;
	c->broken = false;
	void_pools(c, false);
	return 0;
}

static void detach(struct tmem_core *c)
{
	c->attached = false;
	c->c.host_resets_seen++;
	/* The host may have discarded entries we posted. */
	void_pools(c, true);
	c->wanted_bits = 0;
}

/* Attached and usable: 0; else -ENODEV, -EAGAIN (not READY) or -EPROTO. */
static int ensure_attached_err(struct tmem_core *c)
{
	int err;

	if (!c->present)
		return -ENODEV;
	if (c->attached) {
		if (!host_changed(c))
			return c->broken ? -EAGAIN : 0;
		detach(c);
	}
	if (host_state(c) != TMEM_HOST_STATE_READY)
		return -EAGAIN;
	err = attach(c);
	if (err == -EPROTO)
		c->c.errors++;
	return err;
}

static bool ensure_attached(struct tmem_core *c)
{
	return ensure_attached_err(c) == 0;
}

static void host_fault(struct tmem_core *c)
{
	/* A reset rewrites indices after RESET: that is a host change. */
	if (host_changed(c)) {
		detach(c);
		return;
	}
	c->c.errors++;
	c->broken = true;
	void_pools(c, true);
}

/* --- ring ---------------------------------------------------------------- */

static u32 in_flight(struct tmem_core *c)
{
	return c->pending_cap - c->nfree_pending;
}

static bool have_room(struct tmem_core *c, enum need need)
{
	u32 used, limit;

	if (!c->attached || c->broken || c->nfree_pending == 0)
		return false;
	if ((need == NEED_PUT || need == NEED_GET) && c->nfree_slots == 0)
		return false; /* a GET_BATCH brings its slots: NEED_CONTROL */
	used = c->sq_tail - sq_head(c);
	if (used > c->g.sq_entries) {
		host_fault(c);
		return false;
	}
	limit = need == NEED_INVALIDATE ? c->g.sq_entries :
		c->g.sq_entries - c->reserve;
	return used < limit;
}

static void maybe_doorbell(struct tmem_core *c)
{
	smp_mb(); /* publish sq_tail before reading host_flags (Dekker) */
	if (READ_ONCE(hdr(c)->host_flags) & TMEM_HOST_NEEDS_DOORBELL) {
		c->ops->doorbell(c->ops_ctx,
				 (c->g.host_peer_id << 16) | TMEM_VEC_SUBMIT);
		c->c.doorbells++;
	}
	c->unrung = 0;
}

/*
 * Nothing waits for a put or an invalidate: a sleeping host is woken once
 * per doorbell_batch of them (a doorbell is a VM exit); its timer re-check
 * or the next waited-on entry (ring order) takes the rest.
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

static void free_entry(struct tmem_core *c, u32 index)
{
	c->pending[index].tag = 0;
	c->free_pending[c->nfree_pending++] = index;
}

/* Writes and publishes @sqe; returns its tag, or 0 if not published. */
static u64 post(struct tmem_core *c, struct tmem_sqe *sqe, u32 slot, int pool)
{
	u32 index = c->free_pending[--c->nfree_pending];
	u64 tag = (c->next_serial++ << TAG_INDEX_BITS) | index;
	struct tmem_core_pending *p = &c->pending[index];
	struct tmem_sqe *at;

	p->tag = tag;
	p->opcode = sqe->opcode;
	p->slot = slot;
	p->pool = pool;
	p->incarnation = pool >= 0 ? c->pools[pool].incarnation : 0;
	p->epoch = c->epoch;
	p->waiter = WAIT_NONE;
	sqe->tag = tag;
	at = (struct tmem_sqe *)(c->shm + c->g.sq_offset) +
	     (c->sq_tail & (c->g.sq_entries - 1));
	memcpy(at, sqe, sizeof(*sqe));
	if (host_changed(c)) {
		/*
		 * A reset rewrote sq_tail: never store an old-based tail over
		 * it. Unpublished, the entry is nobody's.
		 */
		free_entry(c, index);
		if (slot != NO_SLOT)
			c->free_slots[c->nfree_slots++] = slot;
		return 0;
	}
	c->sq_tail++;
	st_release(&hdr(c)->sq_tail.value, c->sq_tail);
	c->c.sqes_posted++;
	if (waited_on(sqe) || ++c->unrung >= c->doorbell_batch) {
		maybe_doorbell(c);
	} else {
		/* Only a counter hangs on this read: no Dekker barrier needed. */
		if (READ_ONCE(hdr(c)->host_flags) & TMEM_HOST_NEEDS_DOORBELL)
			c->c.doorbells_deferred++;
		else
			c->unrung = 0; /* the host is polling: it sees them */
	}
	return tag;
}

static void op_failed(struct tmem_core *c, const struct tmem_core_pending *p,
		      s32 status)
{
	struct tmem_core_pool *pool;

	if (p->epoch != c->epoch)
		return; /* from before a reset: the host forgot those pools */
	c->c.errors++;
	if (status == TMEM_ERR_NOENT && p->pool >= 0) {
		/* The host forgot this pool: make it again on next use. */
		pool = &c->pools[p->pool];
		if (pool->state == POOL_READY &&
		    pool->incarnation == p->incarnation)
			pool->state = POOL_NONE;
	}
}

static void complete_cqe(struct tmem_core *c, const struct tmem_cqe *cqe)
{
	u64 index = cqe->tag & TAG_INDEX_MASK;
	struct tmem_core_pending *p;
	struct tmem_core_pool *pool;
	s32 status = cqe->status;
	u32 result = cqe->result;

	if (cqe->tag == 0 || index >= c->pending_cap ||
	    c->pending[index].tag != cqe->tag) {
		c->c.stale_completions++;
		return;
	}
	c->c.completions_reaped++;
	p = &c->pending[index];
	switch (p->opcode) {
	case TMEM_OP_PUT:
		/* The host copied the page out before completing. */
		c->free_slots[c->nfree_slots++] = p->slot;
		if (status == TMEM_ERR_DROPPED)
			c->c.puts_dropped_by_host++;
		else if (status != TMEM_OK)
			op_failed(c, p, status);
		free_entry(c, index);
		break;
	case TMEM_OP_GET:
		if (status == TMEM_OK && result > 1)
			c->c.errors++;
		else if (status != TMEM_OK)
			op_failed(c, p, status);
		if (p->waiter == WAITING) {
			/* The waiter copies the page and frees slot and entry. */
			p->waiter = (status == TMEM_OK && result == 1) ?
				    DONE_HIT : DONE_MISS;
			break;
		}
		/* A timed-out get's page is simply not delivered. */
		c->free_slots[c->nfree_slots++] = p->slot;
		free_entry(c, index);
		break;
	case TMEM_OP_GET_BATCH:
		if (p->waiter == WAITING) {
			/* The waiter copies its page and frees the entry. */
			batch_completed(c, p, status, result);
			break;
		}
		batch_completed(c, p, status, result);
		free_entry(c, index);
		break;
	case TMEM_OP_NEW_POOL:
		pool = &c->pools[p->pool];
		/* Voided (reset) or superseded since it was posted: ignore. */
		if (pool->state == POOL_CREATING && pool->create_tag == cqe->tag) {
			if (status == TMEM_OK && result < TMEM_MAX_POOLS) {
				pool->state = POOL_READY;
				pool->host_id = result;
				pool->incarnation = c->next_incarnation++;
				/* A private pool is born empty. */
				if (pool->sent)
					sent_clear(pool);
				c->c.pools_created++;
			} else {
				pool->state = POOL_FAILED;
				/*
				 * Hostile input: only a negative status is a
				 * refusal; new_handle returns it as an error.
				 */
				pool->refusal = status < 0 ? status : TMEM_ERR_INVAL;
				pool->retry_after_ns = now(c) +
						       READ_ONCE(c->cfg->pool_retry_ns);
				c->c.errors++;
			}
		}
		free_entry(c, index);
		break;
	default:
		if (status != TMEM_OK)
			op_failed(c, p, status);
		free_entry(c, index);
		break;
	}
}

/* --- prefetch windows (batched gets) -------------------------------------- */

static u32 window_slot(struct tmem_core *c, u32 w)
{
	return c->area_base + w * TMEM_GET_BATCH_MAX;
}

/* Forgets a readable window's pages (a delivering one stays in use). */
static void window_drop(struct tmem_core *c, struct tmem_core_window *w)
{
	c->c.prefetch_unused += hweight32(w->present);
	w->present = 0;
	w->missing = 0;
	if (w->state == WIN_READY)
		w->state = WIN_FREE;
}

/* New rings: the host uses none of the slots any more. */
static void windows_reset(struct tmem_core *c)
{
	u32 i;

	for (i = 0; i < TMEM_CORE_MAX_WINDOWS; i++) {
		c->c.prefetch_unused += hweight32(c->win[i].present);
		c->win[i].present = 0;
		c->win[i].missing = 0;
		c->win[i].state = WIN_FREE;
	}
}

static bool flagged(struct tmem_core *c, int host_id);

static bool same_oid(const u32 *a, const u32 *b)
{
	return !memcmp(a, b, TMEM_OBJECT_WORDS * sizeof(u32));
}

/*
 * Drops what the windows know of handle h's key (oid, index), of its object
 * (index U64_MAX), or of the whole pool (oid NULL): every put and invalidate
 * calls this before anything else, so no get can read a prefetched copy
 * that a later put or invalidate made stale. A window still fetching
 * remembers it and drops those pages when its CQE comes.
 */
static void windows_kill(struct tmem_core *c, int h, const u32 *oid, u64 index)
{
	struct tmem_core_window *w;
	u32 i, bit;

	for (i = 0; i < c->nwin; i++) {
		w = &c->win[i];
		if (w->state == WIN_FREE || w->pool != h)
			continue;
		if (oid && !same_oid(w->oid, oid))
			continue;
		if (!oid || index == U64_MAX) {
			if (w->state == WIN_FETCHING)
				w->doomed = true;
			else
				window_drop(c, w);
			continue;
		}
		if (index < w->first || index - w->first >= w->count)
			continue;
		bit = 1u << (index - w->first);
		if (w->state == WIN_FETCHING) {
			w->killed |= bit;
		} else {
			if (w->present & bit)
				c->c.prefetch_unused++;
			w->present &= ~bit;
			w->missing &= ~bit;
		}
	}
}

/* Pools flushed by host id (barrier, INVAL_POOL from flush_wanted). */
static void windows_kill_host_ids(struct tmem_core *c, u64 host_id_bits)
{
	u32 i;
	int h;

	for (i = 0; i < c->nwin; i++) {
		h = c->win[i].pool;
		if (c->win[i].state != WIN_FREE && h >= 0 &&
		    c->pools[h].state == POOL_READY &&
		    ((host_id_bits >> c->pools[h].host_id) & 1))
			windows_kill(c, h, NULL, 0);
	}
}

/* A GET_BATCH's CQE: the window becomes readable, or is dropped. */
static void batch_completed(struct tmem_core *c, struct tmem_core_pending *p,
			    s32 status, u32 result)
{
	struct tmem_core_window *w = &c->win[p->slot];
	u32 mask = w->count >= 32 ? ~0u : (1u << w->count) - 1;
	u32 bits = status == TMEM_OK ? result & mask : 0;
	struct tmem_core_pool *pool = &c->pools[w->pool];
	u32 first;
	bool valid;

	if (status != TMEM_OK)
		op_failed(c, p, status);
	/* A host that refuses batches gets plain gets from now on. */
	if (status == TMEM_ERR_INVAL)
		c->features &= ~TMEM_FEAT_GET_BATCH;
	if (status == TMEM_OK && (result & ~mask))
		c->c.errors++; /* hits outside the window: ignored */
	/* A read-ahead has no waiter: its first page is prefetched too. */
	first = p->waiter == WAIT_NONE ? 0 : 1u;
	if (p->waiter == WAITING)
		p->waiter = (bits & 1) ? DONE_HIT : DONE_MISS;
	/* Else the first page is the waiter's (or nobody's, if it gave up). */
	if (first && p->waiter != DONE_HIT && (bits & 1))
		c->c.prefetch_unused++;
	bits &= ~first;
	valid = !w->doomed && w->epoch == c->epoch && pool->state == POOL_READY &&
		pool->incarnation == w->incarnation && c->attached && !c->broken;
	if (!valid) {
		c->c.prefetch_unused += hweight32(bits);
		bits = 0;
	}
	c->c.prefetch_unused += hweight32(bits & w->killed);
	w->present = bits & ~w->killed;
	w->missing = valid ? ~bits & mask & ~w->killed & ~first : 0;
	/* Until the waiter copied its page, the window's slot 0 is in use. */
	if (p->waiter == DONE_HIT || p->waiter == DONE_MISS)
		w->state = WIN_DELIVERING;
	else
		w->state = (w->present | w->missing) ? WIN_READY : WIN_FREE;
}

/* A window of handle h (any state but free) whose range holds the key. */
static bool window_covers(const struct tmem_core_window *w, int h,
			  const u32 *oid, u64 index)
{
	return w->state != WIN_FREE && w->pool == h && index >= w->first &&
	       index - w->first < w->count && same_oid(w->oid, oid);
}

/*
 * Serves a get from a window: 1 hit (page copied), 0 a remembered miss,
 * -1 the windows know nothing of this key, -2 a window being filled by a
 * read-ahead holds it (wait for it, then ask again). *win: the window.
 */
static int window_serve(struct tmem_core *c, int h, const u32 *oid, u64 index,
			void *page, int *win)
{
	struct tmem_core_pool *pool = &c->pools[h];
	struct tmem_core_window *w;
	int filling = -1;
	u32 i, k;

	for (i = 0; i < c->nwin; i++) {
		w = &c->win[i];
		if (!window_covers(w, h, oid, index))
			continue;
		if (w->state == WIN_FETCHING && !w->doomed &&
		    !(w->killed & (1u << (index - w->first))) &&
		    c->pending[w->tag & TAG_INDEX_MASK].tag == w->tag &&
		    c->pending[w->tag & TAG_INDEX_MASK].waiter == WAIT_NONE)
			filling = i;
		if (w->state != WIN_READY)
			continue;
		if (w->epoch != c->epoch || pool->state != POOL_READY ||
		    pool->incarnation != w->incarnation || flagged(c, pool->host_id)) {
			/* A reset, re-created pool or flush: all of it is void. */
			window_drop(c, w);
			continue;
		}
		k = index - w->first;
		w->lru = ++c->lru_clock;
		if (w->present & (1u << k)) {
			/* Exclusive: the host forgot it; this copy is the last. */
			c->ops->copy_from_slot(c->ops_ctx, page,
					       slot_addr(c, window_slot(c, i) + k));
			w->present &= ~(1u << k);
			c->c.prefetch_used++;
			*win = i;
			return 1;
		}
		if (w->missing & (1u << k)) {
			w->missing &= ~(1u << k);
			c->c.gets_negative_cached++;
			*win = i;
			return 0;
		}
	}
	*win = filling;
	return filling >= 0 ? -2 : -1;
}

/*
 * A window to fetch into: a free one, else with take_unread the least
 * recently used readable one (its unread pages dropped), without it one
 * read out (nothing unread: another reader's pages stay); or -1.
 */
static int window_pick(struct tmem_core *c, bool take_unread)
{
	struct tmem_core_window *w;
	int best = -1;
	u32 i;

	for (i = 0; i < c->nwin; i++) {
		w = &c->win[i];
		if (w->state == WIN_FREE)
			return i;
		if (w->state != WIN_READY)
			continue;
		if (!take_unread && !(w->present | w->missing))
			return i;
		if (take_unread && (best < 0 || w->lru < c->win[best].lru))
			best = i;
	}
	if (best >= 0)
		window_drop(c, &c->win[best]);
	return best;
}

static void flush_wanted(struct tmem_core *c);
static void post_deferred(struct tmem_core *c);

static void reap(struct tmem_core *c)
{
	u32 tail;
	struct tmem_cqe cqe;
	const struct tmem_cqe *ring;

	if (!c->attached || c->broken)
		return;
	tail = cq_tail(c);
	if (tail - c->cq_head > c->g.cq_entries) {
		host_fault(c);
		return;
	}
	if (tail != c->cq_head) {
		ring = (const struct tmem_cqe *)(c->shm + c->g.cq_offset);
		while (c->cq_head != tail) {
			/* One copy: validated below as a snapshot. */
			memcpy(&cqe, &ring[c->cq_head & (c->g.cq_entries - 1)],
			       sizeof(cqe));
			c->cq_head++;
			complete_cqe(c, &cqe);
		}
		/* As in post: never write an old-based index over a reset. */
		if (host_changed(c))
			return;
		st_release(&hdr(c)->cq_head.value, c->cq_head);
	}
	if (c->flush_bits && flush_done_seq(c) == c->flush_seq) {
		WRITE_ONCE(hdr(c)->flush_request, 0);
		c->flush_bits = 0;
	}
	flush_wanted(c);
	if (c->ndeferred)
		post_deferred(c);
}

/* --- pools --------------------------------------------------------------- */

static void start_create(struct tmem_core *c, int h)
{
	struct tmem_core_pool *p = &c->pools[h];
	struct tmem_sqe sqe = {};
	u64 tag;

	if (p->shared && !(c->features & TMEM_FEAT_SHARED_POOLS)) {
		p->state = POOL_FAILED;
		p->refusal = TMEM_ERR_PERM;
		p->retry_after_ns = now(c) + READ_ONCE(c->cfg->pool_retry_ns);
		return;
	}
	if (!have_room(c, NEED_CONTROL)) {
		reap(c);
		if (!have_room(c, NEED_CONTROL))
			return; /* next use tries again */
	}
	sqe.opcode = TMEM_OP_NEW_POOL;
	/* IRQ: init_fs may be waiting for it. */
	sqe.flags = TMEM_SQE_F_IRQ | (p->shared ? TMEM_SQE_F_SHARED : 0);
	if (p->shared)
		memcpy(sqe.oid, p->uuid, sizeof(p->uuid));
	tag = post(c, &sqe, NO_SLOT, h);
	if (!tag)
		return;
	p->state = POOL_CREATING;
	p->create_tag = tag;
}

static bool valid_handle(struct tmem_core *c, int h)
{
	return h >= 0 && h < (int)TMEM_MAX_POOLS && c->pools[h].state != POOL_UNUSED;
}

static void issue_invalidate(struct tmem_core *c, u8 opcode, int h,
			     int host_id, const u32 *oid, u64 index);

/* The host pool id of a usable pool, or -1 (then maybe starts creating it). */
static int resolve(struct tmem_core *c, int h, bool create)
{
	struct tmem_core_pool *p;

	if (!valid_handle(c, h)) {
		c->c.errors++; /* a caller bug: no such handle */
		return -1;
	}
	p = &c->pools[h];
	switch (p->state) {
	case POOL_READY:
		if (p->inval_on_ready) {
			p->inval_on_ready = false;
			issue_invalidate(c, TMEM_OP_INVAL_POOL, h, p->host_id,
					 NULL, 0);
			/* A reap in there may have voided the pool again. */
			if (p->state != POOL_READY)
				return -1;
		}
		return p->host_id;
	case POOL_NONE:
		if (create)
			start_create(c, h);
		return -1;
	case POOL_FAILED:
		if (create && now(c) >= p->retry_after_ns)
			start_create(c, h);
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

static u64 oid_mix(const u32 *oid)
{
	u64 h = 0;
	u32 i;

	for (i = 0; i < TMEM_OBJECT_WORDS; i += 2)
		h = mix64(h ^ (oid[i] | (u64)oid[i + 1] << 32));
	return h;
}

/* Hash of an object id, remembered for the next call (under the lock). */
static u64 oid_hash(struct tmem_core *c, const u32 *oid)
{
	u64 h;

	if (c->hashed_valid && !memcmp(c->hashed_oid, oid, sizeof(c->hashed_oid)))
		return c->hashed_oid_hash;
	h = oid_mix(oid);
	memcpy(c->hashed_oid, oid, sizeof(c->hashed_oid));
	c->hashed_oid_hash = h;
	c->hashed_valid = true;
	return h;
}

/* Hash of an object id; of a page when @index is not U64_MAX. */
static u64 key_hash_of(u64 oid_h, u64 index)
{
	return mix64(oid_h ^ (index * 0x9e3779b97f4a7c15ull));
}

/*
 * Where a key's bits lie in a pool's sent-keys filter. SENT_RUN_PAGES
 * consecutive pages of an object share one SENT_LINE_BITS line (a cache
 * line), picked by a hash of the object and index / SENT_RUN_PAGES; the
 * key picks its SENT_KEY_BITS bits inside that line. A reader going
 * through a file touches one line per run of pages instead of two random
 * words per page: the filter (128 KiB by default) does not stay cached
 * beside the page cache's traffic, and in a profile of the scenario's
 * streaming guest nearly all of the frontend's time per page-cache miss
 * was the load of a filter word. Runs arrive in clumps (admission is by
 * blocks), so lines fill unevenly: four bits per key keep the false
 * positives (each one a get that waits for the host to miss) below a flat
 * two-bit filter's at the same load. The object marker (index U64_MAX) is
 * a key of its own: its line hash cannot equal a run's (index / RUN_PAGES
 * stays below U64_MAX / RUN_PAGES).
 */
#define SENT_LINE_BITS 512u
#define SENT_RUN_PAGES 8u
#define SENT_KEY_BITS 4

struct sent_pos {
	unsigned long *line;
	u32 bit[SENT_KEY_BITS];
};

static struct sent_pos sent_pos(const struct tmem_core_pool *p, u64 oid_h,
				u64 index)
{
	u64 line_bits = min_t(u64, p->sent_bits, SENT_LINE_BITS);
	u64 run = index == U64_MAX ? U64_MAX : index / SENT_RUN_PAGES;
	u64 line = key_hash_of(oid_h, run);
	/*
	 * The bits within the line: the top bits of a multiplicative hash of
	 * the line's hash and the page (one multiply; the line hash is
	 * already mixed).
	 */
	u64 key = ((line >> 32) ^ index) * 0x9e3779b97f4a7c15ull;
	struct sent_pos pos;
	int i;

	pos.line = p->sent + ((line * line_bits) & (p->sent_bits - 1)) /
				     BITS_PER_LONG;
	for (i = 0; i < SENT_KEY_BITS; i++)
		pos.bit[i] = (key >> (55 - 9 * i)) & (line_bits - 1);
	return pos;
}

/*
 * The filter's words are read without the lock (sent_maybe_of) and written
 * only under it, each word with one store: a reader sees a word before or
 * after another key's bits were added, and its own key's bits cannot
 * change under it (the page cache orders a key's put and its get).
 */
static void mark_sent(struct tmem_core *c, struct tmem_core_pool *p,
		      const u32 *oid, u64 index)
{
	struct sent_pos pos;
	unsigned long *word;
	int i;

	if (!p->sent)
		return;
	pos = sent_pos(p, oid_hash(c, oid), index);
	for (i = 0; i < SENT_KEY_BITS; i++) {
		word = &pos.line[pos.bit[i] / BITS_PER_LONG];
		WRITE_ONCE(*word, READ_ONCE(*word) |
					  1ul << (pos.bit[i] % BITS_PER_LONG));
	}
}

static bool sent_maybe_of(const struct tmem_core_pool *p, u64 oid_h, u64 index)
{
	struct sent_pos pos;
	int i;

	if (!p->sent)
		return true;
	pos = sent_pos(p, oid_h, index);
	for (i = 0; i < SENT_KEY_BITS; i++)
		if (!((READ_ONCE(pos.line[pos.bit[i] / BITS_PER_LONG]) >>
		       (pos.bit[i] % BITS_PER_LONG)) & 1))
			return false;
	return true;
}

static bool maybe_sent(struct tmem_core *c, const struct tmem_core_pool *p,
		       const u32 *oid, u64 index)
{
	return sent_maybe_of(p, oid_hash(c, oid), index);
}

/* Empties a pool's filter, word by word (lockless readers: see mark_sent). */
static void sent_clear(struct tmem_core_pool *p)
{
	u32 i;

	for (i = 0; i < p->sent_bits / BITS_PER_LONG; i++)
		WRITE_ONCE(p->sent[i], 0);
}

/* Could the host hold this page (index) or object (index U64_MAX)? */
static bool host_may_hold(struct tmem_core *c, int h, const u32 *oid, u64 index)
{
	struct tmem_core_pool *p = &c->pools[h];

	/* Shared pools: other VMs' puts of a key are invisible to us. */
	return p->shared || maybe_sent(c, p, oid, index);
}

/*
 * The host holds nothing of these pools any more (or will not, before any
 * later op reaches them): their filters start empty.
 */
static void forget_sent(struct tmem_core *c, u64 host_id_bits)
{
	u32 i;

	for (i = 0; i < TMEM_MAX_POOLS; i++) {
		struct tmem_core_pool *p = &c->pools[i];

		if (p->state == POOL_READY && p->sent &&
		    ((host_id_bits >> p->host_id) & 1))
			sent_clear(p);
	}
}

/* --- flush barrier and invalidates ---------------------------------------- */

static bool flagged(struct tmem_core *c, int host_id)
{
	return ((c->flush_bits | c->wanted_bits) >> host_id) & 1;
}

static void guest_reset(struct tmem_core *c, u64 lost_bits)
{
	u32 i;

	/*
	 * Last resort for an invalidate that cannot be queued or barriered: a
	 * new guest generation makes the host forget this VM. A shared pool
	 * outlives us on the host: wipe it when it is joined again.
	 */
	lost_bits |= c->wanted_bits;
	for (i = 0; i < TMEM_MAX_POOLS; i++) {
		struct tmem_core_pool *p = &c->pools[i];

		if (p->shared && p->state == POOL_READY &&
		    ((lost_bits >> p->host_id) & 1))
			p->inval_on_ready = true;
	}
	c->guest_generation = new_generation(c, c->guest_generation);
	store_guest_generation(c);
	c->c.guest_resets++;
	void_pools(c, false);
	c->wanted_bits = 0;
	maybe_doorbell(c);
}

static void request_flush(struct tmem_core *c, u64 bits)
{
	u64 seq;

	if (!(c->features & TMEM_FEAT_FLUSH_BARRIER)) {
		guest_reset(c, bits);
		return;
	}
	/*
	 * Flagged from now on: nothing of these pools is posted until a
	 * barrier or INVAL_POOL ahead in ring order has wiped them.
	 */
	forget_sent(c, bits);
	windows_kill_host_ids(c, bits);
	if (c->flush_bits) {
		/*
		 * One barrier at a time: the host acks a seq, not bits, so bits
		 * added to a barrier being completed could be acked unflushed.
		 */
		c->wanted_bits |= bits;
		return;
	}
	seq = c->sq_tail;
	if (seq == flush_done_seq(c)) {
		/* The host would take it as done: never risk a lost invalidate. */
		guest_reset(c, bits);
		return;
	}
	WRITE_ONCE(hdr(c)->flush_request, READ_ONCE(hdr(c)->flush_request) | bits);
	/* Release: a host that acquires the seq also sees the bits. */
	st_release(&hdr(c)->flush_request_seq, seq);
	c->flush_bits = bits;
	c->flush_seq = seq;
	maybe_doorbell(c);
}

/* Pools that needed a flush while one was pending, right after a reap. */
static void flush_wanted(struct tmem_core *c)
{
	u64 bits;
	struct tmem_sqe sqe;

	if (c->flush_bits || !c->wanted_bits || !c->attached || c->broken)
		return;
	bits = c->wanted_bits;
	c->wanted_bits = 0;
	while (bits) {
		int id = __ffs64(bits);

		if (!have_room(c, NEED_INVALIDATE)) {
			if (c->attached && !c->broken)
				request_flush(c, bits);
			return;
		}
		memset(&sqe, 0, sizeof(sqe));
		sqe.opcode = TMEM_OP_INVAL_POOL;
		sqe.pool = id;
		post(c, &sqe, NO_SLOT, -1);
		forget_sent(c, 1ull << id);
		bits &= bits - 1;
	}
}

static void check_flush_done(struct tmem_core *c)
{
	if (c->flush_bits && flush_done_seq(c) == c->flush_seq) {
		/* Acked: the host ignores the bits until the seq moves again. */
		WRITE_ONCE(hdr(c)->flush_request, 0);
		c->flush_bits = 0;
	}
	if (!c->flush_bits && c->wanted_bits)
		reap(c);
}

/* Ring full: give a busy host a few microseconds (IRQs may be off). */
static bool wait_for_room(struct tmem_core *c)
{
	u64 deadline = now(c) + READ_ONCE(c->cfg->ring_full_spin_ns);

	while (now(c) < deadline) {
		cpu_relax();
		reap(c);
		if (!c->attached || c->broken)
			return false;
		if (have_room(c, NEED_INVALIDATE))
			return true;
	}
	return false;
}

/*
 * Deferred invalidates. A dropped put of a key the host may hold, like a
 * page invalidate, must kill the host's copy. When not even the invalidate
 * reserve has room, its INVAL_PAGE waits in c->deferred (at most
 * cfg->deferred_invalidates) and is posted at the next reap that finds
 * room. Until then a get of that key misses locally and no batch reaches
 * it (batch_size); a put of the key that reaches the ring supersedes it
 * (the host replaces its page in ring order). A deferred invalidate dies
 * with its pool's incarnation or the core's epoch (the host forgot the
 * pool) and under a pending flush of its pool (the barrier kills it).
 * Only past the bound does the pool fall back to the flush barrier: before
 * this, a burst of puts (drop_caches, a large read) into a host slower
 * than the guest turned a few dropped puts into a flush of the whole pool.
 */
static bool deferred_live(struct tmem_core *c,
			  const struct tmem_core_deferred_invalidate *d)
{
	const struct tmem_core_pool *p = &c->pools[d->h];

	return d->epoch == c->epoch && p->state == POOL_READY &&
	       p->incarnation == d->incarnation && !flagged(c, p->host_id);
}

static bool defer_invalidate(struct tmem_core *c, int h, const u32 *oid,
			     u64 index)
{
	struct tmem_core_deferred_invalidate *d;
	u32 cap = min(READ_ONCE(c->cfg->deferred_invalidates),
		      TMEM_CORE_MAX_DEFERRED_INVALIDATES);

	if (!valid_handle(c, h) || c->ndeferred >= cap)
		return false;
	d = &c->deferred[c->ndeferred++];
	d->h = h;
	memcpy(d->oid, oid, sizeof(d->oid));
	d->index = index;
	d->incarnation = c->pools[h].incarnation;
	d->epoch = c->epoch;
	c->c.invalidates_deferred++;
	return true;
}

static void post_deferred(struct tmem_core *c)
{
	struct tmem_sqe sqe;
	u32 i, kept = 0;

	for (i = 0; i < c->ndeferred; i++) {
		struct tmem_core_deferred_invalidate *d = &c->deferred[i];

		if (!deferred_live(c, d))
			continue;
		if (kept == 0 && have_room(c, NEED_INVALIDATE)) {
			memset(&sqe, 0, sizeof(sqe));
			sqe.opcode = TMEM_OP_INVAL_PAGE;
			sqe.pool = c->pools[d->h].host_id;
			sqe.index = d->index;
			memcpy(sqe.oid, d->oid, sizeof(sqe.oid));
			if (post(c, &sqe, NO_SLOT, d->h))
				continue;
			/* The host reset meanwhile: it forgot the pool. */
			c->ndeferred = 0;
			return;
		}
		if (kept != i)
			c->deferred[kept] = *d;
		kept++;
	}
	c->ndeferred = kept;
}

static bool deferred_of(const struct tmem_core_deferred_invalidate *d, int h,
			const u32 *oid)
{
	return d->h == h && !memcmp(d->oid, oid, sizeof(d->oid));
}

/* How many pages from index on a batch may ask for: none deferred. */
static u32 deferred_clip(struct tmem_core *c, int h, const u32 *oid, u64 index,
			 u32 count)
{
	u32 i;

	for (i = 0; i < c->ndeferred; i++) {
		const struct tmem_core_deferred_invalidate *d = &c->deferred[i];

		if (deferred_of(d, h, oid) && d->index >= index &&
		    d->index - index < count && deferred_live(c, d))
			count = d->index - index;
	}
	return count;
}

/* A put of the key reached the ring: it replaces the host's page. */
static void deferred_superseded(struct tmem_core *c, int h, const u32 *oid,
				u64 index)
{
	u32 i, kept = 0;

	for (i = 0; i < c->ndeferred; i++) {
		const struct tmem_core_deferred_invalidate *d = &c->deferred[i];

		if (deferred_of(d, h, oid) && d->index == index)
			continue;
		if (kept != i)
			c->deferred[kept] = *d;
		kept++;
	}
	c->ndeferred = kept;
}

static void issue_invalidate(struct tmem_core *c, u8 opcode, int h,
			     int host_id, const u32 *oid, u64 index)
{
	struct tmem_sqe sqe = {};

	if (flagged(c, host_id))
		return; /* the pending flush covers it */
	if (!have_room(c, NEED_INVALIDATE)) {
		reap(c);
		/* A reset or fault in the reap voided everything anyway. */
		if (!c->attached || c->broken || flagged(c, host_id))
			return;
		if (!have_room(c, NEED_INVALIDATE) && !wait_for_room(c)) {
			if (!c->attached || c->broken || flagged(c, host_id))
				return;
			if (opcode == TMEM_OP_INVAL_PAGE && oid &&
			    defer_invalidate(c, h, oid, index))
				return;
			c->c.flush_fallbacks++;
			request_flush(c, 1ull << host_id);
			return;
		}
	}
	sqe.opcode = opcode;
	sqe.pool = host_id;
	sqe.index = index;
	if (oid)
		memcpy(sqe.oid, oid, sizeof(sqe.oid));
	post(c, &sqe, NO_SLOT, h);
	if (opcode == TMEM_OP_INVAL_POOL)
		forget_sent(c, 1ull << host_id);
}

/* An unsent put must still kill the host's older page of its key. */
static void drop_put(struct tmem_core *c, int h, int host_id, const u32 *oid,
		     u64 index)
{
	if (!host_may_hold(c, h, oid, index)) {
		c->c.drop_invalidates_avoided++;
		return;
	}
	c->c.invalidates_for_dropped_puts++;
	issue_invalidate(c, TMEM_OP_INVAL_PAGE, h, host_id, oid, index);
}

/*
 * Cheap when off: no put of ours reached a private pool since the host last
 * forgot us (attach with a new generation; stand-aside's INVAL_POOLs), so
 * the host holds nothing of ours there. A get, an invalidate, or a put the
 * hint refuses then needs no hashing, no filter, no window scan and no
 * reap: what a frontend told "send nothing" costs per page-cache event.
 */
static bool holds_nothing_private(struct tmem_core *c, int h)
{
	return !c->private_sent && valid_handle(c, h) && !c->pools[h].shared &&
	       c->attached && !c->broken && !host_changed(c);
}

static void invalidate(struct tmem_core *c, u8 opcode, int h, const u32 *oid,
		       u64 index)
{
	int id;

	c->c.invalidates++;
	/* Aside: a private pool was wiped, nothing of it was sent since. */
	if (c->aside && valid_handle(c, h) && !c->pools[h].shared) {
		c->c.invalidates_skipped_aside++;
		return;
	}
	if (oid && holds_nothing_private(c, h)) {
		c->c.invalidates_skipped_never_sent++;
		return;
	}
	/* Before anything else: a prefetched copy must never outlive this. */
	if (valid_handle(c, h))
		windows_kill(c, h, oid,
			     opcode == TMEM_OP_INVAL_PAGE ? index : U64_MAX);
	if (!ensure_attached(c)) {
		/*
		 * The next attach writes a new guest generation: the host drops
		 * this VM's pages. Shared pools hold other VMs' pages too.
		 */
		if (valid_handle(c, h) && c->pools[h].shared)
			c->pools[h].inval_on_ready = true;
		return;
	}
	id = resolve(c, h, false);
	if (id < 0) {
		/* Not on the host in this generation: it holds none of ours. */
		if (valid_handle(c, h) && c->pools[h].shared)
			c->pools[h].inval_on_ready = true;
		return;
	}
	if (oid && !host_may_hold(c, h, oid,
				  opcode == TMEM_OP_INVAL_PAGE ? index : U64_MAX)) {
		c->c.invalidates_skipped_never_sent++;
		return;
	}
	check_flush_done(c);
	issue_invalidate(c, opcode, h, id, oid, index);
}

/*
 * Admission by readahead block: a hint of h admits h / TMEM_ADMIT_ALL of the
 * puts, but whole blocks of TMEM_GET_BATCH_MAX pages of an object at a time
 * (picked by a hash of the object and index / TMEM_GET_BATCH_MAX). A window
 * the page cache reads again is then served wholly by tmem (one batched get)
 * or wholly by the disk (one readahead request): a per-page sample would cut
 * every disk read into fragments and pay a round trip per page besides.
 */
#define ADMIT_EPOCH_PUTS 4096u
#define PROBE_RUN_WINDOWS 8u

/*
 * Under the lock, attached: the host's hint, also kept for
 * put_refused_unlocked with the count of lockless refusals it has seen.
 */
static u32 read_hint(struct tmem_core *c)
{
	u32 hint = TMEM_ADMIT_ALL;

	if (c->features & TMEM_FEAT_ADMISSION_HINT)
		hint = min(READ_ONCE(hdr(c)->admission_hint), TMEM_ADMIT_ALL);
	WRITE_ONCE(c->hint_seen, hint);
	WRITE_ONCE(c->hint_seen_at,
		   tmem_core_counter_read(&c->puts_refused_unlocked));
	return hint;
}

/* The epoch clock: puts that asked admit(), with or without the lock. */
static u64 admit_clock(struct tmem_core *c)
{
	return READ_ONCE(c->admit_puts) +
	       tmem_core_counter_read(&c->puts_refused_unlocked);
}

static bool admits_block(u32 hint, u64 oid_h, u64 block_index, u64 epoch)
{
	return (mix64(key_hash_of(oid_h, block_index) ^ epoch) >> 48) < hint;
}

/*
 * The share of blocks admitted under hint, and the block's size in pages
 * (*block): while probing, only aside_probe_share of it, in runs of
 * PROBE_RUN_WINDOWS windows (read-ahead keeps going within a run, so the
 * probe measures batches as a reader at full admission gets them, not one
 * waited-for batch per block). Lockless callers pass what they read.
 */
static u32 admitted_share(struct tmem_core *c, u32 hint, bool probing,
			  u64 *block)
{
	*block = TMEM_GET_BATCH_MAX;
	if (!probing)
		return hint;
	*block = TMEM_GET_BATCH_MAX * PROBE_RUN_WINDOWS;
	return min(hint, READ_ONCE(c->cfg->aside_probe_share));
}

static bool admit(struct tmem_core *c, const u32 *oid, u64 index)
{
	u64 block, epoch;
	u32 hint = admitted_share(c, read_hint(c), c->probing, &block);

	/*
	 * The choice of blocks moves on every ADMIT_EPOCH_PUTS puts: a page
	 * evicted again and again gets its chance like any other, so a fixed
	 * share of a working set is not shut out for as long as the hint
	 * holds. An epoch spans many readahead windows, so few are split.
	 */
	epoch = admit_clock(c) / ADMIT_EPOCH_PUTS;
	WRITE_ONCE(c->admit_puts, c->admit_puts + 1);
	if (hint >= TMEM_ADMIT_ALL)
		return true;
	return admits_block(hint, oid_hash(c, oid), index / block, epoch);
}

/*
 * A put the hint refuses, of a key the host cannot hold (the filter never
 * saw it): decided without the lock, like get_never_sent_unlocked, on the
 * hint the locked path last read, at most TMEM_CORE_HINT_RECHECK_PUTS
 * lockless refusals old: then the locked path reads it again (a host that
 * raised it is heard within that many puts). While probing, on the probe's
 * share as admit() takes it: a guest that stood aside probes for a pass of
 * its re-read or more, and those evictions' locked refusals cost the real
 * guest's seq row a few percent (0.92x -> 0.93-0.95x, within its noise).
 * Not while standing aside (the top of
 * tmem_core_put decides those), nor for shared pools. A stale view only
 * sends a put to the locked path or refuses one the host cannot hold, so
 * nothing is owed to the host either way. The kernel calls a put with the
 * mapping's lock held and interrupts off, on every eviction: under TCG the
 * locked refusal was a throttled streamer's largest cost per page.
 */
static bool put_refused_unlocked(struct tmem_core *c, int h, const u32 *oid,
				 u64 index)
{
	const struct tmem_core_pool *p;
	u64 refused, oid_h, epoch, block;
	u32 hint;

	hint = admitted_share(c, READ_ONCE(c->hint_seen),
			      READ_ONCE(c->probing), &block);
	if (hint >= TMEM_ADMIT_ALL || h < 0 || h >= (int)TMEM_MAX_POOLS)
		return false;
	p = &c->pools[h];
	/* A ready pool's filter only, as in get_never_sent_unlocked. */
	if (p->shared || READ_ONCE(p->state) != POOL_READY ||
	    READ_ONCE(c->aside))
		return false;
	refused = tmem_core_counter_read(&c->puts_refused_unlocked);
	if (refused - READ_ONCE(c->hint_seen_at) >= TMEM_CORE_HINT_RECHECK_PUTS)
		return false;
	/* Told "off" and holding nothing: no hash, no filter. */
	if (hint == 0 && !READ_ONCE(c->private_sent))
		goto refused;
	oid_h = oid_mix(oid);
	if (sent_maybe_of(p, oid_h, index))
		return false;
	epoch = admit_clock(c) / ADMIT_EPOCH_PUTS;
	if (admits_block(hint, oid_h, index / block, epoch))
		return false;
refused:
	tmem_core_counter_inc(&c->puts_refused_unlocked);
	return true;
}

/* --- entry points ---------------------------------------------------------- */

void tmem_core_init(struct tmem_core *c, const struct tmem_core_ops *ops,
		    void *ops_ctx, const struct tmem_core_config *cfg)
{
	memset(c, 0, sizeof(*c));
	c->ops = ops;
	c->ops_ctx = ops_ctx;
	c->cfg = cfg;
	c->next_incarnation = 1;
	c->last_get_pool = -1;
	c->hint_seen = TMEM_ADMIT_ALL; /* nothing refused before a hint is read */
	c->unsent_get_index = U64_MAX - 1; /* no page follows it */
}

int tmem_core_bind(struct tmem_core *c, u8 *shm, u64 size,
		   struct tmem_core_pending *pending, u32 *free_pending,
		   u32 pending_max, u32 *free_slots, u32 slots_max)
{
	unsigned long flags;
	int err;

	lock(c, &flags);
	c->shm = shm;
	c->shm_size = size;
	c->pending = pending;
	c->free_pending = free_pending;
	c->pending_max = min(pending_max, MAX_PENDING);
	c->free_slots = free_slots;
	c->slots_max = slots_max;
	c->have_rings = false;
	c->attached = false;
	c->broken = false;
	c->present = true;
	/* A new device is a new host: measure whether it pays afresh. */
	WRITE_ONCE(c->aside, false);
	WRITE_ONCE(c->probing, false);
	c->aside_backoff_ns = 0;
	sample_reset(c);
	err = ensure_attached_err(c);
	unlock(c, flags);
	return err;
}

void tmem_core_unbind(struct tmem_core *c)
{
	unsigned long flags;

	lock(c, &flags);
	c->present = false;
	if (c->attached)
		detach(c);
	c->have_rings = false;
	c->rings_gen++;
	c->pending = NULL;
	c->free_pending = NULL;
	c->free_slots = NULL;
	c->pending_cap = 0;
	c->pending_max = 0;
	c->nfree_pending = 0;
	c->nfree_slots = 0;
	c->slots_max = 0;
	unlock(c, flags);
}

int tmem_core_try_attach(struct tmem_core *c)
{
	unsigned long flags;
	int err;

	lock(c, &flags);
	err = ensure_attached_err(c);
	unlock(c, flags);
	return err;
}

struct pool_wait {
	struct tmem_core *c;
	struct tmem_core_pool *p;
};

static bool pool_created(void *arg)
{
	struct pool_wait *w = arg;
	unsigned long flags;
	bool done;

	lock(w->c, &flags);
	if (w->c->attached)
		reap(w->c);
	done = w->p->state != POOL_CREATING;
	unlock(w->c, flags);
	return done;
}

int tmem_core_new_handle(struct tmem_core *c, bool shared, const u8 *uuid,
			 unsigned long *sent, u32 sent_bits,
			 unsigned long **old_sent)
{
	unsigned long flags;
	struct tmem_core_pool *p;
	struct pool_wait w;
	u64 deadline, t;
	int h, ret;

	*old_sent = sent;
	lock(c, &flags);
	for (h = 0; h < (int)TMEM_MAX_POOLS; h++)
		if (c->pools[h].state == POOL_UNUSED)
			break;
	if (h == (int)TMEM_MAX_POOLS) {
		unlock(c, flags);
		return TMEM_CORE_ERR_NO_HANDLE;
	}
	p = &c->pools[h];
	/* The handle's old filter (after release_handle) goes back. */
	*old_sent = p->sent;
	memset(p, 0, sizeof(*p));
	p->sent = sent;
	p->sent_bits = sent_bits;
	p->state = POOL_NONE;
	p->shared = shared;
	if (shared)
		memcpy(p->uuid, uuid, sizeof(p->uuid));
	if (!ensure_attached(c)) {
		unlock(c, flags);
		return h; /* made on first use */
	}
	if (shared && !(c->features & TMEM_FEAT_SHARED_POOLS)) {
		p->state = POOL_UNUSED;
		unlock(c, flags);
		return TMEM_CORE_ERR_NO_SHARED;
	}
	start_create(c, h);
	unlock(c, flags);

	w.c = c;
	w.p = p;
	deadline = now(c) + READ_ONCE(c->cfg->pool_create_timeout_ns);
	while (!pool_created(&w)) {
		t = now(c);
		if (t >= deadline)
			break;
		c->ops->wait(c->ops_ctx, pool_created, &w, deadline - t);
	}
	lock(c, &flags);
	ret = h;
	if (p->state == POOL_CREATING)
		c->c.pool_create_timeouts++;
	if (p->state == POOL_FAILED) {
		ret = p->refusal;
		p->state = POOL_UNUSED;
	}
	unlock(c, flags);
	return ret;
}

void tmem_core_put(struct tmem_core *c, int h, const u32 *oid, u64 index,
		   const void *page)
{
	unsigned long flags;
	struct tmem_sqe sqe = {};
	u64 t0;
	u32 slot;
	int id, admitted = -1; /* admit() counts puts: asked once at most */

	/*
	 * Standing aside, a private pool's put sends nothing (the pools were
	 * wiped when it stood aside): decided without the lock, as
	 * get_never_sent_unlocked decides its gets. A put that reads a
	 * stale true skips a page the host cannot hold an older copy of: a
	 * copy put after the resume was put, then read back (a get, which
	 * takes it from a private pool) before this eviction, and the page
	 * cache's locks order all of that after the resume's write. In the
	 * kernel this runs under the mapping's lock with interrupts off, on
	 * every eviction: the writeback row's guest evicts ~49k pages a pass
	 * while aside, and the tick profile put the locked decision's cost
	 * there.
	 */
	if (h >= 0 && h < (int)TMEM_MAX_POOLS && !c->pools[h].shared &&
	    READ_ONCE(c->aside)) {
		tmem_core_counter_inc(&c->puts_skipped_aside);
		return;
	}
	if (put_refused_unlocked(c, h, oid, index))
		return;
	lock(c, &flags);
	if (sampled_for_nothing(c, h))
		stand_aside_unused(c);
	/*
	 * Told to send nothing and holding nothing: decided before the clock
	 * is read, so a frontend told "off" costs the guest a lock and a few
	 * loads per evicted page (not timed in put_ns).
	 */
	if (holds_nothing_private(c, h) &&
	    (c->features & TMEM_FEAT_ADMISSION_HINT) && read_hint(c) == 0) {
		c->c.puts_skipped_by_hint++;
		c->c.drop_invalidates_avoided++;
		unlock(c, flags);
		return;
	}
	/*
	 * The hint refuses a key never sent: no window holds it and no older
	 * version needs an invalidate. Decided before any window scan, reap
	 * or pool lookup, and before the clock, so a streamer's evictions
	 * (nearly all refused) cost the guest a hash and a filter test each
	 * (counted, not timed, as above). Standing aside is decided below.
	 */
	if (!c->aside && valid_handle(c, h) && !c->pools[h].shared &&
	    c->attached && !c->broken && !host_changed(c) &&
	    !host_may_hold(c, h, oid, index)) {
		admitted = admit(c, oid, index);
		if (!admitted) {
			c->c.puts_skipped_by_hint++;
			c->c.drop_invalidates_avoided++;
			unlock(c, flags);
			return;
		}
	}
	/*
	 * Standing aside: private pools were wiped and hold nothing; a shared
	 * pool's older page still dies (drop_put below). Decided before the
	 * clock, counted, not timed: the writeback row's guest evicts ~49k
	 * pages a pass while aside, and under TCG its two clock reads each
	 * cost more than the decision (the wait ends at a get, which reads
	 * the clock anyway).
	 */
	if (c->aside && valid_handle(c, h) && !c->pools[h].shared) {
		tmem_core_counter_inc(&c->puts_skipped_aside);
		unlock(c, flags);
		return;
	}
	t0 = now(c);
	/* Sent or not, this put makes a prefetched copy of the key stale. */
	if (valid_handle(c, h))
		windows_kill(c, h, oid, index);
	if (!ensure_attached(c)) {
		c->c.puts_dropped_no_pool++;
		goto out;
	}
	/*
	 * Nobody waits for a put's CQE, but the host stops consuming when
	 * the CQ is full: reap once half of it may be in use.
	 */
	if (in_flight(c) >= c->g.cq_entries / 2)
		reap(c);
	id = resolve(c, h, true);
	if (id < 0 && valid_handle(c, h) && c->pools[h].state == POOL_CREATING) {
		reap(c); /* its NEW_POOL may have completed already */
		id = resolve(c, h, false);
	}
	if (id < 0) {
		/* No host pool in this generation: the host holds nothing. */
		c->c.puts_dropped_no_pool++;
		goto out;
	}
	check_flush_done(c);
	if (flagged(c, id)) {
		/* The barrier drops older versions of this key too. */
		c->c.puts_dropped_flush_pending++;
		goto out;
	}
	if (c->aside || !(admitted >= 0 ? admitted : admit(c, oid, index))) {
		c->c.puts_skipped_aside += c->aside;
		c->c.puts_skipped_by_hint++;
		drop_put(c, h, id, oid, index);
		goto out;
	}
	if (!have_room(c, NEED_PUT)) {
		reap(c);
		id = resolve(c, h, false);
		if (id < 0 || !have_room(c, NEED_PUT) || flagged(c, id)) {
			c->c.puts_dropped_ring_full++;
			if (id >= 0)
				drop_put(c, h, id, oid, index);
			goto out;
		}
	}
	slot = c->free_slots[--c->nfree_slots];
	/* Ours until its CQE: nobody reads it before the SQE is published. */
	c->ops->copy_to_slot(c->ops_ctx, slot_addr(c, slot), page);
	sqe.opcode = TMEM_OP_PUT; /* no IRQ: nobody waits for a put */
	sqe.pool = id;
	sqe.slot = slot;
	sqe.index = index;
	memcpy(sqe.oid, oid, sizeof(sqe.oid));
	if (!post(c, &sqe, slot, h)) {
		c->c.puts_dropped_no_pool++; /* the host reset meanwhile */
		goto out;
	}
	mark_sent(c, &c->pools[h], oid, index);
	mark_sent(c, &c->pools[h], oid, U64_MAX);
	if (!c->pools[h].shared)
		WRITE_ONCE(c->private_sent, true);
	if (c->ndeferred)
		deferred_superseded(c, h, oid, index);
	c->c.puts_sent++;
out:
	t0 = now(c) - t0;
	c->c.put_ns += t0;
	c->sample_put_ns += t0;
	c->sample_puts++;
	unlock(c, flags);
}

static void note_get_timeout(struct tmem_core *c)
{
	u32 limit = READ_ONCE(c->cfg->stall_after_timeouts);
	u32 head = sq_head(c);

	if (!limit)
		return;
	/* Timeouts while the host keeps consuming: slow, not dead. */
	if (c->consecutive_timeouts > 0 && head != c->stall_sq_head)
		c->consecutive_timeouts = 0;
	c->stall_sq_head = head;
	if (++c->consecutive_timeouts < limit)
		return;
	if (c->consecutive_timeouts == limit)
		c->c.host_stalls++;
	c->stalled_until_ns = now(c) + READ_ONCE(c->cfg->stall_probe_ns);
}

struct get_ticket {
	struct tmem_core *c;
	u64 tag;
	u64 rings_gen;
	u32 index;
	u32 interrupt_waits;
	bool lost;
};

/* Under the lock: reaps, then tells whether the get's CQE is in. */
static bool get_done(struct get_ticket *t)
{
	struct tmem_core *c = t->c;
	struct tmem_core_pending *p;

	if (c->rings_gen != t->rings_gen || !c->attached || c->broken) {
		t->lost = true;
		return true;
	}
	reap(c);
	if (c->rings_gen != t->rings_gen || !c->attached || c->broken ||
	    host_changed(c)) {
		t->lost = true;
		return true;
	}
	p = &c->pending[t->index];
	if (p->tag != t->tag) {
		t->lost = true;
		return true;
	}
	return p->waiter == DONE_HIT || p->waiter == DONE_MISS;
}

static bool get_done_locked(void *arg)
{
	struct get_ticket *t = arg;
	unsigned long flags;
	bool done;

	lock(t->c, &flags);
	done = get_done(t);
	unlock(t->c, flags);
	return done;
}

/*
 * Without the lock: spin, then sleep, until done(arg), or the deadline
 * (returns true). A get spins get_spin_ns per page it waits for, and at
 * least get_spin_min_ns: a batch keeps the host longer, a worker asleep
 * wakes late, and sleeping costs an interrupt and a wake-up, which under
 * emulation cost more than the host's whole batch.
 */
static bool wait_for(struct tmem_core *c, bool (*done)(void *arg), void *arg,
		     u32 pages, u32 *interrupt_waits)
{
	u64 t_now = now(c);
	u64 spin_until = t_now +
			 max(READ_ONCE(c->cfg->get_spin_ns) * max(pages, 1u),
			     READ_ONCE(c->cfg->get_spin_min_ns));
	u64 deadline = t_now + READ_ONCE(c->cfg->get_timeout_ns);

	for (;;) {
		if (done(arg))
			return false;
		t_now = now(c);
		if (t_now >= deadline)
			return true;
		if (t_now < spin_until) {
			cpu_relax();
			continue;
		}
		if (c->ops->wait(c->ops_ctx, done, arg, deadline - t_now))
			(*interrupt_waits)++; /* counted under the lock later */
	}
}

/* A read-ahead window being filled, waited for by a get. */
struct window_ticket {
	struct tmem_core *c;
	u64 tag;
	u64 rings_gen;
	u32 win;
};

static bool window_filled(void *arg)
{
	struct window_ticket *t = arg;
	struct tmem_core *c = t->c;
	unsigned long flags;
	bool done;

	lock(c, &flags);
	reap(c);
	done = c->rings_gen != t->rings_gen || !c->attached || c->broken ||
	       c->win[t->win].state != WIN_FETCHING || c->win[t->win].tag != t->tag;
	unlock(c, flags);
	return done;
}

/*
 * Under the lock (dropped while waiting): waits for read-ahead window win
 * to be filled, then serves the get from the windows as window_serve does
 * (-1 if they no longer know the key, -2 if still filling).
 */
static int window_wait_serve(struct tmem_core *c, unsigned long *flags, int h,
			     const u32 *oid, u64 index, void *page, int *win)
{
	struct window_ticket t = { .c = c, .win = *win,
				   .tag = c->win[*win].tag,
				   .rings_gen = c->rings_gen };
	u32 pages = c->win[*win].count, waits = 0;
	u64 t0 = now(c);
	bool timed_out;

	unlock(c, *flags);
	timed_out = wait_for(c, window_filled, &t, pages, &waits);
	lock(c, flags);
	c->c.readahead_waits++;
	c->c.readahead_wait_ns += now(c) - t0;
	c->c.interrupt_waits += waits;
	if (timed_out)
		return -2;
	return window_serve(c, h, oid, index, page, win);
}

/* Pages to ask for from index on (1: a plain GET). */
static u32 batch_size(struct tmem_core *c, int h, const u32 *oid, u64 index,
		      u32 max_pages, bool sequential)
{
	u32 n = min(READ_ONCE(c->cfg->batch_pages), TMEM_GET_BATCH_MAX);

	if (!c->nwin || c->pools[h].shared || !(c->features & TMEM_FEAT_GET_BATCH))
		return 1;
	if (!sequential) {
		c->c.gets_not_sequential++;
		return 1;
	}
	if (max_pages && max_pages < n)
		n = max_pages;
	if (index > U64_MAX - TMEM_GET_BATCH_MAX)
		return 1;
	/* Pages never sent are misses for sure: do not ask for a tail of them. */
	while (n > 1 && !host_may_hold(c, h, oid, index + n - 1))
		n--;
	/* Nor for a page whose invalidate still waits: the host's is stale. */
	if (c->ndeferred)
		n = max(1u, deferred_clip(c, h, oid, index, n));
	return n;
}

static u64 post_batch(struct tmem_core *c, int h, int id, const u32 *oid,
		      u64 index, u32 count, int win, u64 end)
{
	struct tmem_core_window *w = &c->win[win];
	struct tmem_sqe sqe = {};
	u64 tag;

	sqe.opcode = TMEM_OP_GET_BATCH;
	sqe.flags = TMEM_SQE_F_IRQ;
	sqe.pool = id;
	sqe.slot = window_slot(c, win);
	sqe.index = index;
	sqe.count = count;
	memcpy(sqe.oid, oid, sizeof(sqe.oid));
	/* The window's slots are not on the free list: post must not free them. */
	tag = post(c, &sqe, NO_SLOT, h);
	if (!tag)
		return 0;
	c->pending[tag & TAG_INDEX_MASK].slot = win;
	memcpy(w->oid, oid, sizeof(w->oid));
	w->first = index;
	w->count = count;
	w->pool = h;
	w->epoch = c->epoch;
	w->incarnation = c->pools[h].incarnation;
	w->lru = ++c->lru_clock;
	w->present = 0;
	w->missing = 0;
	w->killed = 0;
	w->doomed = false;
	w->tag = tag;
	w->end = end;
	w->ahead = false;
	w->state = WIN_FETCHING;
	c->c.get_batches++;
	return tag;
}

/*
 * A get was served from window wi (the reader went on past a batch's first
 * page, so it reads on): ask now for the object's next blocks,
 * with no one waiting, so that a sequential reader finds them filled, as
 * the page cache's async readahead keeps the disk ahead of the reader.
 * Only after a full window (a short one stopped at the file's end or at
 * pages never sent), and only for blocks no window holds. The pages come
 * out of the host (exclusive gets); those never read are counted unused.
 */
static void read_ahead(struct tmem_core *c, int h, const u32 *oid, u32 wi)
{
	struct tmem_core_window *w = &c->win[wi];
	u32 batch = min(READ_ONCE(c->cfg->batch_pages), TMEM_GET_BATCH_MAX);
	u32 depth = min(READ_ONCE(c->cfg->readahead_windows), c->nwin - 1);
	u64 next = w->first, end = w->end;
	u32 i, j, count;
	bool covered;
	int id, nw;

	if (w->ahead || w->count < batch || batch < 2 || !depth)
		return;
	w->ahead = true;
	id = resolve(c, h, false);
	if (id < 0 || flagged(c, id))
		return;
	for (j = 0; j < depth; j++) {
		if (next > U64_MAX - 2 * TMEM_GET_BATCH_MAX)
			return;
		next += batch;
		if (end && next >= end)
			return;
		covered = false;
		for (i = 0; i < c->nwin; i++)
			covered |= window_covers(&c->win[i], h, oid, next);
		if (covered)
			continue;
		/* The reader is past what was sent: nothing more to fetch. */
		if (!host_may_hold(c, h, oid, next))
			return;
		count = batch_size(c, h, oid, next, end ? end - next : 0, true);
		if (count < 2 || !have_room(c, NEED_CONTROL))
			return;
		/* Never one with unread pages: they left the host. */
		nw = window_pick(c, false);
		if (nw < 0 || (u32)nw == wi)
			return;
		if (!post_batch(c, h, id, oid, next, count, nw, end))
			return;
		c->c.readaheads++;
	}
}

/* --- never slower: stand aside when tmem costs more than it saves --------- */

static void stand_aside(struct tmem_core *c)
{
	struct tmem_core_pool *p;
	u32 i;

	/*
	 * Private pools: wipe them (ring order puts the INVAL_POOL before
	 * anything later), so no per-key invalidate is owed while aside.
	 * Shared pools hold other VMs' pages: they keep their invalidates.
	 */
	for (i = 0; i < TMEM_MAX_POOLS; i++) {
		p = &c->pools[i];
		if (p->state == POOL_READY && !p->shared)
			issue_invalidate(c, TMEM_OP_INVAL_POOL, i, p->host_id, NULL, 0);
		if (p->state != POOL_UNUSED)
			windows_kill(c, i, NULL, 0);
	}
	/* Before aside: a lockless get never pairs it with an old deadline. */
	WRITE_ONCE(c->aside_until_ns, now(c) + c->aside_backoff_ns);
	WRITE_ONCE(c->aside, true);
	/* The INVAL_POOLs above go first in the ring. */
	WRITE_ONCE(c->private_sent, false);
	c->c.stood_aside++;
	if (c->attached) {
		st_release(&hdr(c)->guest_flags, TMEM_GUEST_STANDING_ASIDE);
		/* Nothing follows that would ring for the INVAL_POOLs. */
		if (c->unrung)
			maybe_doorbell(c);
	}
}

static void resume(struct tmem_core *c)
{
	WRITE_ONCE(c->aside, false);
	/*
	 * A probe: pages must be put before any can come back, so only a
	 * share of the blocks is sent until a sample says tmem pays (whole
	 * blocks, so hits still come in batches and cost what they would).
	 */
	WRITE_ONCE(c->probing, true);
	sample_reset(c);
	c->unused_from = admit_clock(c);
	if (c->attached)
		st_release(&hdr(c)->guest_flags, 0);
}

/* Standing aside now? Resumes (to measure again) once the time is up. */
static bool standing_aside(struct tmem_core *c)
{
	if (!c->aside)
		return false;
	if (now(c) < c->aside_until_ns)
		return true;
	resume(c);
	return false;
}

/* What a miss costs: measured if the platform could, else configured. */
static u64 miss_cost(struct tmem_core *c)
{
	u64 configured = READ_ONCE(c->cfg->miss_cost_ns);

	if (!configured)
		return 0; /* never stand aside */
	return c->miss_cost_measured_ns ? c->miss_cost_measured_ns : configured;
}

#define COST_UNKNOWN U64_MAX

/*
 * What the disk would have cost for the page a get was served: a plain GET
 * stands for a small random read, a batch or window for readahead.
 */
static u64 miss_cost_for(struct tmem_core *c, bool single)
{
	if (!READ_ONCE(c->cfg->miss_cost_ns))
		return 0;
	if (!single)
		return miss_cost(c);
	if (c->miss_cost_random_ns)
		return c->miss_cost_random_ns;
	return c->miss_cost_measured_ns ? COST_UNKNOWN : miss_cost(c);
}

/*
 * The host admits at least the share of blocks a probe puts
 * (aside_probe_share)? Then what comes back is as dense as a probe's and
 * costs what a probe's does.
 */
static bool admitted_as_a_probe(struct tmem_core *c)
{
	u32 share = min_t(u32, READ_ONCE(c->cfg->aside_probe_share),
			  TMEM_ADMIT_ALL);

	return !(c->features & TMEM_FEAT_ADMISSION_HINT) ||
	       READ_ONCE(hdr(c)->admission_hint) >= share;
}

static void sample_reset(struct tmem_core *c)
{
	c->sample_ns = 0;
	c->sample_hits = 0;
	c->sample_gets = 0;
	c->sample_cost_ns = 0;
}

/*
 * How long to stand aside after a sample that did not pay (base: the
 * configured aside_probe_ns). Each time it still does not pay, twice as
 * long, up to ASIDE_LONGEST_WAIT times base. But a sample whose gets and
 * puts would cost more than the misses they save even if every get hit
 * and every put came back once (the get's and the put's own cost against
 * a miss's, with a quarter's margin) is a loss no workload turns: only
 * costs can, and a miss that costs twice as much ends the wait at once
 * (resume_if_cost_rose). If the verdict before it was a loss too, it
 * waits the longest at once. Each probe puts a share of the evictions for
 * a pass of a re-read or more: under TCG, where a hit costs two page
 * copies and a disk read none, a sequential re-read lost ~4% to the probe
 * a second after the first verdict. Not on a first loss: a first sample
 * carries what starting costs (a guest on a throttled cloud volume, for
 * which tmem pays, measured 15 us per hit in its first sample, 3.9 us in
 * its second) and would have kept it aside for the longest wait.
 */
#define ASIDE_LONGEST_WAIT 64

/* The wait after another loss: twice the last, up to longest x base. */
static u64 next_backoff(struct tmem_core *c, u64 base, u64 longest)
{
	return c->aside_backoff_ns ?
	       min(c->aside_backoff_ns * 2, base * longest) : base;
}

static u64 aside_wait(struct tmem_core *c, u64 base, u64 per_hit)
{
	u64 best = c->sample_ns / max(c->sample_gets, 1u);

	if (c->sample_puts)
		best += c->sample_put_ns / c->sample_puts;
	if (c->aside_backoff_ns && c->sample_hits &&
	    best > per_hit + per_hit / 4) {
		c->c.stood_aside_longest++;
		return base * ASIDE_LONGEST_WAIT;
	}
	return next_backoff(c, base, ASIDE_LONGEST_WAIT);
}

/*
 * A get served by the host or a window took ns (single: a plain GET, not
 * a batch or window): close samples, decide.
 */
static void account_get(struct tmem_core *c, u64 ns, bool hit, bool single)
{
	const struct tmem_core_config *cfg = c->cfg;
	u64 cost = miss_cost_for(c, single);
	u64 base = max(READ_ONCE(cfg->aside_probe_ns), 1ull);
	u64 per_hit;

	/*
	 * A sample describes what tmem costs now: one left open for longer
	 * than aside_probe_ns (a few misses in a put storm, then a pause
	 * until the files are read again) starts over.
	 */
	if (c->sample_gets && now(c) - c->sample_start_ns > base) {
		c->c.aside_samples_discarded += c->sample_gets;
		sample_reset(c);
	}
	/*
	 * While the host samples our puts below a probe's share (a streamer
	 * at 1/64), the few pages it holds come back too sparsely to say
	 * what tmem costs a reader: it decides nothing. A host that cut us
	 * less (its CPU budget's cut of a re-reader whose reuse has not shown
	 * yet) leaves blocks as dense as a probe's: those decide, or a guest
	 * probing under that cut never concluded (a real guest on a cloud
	 * volume probed at 1/8 for its whole run). Nor does a get whose
	 * alternative is not measured yet decide.
	 */
	if ((c->attached && !admitted_as_a_probe(c)) || cost == COST_UNKNOWN) {
		c->c.aside_samples_discarded += c->sample_gets + 1;
		sample_reset(c);
		return;
	}
	if (!c->sample_gets) {
		c->sample_start_ns = now(c);
		c->sample_put_ns = 0;
		c->sample_puts = 0;
	}
	c->sample_ns += ns;
	c->sample_hits += hit;
	c->sample_cost_ns += hit ? cost : 0;
	if (++c->sample_gets < max(READ_ONCE(cfg->aside_sample_gets), 1u))
		return;
	c->get_ns_per_hit = c->sample_ns / max(c->sample_hits, 1ull);
	per_hit = c->sample_cost_ns / max(c->sample_hits, 1ull);
	if (c->attached) {
		WRITE_ONCE(hdr(c)->guest_get_ns, c->get_ns_per_hit);
		WRITE_ONCE(hdr(c)->guest_miss_ns, per_hit);
	}
	/*
	 * What tmem cost the guest over the sample: its gets, and the puts
	 * made meanwhile (a re-reader puts about a page per page it reads: a
	 * hit is paid for by a put as well as by its get).
	 */
	if (cost && c->sample_ns + c->sample_put_ns > c->sample_cost_ns) {
		c->aside_backoff_ns = aside_wait(c, base, per_hit);
		c->aside_miss_ns = max(per_hit, 1ull);
		stand_aside(c);
	} else {
		c->aside_backoff_ns = 0;
		WRITE_ONCE(c->probing, false); /* it pays: every block again */
	}
	sample_reset(c);
}

/*
 * Sampled for nothing (cfg->aside_unused_evictions): under a hint below a
 * probe's share, the host keeps our puts' keys to notice reuse, which
 * shows as a get of a page it may hold. With none for that many evictions
 * (or the host's reach_pages, if more: a page re-read further away than
 * that cannot come back), every eviction and page-cache miss still pays a
 * hash and a filter test, and a sampled put a copy, for nothing: in the
 * scenario's stream (a CPU-saturated host) a throttled streamer read at
 * 0.94x of no tmem with a sample of 1/64 and at 0.94x with none at all,
 * where one told "off" (nothing sent, so no filter to test) read at
 * 0.98-1.0x. Standing aside wipes the pools, so the filter's tests go too.
 * The wait doubles while it goes on, up to UNUSED_LONGEST_WAIT probe
 * intervals: a reader whose pages start coming back waits that long at
 * most, then the probe's sample shows it. Told "off" with nothing sent,
 * it already costs what aside does.
 */
#define UNUSED_LONGEST_WAIT 8

static bool sampled_for_nothing(struct tmem_core *c, int h)
{
	u64 limit = READ_ONCE(c->cfg->aside_unused_evictions);
	u64 clock = admit_clock(c);

	if (!limit || c->aside || !valid_handle(c, h) || c->pools[h].shared ||
	    !c->attached || c->broken || host_changed(c) ||
	    admitted_as_a_probe(c) ||
	    (!c->private_sent && READ_ONCE(hdr(c)->admission_hint) == 0)) {
		c->unused_from = clock;
		return false;
	}
	/* Where the host could still hold a page, it may yet come back. */
	limit = max(limit, (u64)READ_ONCE(hdr(c)->reach_pages));
	return clock - c->unused_from >= limit;
}

static void stand_aside_unused(struct tmem_core *c)
{
	u64 base = max(READ_ONCE(c->cfg->aside_probe_ns), 1ull);

	c->aside_backoff_ns = next_backoff(c, base, UNUSED_LONGEST_WAIT);
	c->aside_miss_ns = 0; /* not a matter of cost: no cost rise ends it */
	c->c.stood_aside_unused++;
	stand_aside(c);
}

/* The guest's own view, for the host to show (never trusted there). */
static void publish_prefetch_counts(struct tmem_core *c)
{
	if (!c->nwin || !c->attached)
		return;
	WRITE_ONCE(hdr(c)->guest_prefetch_used, c->c.prefetch_used);
	WRITE_ONCE(hdr(c)->guest_prefetch_unused, c->c.prefetch_unused);
}

/*
 * A get of private pool h decided without the lock or the clock: true (a
 * miss, counted) when the host cannot hold the key (no put reached a
 * private pool since the host last forgot us, or the pool's sent-keys
 * filter never saw this key) and the guest is not standing aside, so a
 * frontend the host told "send nothing", or a streaming reader, costs next
 * to nothing per page-cache miss.
 */
static bool get_never_sent_unlocked(struct tmem_core *c, int h, const u32 *oid,
				    u64 index)
{
	/*
	 * Lockless: private_sent and aside are written under the lock with
	 * WRITE_ONCE, and so are the filter's words (mark_sent). A get cannot
	 * race with a put of its own key (the page cache orders the eviction
	 * that puts a key before the read that gets it), so a put of another
	 * key flipping private_sent or adding bits meanwhile changes nothing
	 * for this key. A guest standing aside takes the locked path: that is
	 * where its wait ends. The kernel's lock disables interrupts: under
	 * TCG the locked decision was a streaming guest's largest cost per
	 * page-cache miss (the tick profile, bench/RESULTS.md).
	 */
	if (!c->cfg->skip_unsent_gets || h < 0 || h >= (int)TMEM_MAX_POOLS ||
	    c->pools[h].shared || READ_ONCE(c->aside))
		return false;
	/*
	 * Only a ready pool's filter is read: a pool that failed or was
	 * released keeps a filter its platform may free (and a get of it is
	 * no page cache's).
	 */
	if (READ_ONCE(c->private_sent)) {
		u64 oid_h;

		if (READ_ONCE(c->pools[h].state) != POOL_READY)
			return false;
		oid_h = oid_mix(oid);
		if (sent_maybe_of(&c->pools[h], oid_h, index))
			return false;
		/*
		 * For the locked path's sequential test: a hint, so racing
		 * writers may leave either one's (the two words torn at worst:
		 * one batch more or less).
		 */
		WRITE_ONCE(c->unsent_get_oid_hash, oid_h);
		WRITE_ONCE(c->unsent_get_index, index);
	}
	tmem_core_counter_inc(&c->gets_skipped_nothing_sent);
	return true;
}

/* A get the sent-keys filter alone answers: the host cannot hold the key. */
static bool never_sent_get(struct tmem_core *c, int h, const u32 *oid,
			   u64 index)
{
	return c->cfg->skip_unsent_gets &&
	       (holds_nothing_private(c, h) ||
		(valid_handle(c, h) && !host_may_hold(c, h, oid, index)));
}

int tmem_core_get(struct tmem_core *c, int h, const u32 *oid, u64 index,
		  u32 max_pages, void *page)
{
	unsigned long flags;
	struct tmem_sqe sqe = {};
	struct get_ticket t = { .c = c };
	struct tmem_core_pending *p;
	struct tmem_core_window *w;
	u64 t0, t_wait;
	bool hit = false, timed_out, sequential;
	u32 slot, count;
	int id, served, win;

	if (get_never_sent_unlocked(c, h, oid, index))
		return 0;
	/*
	 * Standing aside and still waiting: a miss, decided on one coarse
	 * clock read (a wait ends a tick late at most) without the lock
	 * (aside and aside_until_ns are written under it with WRITE_ONCE),
	 * counted, not timed. A stale view only makes a get miss or take the
	 * locked path, where the wait ends: both exact. The kernel's lock
	 * disables interrupts, and under TCG the locked decision was the
	 * writeback row's largest cost per page-cache miss while aside (the
	 * tick profile: ~5% more of the kernel's ticks at
	 * spin_unlock_irqrestore than without tmem), and then ktime_get with
	 * 1.4% of them.
	 */
	if (READ_ONCE(c->aside) &&
	    coarse_now(c) < READ_ONCE(c->aside_until_ns)) {
		tmem_core_counter_inc(&c->gets_skipped_aside);
		return 0;
	}
	lock(c, &flags);
	/*
	 * A file's first page starts a sequential read as often as not, and
	 * so does the page after the last get decided without the lock (a
	 * reader reaching a probe's block after pages never sent).
	 */
	sequential = index == 0 ||
		     (c->last_get_pool == h && c->last_get_index + 1 == index &&
		      !memcmp(c->last_get_oid, oid, sizeof(c->last_get_oid))) ||
		     (READ_ONCE(c->unsent_get_index) + 1 == index &&
		      READ_ONCE(c->unsent_get_oid_hash) == oid_hash(c, oid));
	c->last_get_pool = h;
	c->last_get_index = index;
	memcpy(c->last_get_oid, oid, sizeof(c->last_get_oid));
	/*
	 * A key never sent cannot be on the host nor in a window (a window
	 * holds only pages the host returned, and whatever makes the filter
	 * forget a pool kills its windows): a streaming reader's page-cache
	 * misses stop here, before any attach, reap or window scan, and
	 * before the clock (under TCG two clock reads cost more than the
	 * filter's decision): counted, not timed. A guest standing aside
	 * goes on, to the locked path where its wait ends.
	 */
	if (!c->aside && never_sent_get(c, h, oid, index)) {
		c->c.gets_skipped_never_sent++;
		c->c.gets_miss++;
		c->c.gets_miss_local++;
		unlock(c, flags);
		return false;
	}
	/*
	 * Standing aside, every page-cache miss still asks: decided on the one
	 * clock read its wait needs (standing_aside() resumes once it is
	 * over), counted, not timed (under TCG a clock read costs more than
	 * the decision; the writeback row's guest asked 44k times while
	 * aside, three reads each).
	 */
	if (standing_aside(c)) {
		c->c.gets_skipped_aside++;
		c->c.gets_miss++;
		c->c.gets_miss_local++;
		publish_prefetch_counts(c);
		unlock(c, flags);
		return false;
	}
	t0 = now(c);
	if (never_sent_get(c, h, oid, index)) {
		c->c.gets_skipped_never_sent++;
		goto miss_local;
	}
	/* A page the host may hold was read again: what a sample is for. */
	c->unused_from = admit_clock(c);
	if (!ensure_attached(c))
		goto miss_local;
	reap(c); /* frees slots, completes barriers and pool creations */
	if (c->stalled_until_ns && now(c) < c->stalled_until_ns) {
		if (sq_head(c) == c->stall_sq_head) {
			c->c.gets_skipped_stalled++;
			goto miss_local;
		}
		c->stalled_until_ns = 0; /* the host moved: it is back */
		c->consecutive_timeouts = 0;
	}
	if (c->ndeferred && valid_handle(c, h) &&
	    !deferred_clip(c, h, oid, index, 1)) {
		c->c.gets_skipped_invalidating++;
		goto miss_local;
	}
	/* Prefetched by an earlier batch: no round trip, hit or miss. */
	if (c->nwin && valid_handle(c, h) && !c->pools[h].shared) {
		served = window_serve(c, h, oid, index, page, &win);
		if (served == -2)
			served = window_wait_serve(c, &flags, h, oid, index,
						   page, &win);
		if (served == 1) {
			hit = true;
			c->c.gets_hit++;
			account_get(c, now(c) - t0, true, false);
			read_ahead(c, h, oid, win);
			goto out;
		}
		/* Still filling after the get's whole timeout: a miss. */
		if (served == 0 || served == -2)
			goto miss_local;
	}
	id = resolve(c, h, true);
	if (id < 0 || flagged(c, id))
		goto miss_local;
	count = batch_size(c, h, oid, index, max_pages, sequential);
	win = count > 1 && have_room(c, NEED_CONTROL) ? window_pick(c, true) : -1;
	if (win >= 0) {
		t.tag = post_batch(c, h, id, oid, index, count, win,
				   max_pages ? index + max_pages : 0);
	} else {
		if (!have_room(c, NEED_GET))
			goto miss_local;
		slot = c->free_slots[--c->nfree_slots];
		sqe.opcode = TMEM_OP_GET;
		sqe.flags = TMEM_SQE_F_IRQ;
		sqe.pool = id;
		sqe.slot = slot;
		sqe.index = index;
		memcpy(sqe.oid, oid, sizeof(sqe.oid));
		t.tag = post(c, &sqe, slot, h);
	}
	if (!t.tag)
		goto miss_local;
	t.index = t.tag & TAG_INDEX_MASK;
	t.rings_gen = c->rings_gen;
	c->pending[t.index].waiter = WAITING;
	unlock(c, flags);

	t_wait = now(c);
	timed_out = wait_for(c, get_done_locked, &t, win >= 0 ? count : 1,
			     &t.interrupt_waits);
	t_wait = now(c) - t_wait;

	lock(c, &flags);
	/* Where a round trip's time goes: waiting for the host vs the rest. */
	c->c.round_trips++;
	c->c.round_trip_wait_ns += t_wait;
	if (c->rings_gen == t.rings_gen && c->pending[t.index].tag == t.tag) {
		p = &c->pending[t.index];
		if (p->waiter == DONE_HIT || p->waiter == DONE_MISS) {
			/* A reset noticed meanwhile makes it a miss, to be safe. */
			hit = !t.lost && p->waiter == DONE_HIT;
			if (p->opcode == TMEM_OP_GET_BATCH) {
				w = &c->win[p->slot];
				if (hit)
					c->ops->copy_from_slot(c->ops_ctx, page,
							       slot_addr(c, window_slot(c, p->slot)));
				w->state = (w->present | w->missing) ? WIN_READY : WIN_FREE;
			} else {
				if (hit)
					c->ops->copy_from_slot(c->ops_ctx, page,
							       slot_addr(c, p->slot));
				c->free_slots[c->nfree_slots++] = p->slot;
			}
			free_entry(c, t.index);
			timed_out = false;
		} else {
			/* Timed out: the completion frees slot and entry later. */
			p->waiter = ABANDONED;
		}
	}
	if (timed_out) {
		note_get_timeout(c);
		c->c.gets_timeout++;
	} else if (!t.lost) {
		c->consecutive_timeouts = 0;
	}
	if (hit)
		c->c.gets_hit++;
	else
		c->c.gets_miss++;
	if (t.lost)
		c->c.gets_miss_local++;
	c->c.interrupt_waits += t.interrupt_waits;
	account_get(c, now(c) - t0, hit, win < 0);
	goto out;

miss_local:
	c->c.gets_miss++;
	c->c.gets_miss_local++;
out:
	publish_prefetch_counts(c);
	c->c.get_ns += now(c) - t0;
	unlock(c, flags);
	return hit;
}

void tmem_core_invalidate_page(struct tmem_core *c, int h, const u32 *oid,
			       u64 index)
{
	unsigned long flags;

	lock(c, &flags);
	invalidate(c, TMEM_OP_INVAL_PAGE, h, oid, index);
	unlock(c, flags);
}

void tmem_core_invalidate_object(struct tmem_core *c, int h, const u32 *oid)
{
	unsigned long flags;

	lock(c, &flags);
	invalidate(c, TMEM_OP_INVAL_OBJECT, h, oid, 0);
	unlock(c, flags);
}

void tmem_core_invalidate_pool(struct tmem_core *c, int h)
{
	unsigned long flags;

	lock(c, &flags);
	invalidate(c, TMEM_OP_INVAL_POOL, h, NULL, 0);
	unlock(c, flags);
}

void tmem_core_release_handle(struct tmem_core *c, int h)
{
	unsigned long flags;
	struct tmem_sqe sqe = {};
	struct tmem_core_pool *p;

	lock(c, &flags);
	c->c.invalidates++;
	if (!valid_handle(c, h))
		goto out;
	p = &c->pools[h];
	windows_kill(c, h, NULL, 0);
	if (ensure_attached(c) && p->state == POOL_READY) {
		check_flush_done(c);
		if (!p->shared && !flagged(c, p->host_id) &&
		    have_room(c, NEED_CONTROL)) {
			sqe.opcode = TMEM_OP_DESTROY_POOL;
			sqe.pool = p->host_id;
			post(c, &sqe, NO_SLOT, -1);
		} else {
			/* Shared pools outlive us; a full ring gets the barrier. */
			issue_invalidate(c, TMEM_OP_INVAL_POOL, h, p->host_id,
					 NULL, 0);
		}
	}
	p->state = POOL_UNUSED;
out:
	unlock(c, flags);
}

void tmem_core_poll(struct tmem_core *c)
{
	unsigned long flags;

	lock(c, &flags);
	if (ensure_attached(c))
		reap(c);
	unlock(c, flags);
}

void tmem_core_interrupt(struct tmem_core *c)
{
	unsigned long flags;

	lock(c, &flags);
	c->c.interrupts++;
	if (c->present && c->attached)
		reap(c);
	unlock(c, flags);
}

int tmem_core_host_pool_id(struct tmem_core *c, int h)
{
	unsigned long flags;
	int id = -1;

	lock(c, &flags);
	if (valid_handle(c, h) && c->pools[h].state == POOL_READY &&
	    c->attached && !c->broken)
		id = c->pools[h].host_id;
	unlock(c, flags);
	return id;
}

/*
 * Under the lock: what the guest reads changed (a sequential scan that
 * readahead made cheap gave way to random reads, say): a miss now costs at
 * least twice what it did when tmem did not pay, so look again at once
 * rather than after a backoff of up to a minute.
 */
static void resume_if_cost_rose(struct tmem_core *c, u64 cost)
{
	if (c->aside && c->aside_miss_ns && cost / 2 >= c->aside_miss_ns) {
		WRITE_ONCE(c->aside_until_ns, 0);
		c->aside_backoff_ns = 0;
		c->c.aside_cost_rose++;
	}
}

void tmem_core_set_miss_cost(struct tmem_core *c, u64 ns_per_page)
{
	unsigned long flags;

	lock(c, &flags);
	c->miss_cost_measured_ns = ns_per_page;
	resume_if_cost_rose(c, ns_per_page);
	unlock(c, flags);
}

void tmem_core_set_random_miss_cost(struct tmem_core *c, u64 ns_per_read)
{
	unsigned long flags;

	lock(c, &flags);
	c->miss_cost_random_ns = ns_per_read;
	resume_if_cost_rose(c, ns_per_read);
	unlock(c, flags);
}

void tmem_core_read_counters(const struct tmem_core *c,
			     struct tmem_core_counters *out)
{
	u64 skipped = tmem_core_counter_read(&c->gets_skipped_nothing_sent);
	u64 aside = tmem_core_counter_read(&c->puts_skipped_aside);
	u64 aside_gets = tmem_core_counter_read(&c->gets_skipped_aside);
	u64 refused = tmem_core_counter_read(&c->puts_refused_unlocked);

	memcpy(out, &c->c, sizeof(*out));
	out->gets_miss += skipped;
	out->gets_miss_local += skipped;
	out->gets_skipped_never_sent += skipped;
	out->puts_skipped_aside += aside;
	out->puts_skipped_by_hint += aside;
	out->gets_skipped_aside += aside_gets;
	out->puts_skipped_by_hint += refused;
	out->puts_refused_unlocked = refused;
	out->drop_invalidates_avoided += refused;
	out->gets_miss += aside_gets;
	out->gets_miss_local += aside_gets;
}

void tmem_core_get_state(struct tmem_core *c, struct tmem_core_state *s)
{
	unsigned long flags;
	u32 i;

	memset(s, 0, sizeof(*s));
	lock(c, &flags);
	s->present = c->present;
	s->attached = c->attached;
	s->broken = c->broken;
	s->host_generation = c->host_generation;
	s->guest_generation = c->guest_generation;
	if (c->present) {
		s->host_state = host_state(c);
		s->admission_hint = READ_ONCE(hdr(c)->admission_hint);
	}
	s->in_flight = c->attached ? in_flight(c) : 0;
	s->free_slots = c->nfree_slots;
	s->slots_usable = c->slots_usable;
	s->invalidate_reserve = c->reserve;
	s->flush_pending = (c->flush_bits | c->wanted_bits) != 0;
	s->prefetch_windows = c->nwin;
	s->standing_aside = c->aside;
	s->get_ns_per_hit = c->get_ns_per_hit;
	s->miss_cost_ns = miss_cost(c);
	for (i = 0; i < c->nwin; i++)
		s->prefetched += hweight32(c->win[i].present);
	unlock(c, flags);
}
