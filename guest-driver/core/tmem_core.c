// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * tmem_core.c - the guest ring protocol of proto/tmem_abi.h (see
 * tmem_core.h for the contract): its entry points, pools, and the put and
 * get paths; the other tmem_core_*.c files hold one concept each (see
 * tmem_core_internal.h). Built into tmem_ivshmem.ko and into the userspace
 * guest library; nothing here allocates or sleeps except through ops->wait
 * in get and new_handle, with the lock released.
 */
#include "tmem_core_internal.h"

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
	if (!tmem_have_room(c, NEED_CONTROL)) {
		tmem_reap(c);
		if (!tmem_have_room(c, NEED_CONTROL))
			return; /* next use tries again */
	}
	sqe.opcode = TMEM_OP_NEW_POOL;
	/* IRQ: init_fs may be waiting for it. */
	sqe.flags = TMEM_SQE_F_IRQ | (p->shared ? TMEM_SQE_F_SHARED : 0);
	if (p->shared)
		memcpy(sqe.oid, p->uuid, sizeof(p->uuid));
	tag = tmem_post(c, &sqe, NO_SLOT, h);
	if (!tag)
		return;
	p->state = POOL_CREATING;
	p->create_tag = tag;
}

/* The host pool id of a usable pool, or -1 (then maybe starts creating it). */
int tmem_resolve(struct tmem_core *c, int h, bool create)
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
			tmem_issue_invalidate(c, TMEM_OP_INVAL_POOL, h, p->host_id,
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

/* --- entry points --------------------------------------------------------- */

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
	tmem_sample_reset(c);
	err = tmem_ensure_attached_err(c);
	unlock(c, flags);
	return err;
}

