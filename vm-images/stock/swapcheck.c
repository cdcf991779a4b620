// SPDX-License-Identifier: GPL-2.0
/*
 * swapcheck: drives a guest into swap with verifiable anonymous memory and
 * checks every page that comes back (linked statically into the stock
 * guest's initramfs).
 *
 * A plain anonymous mapping (no mlock) of --mib MiB is written page by
 * page, then touched in passes, each in a new random permutation of the
 * pages; with several times guest RAM most touches fault the page in from
 * swap. Page i (4 KiB) is self-describing: words 0-3 hold a magic, i, the
 * run's seed and the page's generation, and a checksum over the rest of the
 * page; the remaining words are a function of (seed, i, generation) in one
 * of three contents: random (incompressible), 2x (each 128-byte chunk is 56
 * random bytes and a 72-byte repeat of them: LZ4 compresses a page 1.9x) or
 * zero (header, then zeros). Every touch compares the whole page with its expected content and
 * sorts a wrong one: zero (a lost page), stale (our index, an older
 * generation), misplaced (another page's valid content), corrupt (the
 * checksum fails).
 *
 *   swapcheck [--mib N] [--content random|2x|zero] [--seed S]
 *             [--passes P] [--touch read|write] [--free-half]
 *             [--wait PHASE]... [--report-bad N]
 *
 * --touch write rewrites each touched page with the next generation (a dirty
 * working set: every page goes out again); --free-half drops the upper half
 * of the mapping (MADV_DONTNEED: its swap slots are freed, and discarded by
 * `swapon -d`) and verifies the lower half once more. --wait PHASE prints
 * "SWAPCHECK WAIT PHASE" after that phase and reads one line from stdin
 * before going on: the host acts on the swap device meanwhile (the negative
 * control corrupts swapped-out pages there).
 *
 * Output, one line per phase (write, pass1..passP, free, after-free) and a
 * summary, each a JSON object after "SWAPCHECK ":
 *   {"phase":..,"pages":..,"ok":..,"bad":..,"zero":..,"stale":..,
 *    "misplaced":..,"corrupt":..,"ms":..,"MBps":..,"pswpin":..,"pswpout":..,
 *    "pgmajfault":..,"cpu_busy_ms":..,"cpu_total_ms":..,"utime_ms":..,
 *    "stime_ms":..,"touch_ns_p50":..,"touch_ns_p99":..,"swap_used_kb":..}
 * and "SWAPCHECK BAD {"index":..,"kind":..}" for the first --report-bad
 * wrong pages. Exit status: 0 every page verified, 1 a page was wrong,
 * 2 usage or system error.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096
#define WORDS (PAGE / 8)
#define MAGIC 0x314b484350415753ULL /* "SWAPCHK1" */
#define MAX_WAITS 8
/* Touch latency histogram: 8 buckets per power of two of nanoseconds. */
#define HSUB 8
#define HBUCKETS (64 * HSUB)

enum content { C_RANDOM, C_2X, C_ZERO };
enum kind { K_OK, K_ZERO, K_STALE, K_MISPLACED, K_CORRUPT, K_N };
static const char *const kind_name[K_N] = {"ok", "zero", "stale", "misplaced", "corrupt"};

static struct {
	uint64_t mib, seed, passes, report_bad;
	enum content content;
	int touch_write, free_half, nwaits;
	const char *waits[MAX_WAITS];
} opt = {.mib = 64, .seed = 1, .passes = 1, .report_bad = 16};

static uint64_t npages;
static uint8_t *base;
static uint8_t *gen;	    /* current generation of each page */
static uint64_t reported;   /* BAD lines printed so far */
static uint64_t total_bad;

struct sample {
	uint64_t ns, pswpin, pswpout, pgmajfault, cpu_busy, cpu_total, utime_us, stime_us;
	uint64_t swap_used_kb;
};

struct phase {
	uint64_t pages, kinds[K_N];
	uint64_t hist[HBUCKETS];
	struct sample start;
};

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static uint64_t mix(uint64_t x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ULL;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebULL;
	return x ^ (x >> 31);
}

static uint64_t checksum(const uint64_t *w)
{
	uint64_t h = 0xcbf29ce484222325ULL;
	size_t i;

	for (i = 0; i < WORDS; i++) {
		if (i == 3)
			continue;
		h = (h ^ w[i]) * 0x100000001b3ULL;
	}
	return mix(h);
}

