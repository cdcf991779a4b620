// SPDX-License-Identifier: GPL-2.0
/*
 * tmem_ivshmem - cleancache frontend for tmemd over ivshmem-doorbell.
 *
 * Binds to the QEMU ivshmem-doorbell PCI device (1af4:1110) that tmemd
 * serves. The ring protocol of proto/tmem_abi.h lives in core/ (tmem_core*.c),
 * the same code the userspace guest library runs; this file is only what
 * is kernel-specific: the platform ops the core calls (spinlock, clock,
 * doorbell register, wait queue, page copies), cleancache ops, PCI/MSI-X
 * probe and remove, module parameters and debugfs.
 *
 * Contexts and locking: one spinlock (irqsave) guards all core state; the
 * core takes it in every entry point. put_page and the invalidates run with
 * IRQs off under the page-cache xarray lock: the core only copies into a
 * free slot, posts an SQE and rings the doorbell when the host asked for it.
 * Only get_page (process context, page locked) waits for its completion:
 * it spins briefly, then sleeps on a wait queue woken by the MSI-X
 * interrupt, bounded by get_timeout_ms (a timeout is a miss).
 *
 * cleancache has no unregister: once the ops are registered, the module
 * holds a reference on itself and can never be unloaded; without a device
 * the core turns every op into a safe no-op (get = miss).
 *
 * Frontswap is not implemented.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/bitmap.h>
#include <linux/cleancache.h>
#include <linux/debugfs.h>
#include <linux/delay.h>
#include <linux/fs.h>
#include <linux/highmem.h>
#include <linux/interrupt.h>
#include <linux/io.h>
#include <linux/ktime.h>
#include <linux/log2.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/part_stat.h>
#include <linux/pci.h>
#include <linux/random.h>
#include <linux/seq_file.h>
#include <linux/slab.h>
#include <linux/spinlock.h>
#include <linux/uuid.h>
#include <linux/wait.h>

#include "core/tmem_core.h"

#ifdef __BIG_ENDIAN
#error "the tmem ABI is little-endian; this driver does not byte-swap"
#endif

#define TMEM_PCI_VENDOR 0x1af4
#define TMEM_PCI_DEVICE 0x1110
#define TMEM_REG_IVPOSITION 8
#define TMEM_REG_DOORBELL 12
#define MAX_PENDING 8192u /* tmemd rings: at most 4096 + 4096 entries */

/* --- module parameters (the core reads them at every use) ------------------ */

static struct tmem_core_config tmem_cfg = {
	.get_spin_ns = 20 * NSEC_PER_USEC,
	.get_spin_min_ns = 80 * NSEC_PER_USEC, /* a doorbell's wake-up, RESULTS.md */
	.get_timeout_ns = 50 * NSEC_PER_MSEC,
	.pool_create_timeout_ns = 1000 * NSEC_PER_MSEC,
	.pool_retry_ns = 1000 * NSEC_PER_MSEC,
	.stall_probe_ns = 1000 * NSEC_PER_MSEC,
	.ring_full_spin_ns = 20 * NSEC_PER_USEC,
	.deferred_invalidates = TMEM_CORE_MAX_DEFERRED_INVALIDATES,
	.stall_after_timeouts = 3,
	.batch_pages = TMEM_GET_BATCH_MAX,
	.prefetch_windows = 8,
	.readahead_windows = 2,
	.miss_cost_ns = 18 * NSEC_PER_USEC, /* a virtio disk's, with readahead */
	.aside_probe_ns = 1000 * NSEC_PER_MSEC,
	.aside_sample_gets = 1024,
	.aside_probe_share = TMEM_ADMIT_ALL / 8,
	.aside_unused_evictions = 8192,
	.skip_unsent_gets = true,
};

static int param_set_scaled(const char *val, const struct kernel_param *kp,
			    u64 scale)
{
	unsigned int v;
	int err = kstrtouint(val, 0, &v);

	if (err)
		return err;
	WRITE_ONCE(*(u64 *)kp->arg, (u64)v * scale);
	return 0;
}

