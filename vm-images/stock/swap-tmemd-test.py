#!/usr/bin/env python3
"""The stock Debian 12 guest (kernel 6.1, unmodified) swapping to the real
tmemd's swap device (`tmemd --swap vm1=SIZE`, the spill image in a state
directory, sockets in a private directory), over tmemd's vhost-user-blk
socket. The working set is 1.5x guest RAM; every page is verified.

  --case quota    the VM's quota is set to a quarter of the working set
                  the way an operator does it (`tmemctl set-quota`) before
                  the guest starts. Checked: every page verified; pages
                  spilled to the image at the quota (spill counters > 0);
                  the store held pages too; the VM's charged memory within
                  its quota at every poll during the run (`tmemctl vms -o
                  json`, every 0.5 s); no page lost, no device error.
  --case restart  after the write phase, while the guest holds pages in
                  tmemd, SIGTERM: tmemd writes every store page back into
                  the image (count > 0) and exits; a new tmemd with the same
                  flags takes the image as the device's content, QEMU
                  reconnects (chardev reconnect=1) and the guest's read phase
                  verifies every page.

Exit 0 when every check holds, 77 when QEMU or the stock guest images are
not available. Prints SWAPTMEMD lines with the numbers of the run.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import swaptest  # noqa: E402

VM = "vm1"


def log(msg):
    print(f"[swap-tmemd {time.strftime('%H:%M:%S', time.gmtime())}] {msg}",
          file=sys.stderr, flush=True)


def check(name, cond, detail):
    print(f"SWAPTMEMD CHECK {name} {'PASS' if cond else 'FAIL'} {detail}",
          flush=True)
    return bool(cond)


def cpu_seconds(pid):
    return swaptest.cpu_seconds(pid)


class Tmemd:
    """One tmemd process serving VM's swap device; restartable."""

    def __init__(self, a, work, swap_mib):
        self.a = a
        self.work = work
        self.sock_dir = os.path.join(work, "run")
        self.state_dir = os.path.join(work, "state")
        os.makedirs(self.sock_dir, mode=0o700)
        self.control = os.path.join(self.sock_dir, "control.sock")
        self.swap_sock = os.path.join(self.sock_dir, f"{VM}.swap.sock")
        self.argv = [a.tmemd, "--swap", f"{VM}={swap_mib}MiB",
                     "--socket-dir", self.sock_dir,
                     "--state-dir", self.state_dir,
                     "--control-socket", self.control,
                     "--memory-cap", "1GiB", "--log-level", "info"]
        self.proc = None
        self.logs = []
        self.cpu_s = 0.0  # of the processes that exited

    def start(self):
        path = os.path.join(self.work, f"tmemd{len(self.logs) + 1}.log")
        self.logs.append(path)
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                     stdout=open(path, "w"),
                                     stderr=subprocess.STDOUT)
        ok = swaptest.wait_for(
            lambda: (os.path.exists(self.swap_sock) and
                     os.path.exists(self.control)) or
            self.proc.poll() is not None, 30)
        if not ok or self.proc.poll() is not None:
            raise RuntimeError("tmemd did not start:\n" + open(path).read())
        log(f"tmemd pid {self.proc.pid} serving {self.swap_sock}")

    def stop(self):
        """SIGTERM; returns the exit status. Keeps the process's CPU."""
        self.proc.send_signal(signal.SIGTERM)
        _, status, ru = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.cpu_s += ru.ru_utime + ru.ru_stime
        return self.proc.returncode

    def cpu_total(self):
        live = cpu_seconds(self.proc.pid) if self.proc.poll() is None else 0
        return self.cpu_s + (live or 0)

    def ctl(self, *args, check=True):
        r = subprocess.run([self.a.tmemctl, "-s", self.control, *args],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, timeout=30)
        if check and r.returncode != 0:
            raise RuntimeError(f"tmemctl {' '.join(args)}: {r.stderr}")
        return r

    def vm(self):
        """The VM's summary from `tmemctl vms -o json` (None: not listed)."""
        r = self.ctl("-o", "json", "vms", check=False)
        if r.returncode != 0:
            return None
        for v in json.loads(r.stdout).get("vms", []):
            if v["name"] == VM:
                return v
        return None

    def log_text(self):
        return "".join(open(p).read() for p in self.logs)


def last_value(text, event, key):
    value = None
    for line in text.splitlines():
        if f"event={event} " in line:
            m = re.search(rf" {key}=(-?\d+)", line)
            if m:
                value = int(m.group(1))
    return value


