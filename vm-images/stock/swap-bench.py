#!/usr/bin/env python3
"""Swap benchmark on the stock Debian 12 guest: the same guest (256 MiB) and
workload on each swap device, side by side, one JSON document.

Rows (--rows, comma-separated; each one boot of vm-images/stock/swaptest.py):
  a      virtio-blk on a file on host disk, cache=none
  a1     a, throttled like a cloud volume (3000 IOPS, 125 MB/s)   [a']
  b      guest zram (lz4, --zram-mib) with a behind it
  b_fit  b with a working set zram can hold (--fit-ws-ratio)
  d      qemu-storage-daemon, vhost-user-blk over a tmpfs file
  c      a tmemd swap device: --socket S (vhost-user-blk), with --backend-pid
         for its CPU time
Workload (the issue's shape by default): an anonymous working set of
--ws-ratio x RAM (2.5), ~2x LZ4-compressible, written once, then --passes (2)
passes touching every page once in a random order; every page is verified.
The figures are the touch passes': MB/s of pages touched, guest CPU per
swapped page, QEMU's and the backend's CPU, touch latency p50/p99 (the
first load of a page: a swap-in when it was out), host bytes held per
swapped page (the swap file's allocation / the guest's swap use).
Ratios (c/d, c/a1, c/a, and each row / a) are printed, never asserted:
under TCG on a shared machine they are measurements, not guarantees.

Usage: swap-bench.py [--rows a,a1,b,d] [--ws-ratio 2.5] [--passes 2]
         [--socket S --backend-pid PID] [--out FILE] [--accel auto|tcg|kvm]
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import swaptest  # noqa: E402

ROW_BACKEND = {"a": "disk", "a1": "cloud", "b": "zram", "b_fit": "zram", "d": "qsd",
               "c": "vhost"}


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
    p.add_argument("--socket", help="row c: the tmemd vhost-user-blk socket")
    p.add_argument("--backend-pid", type=int, help="row c: tmemd's pid")
    p.add_argument("--accel", default=os.environ.get("TMEM_VM_ACCEL", "auto"))
    p.add_argument("--timeout", type=int, default=2400, help="per row, seconds")
    p.add_argument("--out")
    a = p.parse_args()
    rows = [r for r in a.rows.split(",") if r]
    for r in rows:
        if r not in ROW_BACKEND:
            p.error(f"unknown row {r}")
    if "c" in rows and not a.socket:
        p.error("row c needs --socket")

    images = swaptest.build_images()
    accel = swaptest.probe_kvm(images) if a.accel == "auto" else a.accel
    doc = {"kernel": images.get("KVER"), "accel": accel, "mem_mib": a.mem,
           "ws_ratio": a.ws_ratio, "passes": a.passes, "content": a.content,
           "touch": a.touch, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_avg_start": os.getloadavg(), "rows": {}}
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
        if row == "c":
            sargs += ["--socket", a.socket]
            if a.backend_pid:
                sargs += ["--backend-pid", str(a.backend_pid)]
        swaptest.log(f"row {row}: {' '.join(sargs)}")
        r = swaptest.run_one(swaptest.parse_args(sargs), images, accel)
        s = r.get("summary", {})
        doc["rows"][row] = {
            "backend": r["backend"], "ok": r["ok"], "verdict": r["verdict"],
            "oom_killed": bool(r.get("oom_killed")), "ws_mib": r["ws_mib"],
            "elapsed_s": r.get("elapsed_s"), "boot_s": r.get("boot_s"),
            "write_MBps": next((ph["MBps"] for ph in r["phases"]
                                if ph["phase"] == "write"), None),
            **s,
            "phases": r["phases"], "host": r["host"],
            "zram_mm_stat": r.get("zram_mm_stat"),
        }
        swaptest.log(f"row {row}: {r['verdict']}; MB/s {s.get('MBps')}, "
                     f"{r.get('elapsed_s')} s")
        doc["load_avg_end"] = os.getloadavg()
        finish(doc, a.out)
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
    return 0 if all(x["ok"] or x["oom_killed"] for x in doc["rows"].values()) else 1


def finish(doc, out):
    """Ratios over the rows so far; the document is rewritten after every
    row, so a long run that is stopped keeps what it measured."""
    def mbps(row):
        x = doc["rows"].get(row)
        return x.get("MBps") if x and x["ok"] else None

    ratios = {}
    for num, den in (("c", "d"), ("c", "a1"), ("c", "a"), ("d", "a"), ("a1", "a"),
                     ("b", "a"), ("b_fit", "a")):
        if mbps(num) and mbps(den):
            ratios[f"{num}/{den}"] = round(mbps(num) / mbps(den), 3)
    doc["ratios"] = ratios
    if out:
        with open(out + ".tmp", "w") as f:
            f.write(json.dumps(doc, indent=1) + "\n")
        os.replace(out + ".tmp", out)


if __name__ == "__main__":
    sys.exit(main())