static int param_set_us(const char *val, const struct kernel_param *kp)
{
	return param_set_scaled(val, kp, NSEC_PER_USEC);
}

static int param_get_us(char *buf, const struct kernel_param *kp)
{
	return sprintf(buf, "%llu\n", READ_ONCE(*(u64 *)kp->arg) / NSEC_PER_USEC);
}

static int param_set_ms(const char *val, const struct kernel_param *kp)
{
	return param_set_scaled(val, kp, NSEC_PER_MSEC);
}

static int param_get_ms(char *buf, const struct kernel_param *kp)
{
	return sprintf(buf, "%llu\n", READ_ONCE(*(u64 *)kp->arg) / NSEC_PER_MSEC);
}

/* Parameters in us or ms, kept by the core in ns. */
static const struct kernel_param_ops param_ops_us = {
	.set = param_set_us,
	.get = param_get_us,
};

static const struct kernel_param_ops param_ops_ms = {
	.set = param_set_ms,
	.get = param_get_ms,
};

module_param_cb(get_spin_us, &param_ops_us, &tmem_cfg.get_spin_ns, 0644);
MODULE_PARM_DESC(get_spin_us, "a get spins this long per page it waits for before sleeping on the interrupt");
module_param_cb(get_spin_min_us, &param_ops_us, &tmem_cfg.get_spin_min_ns, 0644);
MODULE_PARM_DESC(get_spin_min_us, "a get spins at least this long before sleeping on the interrupt");
module_param_cb(get_timeout_ms, &param_ops_ms, &tmem_cfg.get_timeout_ns, 0644);
MODULE_PARM_DESC(get_timeout_ms, "a get without a completion after this long is a miss");
module_param_cb(pool_create_timeout_ms, &param_ops_ms, &tmem_cfg.pool_create_timeout_ns, 0644);
MODULE_PARM_DESC(pool_create_timeout_ms, "init_fs waits this long for NEW_POOL");
module_param_cb(pool_retry_ms, &param_ops_ms, &tmem_cfg.pool_retry_ns, 0644);
MODULE_PARM_DESC(pool_retry_ms, "after a refused NEW_POOL, ask again after this long");
module_param_cb(stall_probe_ms, &param_ops_ms, &tmem_cfg.stall_probe_ns, 0644);
MODULE_PARM_DESC(stall_probe_ms, "a stalled host is probed by one get this often");
module_param_cb(ring_full_spin_us, &param_ops_us, &tmem_cfg.ring_full_spin_ns, 0644);
MODULE_PARM_DESC(ring_full_spin_us,
		 "an invalidate facing a full ring waits this long for room before the flush barrier");
module_param_named(stall_after_timeouts, tmem_cfg.stall_after_timeouts, uint, 0644);
MODULE_PARM_DESC(stall_after_timeouts,
		 "gets in a row timing out without host progress before gets miss at once (0: off)");
module_param_named(invalidate_reserve, tmem_cfg.invalidate_reserve, uint, 0444);
MODULE_PARM_DESC(invalidate_reserve, "SQ entries only invalidates may use (0: sq_entries/8)");
module_param_named(deferred_invalidates, tmem_cfg.deferred_invalidates, uint, 0644);
MODULE_PARM_DESC(deferred_invalidates,
		 "page invalidates kept while the ring is full, then a flush barrier (0: none; max 128)");
module_param_named(get_batch_pages, tmem_cfg.batch_pages, uint, 0644);
MODULE_PARM_DESC(get_batch_pages,
		 "a get asks for up to this many pages of its file in one round trip, when the host offers it (<= 32; 0/1: off)");
module_param_named(prefetch_windows, tmem_cfg.prefetch_windows, uint, 0444);
MODULE_PARM_DESC(prefetch_windows, "windows of 32 slots that batched gets prefetch into (<= 16)");
module_param_named(readahead_windows, tmem_cfg.readahead_windows, uint, 0644);
MODULE_PARM_DESC(readahead_windows,
		 "a get served from a full window asks for this many next windows without waiting (0: off)");
