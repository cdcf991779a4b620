/* SPDX-License-Identifier: (GPL-2.0 OR MIT) */
/*
 * tmem_core.h - the guest side of the tmemd ring protocol (proto/tmem_abi.h),
 * once, for the Linux module (tmem_ivshmem_main.c) and the userspace library
 * (TmemGuest). Kernel-style C that the kernel compiles as is.
 *
 * Contract (cleancache semantics):
 *  - Put never blocks and may be dropped; a put that is not sent still kills
 *    the key's older page on the host (INVAL_PAGE), unless the pool's
 *    sent-keys filter says the key was never sent. Get may wait, at most
 *    get_timeout_ns; a timeout is a miss. Invalidates never block and are
 *    never lost (a full ring falls back to the pool's flush barrier).
 *  - No stale data: a get returns a miss or the bytes of the latest put of
 *    that key, honouring every earlier invalidate. Ring order is op order.
 *  - Everything read from shared memory is hostile: geometry is validated
 *    once per host generation and used only through the validated copy;
 *    corrupt indices stop the ring until the host resets it.
 *
 * Memory: the caller owns all of it. tmem_core_bind() takes the region and
 * the tables; tmem_core_new_handle() takes a pool's sent-keys filter and
 * gives back the one it replaces. Nothing here allocates.
 *
 * Context: every entry point takes the platform lock (ops->lock) itself.
 * put, invalidate_*, release_handle, poll and interrupt never sleep and may
 * run with IRQs off (the kernel calls put/invalidate under the mapping's
 * xa_lock). get and new_handle may sleep, through ops->wait, with the lock
 * released. Entry points must not be called with the platform lock held.
 */
#ifndef TMEMD_GUEST_DRIVER_CORE_TMEM_CORE_H_
#define TMEMD_GUEST_DRIVER_CORE_TMEM_CORE_H_

#include "tmem_core_compat.h"
#include "tmem_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Errors of tmem_core_new_handle() besides the host's TMEM_ERR_* refusal. */
#define TMEM_CORE_ERR_NO_HANDLE (-24)	/* TMEM_MAX_POOLS handles in use */
#define TMEM_CORE_ERR_NO_SHARED (-95)	/* host offers no shared pools */

/* Platform services. ctx is tmem_core.ops_ctx. */
struct tmem_core_ops {
	/* The one lock around all core state (kernel: spin_lock_irqsave). */
	void (*lock)(void *ctx, unsigned long *flags);
	void (*unlock)(void *ctx, unsigned long flags);
	/* A monotonic clock. */
	u64 (*now_ns)(void *ctx);
	/*
	 * The same clock read cheaply, late by up to a scheduler tick (kernel:
	 * ktime_get_coarse_ns): for deadlines of milliseconds or more, checked
	 * on every page-cache miss. NULL: now_ns.
	 */
	u64 (*coarse_now_ns)(void *ctx);
	/* Writes (peer << 16) | vector to the doorbell register. Never sleeps. */
	void (*doorbell)(void *ctx, u32 value);
	/*
	 * Called without the lock: sleeps until the completion interrupt, until
	 * done(arg) holds, or for about timeout_ns, whichever is first (may
	 * return early). Returns true if it waited on the interrupt (counted),
	 * false if it only slept (no interrupt available).
	 */
	bool (*wait)(void *ctx, bool (*done)(void *arg), void *arg,
		     u64 timeout_ns);
	/* One TMEM_PAGE_SIZE copy between a caller's page and a slot. */
	void (*copy_to_slot)(void *ctx, void *slot, const void *page);
	void (*copy_from_slot)(void *ctx, void *page, const void *slot);
	/* Random bits for generations and tag serials. */
	u64 (*random_u64)(void *ctx);
};

