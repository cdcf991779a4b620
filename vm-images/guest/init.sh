#!/bin/sh
# /init of the tmemd test guest (busybox). Reports over the serial console
# with lines "TMEMTEST ..." that vm-images/e2e-test.sh parses:
#   TMEMTEST CHECK <name> PASS|FAIL <detail>
#   TMEMTEST COUNTERS <phase> name=value ...   (tmem_ivshmem debugfs)
#   TMEMTEST WAIT_RESTART                      (host: restart tmemd now)
#   TMEMTEST WAIT_HOST_RESTART <round>         (ops: restart/upgrade tmemd,
#                                               keeping the device)
#   TMEMTEST DONE fails=N
# Kernel command line: tmemtest=e2e|bench|probe|ops, tmemtest_pages=N (pages per
# big file), tmemtest_files=N, tmemtest_module=0 (do not load the driver),
# tmemtest_phases=without,with (bench: each workload once per phase, the
# driver loaded at the first "with"),
# tmemtest_round_s=S (ops: read at most S seconds waiting for the host);
# profile=N (the kernel's tick profiler; bench: /proc/profile of each
# workload's measured passes is saved to /mnt/prof-<phase>-<workload>
# for vm-images/bench.sh --profile);
# tmem_ivshmem.PARAM=VALUE words are passed to insmod as PARAM=VALUE.
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t debugfs debugfs /sys/kernel/debug
exec </dev/console >/dev/console 2>&1

arg() {
	for w in $(cat /proc/cmdline); do
		case "$w" in "$1"=*) echo "${w#*=}"; return ;; esac
	done
	echo "$2"
}
MODE=$(arg tmemtest e2e)
PAGES=$(arg tmemtest_pages 24000)
NFILES=$(arg tmemtest_files 4)
LOADMOD=$(arg tmemtest_module 1)
ROUND_S=$(arg tmemtest_round_s 300)
D=/sys/kernel/debug/tmem_ivshmem
CC=/sys/kernel/debug/cleancache
FAILS=0

say() { echo "TMEMTEST $*"; }
check() { # check NAME CONDITION-STATUS DETAIL
	if [ "$2" = 0 ]; then say "CHECK $1 PASS $3"; else say "CHECK $1 FAIL $3"; FAILS=$((FAILS + 1)); fi
}
finish() {
	say "DONE fails=$FAILS"
	sync
	umount /mnt 2>/dev/null
	poweroff -f
}
ctr() { cat "$D/$1" 2>/dev/null || echo 0; }
counters() {
	line="COUNTERS $1"
	for f in puts_sent puts_skipped_by_hint puts_dropped_ring_full puts_dropped_no_pool \
		puts_dropped_flush_pending puts_dropped_by_host gets_hit gets_miss gets_timeout \
		gets_miss_local gets_skipped_never_sent invalidates invalidates_for_dropped_puts \
		invalidates_skipped_never_sent flush_fallbacks resets \
		pools_created doorbells interrupts errors put_ns get_ns; do
		line="$line $f=$(ctr $f)"
	done
	# Whatever else the driver counts (newer drivers add fields), by name.
	for f in "$D"/*; do
		n=${f##*/}
		case " $line " in *" $n="*) continue ;; esac
		v=$(cat "$f" 2>/dev/null | head -n 1)
		case "$v" in ''|*[!0-9]*) continue ;; esac
		line="$line $n=$v"
	done
	for f in puts succ_gets failed_gets invalidates; do
		line="$line cc_$f=$(cat $CC/$f 2>/dev/null || echo 0)"
	done
	say "$line"
}
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
# The kernel's tick profiler (boot with profile=N) over a measured window:
# any write but an int's size resets it; the copy is made after the window.
profile_start() { [ -w /proc/profile ] && echo 0 > /proc/profile; }
profile_save() {
	[ -r /proc/profile ] || return 0
	cp /proc/profile "/mnt/prof-$1.tmp" && mv "/mnt/prof-$1.tmp" "/mnt/prof-$1"
	sync
}
# verify NAME FILE SEED PAGES [ZERO_FROM]
verify() {
	name=$1; shift
	out=$(pagecheck verify "$@")
	rc=$?
	echo "$out" | grep -v '^pagecheck ok=' | head -n 5
	check "$name" $rc "$(echo "$out" | grep '^pagecheck ok=' | sed 's/^pagecheck //')"
}
gen() { pagecheck gen "$@" >/dev/null || { check "gen-$1" 1 "write failed"; finish; }; }

if [ "$MODE" = probe ]; then
	say PROBE_OK
	poweroff -f
fi