module_param_named(miss_cost_ns, tmem_cfg.miss_cost_ns, ullong, 0644);
MODULE_PARM_DESC(miss_cost_ns,
		 "what a page-cache miss costs without tmem; tmem stands aside when it costs more per page served (0: never)");
module_param_cb(aside_probe_ms, &param_ops_ms, &tmem_cfg.aside_probe_ns, 0644);
MODULE_PARM_DESC(aside_probe_ms, "after standing aside, measure again after this long (doubling to 64x; 64x at once when no hit ratio would pay)");
module_param_named(aside_sample_gets, tmem_cfg.aside_sample_gets, uint, 0644);
MODULE_PARM_DESC(aside_sample_gets, "gets served by tmem per cost/benefit decision");
module_param_named(aside_probe_share, tmem_cfg.aside_probe_share, uint, 0644);
MODULE_PARM_DESC(aside_probe_share,
		 "after standing aside, puts go out for this share of blocks (of 65536) until tmem pays");
module_param_named(aside_unused_evictions, tmem_cfg.aside_unused_evictions, ullong, 0644);
MODULE_PARM_DESC(aside_unused_evictions,
		 "while the host admits less than aside_probe_share of the puts, stand aside after this many evictions with no get of a page it may hold (0: never)");
module_param_named(doorbell_batch, tmem_cfg.doorbell_batch, uint, 0444);
MODULE_PARM_DESC(doorbell_batch,
		 "puts/invalidates posted to a sleeping host before one doorbell (0: min(sq, slots)/16)");

static unsigned int attach_timeout_ms = 2000;
module_param(attach_timeout_ms, uint, 0644);
MODULE_PARM_DESC(attach_timeout_ms, "probe waits this long for the host to be READY");
static unsigned int sent_filter_bits = 1u << 20;
module_param(sent_filter_bits, uint, 0444);
MODULE_PARM_DESC(sent_filter_bits,
		 "bits of each private pool's sent-keys filter, a power of two (0: none)");
static bool measure_miss_cost = true;
module_param(measure_miss_cost, bool, 0644);
MODULE_PARM_DESC(measure_miss_cost,
		 "a miss costs what the block device's reads take per page, measured (else miss_cost_ns)");
static bool use_irq = true;
module_param(use_irq, bool, 0444);
MODULE_PARM_DESC(use_irq, "use the MSI-X completion interrupt (else gets poll)");

/* --- device state and the core's platform ops ------------------------------ */

static DEFINE_SPINLOCK(tmem_lock); /* the core's lock: all core state */
static DECLARE_WAIT_QUEUE_HEAD(tmem_wq);
static DEFINE_MUTEX(probe_mutex); /* probe/remove; then tmem_lock */
static struct tmem_core core;
static struct pci_dev *tmem_pdev;
static void __iomem *tmem_regs;
static bool have_irq;
/* Probes that stopped waiting for READY (attach_timeout_ms); attach is lazy. */
static u64 attach_timeouts;
static bool ops_registered;
static struct dentry *debug_dir;

static void k_lock(void *ctx, unsigned long *flags)
{
	spin_lock_irqsave(&tmem_lock, *flags);
}

static void k_unlock(void *ctx, unsigned long flags)
{
	spin_unlock_irqrestore(&tmem_lock, flags);
}

static u64 k_now_ns(void *ctx)
{
	return ktime_get_ns();
}

static u64 k_coarse_now_ns(void *ctx)
{
	return ktime_get_coarse_ns();
}

static void k_doorbell(void *ctx, u32 value)
{
	writel(value, tmem_regs + TMEM_REG_DOORBELL);
}

static bool k_wait(void *ctx, bool (*done)(void *arg), void *arg, u64 timeout_ns)
{
	if (READ_ONCE(have_irq)) {
		/* Re-check at least every jiffy: interrupts can be lost. */
		wait_event_timeout(tmem_wq, done(arg), 1);
		return true;
	}
	usleep_range(50, 100);
	return false;
}