static void fill(uint64_t *w, uint64_t index, uint8_t g)
{
	uint64_t x = mix(opt.seed ^ mix(index * 256 + g + 1)) | 1;
	size_t i;

	w[0] = MAGIC;
	w[1] = index;
	w[2] = (opt.seed << 8) | g;
	for (i = 4; i < WORDS; i++) {
		if (opt.content == C_ZERO) {
			w[i] = 0;
			continue;
		}
		if (opt.content == C_2X && i >= 16 && (i % 16) >= 7) {
			w[i] = w[i - 8];
			continue;
		}
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		w[i] = x;
	}
	w[3] = checksum(w);
}

static enum kind classify(const uint64_t *w, uint64_t index)
{
	static uint64_t want[WORDS];
	size_t i;

	fill(want, index, gen[index]);
	if (memcmp(w, want, PAGE) == 0)
		return K_OK;
	for (i = 0; i < WORDS && w[i] == 0; i++)
		;
	if (i == WORDS)
		return K_ZERO;
	if (w[0] == MAGIC && w[3] == checksum(w) && (w[2] >> 8) == opt.seed)
		return w[1] == index ? K_STALE : K_MISPLACED;
	return K_CORRUPT;
}

static uint64_t vmstat(const char *name)
{
	char key[64];
	unsigned long long v;
	uint64_t r = 0;
	FILE *f = fopen("/proc/vmstat", "r");

	if (!f)
		return 0;
	while (fscanf(f, "%63s %llu", key, &v) == 2)
		if (strcmp(key, name) == 0)
			r = v;
	fclose(f);
	return r;
}

static uint64_t meminfo_kb(const char *name)
{
	char line[256];
	size_t n = strlen(name);
	uint64_t r = 0;
	FILE *f = fopen("/proc/meminfo", "r");

	if (!f)
		return 0;
	while (fgets(line, sizeof(line), f))
		if (strncmp(line, name, n) == 0 && line[n] == ':')
			r = strtoull(line + n + 1, NULL, 10);
	fclose(f);
	return r;
}

/* All CPUs' busy and total time from /proc/stat, in ms (USER_HZ ticks). */
static void cpu_ms(uint64_t *busy, uint64_t *total)
{
	unsigned long long v[10] = {0};
	long hz = sysconf(_SC_CLK_TCK);
	FILE *f = fopen("/proc/stat", "r");
	uint64_t t = 0;
	int i;

	*busy = *total = 0;
	if (!f)
		return;
	if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2],
		   &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &v[9]) >= 8) {
		for (i = 0; i < 8; i++)
			t += v[i];
		*total = t * 1000 / (uint64_t)hz;
		/* idle (3) and iowait (4) are not work */
		*busy = (t - v[3] - v[4]) * 1000 / (uint64_t)hz;
	}
	fclose(f);
}

static void sample(struct sample *s)
{
	struct rusage ru;

	getrusage(RUSAGE_SELF, &ru);
	s->utime_us = (uint64_t)ru.ru_utime.tv_sec * 1000000 + (uint64_t)ru.ru_utime.tv_usec;
	s->stime_us = (uint64_t)ru.ru_stime.tv_sec * 1000000 + (uint64_t)ru.ru_stime.tv_usec;
	s->pswpin = vmstat("pswpin");
	s->pswpout = vmstat("pswpout");
	s->pgmajfault = vmstat("pgmajfault");
	cpu_ms(&s->cpu_busy, &s->cpu_total);
	s->swap_used_kb = meminfo_kb("SwapTotal") - meminfo_kb("SwapFree");
	s->ns = now_ns();
}

static void begin(struct phase *p)
{
	memset(p, 0, sizeof(*p));
	sample(&p->start);
}

static void hist_add(struct phase *p, uint64_t ns)
{
	int b = 0;

	if (ns > 0) {
		int lg = 63 - __builtin_clzll(ns);
		uint64_t frac = lg >= 3 ? (ns >> (lg - 3)) & (HSUB - 1) : (ns << (3 - lg)) & (HSUB - 1);

		b = lg * HSUB + (int)frac;
	}
	p->hist[b]++;
}