/* Tunables, read at every use (the kernel maps module parameters here). */
struct tmem_core_config {
	u64 get_spin_ns;	 /* a get spins this long per page, then sleeps */
	/*
	 * ... but never less than this: a host worker woken by the doorbell
	 * answers a single get later than get_spin_ns, and a guest that went
	 * to sleep pays an interrupt and a wake-up on top (bench/RESULTS.md).
	 */
	u64 get_spin_min_ns;
	u64 get_timeout_ns;	 /* then it is a miss */
	u64 pool_create_timeout_ns;
	u64 pool_retry_ns;	 /* after a refused NEW_POOL */
	u64 stall_probe_ns;	 /* a stalled host gets one get this often */
	u64 ring_full_spin_ns;	 /* an invalidate waits this long for room */
	u32 stall_after_timeouts; /* 0: never take the host as stalled */
	u32 invalidate_reserve;	 /* 0: sq_entries / 8 */
	/*
	 * Page invalidates (a dropped put's, or the page cache's) that find
	 * no room even in the reserve wait here for room, at most this many
	 * (and TMEM_CORE_MAX_DEFERRED_INVALIDATES); beyond that, or with 0,
	 * the pool falls back to the flush barrier.
	 */
	u32 deferred_invalidates;
	u32 doorbell_batch;	 /* 0: min(sq, slots) / 16 */
	/*
	 * Batched gets (TMEM_OP_GET_BATCH, used only when the host offers
	 * TMEM_FEAT_GET_BATCH): a get on a private pool asks for up to
	 * batch_pages pages from its index on, into one of prefetch_windows
	 * windows of TMEM_GET_BATCH_MAX slots. 0 or 1: plain gets only.
	 */
	u32 batch_pages;
	u32 prefetch_windows;	 /* at most TMEM_CORE_MAX_WINDOWS */
	/*
	 * Read-ahead: when a get is served from a full window, the next
	 * readahead_windows blocks of the object are asked for at once, without
	 * waiting (as the page cache's own async readahead does for the disk),
	 * so a sequential reader finds them filled instead of paying a round
	 * trip per block. A get whose page is in a window still being filled
	 * waits for that window. 0: a batch only when a get asks.
	 */
	u32 readahead_windows;
	/*
	 * Never slower: over every aside_sample_gets gets served by the host
	 * or a window, the guest's time in those gets is compared with what
	 * the pages served would have cost from disk (miss_cost_ns each).
	 * When tmem costs more, the guest stands aside (INVAL_POOL of its
	 * private pools, TMEM_GUEST_STANDING_ASIDE, then no puts, gets or
	 * private invalidates) for aside_probe_ns, doubling up to 64x while
	 * it keeps not paying, then resumes and measures again; 64x at once
	 * when even a hit for every get and every put would not pay (a loss
	 * only a change of costs can turn: see tmem_core_set_miss_cost).
	 * miss_cost_ns 0: never stand aside. A platform that can measure what
	 * a miss costs (the kernel: the block device's read time per page)
	 * reports it with tmem_core_set_miss_cost(); that replaces this
	 * estimate. Gets made while the host admits only a sample of the puts
	 * (admission hint below TMEM_ADMIT_ALL) are a reuse probe, not a
	 * measure of cost: those samples are discarded.
	 */
	u64 miss_cost_ns;
	u64 aside_probe_ns;
	u32 aside_sample_gets;
	/*
	 * While probing after standing aside, puts go out for this share of
	 * the blocks only (of TMEM_ADMIT_ALL), until a sample says tmem pays:
	 * a probe of a guest for which tmem does not pay costs that share.
	 */
	u32 aside_probe_share;
	/*
	 * Sampled for nothing: while the host admits less than a probe's
	 * share of the puts (its valve found no reuse, or is short of CPU),
	 * this many evictions with no get of a page the host may hold make
	 * the guest stand aside as above (aside_probe_ns, doubling up to 8x),
	 * where a page-cache event costs what it does when told "off".
	 * 0: never.
	 */
	u64 aside_unused_evictions;
	bool skip_unsent_gets;	 /* filter says never sent: local miss */
	u64 ram_pages;		 /* told to the host (guest_ram_pages); 0: not */
};