static void k_copy_to_slot(void *ctx, void *slot, const void *page)
{
	void *src = kmap_atomic((struct page *)page);

	memcpy(slot, src, TMEM_PAGE_SIZE);
	kunmap_atomic(src);
}

static void k_copy_from_slot(void *ctx, void *page, const void *slot)
{
	void *dst = kmap_atomic((struct page *)page);

	memcpy(dst, slot, TMEM_PAGE_SIZE);
	kunmap_atomic(dst);
}

static u64 k_random_u64(void *ctx)
{
	return get_random_u64();
}

static const struct tmem_core_ops tmem_kernel_ops = {
	.lock = k_lock,
	.unlock = k_unlock,
	.now_ns = k_now_ns,
	.coarse_now_ns = k_coarse_now_ns,
	.doorbell = k_doorbell,
	.wait = k_wait,
	.copy_to_slot = k_copy_to_slot,
	.copy_from_slot = k_copy_from_slot,
	.random_u64 = k_random_u64,
};

/* --- cleancache ops ------------------------------------------------------- */

static int new_handle(bool shared, const u8 *uuid)
{
	unsigned long *sent = NULL, *old = NULL;
	int h;

	/* Allocated here, in process context: the core never allocates. */
	if (!shared && sent_filter_bits >= BITS_PER_LONG && is_power_of_2(sent_filter_bits))
		sent = bitmap_zalloc(sent_filter_bits, GFP_KERNEL);
	h = tmem_core_new_handle(&core, shared, uuid, sent, sent ? sent_filter_bits : 0, &old);
	bitmap_free(old);
	if (h < 0) {
		pr_warn("no %spool: %d\n", shared ? "shared " : "", h);
		return -1;
	}
	return h;
}

static int tmem_init_fs(size_t pagesize)
{
	if (pagesize != TMEM_PAGE_SIZE)
		return -1;
	return new_handle(false, NULL);
}

static int tmem_init_shared_fs(uuid_t *uuid, size_t pagesize)
{
	if (pagesize != TMEM_PAGE_SIZE)
		return -1;
	return new_handle(true, uuid->b);
}

static void tmem_put_page(int h, struct cleancache_filekey key, pgoff_t index,
			  struct page *page)
{
	tmem_core_put(&core, h, key.u.key, index, page);
}

/*
 * What a page-cache miss costs: the block device's read time per page read,
 * from its I/O statistics, sampled at most every MISS_COST_PERIOD while gets
 * arrive. Per page, the lower of two views: request latency (summed over
 * requests, so overlapping readahead counts twice) and time the device was
 * busy: a conservative cost makes the guest stand aside sooner, never later.
 * A period whose reads averaged fewer than MISS_COST_SMALL_PAGES pages per
 * request is a random reader's: its latency per read goes to the random
 * estimate (plain gets are weighed against it), the others to the per-page
 * one (batches and windows): a random reader must not be judged by what
 * readahead costs, nor the other way round.
 */
#define MISS_COST_PERIOD (HZ / 10)
#define MISS_COST_MIN_SECTORS (64 * (PAGE_SIZE >> 9)) /* 64 pages read */
#define MISS_COST_SMALL_PAGES 4

static struct {
	spinlock_t lock;
	dev_t dev;
	unsigned long next;
	u64 nsecs, sectors, ticks, ios;
	u64 estimate_ns, random_estimate_ns;
} miss_cost = { .lock = __SPIN_LOCK_UNLOCKED(miss_cost.lock) };

static u64 ewma(u64 old, u64 sample)
{
	return old ? (old * 3 + sample) / 4 : sample;
}