def swap_numbers(v):
    """The swap device's page numbers and backing counters, flat."""
    sw = (v or {}).get("swap") or {}
    out = {k: int(sw[k]) for k in
           ("stored_pages", "memory_pages", "compressed_pages", "raw_pages",
            "spilled_pages", "lost_pages", "discarded_pages", "reads",
            "writes", "compressed_puts", "raw_puts") if k in sw}
    for group in ("counters", "backing_counters"):
        for c in sw.get(group, []):
            out[f"{group}.{c['name']}"] = int(c.get("value", 0))
    return out


class Poller:
    """Samples the VM's charge against its quota while the guest runs."""

    def __init__(self, tmemd, period=0.5):
        self.tmemd = tmemd
        self.period = period
        self.samples = []
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self):
        while not self.stop_flag.wait(self.period):
            try:
                v = self.tmemd.vm()
            except Exception:  # tmemd restarting
                v = None
            if v is not None:
                self.samples.append(
                    (int(v.get("charged_bytes", 0)),
                     int(v.get("policy", {}).get("quota_bytes", 0)),
                     swap_numbers(v)))

    def stop(self):
        self.stop_flag.set()
        self.thread.join()


def run_guest(a, tmemd, on_wait=None):
    sargs = ["--backend", "vhost", "--socket", tmemd.swap_sock,
             "--backend-pid", str(tmemd.proc.pid), "--reconnect",
             "--ws-ratio", str(a.ws_ratio), "--passes", "1",
             "--accel", "tcg", "--timeout", str(a.timeout)]
    args = swaptest.parse_args(sargs)
    r = swaptest.run_one(args, on_wait=on_wait)
    for ph in r["phases"]:
        print(f"SWAPTMEMD PHASE {json.dumps(ph)}")
    print(f"SWAPTMEMD ELAPSED {r.get('elapsed_s')}s (boot {r.get('boot_s')}s, "
          f"{r['accel']})")
    if not r["ok"]:
        print(r.get("serial_tail", ""))
    return args, r


def common_checks(r, args, nums):
    ok = check("verified", r["ok"], r["verdict"])
    out_pages = sum(ph["pswpout"] for ph in r["phases"])
    excess = max(0, (args.ws_mib - args.mem) * 256)
    ok &= check("swapped-out", out_pages >= excess,
                f"pswpout={out_pages}, working set exceeds RAM by {excess} pages")
    for key in ("lost_pages", "counters.backing_errors",
                "counters.queues_broken", "counters.requests_bad_layout",
                "backing_counters.store_errors",
                "backing_counters.store_misses",
                "backing_counters.image_write_errors",
                "backing_counters.image_read_errors",
                "backing_counters.pages_lost"):
        if key in nums:
            ok &= check(f"no-{key}", nums[key] == 0, f"{key}={nums[key]}")
    return ok


def case_quota(a, work):
    ws_mib = int(256 * a.ws_ratio)
    quota_mib = ws_mib // 4
    tmemd = Tmemd(a, work, ws_mib + 256)
    tmemd.start()
    ok = True
    try:
        tmemd.ctl("set-quota", VM, f"{quota_mib}MiB")
        v = tmemd.vm()
        quota = int(v["policy"]["quota_bytes"])
        ok &= check("quota-set", quota == quota_mib << 20,
                    f"quota_bytes={quota} for a swap-only VM")
        poller = Poller(tmemd)
        try:
            args, r = run_guest(a, tmemd)
        finally:
            poller.stop()
        final = swap_numbers(tmemd.vm())
        cpu = tmemd.cpu_total()
    finally:
        rc = tmemd.stop()
    peak = max((s[0] for s in poller.samples), default=0)
    over = [s for s in poller.samples if s[1] and s[0] > s[1]]
    spilled = max([s[2].get("spilled_pages", 0) for s in poller.samples] +
                  [final.get("spilled_pages", 0)])
    in_memory = max([s[2].get("memory_pages", s[2].get("compressed_pages", 0))
                     for s in poller.samples] + [0])
    print("SWAPTMEMD NUMBERS " + json.dumps(
        {"quota_bytes": quota, "peak_charged_bytes": peak,
         "polls": len(poller.samples), "tmemd_cpu_s": round(cpu, 2),
         "max_spilled_pages": spilled, "max_memory_pages": in_memory,
         "final": final}))
    ok &= common_checks(r, args, final)
    ok &= check("polled", len(poller.samples) >= 10,
                f"{len(poller.samples)} polls of the VM's charge")
    ok &= check("within-quota", not over and peak > 0,
                f"peak charged {peak} of quota {quota} bytes over "
                f"{len(poller.samples)} polls; {len(over)} over")
    spill_counters = {k: v for k, v in final.items()
                      if k.startswith("backing_counters.spilled")}
    ok &= check("spilled", spilled > 0 and
                final.get("backing_counters.spilled_quota", spilled) > 0,
                f"spilled_pages max {spilled}; {spill_counters}")
    ok &= check("store-held-pages", in_memory > 0,
                f"pages in tmemd's memory, max {in_memory}")
    ok &= check("tmemd-exit", rc == 0, f"tmemd exited {rc}")
    return 0 if ok else 1