#define TMEM_CORE_MAX_WINDOWS 16u
#define TMEM_CORE_MAX_DEFERRED_INVALIDATES 128u

/* An INVAL_PAGE waiting for ring room (tmem_core_flush.c: deferred invalidates). */
struct tmem_core_deferred_invalidate {
	u64 index;
	u64 incarnation;	/* of its pool when it was deferred */
	u64 epoch;		/* the core's, then */
	u32 oid[TMEM_OBJECT_WORDS];
	s32 h;
};

/* Every counter has one meaning; which ones add up is said per group. */
struct tmem_core_counters {
	/* Every put lands in exactly one of these five. */
	u64 puts_sent;
	u64 puts_skipped_by_hint;
	u64 puts_dropped_ring_full;
	u64 puts_dropped_no_pool;
	u64 puts_dropped_flush_pending;
	u64 puts_dropped_by_host;	/* of puts_sent: TMEM_ERR_DROPPED */
	/* gets_hit + gets_miss = gets. */
	u64 gets_hit;
	u64 gets_miss;
	u64 gets_timeout;		/* of gets_miss: no CQE in time */
	u64 gets_miss_local;		/* of gets_miss: decided without host */
	u64 gets_skipped_stalled;	/* of gets_miss_local */
	u64 gets_skipped_never_sent;	/* of gets_miss_local */
	/* Of gets_miss_local: the key's INVAL_PAGE still waits for room. */
	u64 gets_skipped_invalidating;
	u64 host_stalls;
	u64 invalidates;		/* invalidate calls */
	u64 invalidates_skipped_never_sent; /* of those: nothing was sent */
	u64 invalidates_for_dropped_puts;   /* INVAL_PAGE for unsent puts */
	u64 drop_invalidates_avoided;	/* unsent puts of never-sent keys */
	u64 flush_fallbacks;
	u64 invalidates_deferred;	/* INVAL_PAGEs that waited for room */
	u64 guest_resets;
	u64 host_resets_seen;
	u64 pools_created;
	/* new_handle stopped waiting for NEW_POOL (made on first use then). */
	u64 pool_create_timeouts;
	u64 doorbells;
	u64 doorbells_deferred;
	u64 interrupts;
	u64 interrupt_waits;
	u64 stale_completions;
	/*
	 * Every entry published and every completion matched to one: the
	 * host processed at least completions_reaped and at most sqes_posted.
	 */
	u64 sqes_posted;
	u64 completions_reaped;
	u64 errors;
	/* Batched gets. */
	u64 get_batches;		/* GET_BATCH entries sent */
	u64 gets_not_sequential;	/* plain GET: not the next page of the last */
	u64 prefetch_used;		/* of gets_hit: served from a window */
	u64 prefetch_unused;		/* prefetched pages dropped unread */
	u64 gets_negative_cached;	/* of gets_miss_local: the batch said miss */
	u64 readaheads;			/* of get_batches: asked ahead, no waiter */
	u64 readahead_waits;		/* gets that waited for a window filling */
	u64 readahead_wait_ns;		/* of get_ns: those waits */
	/* Standing aside (never slower). */
	u64 stood_aside;		/* times the guest stood aside */
	u64 stood_aside_longest;	/* of those: a loss no hit ratio turns */
	u64 stood_aside_unused;		/* of those: sampled for nothing */
	u64 gets_skipped_aside;		/* of gets_miss_local */
	u64 puts_skipped_aside;		/* of puts_skipped_by_hint */
	u64 puts_refused_unlocked;	/* of puts_skipped_by_hint, no lock */
	u64 invalidates_skipped_aside;	/* private pools, nothing held */
	u64 aside_samples_discarded;	/* under a sampling hint, or stale */
	u64 aside_cost_rose;		/* resumed early: a miss costs 2x more */
	u64 put_ns;	/* time in put, all but those the hint 0 refuses */
	u64 get_ns;	/* time in get, waits included; not the lockless ones */
	u64 round_trips;		/* gets that waited for a CQE */
	u64 round_trip_wait_ns;		/* of get_ns: posted to CQE seen */
};