static void sample_miss_cost(struct inode *inode)
{
	struct block_device *bdev = inode->i_sb->s_bdev;
	struct hd_struct *part;
	u64 nsecs, sectors, ticks, ios, d_sec, d_ios, lat, busy, per_page;
	unsigned long flags;

	if (!measure_miss_cost || !bdev || !bdev->bd_part ||
	    time_before(jiffies, READ_ONCE(miss_cost.next)))
		return;
	if (!spin_trylock_irqsave(&miss_cost.lock, flags))
		return;
	part = bdev->bd_part;
	nsecs = part_stat_read(part, nsecs[STAT_READ]);
	sectors = part_stat_read(part, sectors[STAT_READ]);
	ticks = part_stat_read(part, io_ticks);
	ios = part_stat_read(part, ios[STAT_READ]);
	if (miss_cost.dev != bdev->bd_dev || sectors < miss_cost.sectors ||
	    ios < miss_cost.ios) {
		miss_cost.dev = bdev->bd_dev; /* a new baseline */
	} else if (sectors - miss_cost.sectors >= MISS_COST_MIN_SECTORS) {
		d_sec = sectors - miss_cost.sectors;
		d_ios = max(ios - miss_cost.ios, 1ull);
		lat = div64_u64((nsecs - miss_cost.nsecs) * (PAGE_SIZE >> 9), d_sec);
		if (d_sec < d_ios * MISS_COST_SMALL_PAGES * (PAGE_SIZE >> 9)) {
			/* Per read: latency summed over requests / requests. */
			miss_cost.random_estimate_ns =
				ewma(miss_cost.random_estimate_ns,
				     div64_u64(nsecs - miss_cost.nsecs, d_ios));
			tmem_core_set_random_miss_cost(&core,
						       miss_cost.random_estimate_ns);
		} else {
			busy = div64_u64(jiffies_to_nsecs(ticks - miss_cost.ticks) *
					 (PAGE_SIZE >> 9), d_sec);
			per_page = busy ? min(lat, busy) : lat;
			miss_cost.estimate_ns = ewma(miss_cost.estimate_ns, per_page);
			tmem_core_set_miss_cost(&core, miss_cost.estimate_ns);
		}
	} else {
		goto out; /* too few reads yet: keep the baseline */
	}
	miss_cost.nsecs = nsecs;
	miss_cost.sectors = sectors;
	miss_cost.ticks = ticks;
	miss_cost.ios = ios;
out:
	WRITE_ONCE(miss_cost.next, jiffies + MISS_COST_PERIOD);
	spin_unlock_irqrestore(&miss_cost.lock, flags);
}

static int tmem_get_page(int h, struct cleancache_filekey key, pgoff_t index,
			 struct page *page)
{
	struct inode *inode = page->mapping ? page->mapping->host : NULL;
	u32 max_pages = 0;
	pgoff_t end;

	/*
	 * Sampled on every get, even one the core answers without the lock:
	 * a reader whose pages tmem mostly does not hold (standing aside, a
	 * probe's few blocks) decides on this cost whether tmem pays. Cheap
	 * until the period is up.
	 */
	if (inode)
		sample_miss_cost(inode);
	/* A batch stops at the file's end: pages past it cannot be read. */
	if (inode) {
		end = DIV_ROUND_UP(i_size_read(inode), PAGE_SIZE);
		max_pages = end > index ? min_t(pgoff_t, end - index, U32_MAX) : 1;
	}
	return tmem_core_get(&core, h, key.u.key, index, max_pages, page) ? 0 : -1;
}

static void tmem_invalidate_page(int h, struct cleancache_filekey key, pgoff_t index)
{
	tmem_core_invalidate_page(&core, h, key.u.key, index);
}

static void tmem_invalidate_inode(int h, struct cleancache_filekey key)
{
	tmem_core_invalidate_object(&core, h, key.u.key);
}

/* Unmount: the pool goes away; its handle may be handed out again. */
static void tmem_invalidate_fs(int h)
{
	tmem_core_release_handle(&core, h);
}