/* The lower bound of the bucket holding the q-quantile. */
static uint64_t hist_quantile(const struct phase *p, double q)
{
	uint64_t n = 0, seen = 0, want;
	int b;

	for (b = 0; b < HBUCKETS; b++)
		n += p->hist[b];
	if (n == 0)
		return 0;
	want = (uint64_t)(q * (double)n);
	for (b = 0; b < HBUCKETS; b++) {
		seen += p->hist[b];
		if (seen > want)
			break;
	}
	if (b >= HBUCKETS)
		b = HBUCKETS - 1;
	return (1ULL << (b / HSUB)) + ((uint64_t)(b % HSUB) << (b / HSUB)) / HSUB;
}

static void end(struct phase *p, const char *name)
{
	struct sample e;
	uint64_t ms, bad = 0;
	int k;

	sample(&e);
	for (k = K_ZERO; k < K_N; k++)
		bad += p->kinds[k];
	ms = (e.ns - p->start.ns) / 1000000;
	printf("SWAPCHECK {\"phase\":\"%s\",\"pages\":%llu,\"bad\":%llu", name,
	       (unsigned long long)p->pages, (unsigned long long)bad);
	for (k = 0; k < K_N; k++)
		printf(",\"%s\":%llu", kind_name[k], (unsigned long long)p->kinds[k]);
	printf(",\"ms\":%llu,\"MBps\":%.2f,\"pswpin\":%llu,\"pswpout\":%llu,\"pgmajfault\":%llu"
	       ",\"cpu_busy_ms\":%llu,\"cpu_total_ms\":%llu,\"utime_ms\":%llu,\"stime_ms\":%llu"
	       ",\"touch_ns_p50\":%llu,\"touch_ns_p99\":%llu,\"swap_used_kb\":%llu}\n",
	       (unsigned long long)ms,
	       ms ? (double)p->pages * PAGE / 1e6 / ((double)(e.ns - p->start.ns) / 1e9) : 0.0,
	       (unsigned long long)(e.pswpin - p->start.pswpin),
	       (unsigned long long)(e.pswpout - p->start.pswpout),
	       (unsigned long long)(e.pgmajfault - p->start.pgmajfault),
	       (unsigned long long)(e.cpu_busy - p->start.cpu_busy),
	       (unsigned long long)(e.cpu_total - p->start.cpu_total),
	       (unsigned long long)(e.utime_us - p->start.utime_us) / 1000,
	       (unsigned long long)(e.stime_us - p->start.stime_us) / 1000,
	       (unsigned long long)hist_quantile(p, 0.50), (unsigned long long)hist_quantile(p, 0.99),
	       (unsigned long long)e.swap_used_kb);
	fflush(stdout);
	total_bad += bad;
}

static void maybe_wait(const char *phase)
{
	char line[256];
	int i;

	for (i = 0; i < opt.nwaits; i++) {
		if (strcmp(opt.waits[i], phase) != 0)
			continue;
		printf("SWAPCHECK WAIT %s\n", phase);
		fflush(stdout);
		if (!fgets(line, sizeof(line), stdin))
			fprintf(stderr, "swapcheck: stdin closed while waiting after %s\n", phase);
		return;
	}
}

static uint64_t rng_state;

static uint64_t rng(void)
{
	rng_state += 0x9e3779b97f4a7c15ULL;
	return mix(rng_state);
}

static void shuffle(uint32_t *perm, uint64_t n)
{
	uint64_t i;

	for (i = 0; i < n; i++)
		perm[i] = (uint32_t)i;
	for (i = n; i > 1; i--) {
		uint64_t j = rng() % i;
		uint32_t t = perm[i - 1];

		perm[i - 1] = perm[j];
		perm[j] = t;
	}
}

/* Touches page idx (timed: the first load faults it in), verifies it and,
 * with rewrite, writes its next generation. */
static void touch(struct phase *p, uint64_t idx, int rewrite)
{
	uint64_t *w = (uint64_t *)(base + idx * PAGE);
	uint64_t t0 = now_ns();
	enum kind k;

	(void)*(volatile uint64_t *)w;
	hist_add(p, now_ns() - t0);
	k = classify(w, idx);
	p->kinds[k]++;
	p->pages++;
	if (k != K_OK && reported < opt.report_bad) {
		reported++;
		printf("SWAPCHECK BAD {\"index\":%llu,\"kind\":\"%s\",\"gen\":%u}\n",
		       (unsigned long long)idx, kind_name[k], gen[idx]);
	}
	if (rewrite) {
		gen[idx]++;
		fill(w, idx, gen[idx]);
	}
}

