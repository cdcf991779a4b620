// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * tmem_core_flush.c - invalidates that are never lost. An invalidate goes
 * into the ring (waiting briefly for room), else waits as a deferred
 * invalidate, else falls back to the pool's flush barrier (or INVAL_POOL),
 * and as a last resort to a new guest generation, which makes the host
 * forget this VM. Until a pool's flush is done nothing of it is posted.
 */
#include "tmem_core_internal.h"

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
	c->guest_generation = tmem_new_generation(c, c->guest_generation);
	store_guest_generation(c);
	c->c.guest_resets++;
	tmem_void_pools(c, false);
	c->wanted_bits = 0;
	tmem_maybe_doorbell(c);
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
	tmem_forget_sent(c, bits);
	tmem_windows_kill_host_ids(c, bits);
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
	tmem_maybe_doorbell(c);
}

/* Pools that needed a flush while one was pending, right after a reap. */
void tmem_flush_wanted(struct tmem_core *c)
{
	u64 bits;
	struct tmem_sqe sqe;

	if (c->flush_bits || !c->wanted_bits || !c->attached || c->broken)
		return;
	bits = c->wanted_bits;
	c->wanted_bits = 0;
	while (bits) {
		int id = __ffs64(bits);

		if (!tmem_have_room(c, NEED_INVALIDATE)) {
			if (c->attached && !c->broken)
				request_flush(c, bits);
			return;
		}
		memset(&sqe, 0, sizeof(sqe));
		sqe.opcode = TMEM_OP_INVAL_POOL;
		sqe.pool = id;
		tmem_post(c, &sqe, NO_SLOT, -1);
		tmem_forget_sent(c, 1ull << id);
		bits &= bits - 1;
	}
}

void tmem_check_flush_done(struct tmem_core *c)
{
	if (c->flush_bits && flush_done_seq(c) == c->flush_seq) {
		/* Acked: the host ignores the bits until the seq moves again. */
		WRITE_ONCE(hdr(c)->flush_request, 0);
		c->flush_bits = 0;
	}
	if (!c->flush_bits && c->wanted_bits)
		tmem_reap(c);
}

/* Ring full: give a busy host a few microseconds (IRQs may be off). */
static bool wait_for_room(struct tmem_core *c)
{
	u64 deadline = now(c) + READ_ONCE(c->cfg->ring_full_spin_ns);

	while (now(c) < deadline) {
		cpu_relax();
		tmem_reap(c);
		if (!c->attached || c->broken)
			return false;
		if (tmem_have_room(c, NEED_INVALIDATE))
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
 * Only past the bound does the pool fall back to the flush barrier: else
 * a burst of puts (drop_caches, a large read) into a host slower than the
 * guest would turn a few dropped puts into a flush of the whole pool.
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

void tmem_post_deferred(struct tmem_core *c)
{
	struct tmem_sqe sqe;
	u32 i, kept = 0;

	for (i = 0; i < c->ndeferred; i++) {
		struct tmem_core_deferred_invalidate *d = &c->deferred[i];

		if (!deferred_live(c, d))
			continue;
		if (kept == 0 && tmem_have_room(c, NEED_INVALIDATE)) {
			memset(&sqe, 0, sizeof(sqe));
			sqe.opcode = TMEM_OP_INVAL_PAGE;
			sqe.pool = c->pools[d->h].host_id;
			sqe.index = d->index;
			memcpy(sqe.oid, d->oid, sizeof(sqe.oid));
			if (tmem_post(c, &sqe, NO_SLOT, d->h))
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
u32 tmem_deferred_clip(struct tmem_core *c, int h, const u32 *oid, u64 index,
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
void tmem_deferred_superseded(struct tmem_core *c, int h, const u32 *oid,
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

void tmem_issue_invalidate(struct tmem_core *c, u8 opcode, int h,
			   int host_id, const u32 *oid, u64 index)
{
	struct tmem_sqe sqe = {};

	if (flagged(c, host_id))
		return; /* the pending flush covers it */
	if (!tmem_have_room(c, NEED_INVALIDATE)) {
		tmem_reap(c);
		/* A reset or fault in the reap voided everything anyway. */
		if (!c->attached || c->broken || flagged(c, host_id))
			return;
		if (!tmem_have_room(c, NEED_INVALIDATE) && !wait_for_room(c)) {
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
	tmem_post(c, &sqe, NO_SLOT, h);
	if (opcode == TMEM_OP_INVAL_POOL)
		tmem_forget_sent(c, 1ull << host_id);
}

/* An unsent put must still kill the host's older page of its key. */
void tmem_drop_put(struct tmem_core *c, int h, int host_id, const u32 *oid,
		   u64 index)
{
	if (!tmem_host_may_hold(c, h, oid, index)) {
		c->c.drop_invalidates_avoided++;
		return;
	}
	c->c.invalidates_for_dropped_puts++;
	tmem_issue_invalidate(c, TMEM_OP_INVAL_PAGE, h, host_id, oid, index);
}

void tmem_invalidate(struct tmem_core *c, u8 opcode, int h, const u32 *oid,
		     u64 index)
{
	int id;

	c->c.invalidates++;
	/* Aside: a private pool was wiped, nothing of it was sent since. */
	if (c->aside && valid_handle(c, h) && !c->pools[h].shared) {
		c->c.invalidates_skipped_aside++;
		return;
	}
	if (oid && tmem_holds_nothing_private(c, h)) {
		c->c.invalidates_skipped_never_sent++;
		return;
	}
	/* Before anything else: a prefetched copy must never outlive this. */
	if (valid_handle(c, h))
		tmem_windows_kill(c, h, oid,
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
	id = tmem_resolve(c, h, false);
	if (id < 0) {
		/* Not on the host in this generation: it holds none of ours. */
		if (valid_handle(c, h) && c->pools[h].shared)
			c->pools[h].inval_on_ready = true;
		return;
	}
	if (oid && !tmem_host_may_hold(c, h, oid,
				       opcode == TMEM_OP_INVAL_PAGE ? index : U64_MAX)) {
		c->c.invalidates_skipped_never_sent++;
		return;
	}
	tmem_check_flush_done(c);
	tmem_issue_invalidate(c, opcode, h, id, oid, index);
}