static const struct cleancache_ops tmem_cleancache_ops = {
	.init_fs = tmem_init_fs,
	.init_shared_fs = tmem_init_shared_fs,
	.get_page = tmem_get_page,
	.put_page = tmem_put_page,
	.invalidate_page = tmem_invalidate_page,
	.invalidate_inode = tmem_invalidate_inode,
	.invalidate_fs = tmem_invalidate_fs,
};

/* --- debugfs --------------------------------------------------------------- */

static int state_show(struct seq_file *m, void *v)
{
	struct tmem_core_state s;

	tmem_core_get_state(&core, &s);
	seq_printf(m, "present %d\nattached %d\nbroken %d\nhost_state %u\n",
		   s.present, s.attached, s.broken, s.host_state);
	seq_printf(m, "host_generation %llu\nguest_generation %llu\n",
		   s.host_generation, s.guest_generation);
	seq_printf(m, "admission_hint %u\nin_flight %u\nfree_slots %u\nregistered %d\n",
		   s.admission_hint, s.in_flight, s.free_slots, ops_registered);
	seq_printf(m, "prefetch_windows %u\nprefetched %u\n", s.prefetch_windows, s.prefetched);
	seq_printf(m, "standing_aside %d\nguest_get_ns %llu\nguest_miss_ns %llu\n",
		   s.standing_aside, s.get_ns_per_hit, s.miss_cost_ns);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(state);

/* @data: the counter's offset in struct tmem_core_counters. */
static int counter_get(void *data, u64 *val)
{
	struct tmem_core_counters k;

	tmem_core_read_counters(&core, &k);
	*val = *(u64 *)((u8 *)&k + (uintptr_t)data);
	return 0;
}
DEFINE_DEBUGFS_ATTRIBUTE(counter_fops, counter_get, NULL, "%llu\n");

#define COUNTER_AS(file, name)                                                  \
	debugfs_create_file_unsafe(file, 0444, debug_dir,                       \
				   (void *)offsetof(struct tmem_core_counters, name), \
				   &counter_fops)
#define COUNTER(name) COUNTER_AS(#name, name)

static void debugfs_setup(void)
{
	debug_dir = debugfs_create_dir(KBUILD_MODNAME, NULL);
	COUNTER(puts_sent);
	COUNTER(puts_skipped_by_hint);
	COUNTER(puts_dropped_ring_full);
	COUNTER(puts_dropped_no_pool);
	COUNTER(puts_dropped_flush_pending);
	COUNTER(puts_dropped_by_host);
	COUNTER(gets_hit);
	COUNTER(gets_miss);
	COUNTER(gets_timeout);
	COUNTER(gets_miss_local);
	COUNTER(gets_skipped_stalled);
	COUNTER(gets_skipped_never_sent);
	COUNTER(gets_skipped_invalidating);
	COUNTER(host_stalls);
	COUNTER(invalidates);
	COUNTER(invalidates_skipped_never_sent);
	COUNTER(invalidates_for_dropped_puts);
	COUNTER(drop_invalidates_avoided);
	COUNTER(flush_fallbacks);
	COUNTER(invalidates_deferred);
	COUNTER(guest_resets);
	COUNTER_AS("resets", host_resets_seen);
	COUNTER(pools_created);
	COUNTER(pool_create_timeouts);
	COUNTER(doorbells);
	COUNTER(doorbells_deferred);
	COUNTER(interrupts);
	COUNTER(interrupt_waits);
	COUNTER(stale_completions);
	COUNTER(errors);
	COUNTER(get_batches);
	COUNTER(prefetch_used);
	COUNTER(prefetch_unused);
	COUNTER(gets_negative_cached);
	COUNTER(readaheads);
	COUNTER(readahead_waits);
	COUNTER(readahead_wait_ns);
	COUNTER(gets_not_sequential);
	COUNTER(sqes_posted);
	COUNTER(completions_reaped);
	COUNTER(stood_aside);
	COUNTER(stood_aside_longest);
	COUNTER(stood_aside_unused);
	COUNTER(gets_skipped_aside);
	COUNTER(puts_skipped_aside);
	COUNTER(puts_refused_unlocked);
	COUNTER(invalidates_skipped_aside);
	COUNTER(aside_samples_discarded);
	COUNTER(aside_cost_rose);
	COUNTER(put_ns);
	COUNTER(get_ns);
	COUNTER(round_trips);
	COUNTER(round_trip_wait_ns);
	debugfs_create_u64("attach_timeouts", 0444, debug_dir, &attach_timeouts);
	debugfs_create_file("state", 0444, debug_dir, NULL, &state_fops);
}

/* --- PCI ------------------------------------------------------------------- */

static irqreturn_t tmem_irq(int irq, void *data)
{
	tmem_core_interrupt(&core);
	wake_up_all(&tmem_wq);
	return IRQ_HANDLED;
}

static void setup_irq(struct pci_dev *pdev)
{
	int err;

	have_irq = false;
	if (!use_irq)
		return;
	err = pci_alloc_irq_vectors(pdev, TMEM_MIN_VECTORS, TMEM_MIN_VECTORS, PCI_IRQ_MSIX);
	if (err < 0) {
		dev_warn(&pdev->dev, "no MSI-X (%d): gets poll instead of sleeping on the interrupt\n",
			 err);
		return;
	}
	err = request_irq(pci_irq_vector(pdev, TMEM_VEC_COMPLETE), tmem_irq, 0,
			  KBUILD_MODNAME, &core);
	if (err) {
		pci_free_irq_vectors(pdev);
		dev_warn(&pdev->dev, "request_irq failed (%d): gets poll\n", err);
		return;
	}
	have_irq = true;
}

static int tmem_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	struct tmem_shm_header *h;
	resource_size_t start, len;
	u32 *free_pending = NULL, *free_slots = NULL;
	struct tmem_core_pending *pending = NULL;
	u32 slots_max;
	u64 deadline;
	int err;
	u8 *shm;

	mutex_lock(&probe_mutex);
	if (tmem_pdev) {
		dev_err(&pdev->dev, "only one tmem device is supported\n");
		err = -EBUSY;
		goto out_unlock;
	}
	err = pcim_enable_device(pdev);
	if (err)
		goto out_unlock;
	err = pcim_iomap_regions(pdev, BIT(0), KBUILD_MODNAME);
	if (err)
		goto out_unlock;
	start = pci_resource_start(pdev, 2);
	len = pci_resource_len(pdev, 2);
	if (!start || len < TMEM_PAGE_SIZE) {
		dev_err(&pdev->dev, "BAR2 (shared memory) is missing or too small\n");
		err = -ENODEV;
		goto out_unlock;
	}
	if (!devm_request_mem_region(&pdev->dev, start, len, KBUILD_MODNAME)) {
		err = -EBUSY;
		goto out_unlock;
	}
	shm = devm_memremap(&pdev->dev, start, len, MEMREMAP_WB);
	if (IS_ERR(shm)) {
		err = PTR_ERR(shm);
		goto out_unlock;
	}
	slots_max = min_t(u64, len / TMEM_PAGE_SIZE, MAX_PENDING);
	pending = kvcalloc(MAX_PENDING, sizeof(*pending), GFP_KERNEL);
	free_pending = kvcalloc(MAX_PENDING, sizeof(u32), GFP_KERNEL);
	free_slots = kvcalloc(slots_max, sizeof(u32), GFP_KERNEL);
	if (!pending || !free_pending || !free_slots) {
		err = -ENOMEM;
		goto out_free;
	}

	/* The header is the host's; wait for READY, then check magic/version. */
	h = (struct tmem_shm_header *)shm;
	deadline = ktime_get_ns() + (u64)attach_timeout_ms * NSEC_PER_MSEC;
	/* Acquire: the header the host wrote before READY is visible after. */
	while (smp_load_acquire(&h->host_state) != TMEM_HOST_STATE_READY &&
	       ktime_get_ns() < deadline)
		usleep_range(5000, 10000);
	if (READ_ONCE(h->host_state) != TMEM_HOST_STATE_READY)
		attach_timeouts++;
	if (READ_ONCE(h->magic) != TMEM_ABI_MAGIC || READ_ONCE(h->version) != TMEM_ABI_VERSION) {
		dev_err(&pdev->dev, "BAR2 is not a tmem ABI v%u region (magic 0x%x, version %u)\n",
			TMEM_ABI_VERSION, READ_ONCE(h->magic), READ_ONCE(h->version));
		err = -ENODEV;
		goto out_free;
	}

	pci_set_master(pdev);
	tmem_regs = pcim_iomap_table(pdev)[0];
	setup_irq(pdev);
	tmem_pdev = pdev;
	err = tmem_core_bind(&core, shm, len, pending, free_pending, MAX_PENDING,
			     free_slots, slots_max);
	dev_info(&pdev->dev, "tmem region %llu KiB, peer id %u, %s, host %s (%d)\n",
		 (u64)len >> 10, readl(tmem_regs + TMEM_REG_IVPOSITION),
		 have_irq ? "MSI-X" : "polling", err ? "not ready yet" : "READY", err);

	if (!ops_registered) {
		err = cleancache_register_ops(&tmem_cleancache_ops);
		if (err) {
			dev_err(&pdev->dev, "cleancache_register_ops failed (%d): another backend?\n",
				err);
		} else {
			ops_registered = true;
			__module_get(THIS_MODULE);
			pr_info("cleancache ops registered; cleancache has no unregister, so this module can no longer be unloaded\n");
		}
	}
	mutex_unlock(&probe_mutex);
	return 0;

out_free:
	kvfree(pending);
	kvfree(free_pending);
	kvfree(free_slots);
out_unlock:
	mutex_unlock(&probe_mutex);
	return err;
}