say "BOOT kernel=$(uname -r) mem_kb=$(grep MemTotal /proc/meminfo | tr -s ' ' | cut -d' ' -f2) mode=$MODE pages=$PAGES files=$NFILES"
# load_module: insmod with the tmem_ivshmem.PARAM=V words, checked attached.
# Loading after the mount is fine: cleancache hands the mounted filesystems
# to ops registered later.
load_module() {
	params=""
	for w in $(cat /proc/cmdline); do
		case "$w" in tmem_ivshmem.*=*) params="$params ${w#tmem_ivshmem.}" ;; esac
	done
	insmod /tmem_ivshmem.ko $params
	check insmod $? "$params"
	cat $D/state | tr '\n' ' ' | sed 's/^/TMEMTEST STATE /'; echo
	grep -q '^attached 1' $D/state
	check attached $? ""
	# cleancache ops cannot be unregistered: the module must refuse to go.
	rmmod tmem_ivshmem 2>/dev/null
	[ $? != 0 ] && grep -q tmem_ivshmem /proc/modules
	check unload-refused $? ""
}
PHASES=$(arg tmemtest_phases "")
if [ "$LOADMOD" = 1 ] && [ -z "$PHASES" ]; then load_module; fi
mount -t ext4 /dev/vda /mnt
check mount $? "ext4 on /dev/vda"
[ "$FAILS" = 0 ] || finish

if [ "$MODE" = bench ]; then
	# Workloads (tmemtest_workloads, comma-separated; vm-images/bench.sh
	# parses the CHECK lines' ok= and ms= and the COUNTERS around each):
	#   seq     files larger than RAM together, re-read sequentially
	#           (passes 2-3 measured; pass 1 warms tmem)
	#   rand    single 4 KiB pages at random over a file larger than RAM,
	#           without readahead (passes 2-3 measured)
	#   stream  files written, caches dropped, read once, never again
	WORKLOADS=$(arg tmemtest_workloads seq)
	RPAGES=$(arg tmemtest_rand_pages 49152)
	RREADS=$(arg tmemtest_rand_reads 20000)
	SPAGES=$(arg tmemtest_stream_pages 32768)
	SFILES=$(arg tmemtest_stream_files 3)
	# Phases (tmemtest_phases=without,with; a name starting "without" or
	# "with", e.g. without2 to run twice without): every workload runs once
	# per phase in this one boot, the driver loaded at the first "with", so a
	# with/without ratio compares passes of the same QEMU process (on a
	# shared host one guest's speed moves in plateaus for its whole life).
	# The files are written once; every phase starts from dropped caches.
	# Without the parameter: one phase, named after tmemtest_module.
	if [ -z "$PHASES" ]; then
		PHASES=with
		[ "$LOADMOD" = 1 ] || PHASES=without
	fi
	for wl in $(echo "$WORKLOADS" | tr ',' ' '); do
		case "$wl" in
		seq) i=1
			while [ $i -le "$NFILES" ]; do gen /mnt/b$i $((900 + i)) "$PAGES"; i=$((i + 1)); done ;;
		rand) gen /mnt/r1 801 "$RPAGES" ;;
		stream) i=1
			while [ $i -le "$SFILES" ]; do gen /mnt/s$i $((700 + i)) "$SPAGES"; i=$((i + 1)); done ;;
		*) check "bench-workload-$wl" 1 "unknown workload"; finish ;;
		esac
	done
	for ph in $(echo "$PHASES" | tr ',' ' '); do
		case "$ph" in
		without*) grep -q tmem_ivshmem /proc/modules &&
				{ check "bench-phase-$ph" 1 "the driver is loaded already"; finish; } ;;
		with*) # Dropped first: the driver must not start with the last
			# phase's page cache offered to it.
			grep -q tmem_ivshmem /proc/modules || { drop; load_module; }
			[ "$FAILS" = 0 ] || finish ;;
		*) check "bench-phase-$ph" 1 "unknown phase"; finish ;;
		esac
		for wl in $(echo "$WORKLOADS" | tr ',' ' '); do
			BN=bench-$ph-$wl
			drop
			case "$wl" in
			seq)
				counters $BN-start
				for pass in 1 2 3; do
					i=1
					while [ $i -le "$NFILES" ]; do verify $BN-pass$pass-b$i /mnt/b$i $((900 + i)) "$PAGES"; i=$((i + 1)); done
					[ $pass = 1 ] && { counters $BN-warm; profile_start; }
				done
				profile_save "$ph-$wl"
				counters $BN-end
				;;
			rand)
				# Pass 1 reads every page once, in order: the working set is
				# in the page cache or (evicted) offered to tmem before the
				# measured random passes.
				verify $BN-pass1-r1 /mnt/r1 801 "$RPAGES"
				counters $BN-warm
				profile_start
				for pass in 2 3; do
					out=$(pagecheck randread /mnt/r1 801 "$RPAGES" "$RREADS" $pass)
					check $BN-pass$pass-r1 $? "$(echo "$out" | grep '^pagecheck ok=' | sed 's/^pagecheck //')"
				done
				profile_save "$ph-$wl"
				counters $BN-end
				;;
			stream)
				counters $BN-start
				profile_start
				i=1
				while [ $i -le "$SFILES" ]; do verify $BN-pass1-s$i /mnt/s$i $((700 + i)) "$SPAGES"; i=$((i + 1)); done
				profile_save "$ph-$wl"
				counters $BN-end
				;;
			esac
		done
	done
	finish
