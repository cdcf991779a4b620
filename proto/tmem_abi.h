/* SPDX-License-Identifier: (GPL-2.0 OR MIT) */
/*
 * tmem_abi.h - the tmemd shared-memory data plane, version 3.
 *
 * Plain C, included by the Linux guest module (tmem_ivshmem.ko), the
 * userspace guest library and tmemd. All fields are little-endian and
 * fixed-width; every layout is checked by static asserts below.
 *
 * The region is the ivshmem BAR2: one memfd of power-of-two size owned by
 * tmemd. Layout:
 *
 *   offset 0                header page (struct tmem_shm_header)
 *   sq_offset               submission ring: sq_entries x struct tmem_sqe
 *   cq_offset               completion ring: cq_entries x struct tmem_cqe
 *   slots_offset            page slots: slot_count x 4096 bytes
 *
 * Rings use free-running 32-bit indices; an index's ring position is
 * index & (entries - 1), entries a power of two, and a ring holds
 * (tail - head) entries, never more than `entries`.
 *
 * Ownership (who writes what):
 *   guest writes: sq entries, sq_tail, cq_head, guest_* fields, slot contents
 *                 for puts, flush requests.
 *   host  writes: cq entries, cq_head's partner cq_tail, sq_head, host_* fields,
 *                 slot contents for gets, admission hint, flush acks.
 *
 * Memory ordering:
 *   producer: write entries (and slot bytes) -> store-release tail
 *   consumer: load-acquire tail -> read entries -> store-release head
 *   The host reads every guest-written field exactly once into a local and
 *   validates it; a head/tail pair that claims more than `entries` is a
 *   corrupt ring and resets the channel.
 *
 * A put the guest does not send (ring full, admission hint, pool being
 * flushed) must still invalidate its key unless the guest knows the host
 * holds nothing for it: cleancache allows a dropped put, never a get that
 * returns the page's previous contents.
 *
 * Slots: the guest owns a slot from choosing it until the completion of the
 * op that used it is reaped (put: the host has copied the page; get: the host
 * has written it). So the guest reuses a slot only after its CQE.
 *
 * Doorbells: the guest rings ivshmem vector TMEM_VEC_SUBMIT (write
 * (host_peer_id << 16) | vector to BAR0 offset 12; v1 hosts were always
 * peer 0, v2 hosts say which peer they are, because a migratable device
 * (QEMU master=on) needs the VM to be peer 0) only when host_flags has
 * TMEM_HOST_NEEDS_DOORBELL; otherwise the host is polling. Lost wakeups
 * are avoided Dekker-style: the guest publishes sq_tail, then a full fence
 * (__atomic_thread_fence(__ATOMIC_SEQ_CST) / smp_mb()), then reads
 * host_flags; the host sets TMEM_HOST_NEEDS_DOORBELL, then a full fence,
 * then re-reads sq_tail before it sleeps. (tmemd also re-checks every ring
 * on a short timer, so a guest that gets this wrong is slow, not stuck.)
 * A guest may leave entries nothing waits on (puts, invalidates) unrung
 * for a while (a batch, bounded well below the ring size): that timer or
 * the doorbell of the next waited-on entry, executed after them in ring
 * order, takes them. Entries with TMEM_SQE_F_IRQ and pool ops always ring.
 * The host raises vector TMEM_VEC_COMPLETE on the guest only for completions of entries that
 * carry TMEM_SQE_F_IRQ. The rings, not the interrupts, are the truth:
 * interrupts can be lost (before MSI-X is enabled, on reset).
 *
 * Invalidates are never lost: when the SQ is full, the guest sets the pool's
 * bit in flush_request (atomic OR) and stores flush_request_seq =
 * sq_tail at that moment (release). The host, once sq_head reaches
 * flush_request_seq, drops every page of the flagged pools and publishes
 * flush_done_seq = flush_request_seq (release). While flush_done_seq !=
 * flush_request_seq, the guest treats gets of flagged pools as misses and
 * drops their puts. Coarser, but always possible without ring space.
 *
 * Generations: host_generation changes whenever tmemd (re)initializes the
 * region; guest_generation whenever the guest (re)attaches. A side that sees
 * the other's generation change forgets all pool ids and state (the host
 * drops the VM's pages; the guest re-creates pools lazily).
 * A region can arrive holding another host's header and rings (live
 * migration copies the shared memory with the VM): a host that finds a
 * host_generation it did not write treats the region as foreign and
 * re-initializes it, so the guest sees the generation change and
 * resynchronizes (pools, sent-keys filter, prefetched pages all forgotten).
 */
#ifndef TMEMD_PROTO_TMEM_ABI_H_
#define TMEMD_PROTO_TMEM_ABI_H_