static void tmem_remove(struct pci_dev *pdev)
{
	struct tmem_core_pending *pending;
	u32 *free_pending, *free_slots;

	mutex_lock(&probe_mutex);
	/* Bound by probe under the same mutex; unbound before freed. */
	pending = core.pending;
	free_pending = core.free_pending;
	free_slots = core.free_slots;
	tmem_core_unbind(&core);
	wake_up_all(&tmem_wq);
	if (have_irq) {
		free_irq(pci_irq_vector(pdev, TMEM_VEC_COMPLETE), &core);
		pci_free_irq_vectors(pdev);
		have_irq = false;
	}
	kvfree(pending);
	kvfree(free_pending);
	kvfree(free_slots);
	tmem_pdev = NULL;
	dev_info(&pdev->dev, "device removed: cleancache ops are no-ops until a device returns\n");
	mutex_unlock(&probe_mutex);
}

static const struct pci_device_id tmem_ids[] = {
	{ PCI_DEVICE(TMEM_PCI_VENDOR, TMEM_PCI_DEVICE) },
	{ }
};
MODULE_DEVICE_TABLE(pci, tmem_ids);

static struct pci_driver tmem_driver = {
	.name = KBUILD_MODNAME,
	.id_table = tmem_ids,
	.probe = tmem_probe,
	.remove = tmem_remove,
};

static int __init tmem_init(void)
{
	int err;

	/* The host judges our reuse only after about this many evictions. */
	tmem_cfg.ram_pages = totalram_pages();
	tmem_core_init(&core, &tmem_kernel_ops, NULL, &tmem_cfg);
	debugfs_setup();
	err = pci_register_driver(&tmem_driver);
	if (err)
		debugfs_remove_recursive(debug_dir);
	return err;
}

/* Only reachable while the cleancache ops were never registered. */
static void __exit tmem_exit(void)
{
	pci_unregister_driver(&tmem_driver);
	debugfs_remove_recursive(debug_dir);
}

module_init(tmem_init);
module_exit(tmem_exit);

MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("cleancache frontend for the tmemd host agent over ivshmem-doorbell");
