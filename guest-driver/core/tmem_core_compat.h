/* SPDX-License-Identifier: (GPL-2.0 OR MIT) */
/*
 * tmem_core_compat.h - what the guest protocol core needs from its
 * environment: the kernel's own headers when built into the module, and a
 * small userspace shim otherwise (the way Linux's tools/include maps the
 * kernel's primitives for userspace builds).
 *
 * The shim keeps the kernel's memory-model meaning:
 *   READ_ONCE/WRITE_ONCE   one untorn access the compiler may not merge,
 *                          split or re-read (relaxed atomics);
 *   smp_load_acquire /     acquire / release atomics;
 *   smp_store_release
 *   smp_mb / smp_rmb       full and load-load fences.
 * Shared fields are naturally aligned 4- and 8-byte words (the ABI's static
 * asserts), so the __atomic builtins on them are lock-free.
 */
#ifndef TMEMD_GUEST_DRIVER_CORE_TMEM_CORE_COMPAT_H_
#define TMEMD_GUEST_DRIVER_CORE_TMEM_CORE_COMPAT_H_

#ifdef __KERNEL__

#include <linux/atomic.h>
#include <linux/bitmap.h>
#include <linux/bitops.h>
#include <linux/errno.h>
#include <linux/kernel.h>
#include <linux/log2.h>
#include <linux/minmax.h>
#include <linux/processor.h>
#include <linux/string.h>
#include <linux/types.h>
#include <asm/barrier.h>

/* A counter bumped without the core's lock (the lockless fast paths). */
struct tmem_core_counter {
	atomic64_t value;
};
#define tmem_core_counter_inc(p) atomic64_inc(&(p)->value)
#define tmem_core_counter_read(p) ((u64)atomic64_read(&(p)->value))

#else /* userspace */

#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;
typedef int16_t s16;
typedef int32_t s32;
typedef int64_t s64;

/* A counter bumped without the core's lock (the lockless fast paths). */
struct tmem_core_counter {
	u64 value;
};
#define tmem_core_counter_inc(p) __atomic_fetch_add(&(p)->value, 1, __ATOMIC_RELAXED)
#define tmem_core_counter_read(p) __atomic_load_n(&(p)->value, __ATOMIC_RELAXED)

/* The macros below are for the core's C only: they would clash with C++. */
#ifndef __cplusplus

#define U32_MAX UINT32_MAX
#define U64_MAX UINT64_MAX
#define BITS_PER_LONG (sizeof(long) * CHAR_BIT)

/* One untorn access, no ordering: the kernel's READ_ONCE/WRITE_ONCE. */
#define READ_ONCE(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)
#define WRITE_ONCE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELAXED)
/* Acquire load: later accesses stay after it. */
#define smp_load_acquire(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
/* Release store: earlier accesses stay before it. */
#define smp_store_release(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
/* Full fence: orders earlier stores before later loads too. */
#define smp_mb() __atomic_thread_fence(__ATOMIC_SEQ_CST)
/* Load-load fence (acquire is at least that). */
#define smp_rmb() __atomic_thread_fence(__ATOMIC_ACQUIRE)

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#else
#define cpu_relax() __atomic_signal_fence(__ATOMIC_SEQ_CST)
#endif

#define min(a, b) ((a) < (b) ? (a) : (b))
#define max(a, b) ((a) > (b) ? (a) : (b))
#define min3(a, b, c) min(min(a, b), c)
#define min_t(t, a, b) min((t)(a), (t)(b))

static inline bool is_power_of_2(unsigned long n)
{
	return n != 0 && (n & (n - 1)) == 0;
}

static inline unsigned long __ffs64(u64 word)
{
	return (unsigned long)__builtin_ctzll(word);
}

static inline unsigned int hweight32(u32 w)
{
	return (unsigned int)__builtin_popcount(w);
}

static inline void __set_bit(unsigned long nr, unsigned long *addr)
{
	addr[nr / BITS_PER_LONG] |= 1UL << (nr % BITS_PER_LONG);
}

static inline void __clear_bit(unsigned long nr, unsigned long *addr)
{
	addr[nr / BITS_PER_LONG] &= ~(1UL << (nr % BITS_PER_LONG));
}

static inline bool test_bit(unsigned long nr, const unsigned long *addr)
{
	return (addr[nr / BITS_PER_LONG] >> (nr % BITS_PER_LONG)) & 1;
}

static inline void bitmap_zero(unsigned long *dst, unsigned int nbits)
{
	memset(dst, 0, (nbits + BITS_PER_LONG - 1) / BITS_PER_LONG * sizeof(long));
}

#define NSEC_PER_USEC 1000ULL
#define NSEC_PER_MSEC 1000000ULL

#endif /* !__cplusplus */
#endif /* __KERNEL__ */

#endif /* TMEMD_GUEST_DRIVER_CORE_TMEM_CORE_COMPAT_H_ */