/* One per SQE from post to reaped CQE (tag's low bits index it). */
struct tmem_core_pending {
	u64 tag;	/* 0: free */
	u64 incarnation;
	u64 epoch;
	u32 slot;
	s16 pool;
	u8 opcode;
	u8 waiter;
};

struct tmem_core_pool {
	u8 state;
	bool shared;
	bool inval_on_ready;
	u8 uuid[16];
	u16 host_id;
	u64 incarnation;
	u64 create_tag;
	s32 refusal;
	u64 retry_after_ns;
	/*
	 * Private pools: Bloom filter of keys (and objects) sent since the host
	 * last held nothing of the pool. No false negatives. NULL: none.
	 */
	unsigned long *sent;
	u32 sent_bits;
};

/*
 * A prefetch window: TMEM_GET_BATCH_MAX consecutive slots that one GET_BATCH
 * filled with pages first .. first + count - 1 of one object. Private pools
 * only: the host forgot every page it returned, so the slot holds the only
 * copy; every put or invalidate of a key drops it before anything can read
 * it (all under the core lock).
 */
struct tmem_core_window {
	u64 first;		/* page index in the window's first slot */
	u64 epoch;		/* core epoch of the fill */
	u64 incarnation;	/* the pool's */
	u64 lru;		/* last use, for reuse */
	u32 oid[TMEM_OBJECT_WORDS];
	u32 present;		/* bit k: page first + k unread in slot k */
	u32 missing;		/* bit k: the host had no page first + k */
	u32 killed;		/* while fetching: put or invalidated meanwhile */
	u64 tag;		/* its GET_BATCH's, while fetching */
	u64 end;		/* the object's page count when asked; 0: unknown */
	bool ahead;		/* its read-ahead was asked (or not wanted) */
	u16 count;
	s16 pool;		/* handle */
	u8 state;
	bool doomed;		/* while fetching: object or pool invalidated */
};

struct tmem_core_geometry {
	u32 features_host;
	u64 host_generation;
	u32 host_peer_id;
	u32 sq_offset, sq_entries;
	u32 cq_offset, cq_entries;
	u32 slots_offset, slot_count;
};

struct tmem_core {
	/* Set by the caller before tmem_core_init(). */
	const struct tmem_core_ops *ops;
	void *ops_ctx;
	const struct tmem_core_config *cfg;

	/* Bound region and tables (tmem_core_bind). */
	u8 *shm;
	u64 shm_size;
	struct tmem_core_pending *pending;
	u32 *free_pending;
	u32 pending_max;	/* capacity of pending/free_pending */
	u32 *free_slots;
	u32 slots_max;		/* capacity of free_slots */
	bool present;

	bool attached;
	bool broken;
	bool have_rings;
	u64 rings_generation;
	u64 rings_gen;		/* bumped whenever the pending table resets */
	u64 host_generation;
	u64 guest_generation;
	u32 features;
	u64 epoch;		/* bumped whenever host pool ids go void */
	struct tmem_core_geometry g;

	u32 sq_tail;
	u32 cq_head;
	u32 reserve;
	u32 doorbell_batch;
	u32 unrung;
	u32 pending_cap;
	u32 nfree_pending;
	u32 nfree_slots;
	u32 slots_usable;
	u64 next_serial;
	u64 next_incarnation;

	struct tmem_core_pool pools[TMEM_MAX_POOLS];
	u64 flush_bits;
	u64 flush_seq;
	u64 wanted_bits;
	struct tmem_core_deferred_invalidate deferred[TMEM_CORE_MAX_DEFERRED_INVALIDATES];
	u32 ndeferred;