#ifdef __KERNEL__
#include <linux/build_bug.h>
#include <linux/types.h>
typedef __u8 tmem_u8;
typedef __u16 tmem_u16;
typedef __u32 tmem_u32;
typedef __s32 tmem_s32;
typedef __u64 tmem_u64;
#define TMEM_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#include <stdint.h>
typedef uint8_t tmem_u8;
typedef uint16_t tmem_u16;
typedef uint32_t tmem_u32;
typedef int32_t tmem_s32;
typedef uint64_t tmem_u64;
#ifdef __cplusplus
#define TMEM_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define TMEM_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif
#endif

#define TMEM_ABI_MAGIC 0x4d454d54u /* "TMEM" little-endian */
#define TMEM_ABI_VERSION 3u
#define TMEM_PAGE_SIZE 4096u
#define TMEM_MAX_POOLS 64u   /* per VM; fits the flush bitmap */
#define TMEM_OBJECT_WORDS 6u /* cleancache filekey: u32 key[6] */

/* ivshmem vectors. */
#define TMEM_VEC_SUBMIT 0u   /* guest -> host: "SQ has new entries" */
#define TMEM_VEC_COMPLETE 0u /* host -> guest: "CQ has entries you asked for" */
#define TMEM_MIN_VECTORS 1u

/* Feature bits (features_host offered, features_guest accepted). */
#define TMEM_FEAT_SHARED_POOLS (1u << 0)
#define TMEM_FEAT_ADMISSION_HINT (1u << 1)
#define TMEM_FEAT_FLUSH_BARRIER (1u << 2)
#define TMEM_FEAT_GET_BATCH (1u << 3)   /* TMEM_OP_GET_BATCH (v2) */

/* host_state */
#define TMEM_HOST_STATE_INIT 0u  /* region being set up: do nothing */
#define TMEM_HOST_STATE_READY 1u /* rings live */
#define TMEM_HOST_STATE_RESET 2u /* host reset the channel: re-attach */

/* host_flags */
#define TMEM_HOST_NEEDS_DOORBELL (1u << 0) /* host sleeps: ring to wake it */

/*
 * guest_flags (v2). TMEM_GUEST_STANDING_ASIDE: the frontend measured that
 * tmem costs it more than it saves (or it was told "off") and sends no puts
 * and no gets; before setting it the guest invalidated every pool it uses
 * (INVAL_POOL), so it owes the host no per-key invalidates while it stands
 * aside. The host reports it per VM and admits nothing from that VM.
 */
#define TMEM_GUEST_STANDING_ASIDE (1u << 0)

/* Admission hint: puts to send out of TMEM_ADMIT_ALL (the valve's rate). */
#define TMEM_ADMIT_ALL 65536u

/* Opcodes. */
enum tmem_opcode {
	TMEM_OP_NOP = 0,
	TMEM_OP_NEW_POOL = 1,    /* flags: TMEM_SQE_F_SHARED (uuid in oid) */
	TMEM_OP_DESTROY_POOL = 2,
	TMEM_OP_PUT = 3,         /* page in slot */
	TMEM_OP_GET = 4,         /* page into slot; result 1 = hit, 0 = miss */
	TMEM_OP_INVAL_PAGE = 5,
	TMEM_OP_INVAL_OBJECT = 6,
	TMEM_OP_INVAL_POOL = 7,
	TMEM_OP_GET_BATCH = 8,   /* v2: `count` pages into `count` slots */
	TMEM_OP_MAX = 9,
};

/*
 * TMEM_OP_GET_BATCH (v2, TMEM_FEAT_GET_BATCH): one ring round trip for a
 * run of pages of one object, the way the page cache reads a readahead
 * window (index, index + 1, ... back to back).
 *   sqe.index = first page index, sqe.count = n (1 .. TMEM_GET_BATCH_MAX),
 *   sqe.slot  = first of n consecutive slots (slot + n <= slot_count).
 *   Page index + k goes to slot + k. cqe.result is the hit bitmap: bit k
 *   set = page index + k was present and its bytes are in slot + k; clear =
 *   miss (slot contents undefined).
 *   Only on private pools (a shared pool answers TMEM_ERR_INVAL): every hit
 *   is exclusive exactly as a single GET, i.e. the host forgets the page. The
 *   guest then owns the only copy, in its slot, and must honour every later
 *   invalidate or put of that key against it (drop the slot copy) before it
 *   serves a get from it. An unused prefetched page may simply be dropped:
 *   pages are ephemeral.
 *   A bitmap of zeros is a statement about that moment only; a guest may
 *   answer later gets of those keys as misses until it puts them again
 *   (a miss is always allowed).
 * Every other opcode must have count == 0.
 */
#define TMEM_GET_BATCH_MAX 32u

/* sqe.flags */
#define TMEM_SQE_F_IRQ (1u << 0)    /* interrupt the guest on completion */
#define TMEM_SQE_F_SHARED (1u << 1) /* NEW_POOL: shared pool, uuid in oid */

