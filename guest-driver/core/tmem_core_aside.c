// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * tmem_core_aside.c - the never-slower policy: measure what tmem costs the
 * guest against what the disk would, and stand aside (send nothing, private
 * pools wiped) when it costs more or when the host samples the guest's puts
 * for nothing; probe again after a backoff. Decisions only: the put and get
 * paths (tmem_core.c) carry them out.
 */
#include "tmem_core_internal.h"

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
			tmem_issue_invalidate(c, TMEM_OP_INVAL_POOL, i, p->host_id, NULL, 0);
		if (p->state != POOL_UNUSED)
			tmem_windows_kill(c, i, NULL, 0);
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
			tmem_maybe_doorbell(c);
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
	tmem_sample_reset(c);
	c->unused_from = admit_clock(c);
	if (c->attached)
		st_release(&hdr(c)->guest_flags, 0);
}

/* Standing aside now? Resumes (to measure again) once the time is up. */
bool tmem_standing_aside(struct tmem_core *c)
{
	if (!c->aside)
		return false;
	if (now(c) < c->aside_until_ns)
		return true;
	resume(c);
	return false;
}

/* What a miss costs: measured if the platform could, else configured. */
u64 tmem_miss_cost(struct tmem_core *c)
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
		return tmem_miss_cost(c);
	if (c->miss_cost_random_ns)
		return c->miss_cost_random_ns;
	return c->miss_cost_measured_ns ? COST_UNKNOWN : tmem_miss_cost(c);
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

void tmem_sample_reset(struct tmem_core *c)
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
 * a pass of a re-read or more, which costs a sequential re-reader a few
 * percent where tmem cannot pay (under TCG a hit costs two page copies and
 * a disk read none). Not on a first loss: a first sample carries what
 * starting costs (a guest for which tmem pays can cost several times as
 * much per hit in its first sample as in its second), which must not keep
 * it aside for the longest wait.
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
void tmem_account_get(struct tmem_core *c, u64 ns, bool hit, bool single)
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
		tmem_sample_reset(c);
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
		tmem_sample_reset(c);
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
	tmem_sample_reset(c);
}

/*
 * Sampled for nothing (cfg->aside_unused_evictions): under a hint below a
 * probe's share, the host keeps our puts' keys to notice reuse, which
 * shows as a get of a page it may hold. With none for that many evictions
 * (or the host's reach_pages, if more: a page re-read further away than
 * that cannot come back), every eviction and page-cache miss still pays a
 * hash and a filter test, and a sampled put a copy, for nothing: a
 * throttled streamer on a CPU-saturated host pays several percent of its
 * read rate for them, one told "off" (nothing sent, so no filter to test)
 * next to nothing. Standing aside wipes the pools, so the filter's tests
 * go too.
 * The wait doubles while it goes on, up to UNUSED_LONGEST_WAIT probe
 * intervals: a reader whose pages start coming back waits that long at
 * most, then the probe's sample shows it. Told "off" with nothing sent,
 * it already costs what aside does.
 */
#define UNUSED_LONGEST_WAIT 8

bool tmem_sampled_for_nothing(struct tmem_core *c, int h)
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

void tmem_stand_aside_unused(struct tmem_core *c)
{
	u64 base = max(READ_ONCE(c->cfg->aside_probe_ns), 1ull);

	c->aside_backoff_ns = next_backoff(c, base, UNUSED_LONGEST_WAIT);
	c->aside_miss_ns = 0; /* not a matter of cost: no cost rise ends it */
	c->c.stood_aside_unused++;
	stand_aside(c);
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
