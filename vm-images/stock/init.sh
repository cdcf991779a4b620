#!/bin/sh
# /init of the stock Debian 12 guest (busybox, the package's own modules).
# Loads the virtio and zram modules, switches swap on and runs swapcheck;
# vm-images/stock/swaptest.py reads the serial console:
#   SWAPTEST BOOT kernel=... mem_kb=...
#   SWAPTEST SWAPS <one line of /proc/swaps per area, ';'-separated>
#   SWAPCHECK ...                    (swapcheck's own lines, see swapcheck.c)
#   SWAPTEST EXIT rc=N               (swapcheck's exit status; 137: OOM-killed)
#   SWAPTEST ERROR <what>
# Kernel command line:
#   swaptest=run|probe        probe: print SWAPTEST PROBE_OK and power off
#   swaptest_disk=vda         the swap disk (virtio-blk or vhost-user-blk)
#   swaptest_zram=MiB         first a zram swap area (lz4) of that size, the
#                             disk behind it (switched on first: higher
#                             priority)
#   swaptest_zram_limit=MiB   zram's mem_limit (0: none)
#   swaptest_nonrot=1|0       mark the disk non-rotational before swapon
#                             (default 1). Linux discards freed swap slots
#                             only on a non-rotational device (the cluster
#                             allocator), and virtio-blk cannot say it is
#                             one: a real guest does this with a udev rule.
#   swaptest_args=a,b,c       swapcheck's arguments, commas for spaces
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
exec </dev/console >/dev/console 2>&1

arg() {
	for w in $(cat /proc/cmdline); do
		case "$w" in "$1"=*) echo "${w#*=}"; return ;; esac
	done
	echo "$2"
}
say() { echo "SWAPTEST $*"; }
finish() {
	sync
	poweroff -f
}
fail() {
	say "ERROR $*"
	finish
}

if [ "$(arg swaptest run)" = probe ]; then
	say PROBE_OK
	poweroff -f
fi
say "BOOT kernel=$(uname -r) mem_kb=$(grep MemTotal /proc/meminfo | tr -s ' ' | cut -d' ' -f2)"
while read -r m; do
	insmod "$m" || fail "insmod $m"
done </modules.load

DISK=$(arg swaptest_disk vda)
ZRAM=$(arg swaptest_zram 0)
ZLIMIT=$(arg swaptest_zram_limit 0)
# virtio devices probe asynchronously after insmod.
t=0
until [ -b "/dev/$DISK" ] || [ $t -ge 100 ]; do sleep 0.1; t=$((t + 1)); done
[ -b "/dev/$DISK" ] || fail "no /dev/$DISK"
if [ "$ZRAM" != 0 ]; then
	echo 1 >/sys/class/zram-control/hot_add 2>/dev/null
	[ -b /dev/zram0 ] || fail "no /dev/zram0"
	echo lz4 >/sys/block/zram0/comp_algorithm || fail "zram lz4"
	echo "${ZRAM}M" >/sys/block/zram0/disksize || fail "zram disksize"
	[ "$ZLIMIT" != 0 ] && { echo "${ZLIMIT}M" >/sys/block/zram0/mem_limit || fail "zram mem_limit"; }
	mkswap /dev/zram0 >/dev/null || fail "mkswap zram0"
	swapon -d /dev/zram0 || fail "swapon zram0"
fi
if [ "$(arg swaptest_nonrot 1)" = 1 ]; then
	echo 0 >"/sys/block/$DISK/queue/rotational" || fail "$DISK rotational=0"
fi
say "DISK $DISK rotational=$(cat /sys/block/$DISK/queue/rotational) discard_max_bytes=$(cat /sys/block/$DISK/queue/discard_max_bytes)"
mkswap "/dev/$DISK" >/dev/null || fail "mkswap $DISK"
swapon -d "/dev/$DISK" || fail "swapon -d $DISK"
say "SWAPS $(tail -n +2 /proc/swaps | tr -s ' \t' ' ' | tr '\n' ';')"

swapcheck $(arg swaptest_args "" | tr ',' ' ')
rc=$?
[ "$ZRAM" != 0 ] && say "ZRAM mm_stat $(cat /sys/block/zram0/mm_stat)"
say "SWAPS $(tail -n +2 /proc/swaps | tr -s ' \t' ' ' | tr '\n' ';')"
say "EXIT rc=$rc"
finish
