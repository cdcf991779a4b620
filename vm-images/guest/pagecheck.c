// SPDX-License-Identifier: GPL-2.0
/*
 * pagecheck: writes and verifies files of self-describing pages inside the
 * test guest (linked statically into the initramfs).
 *
 * Page i of a file written with seed S starts with a 16-byte header
 * (magic, S, i) followed by xorshift64 bytes seeded from (S, i). verify
 * reads every page and tells apart: good pages, zero pages (holes,
 * expected past a truncation), stale pages (a valid header of another
 * seed or index: data that must no longer be visible), and garbage.
 *
 *   pagecheck gen      FILE SEED PAGES        (O_CREAT, no truncation)
 *   pagecheck verify   FILE SEED PAGES [ZERO_FROM]
 *   pagecheck randread FILE SEED PAGES READS RNGSEED
 * verify prints "pagecheck ok=N zero=N stale=N bad=N ms=N MBps=N" and
 * exits 1 on any unexpected page. randread reads READS single pages at
 * random indices (POSIX_FADV_RANDOM: no readahead, as a database or a file
 * server with many small files reads) and verifies each; same report.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096
#define BATCH 256
#define MAGIC 0x6b636567617074ULL /* "tpagek" */

static uint64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void fill(uint8_t *page, uint64_t seed, uint64_t index)
{
	uint64_t *w = (uint64_t *)page;
	uint64_t x = (seed * 0x9e3779b97f4a7c15ULL) ^ (index + 1) * 0xbf58476d1ce4e5b9ULL;
	size_t i;

	w[0] = MAGIC;
	w[1] = seed;
	w[2] = index;
	for (i = 3; i < PAGE / 8; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		w[i] = x;
	}
}

static int gen(const char *path, uint64_t seed, uint64_t pages)
{
	static uint8_t buf[BATCH * PAGE];
	uint64_t p = 0, t0 = now_ms(), ms;
	int fd = open(path, O_WRONLY | O_CREAT, 0644);

	if (fd < 0) {
		perror(path);
		return 2;
	}
	while (p < pages) {
		uint64_t n = pages - p < BATCH ? pages - p : BATCH, i;

		for (i = 0; i < n; i++)
			fill(buf + i * PAGE, seed, p + i);
		if (pwrite(fd, buf, n * PAGE, p * PAGE) != (ssize_t)(n * PAGE)) {
			perror("pwrite");
			return 2;
		}
		p += n;
	}
	if (fsync(fd) || close(fd)) {
		perror("fsync");
		return 2;
	}
	ms = now_ms() - t0;
	printf("pagecheck gen pages=%llu ms=%llu\n", (unsigned long long)pages,
	       (unsigned long long)ms);
	return 0;
}

static int verify(const char *path, uint64_t seed, uint64_t pages, uint64_t zero_from)
{
	static uint8_t buf[BATCH * PAGE];
	uint8_t want[PAGE], zero[PAGE];
	uint64_t ok = 0, zeros = 0, stale = 0, bad = 0, p = 0, t0 = now_ms(), ms;
	int fd = open(path, O_RDONLY);

	if (fd < 0) {
		perror(path);
		return 2;
	}
	memset(zero, 0, sizeof(zero));
	while (p < pages) {
		uint64_t n = pages - p < BATCH ? pages - p : BATCH, i;
		ssize_t got = pread(fd, buf, n * PAGE, p * PAGE);

		if (got != (ssize_t)(n * PAGE)) {
			fprintf(stderr, "short read at page %llu\n", (unsigned long long)p);
			return 2;
		}
		for (i = 0; i < n; i++) {
			uint8_t *pg = buf + i * PAGE;
			uint64_t *w = (uint64_t *)pg, idx = p + i;

			if (idx >= zero_from) {
				if (!memcmp(pg, zero, PAGE)) {
					zeros++;
					continue;
				}
			} else {
				fill(want, seed, idx);
				if (!memcmp(pg, want, PAGE)) {
					ok++;
					continue;
				}
			}
			if (w[0] == MAGIC) {
				if (stale < 5)
					printf("pagecheck STALE page %llu: seed %llu index %llu\n",
					       (unsigned long long)idx, (unsigned long long)w[1],
					       (unsigned long long)w[2]);
				stale++;
			} else {
				if (bad < 5)
					printf("pagecheck BAD page %llu\n", (unsigned long long)idx);
				bad++;
			}
		}
		p += n;
	}
	close(fd);
	ms = now_ms() - t0;
	printf("pagecheck ok=%llu zero=%llu stale=%llu bad=%llu ms=%llu MBps=%llu\n",
	       (unsigned long long)ok, (unsigned long long)zeros, (unsigned long long)stale,
	       (unsigned long long)bad, (unsigned long long)ms,
	       (unsigned long long)(ms ? pages * PAGE / 1000 / ms : 0));
	return stale || bad ? 1 : 0;
}

static int randread(const char *path, uint64_t seed, uint64_t pages, uint64_t reads,
		    uint64_t rng)
{
	uint8_t buf[PAGE], want[PAGE];
	uint64_t ok = 0, stale = 0, bad = 0, r, t0, ms;
	uint64_t x = rng * 0x9e3779b97f4a7c15ULL + 1;
	int fd = open(path, O_RDONLY);

	if (fd < 0) {
		perror(path);
		return 2;
	}
	if (pages == 0)
		return 2;
	posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
	t0 = now_ms();
	for (r = 0; r < reads; r++) {
		uint64_t idx;

		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		idx = x % pages;
		if (pread(fd, buf, PAGE, idx * PAGE) != PAGE) {
			fprintf(stderr, "short read at page %llu\n", (unsigned long long)idx);
			return 2;
		}
		fill(want, seed, idx);
		if (!memcmp(buf, want, PAGE)) {
			ok++;
		} else if (((uint64_t *)buf)[0] == MAGIC) {
			if (stale < 5)
				printf("pagecheck STALE page %llu\n", (unsigned long long)idx);
			stale++;
		} else {
			if (bad < 5)
				printf("pagecheck BAD page %llu\n", (unsigned long long)idx);
			bad++;
		}
	}
	ms = now_ms() - t0;
	close(fd);
	printf("pagecheck ok=%llu zero=0 stale=%llu bad=%llu ms=%llu MBps=%llu\n",
	       (unsigned long long)ok, (unsigned long long)stale, (unsigned long long)bad,
	       (unsigned long long)ms, (unsigned long long)(ms ? reads * PAGE / 1000 / ms : 0));
	return stale || bad ? 1 : 0;
}

int main(int argc, char **argv)
{
	if (argc >= 7 && !strcmp(argv[1], "randread"))
		return randread(argv[2], strtoull(argv[3], NULL, 0), strtoull(argv[4], NULL, 0),
				strtoull(argv[5], NULL, 0), strtoull(argv[6], NULL, 0));
	if (argc >= 5 && !strcmp(argv[1], "gen"))
		return gen(argv[2], strtoull(argv[3], NULL, 0), strtoull(argv[4], NULL, 0));
	if (argc >= 5 && !strcmp(argv[1], "verify"))
		return verify(argv[2], strtoull(argv[3], NULL, 0), strtoull(argv[4], NULL, 0),
			      argc >= 6 ? strtoull(argv[5], NULL, 0) : UINT64_MAX);
	fprintf(stderr, "usage: pagecheck gen|verify FILE SEED PAGES [ZERO_FROM]\n"
			"       pagecheck randread FILE SEED PAGES READS RNGSEED\n");
	return 2;
}