fi

if [ "$MODE" = ops ]; then
	# tmemd restarts and upgrades under the running guest, keeping its
	# device (vm-images/ops-test.py): no re-plug, reads in flight across
	# the restart stay correct, and tmem is used again afterwards.
	hgen() { grep '^host_generation ' $D/state | cut -d' ' -f2; }
	i=1
	while [ $i -le "$NFILES" ]; do gen /mnt/f$i $((100 + i)) "$PAGES"; i=$((i + 1)); done
	drop
	i=1
	while [ $i -le "$NFILES" ]; do verify warm-f$i /mnt/f$i $((100 + i)) "$PAGES"; i=$((i + 1)); done
	counters warm
	seed1=101  # f1 is rewritten after each restart
	for round in 1 2 3; do
		before=$(hgen)
		say "WAIT_HOST_RESTART $round"
		# Keep reading (gets and puts in flight) until the new tmemd's
		# generation shows up.
		t0=$(date +%s)
		n=0
		while [ "$(hgen)" = "$before" ]; do
			i=$((n % NFILES + 1))
			seed=$((100 + i))
			[ $i = 1 ] && seed=$seed1
			drop
			verify during-$round-$n /mnt/f$i $seed "$PAGES"
			n=$((n + 1))
			[ $(($(date +%s) - t0)) -ge "$ROUND_S" ] && break
		done
		[ "$(hgen)" != "$before" ]
		check restart-$round-seen $? "after ${n} reads, generation $before -> $(hgen)"
		puts_before=$(ctr puts_sent)
		hits_before=$(ctr gets_hit)
		# A file rewritten after the restart: no page from before may
		# come back.
		seed1=$((500 + round))
		gen /mnt/f1 $seed1 "$PAGES"
		drop
		verify after-$round-f1 /mnt/f1 $((500 + round)) "$PAGES"
		drop
		i=1
		while [ $i -le "$NFILES" ]; do
			seed=$((100 + i))
			[ $i = 1 ] && seed=$seed1
			verify after-$round-reread-f$i /mnt/f$i $seed "$PAGES"
			i=$((i + 1))
		done
		# Puts never wait: a host slower than the guest's burst of puts
		# after drop_caches (a busy machine) drops most of them for a
		# full ring, and a round's first re-read may find none of its
		# pages there. Keep re-reading (every page still verified) until
		# a get hits or the round's time is up: the check is that tmem
		# is used again after the restart, not that one burst fitted.
		t0=$(date +%s)
		n=0
		while [ "$(ctr gets_hit)" = "$hits_before" ] &&
			[ $(($(date +%s) - t0)) -lt "$ROUND_S" ]; do
			i=$((n % NFILES + 1))
			seed=$((100 + i))
			[ $i = 1 ] && seed=$seed1
			drop
			verify after-$round-more-$n /mnt/f$i $seed "$PAGES"
			n=$((n + 1))
		done
		grep -q '^attached 1' $D/state
		check restart-$round-attached $? "$(tr '\n' ' ' < $D/state)"
		[ "$(ctr puts_sent)" -gt "$puts_before" ]
		check restart-$round-puts $? "puts_sent before=$puts_before after=$(ctr puts_sent)"
		[ "$(ctr gets_hit)" -gt "$hits_before" ]
		check restart-$round-hits $? "gets_hit before=$hits_before after=$(ctr gets_hit)"
		counters after-restart-$round
	done
	finish
fi

# --- phase 1: several times RAM, written then read back twice -------------
i=1
while [ $i -le "$NFILES" ]; do gen /mnt/f$i $((100 + i)) "$PAGES"; i=$((i + 1)); done
counters after-write
for pass in 1 2; do
	i=1
	while [ $i -le "$NFILES" ]; do verify read$pass-f$i /mnt/f$i $((100 + i)) "$PAGES"; i=$((i + 1)); done
	counters after-read$pass
done
[ "$(ctr puts_sent)" -gt 0 ]; check guest-puts-sent $? "puts_sent=$(ctr puts_sent)"
[ "$(ctr gets_hit)" -gt 0 ]; check guest-gets-hit $? "gets_hit=$(ctr gets_hit)"