	/*
	 * A put reached a private pool since the host last forgot us. Read
	 * without the lock by tmem_core_get (written with
	 * WRITE_ONCE, like aside).
	 */
	bool private_sent;
	/*
	 * Gets tmem_core_get decides without the lock: in
	 * gets_miss, gets_miss_local and gets_skipped_never_sent as read by
	 * tmem_core_read_counters, not in c.
	 */
	struct tmem_core_counter gets_skipped_nothing_sent;
	/* The last get it decided by the filter: object hash and page. */
	u64 unsent_get_oid_hash, unsent_get_index;
	/*
	 * Puts of private pools while standing aside, decided without the
	 * lock: in puts_skipped_aside and puts_skipped_by_hint as read by
	 * tmem_core_read_counters, not in c.
	 */
	struct tmem_core_counter puts_skipped_aside;
	/* Gets while aside decided so: in gets_skipped_aside, gets_miss, gets_miss_local. */
	struct tmem_core_counter gets_skipped_aside;
	/*
	 * Puts refused by put_refused_unlocked: in puts_skipped_by_hint and
	 * drop_invalidates_avoided; with admit_puts, admit()'s epoch clock.
	 * It refuses on hint_seen (the hint as the locked path last read it,
	 * when this counter stood at hint_seen_at), all three written with
	 * WRITE_ONCE under the lock.
	 */
	struct tmem_core_counter puts_refused_unlocked;
	u32 hint_seen;
	u64 hint_seen_at;
	u32 consecutive_timeouts;
	u32 stall_sq_head;
	u64 stalled_until_ns;

	/* Prefetch area: nwin windows from slot area_base on. */
	struct tmem_core_window win[TMEM_CORE_MAX_WINDOWS];
	u32 nwin;
	u32 area_base;
	u64 lru_clock;
	/*
	 * The last get's key: a batch is asked for only when this get follows
	 * it (same pool and object, next index) or reads a file's first page,
	 * i.e. the page cache is reading a file sequentially. A batch takes its pages from the host
	 * (exclusive), so prefetching for random reads would throw away pages
	 * that later gets would have hit.
	 */
	int last_get_pool;
	u32 last_get_oid[TMEM_OBJECT_WORDS];
	u64 last_get_index;
	/*
	 * The last object hashed (under the lock): a file's pages come in
	 * runs, so a page's key hash costs one mix instead of four.
	 */
	bool hashed_valid;
	u32 hashed_oid[TMEM_OBJECT_WORDS];
	u64 hashed_oid_hash;

	/* Never slower: the current sample and the standing-aside state. */
	bool aside;
	bool probing;		/* resumed, not yet shown to pay */
	u64 admit_puts;		/* puts that asked admit(): its epoch clock */
	u64 unused_from;	/* admit_clock() at the last sign of use */
	u64 aside_until_ns;
	u64 aside_backoff_ns;
	u64 sample_ns;		/* guest time in gets served by host or window */
	u64 sample_hits;
	u32 sample_gets;
	u64 sample_start_ns;	/* when the sample's first get came */
	u64 get_ns_per_hit;	/* last sample's, as published */
	u64 miss_cost_measured_ns; /* tmem_core_set_miss_cost(); 0: none yet */
	u64 miss_cost_random_ns; /* tmem_core_set_random_miss_cost(); 0: none */
	u64 sample_cost_ns;	/* what the sample's hits would cost from disk */
	u64 sample_put_ns;	/* time in puts since the sample's first get */
	u64 sample_puts;	/* the puts timed in sample_put_ns */
	u64 aside_miss_ns;	/* the miss cost when it last stood aside */

	struct tmem_core_counters c;
};

/* A debugfs/report view, taken under the lock. */
struct tmem_core_state {
	bool present, attached, broken;
	u32 host_state, admission_hint, in_flight, free_slots, slots_usable;
	u32 invalidate_reserve, prefetch_windows, prefetched;
	bool standing_aside;
	u64 get_ns_per_hit, miss_cost_ns; /* miss cost in use */
	u64 host_generation, guest_generation;
	bool flush_pending;
};

void tmem_core_init(struct tmem_core *c, const struct tmem_core_ops *ops,
		    void *ops_ctx, const struct tmem_core_config *cfg);