void tmem_core_unbind(struct tmem_core *c)
{
	unsigned long flags;

	lock(c, &flags);
	c->present = false;
	if (c->attached)
		tmem_detach(c);
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
	err = tmem_ensure_attached_err(c);
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
		tmem_reap(w->c);
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
	int id, admitted = -1; /* tmem_admit() counts puts: asked once at most */

	/*
	 * Standing aside, a private pool's put sends nothing (the pools were
	 * wiped when it stood aside): decided without the lock, as
	 * get_never_sent_unlocked decides its gets. A put that reads a
	 * stale true skips a page the host cannot hold an older copy of: a
	 * copy put after the resume was put, then read back (a get, which
	 * takes it from a private pool) before this eviction, and the page
	 * cache's locks order all of that after the resume's write. In the
	 * kernel this runs under the mapping's lock with interrupts off, on
	 * every eviction, and a guest standing aside still evicts at its full
	 * rate: taking the core's lock would be most of what a put costs it.
	 */
	if (h >= 0 && h < (int)TMEM_MAX_POOLS && !c->pools[h].shared &&
	    READ_ONCE(c->aside)) {
		tmem_core_counter_inc(&c->puts_skipped_aside);
		return;
	}
	if (tmem_put_refused_unlocked(c, h, oid, index))
		return;
	lock(c, &flags);
	if (tmem_sampled_for_nothing(c, h))
		tmem_stand_aside_unused(c);
	/*
	 * Told to send nothing and holding nothing: decided before the clock
	 * is read, so a frontend told "off" costs the guest a lock and a few
	 * loads per evicted page (not timed in put_ns).
	 */
	if (tmem_holds_nothing_private(c, h) &&
	    (c->features & TMEM_FEAT_ADMISSION_HINT) && tmem_read_hint(c) == 0) {
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
	    !tmem_host_may_hold(c, h, oid, index)) {
		admitted = tmem_admit(c, oid, index);
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
	 * clock, counted, not timed: a guest standing aside still evicts at
	 * its full rate, and under TCG two clock reads cost more than the
	 * decision (the wait ends at a get, which reads the clock anyway).
	 */
	if (c->aside && valid_handle(c, h) && !c->pools[h].shared) {
		tmem_core_counter_inc(&c->puts_skipped_aside);
		unlock(c, flags);
		return;
	}
	t0 = now(c);
	/* Sent or not, this put makes a prefetched copy of the key stale. */
	if (valid_handle(c, h))
		tmem_windows_kill(c, h, oid, index);
	if (!ensure_attached(c)) {
		c->c.puts_dropped_no_pool++;
		goto out;
	}
	/*
	 * Nobody waits for a put's CQE, but the host stops consuming when
	 * the CQ is full: reap once half of it may be in use.
	 */
	if (in_flight(c) >= c->g.cq_entries / 2)
		tmem_reap(c);
	id = tmem_resolve(c, h, true);
	if (id < 0 && valid_handle(c, h) && c->pools[h].state == POOL_CREATING) {
		tmem_reap(c); /* its NEW_POOL may have completed already */
		id = tmem_resolve(c, h, false);
	}
	if (id < 0) {
		/* No host pool in this generation: the host holds nothing. */
		c->c.puts_dropped_no_pool++;
		goto out;
	}
	tmem_check_flush_done(c);
	if (flagged(c, id)) {
		/* The barrier drops older versions of this key too. */
		c->c.puts_dropped_flush_pending++;
		goto out;
	}
	if (c->aside || !(admitted >= 0 ? admitted : tmem_admit(c, oid, index))) {
		c->c.puts_skipped_aside += c->aside;
		c->c.puts_skipped_by_hint++;
		tmem_drop_put(c, h, id, oid, index);
		goto out;
	}
	if (!tmem_have_room(c, NEED_PUT)) {
		tmem_reap(c);
		id = tmem_resolve(c, h, false);
		if (id < 0 || !tmem_have_room(c, NEED_PUT) || flagged(c, id)) {
			c->c.puts_dropped_ring_full++;
			if (id >= 0)
				tmem_drop_put(c, h, id, oid, index);
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
	if (!tmem_post(c, &sqe, slot, h)) {
		c->c.puts_dropped_no_pool++; /* the host reset meanwhile */
		goto out;
	}
	tmem_mark_sent(c, &c->pools[h], oid, index);
	tmem_mark_sent(c, &c->pools[h], oid, U64_MAX);
	if (!c->pools[h].shared)
		WRITE_ONCE(c->private_sent, true);
	if (c->ndeferred)
		tmem_deferred_superseded(c, h, oid, index);
	c->c.puts_sent++;
out:
	t0 = now(c) - t0;
	c->c.put_ns += t0;
	c->sample_put_ns += t0;
	c->sample_puts++;
	unlock(c, flags);
}

/* --- get ------------------------------------------------------------------ */

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
	tmem_reap(c);
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
	 * TCG the locked decision would be a streaming guest's largest cost
	 * per page-cache miss.
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
		oid_h = tmem_oid_mix(oid);
		if (tmem_sent_maybe_of(&c->pools[h], oid_h, index))
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
	       (tmem_holds_nothing_private(c, h) ||
		(valid_handle(c, h) && !tmem_host_may_hold(c, h, oid, index)));
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
	 * disables interrupts, and under TCG the locked decision, then a
	 * precise clock read (ktime_get), would be a guest's largest costs per
	 * page-cache miss while it stands aside.
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
		      READ_ONCE(c->unsent_get_oid_hash) == tmem_oid_hash(c, oid));
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
	 * clock read its wait needs (tmem_standing_aside() resumes once it is
	 * over), counted, not timed (under TCG a clock read costs more than
	 * the decision; the writeback row's guest asked 44k times while
	 * aside, three reads each).
	 */
	if (tmem_standing_aside(c)) {
		c->c.gets_skipped_aside++;
		c->c.gets_miss++;
		c->c.gets_miss_local++;
		tmem_publish_prefetch_counts(c);
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
	tmem_reap(c); /* frees slots, completes barriers and pool creations */
	if (c->stalled_until_ns && now(c) < c->stalled_until_ns) {
		if (sq_head(c) == c->stall_sq_head) {
			c->c.gets_skipped_stalled++;
			goto miss_local;
		}
		c->stalled_until_ns = 0; /* the host moved: it is back */
		c->consecutive_timeouts = 0;
	}
	if (c->ndeferred && valid_handle(c, h) &&
	    !tmem_deferred_clip(c, h, oid, index, 1)) {
		c->c.gets_skipped_invalidating++;
		goto miss_local;
	}
	/* Prefetched by an earlier batch: no round trip, hit or miss. */
	if (c->nwin && valid_handle(c, h) && !c->pools[h].shared) {
		served = tmem_window_serve(c, h, oid, index, page, &win);
		if (served == -2)
			served = tmem_window_wait_serve(c, &flags, h, oid, index,
							page, &win);
		if (served == 1) {
			hit = true;
			c->c.gets_hit++;
			tmem_account_get(c, now(c) - t0, true, false);
			tmem_read_ahead(c, h, oid, win);
			goto out;
		}
		/* Still filling after the get's whole timeout: a miss. */
		if (served == 0 || served == -2)
			goto miss_local;
	}
	id = tmem_resolve(c, h, true);
	if (id < 0 || flagged(c, id))
		goto miss_local;
	count = tmem_batch_size(c, h, oid, index, max_pages, sequential);
	win = count > 1 && tmem_have_room(c, NEED_CONTROL) ? tmem_window_pick(c, true) : -1;
	if (win >= 0) {
		t.tag = tmem_post_batch(c, h, id, oid, index, count, win,
					max_pages ? index + max_pages : 0);
	} else {
		if (!tmem_have_room(c, NEED_GET))
			goto miss_local;
		slot = c->free_slots[--c->nfree_slots];
		sqe.opcode = TMEM_OP_GET;
		sqe.flags = TMEM_SQE_F_IRQ;
		sqe.pool = id;
		sqe.slot = slot;
		sqe.index = index;
		memcpy(sqe.oid, oid, sizeof(sqe.oid));
		t.tag = tmem_post(c, &sqe, slot, h);
	}
	if (!t.tag)
		goto miss_local;
	t.index = t.tag & TAG_INDEX_MASK;
	t.rings_gen = c->rings_gen;
	c->pending[t.index].waiter = WAITING;
	unlock(c, flags);

	t_wait = now(c);
	timed_out = tmem_wait_for(c, get_done_locked, &t, win >= 0 ? count : 1,
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
	tmem_account_get(c, now(c) - t0, hit, win < 0);
	goto out;

miss_local:
	c->c.gets_miss++;
	c->c.gets_miss_local++;
out:
	tmem_publish_prefetch_counts(c);
	c->c.get_ns += now(c) - t0;
	unlock(c, flags);
	return hit;
}

/* --- invalidates, release, poll and state --------------------------------- */

void tmem_core_invalidate_page(struct tmem_core *c, int h, const u32 *oid,
			       u64 index)
{
	unsigned long flags;

	lock(c, &flags);
	tmem_invalidate(c, TMEM_OP_INVAL_PAGE, h, oid, index);
	unlock(c, flags);
}

void tmem_core_invalidate_object(struct tmem_core *c, int h, const u32 *oid)
{
	unsigned long flags;

	lock(c, &flags);
	tmem_invalidate(c, TMEM_OP_INVAL_OBJECT, h, oid, 0);
	unlock(c, flags);
}

void tmem_core_invalidate_pool(struct tmem_core *c, int h)
{
	unsigned long flags;

	lock(c, &flags);
	tmem_invalidate(c, TMEM_OP_INVAL_POOL, h, NULL, 0);
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
	tmem_windows_kill(c, h, NULL, 0);
	if (ensure_attached(c) && p->state == POOL_READY) {
		tmem_check_flush_done(c);
		if (!p->shared && !flagged(c, p->host_id) &&
		    tmem_have_room(c, NEED_CONTROL)) {
			sqe.opcode = TMEM_OP_DESTROY_POOL;
			sqe.pool = p->host_id;
			tmem_post(c, &sqe, NO_SLOT, -1);
		} else {
			/* Shared pools outlive us; a full ring gets the barrier. */
			tmem_issue_invalidate(c, TMEM_OP_INVAL_POOL, h, p->host_id,
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
		tmem_reap(c);
	unlock(c, flags);
}

void tmem_core_interrupt(struct tmem_core *c)
{
	unsigned long flags;

	lock(c, &flags);
	c->c.interrupts++;
	if (c->present && c->attached)
		tmem_reap(c);
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
	s->miss_cost_ns = tmem_miss_cost(c);
	for (i = 0; i < c->nwin; i++)
		s->prefetched += hweight32(c->win[i].present);
	unlock(c, flags);
}
