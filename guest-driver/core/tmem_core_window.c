// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * tmem_core_window.c - read-ahead windows: a get of a sequential reader
 * asks for a batch of pages (GET_BATCH) into a window of slots, later gets
 * are served from it, and a reader going on past a window asks for the
 * next ones without waiting. A window's pages left the host (exclusive
 * gets): every put or invalidate of a key kills its copy here first.
 */
#include "tmem_core_internal.h"

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
void tmem_windows_reset(struct tmem_core *c)
{
	u32 i;

	for (i = 0; i < TMEM_CORE_MAX_WINDOWS; i++) {
		c->c.prefetch_unused += hweight32(c->win[i].present);
		c->win[i].present = 0;
		c->win[i].missing = 0;
		c->win[i].state = WIN_FREE;
	}
}

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
void tmem_windows_kill(struct tmem_core *c, int h, const u32 *oid, u64 index)
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
void tmem_windows_kill_host_ids(struct tmem_core *c, u64 host_id_bits)
{
	u32 i;
	int h;

	for (i = 0; i < c->nwin; i++) {
		h = c->win[i].pool;
		if (c->win[i].state != WIN_FREE && h >= 0 &&
		    c->pools[h].state == POOL_READY &&
		    ((host_id_bits >> c->pools[h].host_id) & 1))
			tmem_windows_kill(c, h, NULL, 0);
	}
}

/* A GET_BATCH's CQE: the window becomes readable, or is dropped. */
void tmem_batch_completed(struct tmem_core *c, struct tmem_core_pending *p,
			  s32 status, u32 result)
{
	struct tmem_core_window *w = &c->win[p->slot];
	u32 mask = w->count >= 32 ? ~0u : (1u << w->count) - 1;
	u32 bits = status == TMEM_OK ? result & mask : 0;
	struct tmem_core_pool *pool = &c->pools[w->pool];
	u32 first;
	bool valid;

	if (status != TMEM_OK)
		tmem_op_failed(c, p, status);
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
int tmem_window_serve(struct tmem_core *c, int h, const u32 *oid, u64 index,
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
int tmem_window_pick(struct tmem_core *c, bool take_unread)
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
	tmem_reap(c);
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
int tmem_window_wait_serve(struct tmem_core *c, unsigned long *flags, int h,
			   const u32 *oid, u64 index, void *page, int *win)
{
	struct window_ticket t = { .c = c, .win = *win,
				   .tag = c->win[*win].tag,
				   .rings_gen = c->rings_gen };
	u32 pages = c->win[*win].count, waits = 0;
	u64 t0 = now(c);
	bool timed_out;

	unlock(c, *flags);
	timed_out = tmem_wait_for(c, window_filled, &t, pages, &waits);
	lock(c, flags);
	c->c.readahead_waits++;
	c->c.readahead_wait_ns += now(c) - t0;
	c->c.interrupt_waits += waits;
	if (timed_out)
		return -2;
	return tmem_window_serve(c, h, oid, index, page, win);
}

/* Pages to ask for from index on (1: a plain GET). */
u32 tmem_batch_size(struct tmem_core *c, int h, const u32 *oid, u64 index,
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
	while (n > 1 && !tmem_host_may_hold(c, h, oid, index + n - 1))
		n--;
	/* Nor for a page whose invalidate still waits: the host's is stale. */
	if (c->ndeferred)
		n = max(1u, tmem_deferred_clip(c, h, oid, index, n));
	return n;
}

u64 tmem_post_batch(struct tmem_core *c, int h, int id, const u32 *oid,
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
	tag = tmem_post(c, &sqe, NO_SLOT, h);
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
void tmem_read_ahead(struct tmem_core *c, int h, const u32 *oid, u32 wi)
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
	id = tmem_resolve(c, h, false);
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
		if (!tmem_host_may_hold(c, h, oid, next))
			return;
		count = tmem_batch_size(c, h, oid, next, end ? end - next : 0, true);
		if (count < 2 || !tmem_have_room(c, NEED_CONTROL))
			return;
		/* Never one with unread pages: they left the host. */
		nw = tmem_window_pick(c, false);
		if (nw < 0 || (u32)nw == wi)
			return;
		if (!tmem_post_batch(c, h, id, oid, next, count, nw, end))
			return;
		c->c.readaheads++;
	}
}

/* The guest's own view, for the host to show (never trusted there). */
void tmem_publish_prefetch_counts(struct tmem_core *c)
{
	if (!c->nwin || !c->attached)
		return;
	WRITE_ONCE(hdr(c)->guest_prefetch_used, c->c.prefetch_used);
	WRITE_ONCE(hdr(c)->guest_prefetch_unused, c->c.prefetch_unused);
}
