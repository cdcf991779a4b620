#!/usr/bin/env python3
"""Swap verification tests on the stock Debian 12 guest (ctest label swap).

  --case verified   qemu-storage-daemon's vhost-user-blk over a tmpfs file:
                    a working set above guest RAM is written, read back in a
                    random order and every page verified (0 bad pages); the
                    guest really swapped (pswpout covers the part of the
                    working set that cannot fit in RAM); freeing half of it
                    gives the host its memory back (the tmpfs swap file's
                    allocation falls: `swapon -d` discards reach the backend)
  --case corrupted  the negative control: after the write phase the host
                    flips a byte in swapped-out pages of the swap file; the
                    guest must report bad pages, and only pages the host
                    corrupted
  --backend/--socket pass another device (e.g. a tmemd swap socket) to the
                    same checks.

Exit status 0 when every check holds. The JSON of the run goes to --out (or
the temp directory) for the log.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import swaptest  # noqa: E402


def check(name, cond, detail):
    print(f"SWAPTEST CHECK {name} {'PASS' if cond else 'FAIL'} {detail}", flush=True)
    return bool(cond)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=("verified", "corrupted"), required=True)
    p.add_argument("--ws-ratio", type=float, default=1.5)
    p.add_argument("--out")
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="after --: more swaptest.py arguments (e.g. --backend vhost "
                   "--socket S)")
    a = p.parse_args()
    rest = [x for x in a.rest if x != "--"]
    base = ["--backend", "qsd"] if "--backend" not in rest else []
    if a.case == "verified":
        sargs = base + ["--ws-ratio", str(a.ws_ratio), "--passes", "1",
                        "--free-half"] + rest
    else:
        sargs = base + ["--ws-ratio", str(a.ws_ratio), "--passes", "1",
                        "--corrupt", "64"] + rest
    args = swaptest.parse_args(sargs)
    r = swaptest.run_one(args)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)
    ok = check("run", r["ok"], r["verdict"])
    for ph in r["phases"]:
        print(f"SWAPTEST PHASE {json.dumps(ph)}")
    if r.get("summary"):
        print(f"SWAPTEST SUMMARY {json.dumps(r['summary'])}")
    print(f"SWAPTEST ELAPSED {r.get('elapsed_s')}s (boot {r.get('boot_s')}s, {r['accel']})")
    if not r["ok"]:
        print(r.get("serial_tail", ""))
        return 1
    # The working set exceeds RAM: at least its excess went out to the
    # device (every page verified means it also came back).
    out_pages = sum(ph["pswpout"] for ph in r["phases"])
    in_pages = sum(ph["pswpin"] for ph in r["phases"])
    excess = max(0, (args.ws_mib - args.mem) * 256)
    ok &= check("swapped-out", out_pages >= excess,
                f"pswpout={out_pages} pages, working set exceeds RAM by {excess}")
    ok &= check("swapped-in", in_pages > 0, f"pswpin={in_pages}")
    if a.case == "verified" and args.free_half and r.get("summary"):
        before = r["summary"].get("swap_file_allocated_before_free")
        after = r["summary"].get("swap_file_allocated_after_free")
        if before is not None and after is not None:
            ok &= check("discard-frees-host-memory", after < before,
                        f"swap file allocated {before} -> {after} bytes")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
