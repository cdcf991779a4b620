#!/usr/bin/env python3
"""Swap benchmark on the stock Debian 12 guest: the same guest (256 MiB) and
workload on each swap device, side by side, one JSON document.

Rows (--rows, comma-separated; each one boot of vm-images/stock/swaptest.py):
  a      virtio-blk on a file on host disk, cache=none
  a1     a, throttled like a cloud volume (3000 IOPS, 125 MB/s)   [a']
  b      guest zram (lz4, --zram-mib) with a behind it
  b_fit  b with a working set zram can hold (--fit-ws-ratio)
  d      qemu-storage-daemon, vhost-user-blk over a tmpfs file
  c      a tmemd swap device: the real tmemd (--tmemd), started for the row
         with --swap vm=SIZE in its own socket and state directories (the
         spill image under --state-parent, host disk), or an external one
         with --socket S [--backend-pid PID]
  a_hog, c_hog   a and c with one normal-priority CPU hog per host CPU
         running for the whole boot (the host CPU saturated)
Workload (the issue's shape by default): an anonymous working set of
--ws-ratio x RAM (2.5), ~2x LZ4-compressible, written once, then --passes (2)
passes touching every page once in a random order; every page is verified.
The figures are the touch passes': MB/s of pages touched, guest CPU per
swapped page, QEMU's and the backend's CPU, touch latency p50/p99 (the
first load of a page: a swap-in when it was out), host bytes held per
swapped byte: for the file rows the swap file's allocation / the guest's
swap use; for tmemd (c) what tmemd itself reports, the VM's store charge
plus the spill image's allocated bytes, / the guest's swap use. tmemd's
figures (tmemctl -o json vms) are sampled while the guest waits between
phases: pages in memory, spilled, compressed and raw puts, its CPU time
against its CPU budget (its --cpu-budget, percent of the host).

Ratios (c/d, c/a1, c/a, c_hog/a_hog, and each row / a) are printed and, with
--results, recorded with the issue's targets as PASS/FAIL rows in the
"swap" section of the results file (bench/results/record.py). They are
measurements, not test assertions: under TCG on a shared machine they say
what this machine did. --prior FILE takes rows from an earlier --out
document (rows not run again), so one section can be recorded from runs
made one at a time.

Usage: swap-bench.py [--rows a,a1,b,d,c] [--ws-ratio 2.5] [--passes 2]
         [--tmemd PATH --tmemctl PATH | --socket S --backend-pid PID]
         [--prior FILE ...] [--out FILE] [--results latest.json]
         [--accel auto|tcg|kvm] [--require-verified]
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import swaptest  # noqa: E402

ROW_BACKEND = {"a": "disk", "a1": "cloud", "b": "zram", "b_fit": "zram", "d": "qsd",
               "c": "vhost", "a_hog": "disk", "c_hog": "vhost"}
ROW_LABEL = {"a": "a disk", "a1": "a' cloud volume", "b": "b zram + disk",
             "b_fit": "b zram (fits)", "d": "d qsd tmpfs", "c": "c tmemd",
             "a_hog": "a disk, host CPU saturated",
             "c_hog": "c tmemd, host CPU saturated"}
TMEMD_ROWS = ("c", "c_hog")
HOG_ROWS = ("a_hog", "c_hog")
PAGE = 4096


def default_binary(*parts):
    for build in ("release", "relwithdebinfo", "debug"):
        path = os.path.join(REPO, "build", build, *parts)
        if os.access(path, os.X_OK):
            return path
    return os.path.join(REPO, "build", "release", *parts)


def u64(v):
    """Proto JSON writes 64-bit integers as strings."""
    return int(v) if v not in (None, "") else 0


def rss_bytes(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Tmemd:
    """The real tmemd serving one swap device, vm, for one row: its own
    socket directory (a fresh /tmp directory), state directory (under
    state_parent: the spill image is on that disk) and control socket."""

    def __init__(self, binary, tmemctl, size_mib, state_parent):
        self.tmemctl = tmemctl
        self.dir = tempfile.mkdtemp(prefix="swapbench-tmemd-")
        self.state = tempfile.mkdtemp(prefix="swapbench-state-", dir=state_parent)
        sockets = os.path.join(self.dir, "s")
        os.mkdir(sockets)
        self.control = os.path.join(self.dir, "c.sock")
        self.log_path = os.path.join(self.dir, "tmemd.log")
        self.socket = os.path.join(sockets, "vm.swap.sock")
        self.image = os.path.join(self.state, "swap", "vm.img")
        self.cmd = [binary, "--socket-dir", sockets, "--swap", f"vm={size_mib}M",
                    "--state-dir", self.state, "--control-socket", self.control,
                    "--metrics-port", "0", "--no-fd-store"]
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL,
                                     stderr=open(self.log_path, "w"))
        self.pid = self.proc.pid
        self.ready = {}
        deadline = time.time() + 60
        while time.time() < deadline and self.proc.poll() is None:
            for line in open(self.log_path, errors="replace"):
                if "event=tmemd_ready" in line:
                    self.ready = dict(w.split("=", 1) for w in line.split()
                                      if "=" in w)
            if self.ready and os.path.exists(self.socket):
                break
            time.sleep(0.2)
        if not self.ready or not os.path.exists(self.socket):
            self.stop()
            raise RuntimeError("tmemd did not become ready: " + self.log_tail())

    def log_tail(self):
        try:
            return open(self.log_path, errors="replace").read()[-3000:]
        except OSError:
            return ""

    def vm(self):
        out = subprocess.run([self.tmemctl, "-s", self.control, "-o", "json", "vms"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, timeout=60).stdout
        doc = json.loads(out[out.index("{"):])
        return next(v for v in doc["vms"] if v["name"] == "vm")

    def probe(self):
        """tmemd's figures for the device, flat, for the runner's samples."""
        s = {"tmemd_alive": self.proc.poll() is None,
             "tmemd_rss": rss_bytes(self.pid),
             "spill_image_allocated": swaptest.allocated_bytes(self.image) or 0}
        try:
            v = self.vm()
        except (OSError, ValueError, StopIteration, subprocess.SubprocessError) as e:
            s["tmemd_error"] = f"{type(e).__name__}: {e}"
            return s
        sw = v.get("swap", {})
        s.update({"vm_charged_bytes": u64(v.get("charged_bytes")),
                  "vm_stored_bytes": u64(v.get("stored_bytes")),
                  "vm_pages": u64(v.get("pages"))})
        for k in ("stored_pages", "memory_pages", "memory_bytes", "spilled_pages",
                  "lost_pages", "compressed_puts", "raw_puts", "reads", "writes",
                  "read_ns", "read_calls", "write_ns", "write_calls",
                  "discarded_pages"):
            s["swap_" + k] = u64(sw.get(k))
        for c in sw.get("backing_counters", []):
            s["backing_" + c["name"]] = u64(c.get("value"))
        return s

    def stop(self):
        """SIGTERM (a graceful stop writes the device back), then removes
        both directories."""
        rc = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        else:
            rc = self.proc.returncode
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.state, ignore_errors=True)
        return rc


class Hogs:
    """One busy loop per host CPU at normal priority (nice 0), so the host
    CPU is saturated for the whole row."""

    def __init__(self, n):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                       stdin=subprocess.DEVNULL)
                      for _ in range(n)]

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait()


def tmemd_summary(r, budget_percent):
    """tmemd's figures over the touch passes: host memory per swapped byte
    (the VM's charge plus the spill image's allocation, at the end of the
    last pass, over the guest's swap use then), its CPU as a share of the
    whole host against its budget, and where the pages went."""
    passes = [p for p in r["phases"] if p["phase"].startswith("pass")]
    h = {s["phase"]: s for s in r["host"]}
    if not passes:
        return {}
    first, last = passes[0]["phase"], passes[-1]["phase"]
    prev = "write" if first == "pass1" else f"pass{int(first[4:]) - 1}"
    end, begin = h.get(last, {}), h.get(prev, {})
    out = {"tmemd_cpu_budget_percent": budget_percent}
    used = passes[-1].get("swap_used_kb")
    if used and "vm_charged_bytes" in end:
        held = end["vm_charged_bytes"] + end.get("spill_image_allocated", 0)
        out["host_bytes_per_swapped_byte"] = round(held / (used * 1024), 3)
        out["host_bytes_held"] = held
        out["guest_swap_used_bytes"] = used * 1024
    for k in ("vm_charged_bytes", "spill_image_allocated", "swap_memory_pages",
              "swap_memory_bytes", "swap_spilled_pages", "swap_stored_pages",
              "swap_lost_pages", "swap_compressed_puts", "swap_raw_puts",
              "tmemd_rss"):
        if k in end:
            out[k] = end[k]
    for k in ("swap_compressed_puts", "swap_raw_puts", "swap_writes", "swap_reads",
              "backing_spilled_valve", "backing_spilled_quota",
              "backing_spilled_no_memory", "backing_spilled_other",
              "backing_reads_store", "backing_reads_store_direct",
              "backing_reads_image", "backing_reads_zero", "backing_discarded"):
        if k in end and k in begin:
            out[k + "_passes"] = end[k] - begin[k]
    puts = out.get("swap_compressed_puts_passes", 0) + out.get("swap_raw_puts_passes", 0)
    if puts:
        out["compressed_put_percent_passes"] = round(
            100.0 * out["swap_compressed_puts_passes"] / puts, 1)
    if "swap_read_ns" in end and "swap_read_ns" in begin:
        calls = end["swap_read_calls"] - begin["swap_read_calls"]
        if calls:
            out["tmemd_read_us_mean_passes"] = round(
                (end["swap_read_ns"] - begin["swap_read_ns"]) / calls / 1e3, 1)
    cpu = r.get("summary", {}).get("backend_cpu_s_passes")
    wall = (end.get("t") or 0) - (begin.get("t") or 0)
    if cpu is not None and wall > 0:
        out["tmemd_cpu_percent_of_host"] = round(
            100.0 * cpu / (wall * os.cpu_count()), 2)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="a,a1,b,d")
    p.add_argument("--mem", type=int, default=256)
    p.add_argument("--ws-ratio", type=float, default=2.5)
    p.add_argument("--fit-ws-ratio", type=float, default=1.25,
                   help="b_fit's working set, x RAM")
    p.add_argument("--zram-mib", type=int, default=128,
                   help="b's zram disksize; when full, swap goes on to the disk")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--content", default="2x")
    p.add_argument("--touch", default="read")
    p.add_argument("--tmemd", default=default_binary("host-agent", "tmemd"),
                   help="rows c, c_hog: the tmemd binary to start")
    p.add_argument("--tmemctl", default=default_binary("host-agent", "tmemctl", "tmemctl"))
    p.add_argument("--state-parent", default=os.environ.get("TMEM_SWAP_DISK_DIR",
                                                            "/var/tmp"),
                   help="where tmemd's state directory (its spill image) is made")
    p.add_argument("--socket", help="row c: an external tmemd's vhost-user-blk "
                   "socket instead of starting tmemd")
    p.add_argument("--backend-pid", type=int, help="with --socket: its pid")
    p.add_argument("--hogs", type=int, default=os.cpu_count(),
                   help="a_hog, c_hog: CPU hogs (one per CPU)")
    p.add_argument("--prior", action="append", default=[],
                   help="an earlier --out document whose rows are taken as measured")
    p.add_argument("--accel", default=os.environ.get("TMEM_VM_ACCEL", "auto"))
    p.add_argument("--timeout", type=int, default=2400, help="per row, seconds")
    p.add_argument("--out")
    p.add_argument("--results", default=os.environ.get("RESULTS_JSON"),
                   help="record the \"swap\" section in this results file")
    p.add_argument("--require-verified", action="store_true",
                   help="exit 1 unless every row verified every page (and "
                   "tmemd lost none): the smoke test's check")
    a = p.parse_args()
    rows = [r for r in a.rows.split(",") if r]
    for r in rows:
        if r not in ROW_BACKEND:
            p.error(f"unknown row {r}")
    if any(r in TMEMD_ROWS for r in rows) and not a.socket and not (
            os.access(a.tmemd, os.X_OK) and os.access(a.tmemctl, os.X_OK)):
        p.error(f"rows c, c_hog need --tmemd and --tmemctl ({a.tmemd}, {a.tmemctl}) "
                "or --socket")

    # SIGTERM unwinds like an exception, so a stopped run still stops the
    # row's tmemd, hogs and guest (the finally blocks) and keeps its --out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    images = swaptest.build_images()
    accel = swaptest.probe_kvm(images) if a.accel == "auto" else a.accel
    doc = {"kernel": images.get("KVER"), "accel": accel, "mem_mib": a.mem,
           "ws_ratio": a.ws_ratio, "passes": a.passes, "content": a.content,
           "touch": a.touch, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_avg_start": os.getloadavg(), "cpus": os.cpu_count(), "rows": {}}
    for prior in a.prior:
        with open(prior) as f:
            old = json.load(f)
        for row, x in old.get("rows", {}).items():
            if row not in rows:
                x.setdefault("run_started", old.get("started"))
                # a row is ok only when the guest reported no bad page
                x.setdefault("bad", 0 if x.get("ok") else None)
                doc["rows"][row] = x
    for row in rows:
        ratio = a.fit_ws_ratio if row == "b_fit" else a.ws_ratio
        sargs = ["--backend", ROW_BACKEND[row], "--mem", str(a.mem),
                 "--ws-ratio", str(ratio), "--passes", str(a.passes),
                 "--content", a.content, "--touch", a.touch,
                 "--accel", accel, "--timeout", str(a.timeout)]
        if row == "b":
            sargs += ["--zram-mib", str(a.zram_mib)]
        if row == "b_fit":
            # zram big enough for the whole excess over RAM
            sargs += ["--zram-mib", str(int(a.mem * ratio))]
        sa = swaptest.parse_args(sargs)
        tmemd = hogs = None
        budget = None
        try:
            if row in TMEMD_ROWS:
                if a.socket:
                    sa.socket, sa.backend_pid = a.socket, a.backend_pid
                else:
                    tmemd = Tmemd(a.tmemd, a.tmemctl, sa.swap_mib, a.state_parent)
                    sa.socket, sa.backend_pid = tmemd.socket, tmemd.pid
                    sa.host_probe = tmemd.probe
                    budget = float(tmemd.ready.get("cpu_budget_percent", "nan"))
            if row in HOG_ROWS:
                hogs = Hogs(a.hogs)
            swaptest.log(f"row {row}: {' '.join(sargs)}"
                         + (f" (tmemd pid {tmemd.pid}, {sa.socket})" if tmemd else "")
                         + (f" with {a.hogs} CPU hogs" if hogs else ""))
            r = swaptest.run_one(sa, images, accel)
        except RuntimeError as e:  # tmemd did not start: this row failed
            r = {"backend": ROW_BACKEND[row], "ok": False, "verdict": str(e),
                 "error": str(e), "ws_mib": sa.ws_mib, "phases": [], "host": []}
        finally:
            if hogs:
                hogs.stop()
            tmemd_rc = tmemd.stop() if tmemd else None
        s = r.get("summary", {})
        x = {
            "backend": r["backend"], "ok": r["ok"], "verdict": r["verdict"],
            "oom_killed": bool(r.get("oom_killed")), "ws_mib": r["ws_mib"],
            "elapsed_s": r.get("elapsed_s"), "boot_s": r.get("boot_s"),
            "bad": r.get("bad"),
            "write_MBps": next((ph["MBps"] for ph in r["phases"]
                                if ph["phase"] == "write"), None),
            "load_avg_end": os.getloadavg(),
            **s,
            "phases": r["phases"], "host": r["host"],
            "zram_mm_stat": r.get("zram_mm_stat"),
        }
        if hogs:
            x["cpu_hogs"] = a.hogs
        if tmemd:
            x.update(tmemd_summary(r, budget))
            x["tmemd_cmd"] = tmemd.cmd
            x["tmemd_exit"] = tmemd_rc
            if not r["ok"]:
                x["tmemd_log_tail"] = tmemd.log_tail()
        if not r["ok"]:
            x["serial_tail"] = r.get("serial_tail")
            x["error"] = r.get("error")
        doc["rows"][row] = x
        swaptest.log(f"row {row}: {r['verdict']}; MB/s {s.get('MBps')}, "
                     f"{r.get('elapsed_s')} s")
        doc["load_avg_end"] = os.getloadavg()
        finish(doc, a.out)
    finish(doc, a.out)  # also when every row came from --prior
    print(json.dumps(doc, indent=1))
    print(f"{'row':6} {'ok':4} {'MB/s':>7} {'pass ms':>8} {'pswpin':>8} {'pswpout':>8} "
          f"{'us/pg':>6} {'p50 us':>7} {'p99 us':>7} {'host/pg':>7}", file=sys.stderr)
    for row, x in doc["rows"].items():
        def f(k, div=1):
            v = x.get(k)
            return "-" if v is None else f"{v / div:.4g}"
        print(f"{row:6} {('yes' if x['ok'] else 'NO'):4} {f('MBps'):>7} {f('ms'):>8} "
              f"{f('pswpin'):>8} {f('pswpout'):>8} {f('guest_cpu_us_per_swapped_page'):>6} "
              f"{f('touch_ns_p50_last_pass', 1000):>7} {f('touch_ns_p99_last_pass', 1000):>7} "
              f"{f('host_bytes_per_swapped_byte'):>7}", file=sys.stderr)
    print(f"ratios: {doc['ratios']}", file=sys.stderr)
    if a.results:
        record(doc, a.results, " ".join(["vm-images/stock/swap-bench.py"] + sys.argv[1:]))
    if a.require_verified:
        def verified(row, x):
            if not (x["ok"] and x.get("bad") == 0 and not x.get("swap_lost_pages")):
                return False
            if row in TMEMD_ROWS and not a.socket:
                # the guest swapped, and to tmemd: it served writes and reads
                last = (x.get("host") or [{}])[-1]
                return (x.get("pswpout", 0) > 0 and last.get("swap_writes", 0) > 0
                        and last.get("swap_reads", 0) > 0)
            return True
        bad = [r for r, x in doc["rows"].items() if r in rows and not verified(r, x)]
        if bad:
            print(f"not verified: {bad}", file=sys.stderr)
            return 1
        return 0
    return 0 if all(x["ok"] or x["oom_killed"] for x in doc["rows"].values()) else 1


RATIOS = (("c", "d"), ("c", "a1"), ("c", "a"), ("c_hog", "a_hog"), ("d", "a"),
          ("a1", "a"), ("b", "a"), ("b_fit", "a"))


def finish(doc, out):
    """Ratios over the rows so far; the document is rewritten after every
    row, so a long run that is stopped keeps what it measured."""
    def mbps(row):
        x = doc["rows"].get(row)
        return x.get("MBps") if x and x["ok"] else None

    ratios = {}
    for num, den in RATIOS:
        if mbps(num) and mbps(den):
            ratios[f"{num}/{den}"] = round(mbps(num) / mbps(den), 3)
    doc["ratios"] = ratios
    if out:
        with open(out + ".tmp", "w") as f:
            f.write(json.dumps(doc, indent=1) + "\n")
        os.replace(out + ".tmp", out)


# The targets: (name, numerator row, denominator row, target).
RATIO_TARGETS = (
    ("throughput c / d (tmemd vs qsd on tmpfs)", "c", "d", ">= 0.9"),
    ("throughput c / a' (tmemd vs cloud volume)", "c", "a1", ">= 1.3"),
    ("throughput c / a (tmemd vs host disk)", "c", "a", ">= 0.85"),
    ("throughput c / a, host CPU saturated", "c_hog", "a_hog", ">= 0.85"),
)


def section_rows(doc):
    """The "swap" section's rows, as record.py's row fields: the issue's
    targets (PASS/FAIL; N/A for a row not measured), then each row's
    figures as information."""
    rows = []

    def add(name, value, unit, target, note=""):
        rows.append((name, "-" if value is None else str(value), unit, target, note))

    for name, num, den, target in RATIO_TARGETS:
        add(name, doc["ratios"].get(f"{num}/{den}"), "x", target,
            "touch MB/s over the random passes; both rows verified every page")
    c = doc["rows"].get("c", {})
    d = doc["rows"].get("d", {})
    # The target is set against (d) holding 1.0x: a page of host RAM per
    # swapped page. By the guest's count (swap in use) (d) holds more, as
    # every backend does: the guest frees swap slots one by one but
    # discards only whole free clusters, so the device still holds data
    # for slots the guest no longer counts. Dividing by (d)'s figure from
    # the same workload measures c against that reference on equal terms.
    c_per, d_per = (c.get("host_bytes_per_swapped_byte"),
                    d.get("host_bytes_per_swapped_byte"))
    add("host memory per swapped page, c tmemd relative to d (idle host)",
        round(c_per / d_per, 3) if c_per and d_per else None,
        "x 4 KiB, d = 1.0", "<= 0.6", "c's (store charge + image allocated) / guest swap in use, "
        "over d's tmpfs allocation / guest swap in use (d = 1.0x)")
    add("host memory per swapped page, c tmemd (idle host)",
        c_per, "x 4 KiB", "",
        "(VM's store charge + spill image allocated) / guest swap in use")
    if c.get("host_bytes_held") and c.get("swap_stored_pages"):
        # The guest keeps the slots of pages it swapped in until a whole
        # cluster is free, so the device holds more pages than the guest
        # counts as swap in use; this is per page tmemd actually holds.
        add("host memory per page tmemd holds, c tmemd",
            round(c["host_bytes_held"] / (c["swap_stored_pages"] * PAGE), 3),
            "x 4 KiB", "", f"{c['swap_stored_pages']} pages held for "
            f"{c.get('guest_swap_used_bytes', 0) // PAGE} in the guest's swap")
    add("host memory per swapped page, d qsd tmpfs",
        d_per, "x 4 KiB", "", "tmpfs file allocated / guest swap in use")
    hog = doc["rows"].get("c_hog", {})
    budget = hog.get("tmemd_cpu_budget_percent")
    add("tmemd CPU, host CPU saturated (% of host)",
        hog.get("tmemd_cpu_percent_of_host"), "%",
        f"<= {budget:g}" if budget is not None else "", "against its --cpu-budget")
    add("tmemd CPU, idle host (% of host)", c.get("tmemd_cpu_percent_of_host"), "%",
        "", f"budget {c.get('tmemd_cpu_budget_percent')}%")
    for row in ("c", "c_hog"):
        x = doc["rows"].get(row)
        if not x:
            continue
        add(f"{ROW_LABEL[row]}: pages compressed of the store's puts",
            x.get("compressed_put_percent_passes"), "%", "",
            f"compressed {x.get('swap_compressed_puts_passes')}, raw "
            f"{x.get('swap_raw_puts_passes')}, spilled (valve/quota/no memory) "
            f"{x.get('backing_spilled_valve_passes')}/"
            f"{x.get('backing_spilled_quota_passes')}/"
            f"{x.get('backing_spilled_no_memory_passes')} during the passes; "
            f"{x.get('swap_memory_pages')} pages in memory "
            f"({x.get('swap_memory_bytes')} B), {x.get('swap_spilled_pages')} "
            f"spilled at the end")
        w = next((h for h in x.get("host", []) if h.get("phase") == "write"), {})
        if "backing_spilled_valve" in w:
            add(f"{ROW_LABEL[row]}: pages spilled to the image during the write",
                w["backing_spilled_valve"] + w.get("backing_spilled_quota", 0)
                + w.get("backing_spilled_no_memory", 0), "pages", "",
                f"of {w.get('swap_stored_pages')} stored after the write phase "
                f"({w.get('swap_memory_pages')} in memory); spilled pages are "
                "read back from host disk")
    for row, x in doc["rows"].items():
        label = ROW_LABEL.get(row, row)
        note = "" if x.get("ok") else f"not verified: {x.get('verdict')}"
        add(f"{label}: bad pages", x.get("bad"), "pages", "<= 0", x.get("verdict", ""))
        add(f"{label}: touch throughput", x.get("MBps"), "MB/s", "", note)
        add(f"{label}: guest CPU per swapped page",
            x.get("guest_cpu_us_per_swapped_page"), "us", "")
        p50, p99 = x.get("touch_ns_p50_last_pass"), x.get("touch_ns_p99_last_pass")
        add(f"{label}: swap-in (first touch) p50", p50 and round(p50 / 1e3, 1), "us", "")
        add(f"{label}: swap-in (first touch) p99", p99 and round(p99 / 1e3, 1), "us", "")
        add(f"{label}: host bytes per swapped byte",
            x.get("host_bytes_per_swapped_byte"), "x", "",
            "disk file, not memory" if row in ("a", "a1", "a_hog", "b") else "")
        if x.get("backend_cpu_s_passes") is not None:
            add(f"{label}: backend CPU over the passes", x["backend_cpu_s_passes"], "s",
                "", f"QEMU {x.get('qemu_cpu_s_passes')} s")
    return rows


def record(doc, path, command):
    sys.path.insert(0, os.path.join(REPO, "bench", "results"))
    import record as rec  # noqa: E402
    rows = [rec.row_from_fields(*f) for f in section_rows(doc)]
    rec.assign_ids(rows)
    warnings = [f"accel {doc['accel']}, guest {doc['mem_mib']} MiB, working set "
                f"{doc['ws_ratio']}x RAM, {doc['passes']} random pass(es), content "
                f"{doc['content']}; kernel {doc['kernel']}"]
    for row, x in doc["rows"].items():
        warnings.append(f"row {row}: load average at its end "
                        f"{[round(v, 1) for v in x.get('load_avg_end') or []]}"
                        + (f", from the run started {x['run_started']}"
                           if x.get("run_started") else ""))
    missing = [r for r in ("a", "a1", "d", "c", "a_hog", "c_hog") if r not in doc["rows"]]
    if missing:
        warnings.append(f"rows not measured: {', '.join(missing)}")
    commit = os.environ.get("TMEM_COMMIT") or subprocess.run(
        ["git", "-C", REPO, "describe", "--always", "--dirty"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout.strip()
    rec.merge(path, {"benchmark": "swap", "command": command, "commit": commit,
                     "rows": rows, "warnings": warnings})
    out = path[:-len(".json")] + ".md" if path.endswith(".json") else path + ".md"
    subprocess.run([sys.executable, os.path.join(REPO, "bench", "results", "render.py"),
                    "--in", path, "--out", out], check=False)
    print(f"results: swap section recorded in {path}, {out} regenerated",
          file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