/*
 * Binds the region (shm, size bytes) and the tables: pending and
 * free_pending hold pending_max entries, free_slots slots_max. Then tries
 * to attach; returns 0, -EAGAIN (host not READY) or -EPROTO (bad header).
 */
int tmem_core_bind(struct tmem_core *c, u8 *shm, u64 size,
		   struct tmem_core_pending *pending, u32 *free_pending,
		   u32 pending_max, u32 *free_slots, u32 slots_max);
/* The device is gone: ops become no-ops; the caller may free the tables. */
void tmem_core_unbind(struct tmem_core *c);
/* Attaches if the host is READY: 0, -EAGAIN, -EPROTO, or -ENODEV. */
int tmem_core_try_attach(struct tmem_core *c);

/*
 * init_fs/init_shared_fs: a handle (>= 0) or TMEM_CORE_ERR_* / the host's
 * TMEM_ERR_* refusal. Takes `sent` as the pool's sent-keys filter (private
 * pools only; sent_bits a power of two >= BITS_PER_LONG; NULL: none) and
 * returns in *old_sent the filter the caller must free: the handle's
 * previous one, or `sent` itself when no handle was free. May sleep up to
 * pool_create_timeout_ns.
 */
int tmem_core_new_handle(struct tmem_core *c, bool shared, const u8 *uuid,
			 unsigned long *sent, u32 sent_bits,
			 unsigned long **old_sent);
void tmem_core_put(struct tmem_core *c, int h, const u32 *oid, u64 index,
		   const void *page);
/*
 * 1: hit, page holds it; 0: miss. May sleep. max_pages: how many pages from
 * index on the object has (the file's end; 0: unknown), bounding a batch.
 */
int tmem_core_get(struct tmem_core *c, int h, const u32 *oid, u64 index,
		  u32 max_pages, void *page);
/*
 * A put the host's hint refuses is decided without the lock on the hint the
 * core last read under it; a change of the hint is heard within this many
 * puts (a valve changes it at most once per period, ~100 ms).
 */
#define TMEM_CORE_HINT_RECHECK_PUTS 64u
void tmem_core_invalidate_page(struct tmem_core *c, int h, const u32 *oid,
			       u64 index);
void tmem_core_invalidate_object(struct tmem_core *c, int h, const u32 *oid);
void tmem_core_invalidate_pool(struct tmem_core *c, int h);
/* Unmount: destroys the pool and frees the handle. */
void tmem_core_release_handle(struct tmem_core *c, int h);
/* Reaps completions, notices resets. */
void tmem_core_poll(struct tmem_core *c);
/* The completion interrupt (counts it, then polls). */
void tmem_core_interrupt(struct tmem_core *c);
/*
 * What a page-cache miss costs now, per page, as the platform measured it
 * (0: unknown, use miss_cost_ns). Replaces the configured estimate in the
 * never-slower decision; a configured miss_cost_ns of 0 still means never.
 */
void tmem_core_set_miss_cost(struct tmem_core *c, u64 ns_per_page);
/*
 * The same for small (random) reads, per read: a plain GET (a random
 * reader's) is weighed against this, a batch or window (a sequential
 * reader's) against the per-page cost above. While the platform has
 * measured sequential reads but no small ones yet, plain GETs decide
 * nothing: a random reader is not judged by what readahead costs.
 */
void tmem_core_set_random_miss_cost(struct tmem_core *c, u64 ns_per_read);
/* The host pool id behind a handle, or -1. */
int tmem_core_host_pool_id(struct tmem_core *c, int h);
void tmem_core_get_state(struct tmem_core *c, struct tmem_core_state *s);
/* The counters, the lockless fast path's folded in (no lock taken). */
void tmem_core_read_counters(const struct tmem_core *c,
			     struct tmem_core_counters *out);

#ifdef __cplusplus
}
#endif

#endif /* TMEMD_GUEST_DRIVER_CORE_TMEM_CORE_H_ */