static int usage(void)
{
	fprintf(stderr, "usage: swapcheck [--mib N] [--content random|2x|zero] [--seed S] [--passes P]\n"
			"                 [--touch read|write] [--free-half] [--wait PHASE]... "
			"[--report-bad N]\n");
	return 2;
}

int main(int argc, char **argv)
{
	struct phase p;
	uint32_t *perm;
	uint64_t i, pass, half;
	int a;

	for (a = 1; a < argc; a++) {
		const char *v = a + 1 < argc ? argv[a + 1] : NULL;

		if (strcmp(argv[a], "--free-half") == 0) {
			opt.free_half = 1;
			continue;
		}
		if (!v)
			return usage();
		if (strcmp(argv[a], "--mib") == 0)
			opt.mib = strtoull(v, NULL, 0);
		else if (strcmp(argv[a], "--seed") == 0)
			opt.seed = strtoull(v, NULL, 0) & 0xffffffffffffULL;
		else if (strcmp(argv[a], "--passes") == 0)
			opt.passes = strtoull(v, NULL, 0);
		else if (strcmp(argv[a], "--report-bad") == 0)
			opt.report_bad = strtoull(v, NULL, 0);
		else if (strcmp(argv[a], "--content") == 0) {
			if (strcmp(v, "random") == 0)
				opt.content = C_RANDOM;
			else if (strcmp(v, "2x") == 0)
				opt.content = C_2X;
			else if (strcmp(v, "zero") == 0)
				opt.content = C_ZERO;
			else
				return usage();
		} else if (strcmp(argv[a], "--touch") == 0) {
			if (strcmp(v, "read") != 0 && strcmp(v, "write") != 0)
				return usage();
			opt.touch_write = strcmp(v, "write") == 0;
		} else if (strcmp(argv[a], "--wait") == 0 && opt.nwaits < MAX_WAITS)
			opt.waits[opt.nwaits++] = v;
		else
			return usage();
		a++;
	}
	npages = opt.mib * (1024 * 1024 / PAGE);
	if (npages == 0 || npages > UINT32_MAX)
		return usage();
	rng_state = opt.seed;
	/* Plain anonymous memory, no mlock: the kernel is free to swap it.
	 * MAP_NORESERVE: a working set above RAM + swap's heuristic is the point. */
	base = mmap(NULL, npages * PAGE, PROT_READ | PROT_WRITE,
		    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	gen = calloc(npages, 1);
	perm = malloc(npages * sizeof(*perm));
	if (base == MAP_FAILED || !gen || !perm) {
		perror("swapcheck: allocation");
		return 2;
	}
	printf("SWAPCHECK START {\"mib\":%llu,\"pages\":%llu,\"content\":\"%s\",\"seed\":%llu,"
	       "\"passes\":%llu,\"touch\":\"%s\",\"free_half\":%d}\n",
	       (unsigned long long)opt.mib, (unsigned long long)npages,
	       opt.content == C_RANDOM ? "random" : opt.content == C_2X ? "2x" : "zero",
	       (unsigned long long)opt.seed, (unsigned long long)opt.passes,
	       opt.touch_write ? "write" : "read", opt.free_half);
	fflush(stdout);

	begin(&p);
	for (i = 0; i < npages; i++) {
		fill((uint64_t *)(base + i * PAGE), i, 0);
		p.pages++;
	}
	end(&p, "write");
	maybe_wait("write");

	for (pass = 1; pass <= opt.passes; pass++) {
		char name[32];

		snprintf(name, sizeof(name), "pass%llu", (unsigned long long)pass);
		shuffle(perm, npages);
		begin(&p);
		for (i = 0; i < npages; i++)
			touch(&p, perm[i], opt.touch_write);
		end(&p, name);
		maybe_wait(name);
	}

	if (opt.free_half) {
		half = npages / 2;
		begin(&p);
		if (madvise(base + half * PAGE, (npages - half) * PAGE, MADV_DONTNEED) != 0) {
			perror("swapcheck: madvise");
			return 2;
		}
		p.pages = npages - half;
		end(&p, "free");
		maybe_wait("free");
		shuffle(perm, half);
		begin(&p);
		for (i = 0; i < half; i++)
			touch(&p, perm[i], 0);
		end(&p, "after-free");
		maybe_wait("after-free");
	}
	printf("SWAPCHECK DONE {\"bad\":%llu}\n", (unsigned long long)total_bad);
	fflush(stdout);
	return total_bad ? 1 : 0;
}
