// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * tmem_core_admit.c - which puts go out under the host's admission hint
 * (and a probe's share after standing aside): whole readahead blocks at a
 * time, decided under the lock or, for keys never sent, without it.
 */
#include "tmem_core_internal.h"

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
u32 tmem_read_hint(struct tmem_core *c)
{
	u32 hint = TMEM_ADMIT_ALL;

	if (c->features & TMEM_FEAT_ADMISSION_HINT)
		hint = min(READ_ONCE(hdr(c)->admission_hint), TMEM_ADMIT_ALL);
	WRITE_ONCE(c->hint_seen, hint);
	WRITE_ONCE(c->hint_seen_at,
		   tmem_core_counter_read(&c->puts_refused_unlocked));
	return hint;
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

bool tmem_admit(struct tmem_core *c, const u32 *oid, u64 index)
{
	u64 block, epoch;
	u32 hint = admitted_share(c, tmem_read_hint(c), c->probing, &block);

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
	return admits_block(hint, tmem_oid_hash(c, oid), index / block, epoch);
}

/*
 * A put the hint refuses, of a key the host cannot hold (the filter never
 * saw it): decided without the lock, like get_never_sent_unlocked, on the
 * hint the locked path last read, at most TMEM_CORE_HINT_RECHECK_PUTS
 * lockless refusals old: then the locked path reads it again (a host that
 * raised it is heard within that many puts). While probing, on the probe's
 * share as tmem_admit() takes it: a guest that stood aside probes for a
 * pass of its re-read or more, and refusing each of those evictions under
 * the lock would cost a sequential re-reader a few percent. Not while
 * standing aside (the top of tmem_core_put decides those), nor for shared
 * pools. A stale view only
 * sends a put to the locked path or refuses one the host cannot hold, so
 * nothing is owed to the host either way. The kernel calls a put with the
 * mapping's lock held and interrupts off, on every eviction: under TCG the
 * locked refusal would be a throttled streamer's largest cost per page.
 */
bool tmem_put_refused_unlocked(struct tmem_core *c, int h, const u32 *oid,
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
	oid_h = tmem_oid_mix(oid);
	if (tmem_sent_maybe_of(p, oid_h, index))
		return false;
	epoch = admit_clock(c) / ADMIT_EPOCH_PUTS;
	if (admits_block(hint, oid_h, index / block, epoch))
		return false;
refused:
	tmem_core_counter_inc(&c->puts_refused_unlocked);
	return true;
}
