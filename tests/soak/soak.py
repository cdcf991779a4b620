#!/usr/bin/env python3
"""Soak: one real tmemd serving 64 simulated VMs with mixed
workloads for a while, checked every second.

Every VM is a guest thread of a tmem-guestsim process, speaking the ivshmem
protocol over tmemd's sockets. The guests verify every page they read back
(their reports count mismatches). Each guestsim run is bounded by its ops
and started again until the time is up, so guests also restart (a new guest
generation: tmemd drops the VM's pages and starts it over).

Checked every --interval seconds, from tmemd's control socket (tmemctl
-o json): the host's memory use never exceeds its cap, and no VM with a
quota is charged more than its quota plus 5% (the all-in charge).
tmemd's private RSS (RssAnon) is sampled from /proc; after --warmup of the run it must stay
flat: the mean of the last fifth of the samples may exceed the mean of the
first fifth after warm-up by at most max(--rss-slack-mib, 5%).

At the end: every guest run finished ok with 0 mismatches, tmemd is still
running and exits 0 on SIGTERM. Exit status 0 only if everything held; the
first broken check is printed with its sample.

Usage: tests/soak/soak.py --tmemd PATH --tmemctl PATH --guestsim PATH
         [--seconds 600] [--vms 64] [--memory-cap-mib 32] [--interval 1]
CI runs a short one (ctest soak_smoke); SPECIFICATION.md gives the full one.
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
import time
import urllib.request

WORKLOADS = ["reread", "random", "coherency", "seq"]
GUESTS_PER_PROCESS = 8
QUOTA_SLACK = 1.05


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tmemd", required=True)
    p.add_argument("--tmemctl", required=True)
    p.add_argument("--guestsim", required=True)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--vms", type=int, default=64)
    p.add_argument("--memory-cap-mib", type=int, default=32)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--warmup", type=float, default=0.3,
                   help="fraction of the run before RSS must be flat")
    p.add_argument("--rss-slack-mib", type=float, default=8.0)
    p.add_argument("--pages", type=int, default=3000,
                   help="distinct pages per guest (64 x 3000 x 4 KiB = 750 MiB"
                        " of demand against the cap)")
    p.add_argument("--ops", type=int, default=20000,
                   help="operations per guest per guestsim run")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    a = p.parse_args()
    for name in ("seconds", "interval"):
        if getattr(a, name) <= 0:
            p.error(f"--{name} {getattr(a, name)}: want a positive number")
    if a.vms < 1 or a.vms > 1024:
        p.error(f"--vms {a.vms}: want 1..1024")
    if not 0 <= a.warmup < 0.9:
        p.error(f"--warmup {a.warmup}: want a fraction in [0, 0.9)")
    for name in ("tmemd", "tmemctl", "guestsim"):
        path = getattr(a, name)
        if not os.access(path, os.X_OK):
            p.error(f"--{name} {path}: not an executable file")
    return a


def quota_of(i):
    """Every fourth VM 1 MiB, every fourth after it 4 MiB, the rest none."""
    return {0: 1 << 20, 1: 4 << 20}.get(i % 4, 0)


def rss_bytes(pid):
    """Private resident memory (heap, stacks): the VM regions are shared
    memfds whose resident pages follow what the guests touch."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class Soak:
    def __init__(self, a):
        self.a = a
        self.dir = tempfile.mkdtemp(prefix="tmemd-soak-")
        os.chmod(self.dir, 0o755)
        self.sock_dir = os.path.join(self.dir, "sock")
        os.mkdir(self.sock_dir, 0o700)
        self.control = os.path.join(self.sock_dir, "control.sock")
        self.names = [f"v{i:03d}" for i in range(a.vms)]
        self.tmemd = None
        self.runs = []  # (Popen, report path, workload, sockets)
        self.failures = []
        self.guest_runs = 0
        self.mismatches = 0
        self.samples = 0
        self.rss = []  # (t, bytes)
        self.max_used = 0
        self.worst_quota = 0.0

    def fail(self, msg):
        self.failures.append(msg)
        print(f"soak: FAIL: {msg}", flush=True)

    def tmemctl(self, *args):
        r = subprocess.run([self.a.tmemctl, "-s", self.control, "-t", "10",
                            *args], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"tmemctl {' '.join(args)}: exit "
                               f"{r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def start_tmemd(self):
        cmd = [self.a.tmemd, "--socket-dir", self.sock_dir,
               "--control-socket", self.control,
               "--memory-cap", f"{self.a.memory_cap_mib}MiB",
               "--stats-interval", "0", "--metrics-port", "0"]
        for n in self.names:
            cmd += ["--vm", n]
        self.tmemd_log = open(os.path.join(self.dir, "tmemd.log"), "w")
        # Under ASan, freed memory waits in a quarantine (256 MiB by
        # default) that would read as RSS growth: keep it small.
        env = dict(os.environ)
        env["ASAN_OPTIONS"] = ":".join(
            o for o in (env.get("ASAN_OPTIONS", ""), "quarantine_size_mb=16")
            if o)
        self.tmemd = subprocess.Popen(cmd, stdout=self.tmemd_log,
                                      stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.tmemd.poll() is not None:
                raise RuntimeError(f"tmemd exited {self.tmemd.returncode} at "
                                   "start (log: tmemd.log)")
            m = re.search(r"metrics_port=(\d+)",
                          open(os.path.join(self.dir, "tmemd.log")).read())
            if m:
                self.metrics_url = f"http://127.0.0.1:{m.group(1)}/metrics"
                break
            time.sleep(0.2)
        else:
            raise RuntimeError("tmemd never logged its metrics port")
        for i, n in enumerate(self.names):
            if quota_of(i):
                self.tmemctl("set-quota", n, str(quota_of(i)))
        # What the checks compare with is what tmemd enforces.
        for v in json.loads(self.tmemctl_json("vms"))["vms"]:
            want = quota_of(self.names.index(v["name"]))
            if int(v["policy"]["quota_bytes"]) != want:
                raise RuntimeError(f"VM {v['name']} has quota "
                                   f"{v['policy']['quota_bytes']}, set {want}")

    def launch(self, group):
        first = group * GUESTS_PER_PROCESS
        names = self.names[first:first + GUESTS_PER_PROCESS]
        workload = WORKLOADS[group % len(WORKLOADS)]
        report = os.path.join(self.dir, f"g{group}-{self.guest_runs}.json")
        cmd = [self.a.guestsim, "--workload", workload,
               "--pages", str(self.a.pages), "--ops", str(self.a.ops),
               "--seed", str(self.guest_runs + 1), "--report", "json",
               "--get-timeout-us", "200000"]
        for n in names:
            cmd += ["--socket", os.path.join(self.sock_dir, n + ".sock")]
        out = open(report, "w")
        err = open(report + ".err", "w")
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        self.guest_runs += 1
        return {"proc": proc, "report": report, "workload": workload,
                "group": group, "out": out, "err": err}

    def reap(self, run):
        run["out"].close()
        run["err"].close()
        rc = run["proc"].returncode
        try:
            with open(run["report"]) as f:
                rep = json.load(f)
        except (OSError, ValueError) as e:
            with open(run["report"] + ".err") as f:
                tail = f.read()[-400:]
            self.fail(f"guestsim group {run['group']} ({run['workload']}) "
                      f"exit {rc}, no report ({e}): {tail}")
            return
        for g in rep.get("guests", []):
            self.mismatches += g.get("mismatches", 0)
            if not g.get("ok") or g.get("mismatches", 0):
                self.fail(f"guest {g.get('socket')} ({run['workload']}): ok="
                          f"{g.get('ok')} mismatches={g.get('mismatches')} "
                          f"error={g.get('error')!r} "
                          f"{g.get('mismatch_report', '')[:300]}")
        if rc != 0 and not self.failures:
            self.fail(f"guestsim group {run['group']} exit {rc}")

    def check(self, t):
        # /metrics, not tmemctl: a check must take far less than a second
        # also under ASan.
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        used = cap = None
        charged = {}
        for line in text.splitlines():
            if line.startswith("tmem_memory_used_bytes "):
                used = int(line.split()[1])
            elif line.startswith("tmem_memory_cap_bytes "):
                cap = int(line.split()[1])
            else:
                m = re.match(r'tmem_charged_bytes\{vm="([^"]+)"\} (\d+)', line)
                if m:
                    charged[m.group(1)] = int(m.group(2))
        if used is None or cap is None or len(charged) != len(self.names):
            raise RuntimeError(f"/metrics lacks the memory gauges or some VM's "
                               f"tmem_charged_bytes ({len(charged)} VMs)")
        self.max_used = max(self.max_used, used)
        if used > cap:
            self.fail(f"t={t:.1f}s host memory {used} > cap {cap}")
        for i, name in enumerate(self.names):
            quota = quota_of(i)
            if quota:
                self.worst_quota = max(self.worst_quota, charged[name] / quota)
                if charged[name] > quota * QUOTA_SLACK:
                    self.fail(f"t={t:.1f}s VM {name} charged {charged[name]} "
                              f"> quota {quota} + 5%")
        self.rss.append((t, rss_bytes(self.tmemd.pid)))
        self.samples += 1

    def tmemctl_json(self, what):
        return self.tmemctl("-o", "json", what)

    def run(self):
        a = self.a
        self.start_tmemd()
        groups = (a.vms + GUESTS_PER_PROCESS - 1) // GUESTS_PER_PROCESS
        t0 = time.monotonic()
        active = {g: self.launch(g) for g in range(groups)}
        next_check = t0
        next_progress = t0 + 10
        while True:
            now = time.monotonic()
            t = now - t0
            done = t >= a.seconds
            for g, run in list(active.items()):
                if run["proc"].poll() is not None:
                    self.reap(run)
                    del active[g]
                    if not done:
                        active[g] = self.launch(g)
            if self.tmemd.poll() is not None:
                self.fail(f"t={t:.1f}s tmemd exited {self.tmemd.returncode}")
                break
            if now >= next_check:
                try:
                    self.check(t)
                except (RuntimeError, OSError, ValueError) as e:
                    self.fail(f"t={t:.1f}s status not readable: {e}")
                next_check += a.interval
            if now >= next_progress:
                rss = self.rss[-1][1] / 2**20 if self.rss else 0
                print(f"soak: {t:.0f}/{a.seconds:.0f} s, {self.guest_runs} "
                      f"guestsim runs, max host use {self.max_used / 2**20:.1f}"
                      f" MiB of {a.memory_cap_mib}, worst quota use "
                      f"{self.worst_quota:.3f}, tmemd RSS {rss:.1f} MiB",
                      flush=True)
                next_progress += 10
            if done and not active:
                break
            if self.failures and len(self.failures) > 20:
                break
            time.sleep(0.05)
        self.finish(t0)

    def finish(self, t0):
        a = self.a
        if self.tmemd.poll() is None:
            self.tmemd.send_signal(signal.SIGTERM)
            try:
                rc = self.tmemd.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.tmemd.kill()
                rc = "killed after 60 s"
            if rc != 0:
                self.fail(f"tmemd exited {rc} on SIGTERM")
        after = [r for t, r in self.rss if t >= a.warmup * a.seconds]
        verdict = "not judged (fewer than 10 samples after warm-up)"
        if len(after) >= 10:
            k = max(1, len(after) // 5)
            early = sum(after[:k]) / k
            late = sum(after[-k:]) / k
            allowed = max(a.rss_slack_mib * 2**20, 0.05 * early)
            verdict = (f"after warm-up {early / 2**20:.1f} MiB, at the end "
                       f"{late / 2**20:.1f} MiB (allowed growth "
                       f"{allowed / 2**20:.1f} MiB)")
            if late - early > allowed:
                self.fail(f"tmemd RSS grew: {verdict}")
        print(f"soak: {time.monotonic() - t0:.0f} s, {a.vms} VMs, "
              f"{self.guest_runs} guestsim runs, {self.samples} checks, "
              f"{self.mismatches} mismatches, max host use "
              f"{self.max_used / 2**20:.1f} MiB of {a.memory_cap_mib} MiB, "
              f"worst quota use {self.worst_quota:.3f} of quota, RSS "
              f"{verdict}", flush=True)
        if self.samples < max(3, a.seconds / a.interval / 4):
            self.fail(f"only {self.samples} checks in {a.seconds} s")

    def cleanup(self):
        for p in (self.tmemd,):
            if p and p.poll() is None:
                p.kill()
        if self.a.keep or self.failures:
            print(f"soak: logs kept in {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def main():
    a = parse_args()
    soak = Soak(a)
    try:
        soak.run()
    except RuntimeError as e:
        soak.fail(str(e))
    finally:
        soak.cleanup()
    print("soak: PASS" if not soak.failures else
          f"soak: FAIL ({len(soak.failures)} broken checks)")
    return 0 if not soak.failures else 1


if __name__ == "__main__":
    sys.exit(main())