# --- phase 2: coherency (no stale byte) -----------------------------------
drop  # every clean page of f1..f4 goes to tmem now
gen /mnt/f1 201 "$PAGES"  # overwrite in place, same inode
drop
verify overwrite-f1 /mnt/f1 201 "$PAGES"
drop
truncate -s $((1000 * 4096)) /mnt/f2 && truncate -s $((PAGES * 4096)) /mnt/f2
drop
verify truncate-f2 /mnt/f2 102 "$PAGES" 1000
ino1=$(stat -c %i /mnt/f3)
rm /mnt/f3
sync
gen /mnt/f3 203 "$PAGES"
ino2=$(stat -c %i /mnt/f3)
say "INFO recreate-f3 inode_before=$ino1 inode_after=$ino2"
drop
verify recreate-f3 /mnt/f3 203 "$PAGES"
# Small files deleted and recreated: the inode number is reused every time.
k=1
while [ $k -le 20 ]; do
	gen /mnt/s 3$k 300
	drop
	verify churn-$k /mnt/s 3$k 300
	ino=$(stat -c %i /mnt/s)
	rm /mnt/s
	k=$((k + 1))
done
gen /mnt/s 399 200
drop
verify churn-final /mnt/s 399 200
say "INFO churn-inode last=$ino now=$(stat -c %i /mnt/s)"
drop
verify all-f1 /mnt/f1 201 "$PAGES"
verify all-f2 /mnt/f2 102 "$PAGES" 1000
verify all-f3 /mnt/f3 203 "$PAGES"
i=4
while [ $i -le "$NFILES" ]; do verify all-f$i /mnt/f$i $((100 + i)) "$PAGES"; i=$((i + 1)); done
counters after-coherency
[ "$(ctr errors)" = 0 ]; check guest-no-errors $? "errors=$(ctr errors)"

# --- phase 3: tmemd restarts under the running guest ----------------------
drop
puts_before=$(ctr puts_sent)
say WAIT_RESTART
t=0
# tmemd marks the region RESET when it stops; a new tmemd cannot reach us.
until grep -q '^host_state [02]' $D/state; do
	sleep 1
	t=$((t + 1))
	[ $t -ge 120 ] && break
done
say "INFO restart seen after ${t}s"
verify restart-f1 /mnt/f1 201 "$PAGES"
grep -q '^attached 0' $D/state
check restart-noticed $? "$(tr '\n' ' ' < $D/state)"
gen /mnt/f1 601 "$PAGES"
drop
verify restart-overwrite-f1 /mnt/f1 601 "$PAGES"
gen /mnt/f5 605 4000
drop
verify restart-new-f5 /mnt/f5 605 4000
puts_after=$(ctr puts_sent)
[ "$puts_after" = "$puts_before" ]; check restart-noop $? "puts_sent before=$puts_before after=$puts_after"
# Device removal and re-probe: the region is still the dead tmemd's.
dev=$(grep -l 0x1110 /sys/bus/pci/devices/*/device | head -n 1)
dev=${dev%/device}
echo 1 > "$dev/remove"
grep -q '^present 0' $D/state; check device-removed $? ""
verify removed-f1 /mnt/f1 601 "$PAGES"
echo 1 > /sys/bus/pci/rescan
sleep 3
grep -q '^present 1' $D/state; check device-reprobed $? "$(tr '\n' ' ' < $D/state)"
drop
verify reprobed-f5 /mnt/f5 605 4000
counters after-restart

# --- phase 4: hot re-plug onto the new tmemd --------------------------------
drop
puts_before=$(ctr puts_sent)
hits_before=$(ctr gets_hit)
say WAIT_REPLUG
t=0
until grep -q '^attached 1' $D/state; do
	sleep 1
	t=$((t + 1))
	[ $t -ge 120 ] && break
done
grep -q '^attached 1' $D/state
check replug-attached $? "after ${t}s: $(tr '\n' ' ' < $D/state)"
verify replug-f1 /mnt/f1 601 "$PAGES"
gen /mnt/f6 706 8000
drop
verify replug-new-f6 /mnt/f6 706 8000
drop
verify replug-reread-f6 /mnt/f6 706 8000
gen /mnt/f6 707 8000
drop
verify replug-overwrite-f6 /mnt/f6 707 8000
[ "$(ctr puts_sent)" -gt "$puts_before" ]
check replug-puts $? "puts_sent before=$puts_before after=$(ctr puts_sent)"
[ "$(ctr gets_hit)" -gt "$hits_before" ]
check replug-hits $? "gets_hit before=$hits_before after=$(ctr gets_hit)"
counters final
finish