/* Completion status (negative errno-like values, fixed here). */
#define TMEM_OK 0
#define TMEM_ERR_INVAL (-22)      /* malformed entry */
#define TMEM_ERR_NOENT (-2)       /* unknown pool */
#define TMEM_ERR_PERM (-1)        /* not authorized (shared pool) */
#define TMEM_ERR_NOSPC (-28)      /* too many pools */
#define TMEM_ERR_DROPPED (-105)   /* put not stored (refused, throttled) */

struct tmem_sqe {
	tmem_u8 opcode;
	tmem_u8 flags;
	tmem_u16 pool;  /* host pool id from NEW_POOL */
	tmem_u32 slot;  /* PUT/GET: page slot index */
	tmem_u64 tag;   /* guest cookie, echoed in the CQE */
	tmem_u64 index; /* page index */
	tmem_u32 oid[TMEM_OBJECT_WORDS]; /* object id; NEW_POOL: uuid (16 B) */
	tmem_u16 count;                  /* GET_BATCH: pages; else zero */
	tmem_u8 reserved[14];            /* must be zero */
};

struct tmem_cqe {
	tmem_u64 tag;
	tmem_s32 status; /* TMEM_OK or TMEM_ERR_* */
	tmem_u32 result; /* NEW_POOL: pool id; GET: 1 hit / 0 miss;
			  * GET_BATCH: hit bitmap (bit k: page index + k) */
};

/* Ring indices live on their own cache lines: each line has one writer. */
struct tmem_ring_index {
	tmem_u32 value;
	tmem_u8 pad[60];
};

struct tmem_shm_header {
	/* Written by the host before host_state = READY; read-only after. */
	tmem_u32 magic;
	tmem_u32 version;
	tmem_u32 features_host;
	tmem_u32 header_size; /* sizeof(struct tmem_shm_header) */
	tmem_u64 region_size;
	tmem_u32 sq_offset;
	tmem_u32 sq_entries;
	tmem_u32 cq_offset;
	tmem_u32 cq_entries;
	tmem_u32 slots_offset;
	tmem_u32 slot_count;
	tmem_u64 host_generation;   /* v2: unique per host and init (random) */
	tmem_u32 host_peer_id;      /* v2: ivshmem peer id the guest rings */
	tmem_u32 pad0;

	/* Host-written, changing. */
	tmem_u32 host_state;
	tmem_u32 host_flags;
	tmem_u32 admission_hint;     /* 0 .. TMEM_ADMIT_ALL */
	tmem_u32 resets;             /* channel resets so far (for the guest) */
	tmem_u64 flush_done_seq;
	/*
	 * v3, host-written, informational (0: not said): how many of this
	 * VM's evictions a page it puts can stay on the host (its share of
	 * the cap), so a re-read further away than this cannot come back. A
	 * guest that the host samples (a low admission_hint) looks at least
	 * this far for its pages to come back before it stands aside.
	 */
	tmem_u64 reach_pages;
	tmem_u8 pad1[32];

	/* Guest-written. */
	tmem_u64 guest_generation;
	tmem_u32 features_guest;
	tmem_u32 guest_flags;        /* TMEM_GUEST_* */
	tmem_u64 flush_request;      /* bitmap of pool ids */
	tmem_u64 flush_request_seq;  /* sq_tail when the flush was requested */
	/*
	 * v2, informational (the host shows them, never trusts them for
	 * safety): the guest's own view of whether tmem pays off.
	 */
	tmem_u64 guest_get_ns;       /* guest time per page served by tmem */
	tmem_u64 guest_miss_ns;      /* guest's estimate of a disk read/page */
	tmem_u64 guest_prefetch_used;   /* batched pages served from slots */
	tmem_u64 guest_prefetch_unused; /* batched pages dropped unused */

	/*
	 * v3, guest-written, informational: the guest's RAM in 4 KiB pages
	 * (0: not said). A page-cache re-read cannot come back before the
	 * guest evicted about this many pages, so the host judges a VM's
	 * reuse only after that many of its evictions (bounded by what the
	 * VM's share of the cap can hold): a guest that lies delays only its
	 * own throttling, within its quota and CPU share.
	 */
	tmem_u64 guest_ram_pages;
	tmem_u8 pad2[56];

	struct tmem_ring_index sq_head; /* host */
	struct tmem_ring_index sq_tail; /* guest */
	struct tmem_ring_index cq_head; /* guest */
	struct tmem_ring_index cq_tail; /* host */
};

TMEM_STATIC_ASSERT(sizeof(struct tmem_sqe) == 64, "sqe is one cache line");
TMEM_STATIC_ASSERT(sizeof(struct tmem_cqe) == 16, "cqe is 16 bytes");
TMEM_STATIC_ASSERT(sizeof(struct tmem_ring_index) == 64, "index owns a line");
TMEM_STATIC_ASSERT(sizeof(struct tmem_shm_header) == 512, "header layout");
TMEM_STATIC_ASSERT(sizeof(struct tmem_shm_header) <= TMEM_PAGE_SIZE,
		   "header fits its page");

#endif /* TMEMD_PROTO_TMEM_ABI_H_ */
