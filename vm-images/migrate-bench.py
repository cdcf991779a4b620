#!/usr/bin/env python3
"""Live-migration cost of tmem: the same real 5.10
guest (TCG, 1 vCPU) migrated between two QEMU processes on this machine,
once without a tmem device and once with one (ivshmem master=on, two tmemd
"hosts"), alternating, --repeats times each, in one run.

Each migration starts while the guest reads and verifies its files (gets
and puts in flight with tmem, disk reads without): the guest workload is
init.sh's tmemtest=ops, which says WAIT_HOST_RESTART once its files are
warm. total-time and downtime come from the source's QMP query-migrate.
Prints one BENCH line per migration and a summary with medians and the
with/without ratios (the issue's target: <= 1.1x).

Usage: vm-images/migrate-bench.py --tmemd PATH [--repeats N] [--pages N]
       [--files N] [--mem MIB] [--disk-cache none|writeback]
"""
import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

VM_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, VM_DIR)
from vmtest import Qmp, wait_for  # noqa: E402


def serial_has(path, text):
    try:
        with open(path, errors="replace") as f:
            return text in f.read()
    except FileNotFoundError:
        return False


def one_migration(args, work, with_tmem, n):
    """Boots a guest, migrates it once while it reads; returns query-migrate."""
    d = os.path.join(work, "run-%d" % n)
    os.makedirs(d)
    disk = os.path.join(d, "disk.img")
    subprocess.run(["truncate", "-s", "1G", disk], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", disk], check=True)
    hosts, procs = [], []
    try:
        for name in ("hostA", "hostB"):
            hd = os.path.join(d, name)
            os.makedirs(hd)
            if with_tmem:
                p = subprocess.Popen(
                    [args.tmemd, "--vm", "guest", "--socket-dir", hd,
                     "--control-socket", os.path.join(hd, "control.sock"),
                     "--mode", "always", "--host-peer-id", "1"],
                    stdout=open(os.path.join(hd, "tmemd.log"), "w"),
                    stderr=subprocess.STDOUT)
                procs.append(p)
            hosts.append(os.path.join(hd, "guest.sock"))
        if with_tmem and not all(wait_for(lambda s=s: os.path.exists(s), 20)
                                 for s in hosts):
            raise SystemExit("tmemd did not start")
        append = ("tmemtest=ops tmemtest_pages=%d tmemtest_files=%d "
                  "tmemtest_round_s=20" % (args.pages, args.files))
        if not with_tmem:
            append = "tmemtest_module=0 " + append

        def start(i, incoming=None):
            serial = os.path.join(d, "serial-%d.log" % i)
            qmp = os.path.join(d, "qmp-%d.sock" % i)
            argv = [os.path.join(VM_DIR, "run-guest.sh"), "--disk", disk,
                    "--mem", str(args.mem), "--smp", "1", "--serial", serial,
                    "--timeout", "900", "--append", append, "--qmp", qmp,
                    "--accel", "tcg", "--disk-cache", args.disk_cache]
            if with_tmem:
                argv += ["--socket", hosts[i], "--migratable"]
            if incoming:
                argv += ["--incoming", "unix:" + incoming]
            p = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
            procs.append(p)
            return p, Qmp(qmp), serial

        src, src_qmp, serial = start(0)
        if not wait_for(lambda: serial_has(serial, "WAIT_HOST_RESTART 1"), 600):
            raise SystemExit("guest never got ready (%s)" % serial)
        mig = os.path.join(d, "mig.sock")
        _, dst_qmp, dst_serial = start(1, incoming=mig)
        r = src_qmp.execute("migrate", uri="unix:" + mig)
        if "error" in r:
            raise SystemExit("migrate refused: %s" % r["error"]["desc"])
        while True:
            q = src_qmp.execute("query-migrate")["return"]
            if q.get("status") in ("completed", "failed", "cancelled"):
                break
            time.sleep(0.02)
        ram = q.get("ram", {})
        print("BENCH real-guest migration with_tmem=%d status=%s total_ms=%s "
              "downtime_ms=%s ram_transferred_kib=%d" %
              (with_tmem, q.get("status"), q.get("total-time"),
               q.get("downtime"), ram.get("transferred", 0) // 1024),
              flush=True)
        src_qmp.execute("quit")
        # Only the migration is measured; a destination guest that dies
        # afterwards (QEMU 7.2 TCG here, with or without tmem: see
        # migrate-test.py) is reported, and the run goes on.
        time.sleep(3)
        if serial_has(dst_serial, "Kernel panic") or serial_has(dst_serial, "BUG:"):
            print("WARN destination guest crashed after migration (with_tmem=%d)"
                  % with_tmem, flush=True)
        try:
            dst_qmp.execute("quit")
        except (OSError, RuntimeError):
            pass  # already gone (panic=-1 with -no-reboot)
        return q
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tmemd", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pages", type=int, default=12000)
    ap.add_argument("--files", type=int, default=3)
    ap.add_argument("--mem", type=int, default=160)
    ap.add_argument("--disk-cache", default="writeback",
                    choices=("none", "writeback"))
    args = ap.parse_args()
    subprocess.run([os.path.join(VM_DIR, "build-all.sh")], check=True,
                   stdout=subprocess.DEVNULL)
    work = tempfile.mkdtemp(prefix="tmem-migbench.")
    res = {0: [], 1: []}
    n = 0
    for _ in range(args.repeats):
        for with_tmem in (0, 1):
            q = one_migration(args, work, with_tmem, n)
            n += 1
            # QEMU answered a completed migration with total-time 0 once
            # here: such a sample is reported, not averaged.
            if q.get("status") == "completed" and q.get("total-time"):
                res[with_tmem].append(q)
    subprocess.run(["rm", "-rf", work])
    if not res[0] or not res[1]:
        print("RESULT: FAIL (a migration did not complete)")
        return 1
    med = {}
    for k in (0, 1):
        med[k] = (statistics.median(q["total-time"] for q in res[k]),
                  statistics.median(q["downtime"] for q in res[k]))
    print("SUMMARY migrations=%d+%d total_ms without=%d with=%d ratio=%.2f "
          "downtime_ms without=%d with=%d ratio=%.2f" %
          (len(res[0]), len(res[1]), med[0][0], med[1][0], med[1][0] / med[0][0],
           med[0][1], med[1][1], med[1][1] / max(1, med[0][1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
