// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * tmem_core_sent.c - the sent-keys filter: per private pool, a Bloom filter
 * of the keys (and objects) put since the host last held nothing of it, so
 * that a get, an invalidate or a dropped put of a key never sent costs no
 * round trip and no ring entry. No false negatives: a key it does not hold
 * is not on the host.
 */
#include "tmem_core_internal.h"

u64 tmem_oid_mix(const u32 *oid)
{
	u64 h = 0;
	u32 i;

	for (i = 0; i < TMEM_OBJECT_WORDS; i += 2)
		h = mix64(h ^ (oid[i] | (u64)oid[i + 1] << 32));
	return h;
}

/* Hash of an object id, remembered for the next call (under the lock). */
u64 tmem_oid_hash(struct tmem_core *c, const u32 *oid)
{
	u64 h;

	if (c->hashed_valid && !memcmp(c->hashed_oid, oid, sizeof(c->hashed_oid)))
		return c->hashed_oid_hash;
	h = tmem_oid_mix(oid);
	memcpy(c->hashed_oid, oid, sizeof(c->hashed_oid));
	c->hashed_oid_hash = h;
	c->hashed_valid = true;
	return h;
}

/*
 * Where a key's bits lie in a pool's sent-keys filter. SENT_RUN_PAGES
 * consecutive pages of an object share one SENT_LINE_BITS line (a cache
 * line), picked by a hash of the object and index / SENT_RUN_PAGES; the
 * key picks its SENT_KEY_BITS bits inside that line. A reader going
 * through a file touches one line per run of pages instead of two random
 * words per page: the filter (128 KiB by default) does not stay cached
 * beside the page cache's traffic, so the load of a filter word would be
 * nearly all of the frontend's time per page-cache miss of a streaming
 * reader. Runs arrive in clumps (admission is by
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
void tmem_mark_sent(struct tmem_core *c, struct tmem_core_pool *p,
		    const u32 *oid, u64 index)
{
	struct sent_pos pos;
	unsigned long *word;
	int i;

	if (!p->sent)
		return;
	pos = sent_pos(p, tmem_oid_hash(c, oid), index);
	for (i = 0; i < SENT_KEY_BITS; i++) {
		word = &pos.line[pos.bit[i] / BITS_PER_LONG];
		WRITE_ONCE(*word, READ_ONCE(*word) |
					  1ul << (pos.bit[i] % BITS_PER_LONG));
	}
}

bool tmem_sent_maybe_of(const struct tmem_core_pool *p, u64 oid_h, u64 index)
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
	return tmem_sent_maybe_of(p, tmem_oid_hash(c, oid), index);
}

/* Empties a pool's filter, word by word (lockless readers: see mark_sent). */
void tmem_sent_clear(struct tmem_core_pool *p)
{
	u32 i;

	for (i = 0; i < p->sent_bits / BITS_PER_LONG; i++)
		WRITE_ONCE(p->sent[i], 0);
}

/* Could the host hold this page (index) or object (index U64_MAX)? */
bool tmem_host_may_hold(struct tmem_core *c, int h, const u32 *oid, u64 index)
{
	struct tmem_core_pool *p = &c->pools[h];

	/* Shared pools: other VMs' puts of a key are invisible to us. */
	return p->shared || maybe_sent(c, p, oid, index);
}

/*
 * The host holds nothing of these pools any more (or will not, before any
 * later op reaches them): their filters start empty.
 */
void tmem_forget_sent(struct tmem_core *c, u64 host_id_bits)
{
	u32 i;

	for (i = 0; i < TMEM_MAX_POOLS; i++) {
		struct tmem_core_pool *p = &c->pools[i];

		if (p->state == POOL_READY && p->sent &&
		    ((host_id_bits >> p->host_id) & 1))
			tmem_sent_clear(p);
	}
}

/*
 * Cheap when off: no put of ours reached a private pool since the host last
 * forgot us (attach with a new generation; stand-aside's INVAL_POOLs), so
 * the host holds nothing of ours there. A get, an invalidate, or a put the
 * hint refuses then needs no hashing, no filter, no window scan and no
 * reap: what a frontend told "send nothing" costs per page-cache event.
 */
bool tmem_holds_nothing_private(struct tmem_core *c, int h)
{
	return !c->private_sent && valid_handle(c, h) && !c->pools[h].shared &&
	       c->attached && !c->broken && !host_changed(c);
}
