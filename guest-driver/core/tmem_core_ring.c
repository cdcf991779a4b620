// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * tmem_core_ring.c - the channel to the host: attach to the rings it
 * offers (geometry validated once per host generation), post SQEs, reap
 * CQEs, notice resets and corrupt indices, and wait for a completion.
 * Everything read from shared memory here is hostile input.
 */
#include "tmem_core_internal.h"

#define FEATURES_UNDERSTOOD \
	(TMEM_FEAT_SHARED_POOLS | TMEM_FEAT_ADMISSION_HINT | TMEM_FEAT_FLUSH_BARRIER)

/* --- channel state ------------------------------------------------------- */

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

u64 tmem_new_generation(struct tmem_core *c, u64 previous)
{
	u64 g;

	do {
		g = c->ops->random_u64(c->ops_ctx);
	} while (g == 0 || g == previous);
	return g;
}

void tmem_void_pools(struct tmem_core *c, bool shared_lost_invalidates)
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
	tmem_windows_reset(c);
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
	c->guest_generation = tmem_new_generation(c, c->guest_generation);
	store_guest_generation(c);
	c->host_generation = g.host_generation;
	/* The new generation: the host holds nothing. */
	WRITE_ONCE(c->private_sent, false);
	c->attached = true;
	c->broken = false;
	tmem_void_pools(c, false);
	return 0;
}

void tmem_detach(struct tmem_core *c)
{
	c->attached = false;
	c->c.host_resets_seen++;
	/* The host may have discarded entries we posted. */
	tmem_void_pools(c, true);
	c->wanted_bits = 0;
}

/* Attached and usable: 0; else -ENODEV, -EAGAIN (not READY) or -EPROTO. */
int tmem_ensure_attached_err(struct tmem_core *c)
{
	int err;

	if (!c->present)
		return -ENODEV;
	if (c->attached) {
		if (!host_changed(c))
			return c->broken ? -EAGAIN : 0;
		tmem_detach(c);
	}
	if (host_state(c) != TMEM_HOST_STATE_READY)
		return -EAGAIN;
	err = attach(c);
	if (err == -EPROTO)
		c->c.errors++;
	return err;
}

static void host_fault(struct tmem_core *c)
{
	/* A reset rewrites indices after RESET: that is a host change. */
	if (host_changed(c)) {
		tmem_detach(c);
		return;
	}
	c->c.errors++;
	c->broken = true;
	tmem_void_pools(c, true);
}

/* --- ring ----------------------------------------------------------------- */

bool tmem_have_room(struct tmem_core *c, enum need need)
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

void tmem_maybe_doorbell(struct tmem_core *c)
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

/* Writes and publishes @sqe; returns its tag, or 0 if not published. */
u64 tmem_post(struct tmem_core *c, struct tmem_sqe *sqe, u32 slot, int pool)
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
		tmem_maybe_doorbell(c);
	} else {
		/* Only a counter hangs on this read: no Dekker barrier needed. */
		if (READ_ONCE(hdr(c)->host_flags) & TMEM_HOST_NEEDS_DOORBELL)
			c->c.doorbells_deferred++;
		else
			c->unrung = 0; /* the host is polling: it sees them */
	}
	return tag;
}

void tmem_op_failed(struct tmem_core *c, const struct tmem_core_pending *p,
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
			tmem_op_failed(c, p, status);
		free_entry(c, index);
		break;
	case TMEM_OP_GET:
		if (status == TMEM_OK && result > 1)
			c->c.errors++;
		else if (status != TMEM_OK)
			tmem_op_failed(c, p, status);
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
			tmem_batch_completed(c, p, status, result);
			break;
		}
		tmem_batch_completed(c, p, status, result);
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
					tmem_sent_clear(pool);
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
			tmem_op_failed(c, p, status);
		free_entry(c, index);
		break;
	}
}

void tmem_reap(struct tmem_core *c)
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
	tmem_flush_wanted(c);
	if (c->ndeferred)
		tmem_post_deferred(c);
}

/* --- waiting for a completion --------------------------------------------- */

/*
 * Without the lock: spin, then sleep, until done(arg), or the deadline
 * (returns true). A get spins get_spin_ns per page it waits for, and at
 * least get_spin_min_ns: a batch keeps the host longer, a worker asleep
 * wakes late, and sleeping costs an interrupt and a wake-up, which under
 * emulation cost more than the host's whole batch.
 */
bool tmem_wait_for(struct tmem_core *c, bool (*done)(void *arg), void *arg,
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