def case_restart(a, work):
    ws_mib = int(256 * a.ws_ratio)
    tmemd = Tmemd(a, work, ws_mib + 256)
    tmemd.start()
    seen = {}

    def on_wait(phase):
        if phase != "write":
            return
        before = swap_numbers(tmemd.vm())
        seen["before"] = before
        t0 = time.monotonic()
        seen["rc1"] = tmemd.stop()
        log(f"tmemd stopped (exit {seen['rc1']}) while the guest holds "
            f"{before.get('stored_pages')} pages")
        tmemd.start()
        seen["restart_s"] = round(time.monotonic() - t0, 2)
        # Reconnected: QEMU connected and ran the vhost-user handshake
        # again (its memory table is mapped), not just a connect.
        reconnected = swaptest.wait_for(
            lambda: swap_numbers(tmemd.vm()).get(
                "counters.mem_tables_mapped", 0) > 0, 60)
        seen["reconnected"] = bool(reconnected)
        seen["after_restart"] = swap_numbers(tmemd.vm())
        log(f"tmemd restarted in {seen['restart_s']} s; QEMU reconnected: "
            f"{seen['reconnected']}")

    ok = True
    try:
        args, r = run_guest(a, tmemd, on_wait)
        final = swap_numbers(tmemd.vm())
        cpu = tmemd.cpu_total()
    finally:
        rc = tmemd.stop()
    text = tmemd.log_text()
    written_back = None
    first_log = open(tmemd.logs[0]).read()
    written_back = last_value(first_log, "swap_written_back", "written_back")
    if written_back is None:
        written_back = seen.get("before", {}).get("memory_pages")
    print("SWAPTMEMD NUMBERS " + json.dumps(
        {"before_stop": seen.get("before"), "after_restart":
         seen.get("after_restart"), "final": final,
         "written_back": written_back, "restart_s": seen.get("restart_s"),
         "tmemd_cpu_s": round(cpu, 2)}))
    ok &= common_checks(r, args, final)
    ok &= check("stopped-mid-run", "rc1" in seen and seen["rc1"] == 0,
                f"first tmemd exit {seen.get('rc1')}")
    ok &= check("written-back", (written_back or 0) > 0,
                f"{written_back} store pages written into the image at SIGTERM")
    held = seen.get("before", {}).get("stored_pages", 0)
    after = seen.get("after_restart", {})
    ok &= check("image-holds-all", held > 0 and
                after.get("stored_pages") == held,
                f"{held} pages before the stop, {after.get('stored_pages')} "
                "after the restart")
    ok &= check("reconnected", seen.get("reconnected"),
                "QEMU reconnected to the new tmemd and set up the device "
                "again (memory table mapped)")
    ok &= check("served-after-restart",
                final.get("reads", 0) > 0,
                f"reads served by the new tmemd: {final.get('reads')}")
    ok &= check("restart-logged", "swap_written_back" in text,
                "tmemd logged swap_written_back")
    ok &= check("tmemd-exit", rc == 0, f"tmemd exited {rc}")
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=("quota", "restart"), required=True)
    p.add_argument("--tmemd", required=True)
    p.add_argument("--tmemctl", required=True)
    p.add_argument("--ws-ratio", type=float, default=1.5)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args()
    if shutil.which("qemu-system-x86_64") is None:
        log("SKIP: qemu-system-x86_64 is not installed")
        return SKIP
    try:
        swaptest.build_images()
    except (subprocess.CalledProcessError, OSError) as e:
        log(f"SKIP: the stock guest images cannot be built here: {e}")
        return SKIP
    work = tempfile.mkdtemp(prefix="swap-tmemd-")
    os.chmod(work, 0o700)
    try:
        return case_quota(a, work) if a.case == "quota" else \
            case_restart(a, work)
    finally:
        if a.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
