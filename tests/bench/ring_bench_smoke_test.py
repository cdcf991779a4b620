#!/usr/bin/env python3
"""The ring benchmark in a tiny configuration (1 round of the 1-guest put
section): it exits 0, records its two verdict rows in the results file as it
printed them, and its notes warn of nothing a correct run does (the ring's
own accounting counters, sqes_posted and completions_reaped, count every put
and are no warning). What load alone causes is allowed (LOAD_WARNINGS):
that is the method's honest note, not a fault. No performance target is
judged here.

Usage: ring_bench_smoke_test.py TMEM_RING_BENCH
"""

import json
import os
import re
import subprocess
import sys
import tempfile

# What a correct run may still warn of on a loaded machine: too few
# undisturbed rounds, and a guest that waited for ring room past its bound
# and dropped a put (with the invalidate it then owes and the count it
# leaves short). Anything else (a counter every put moves, a channel
# error, a wrong page) fails.
LOAD_WARNINGS = ("machine busy", "guest puts_dropped_ring_full",
                 "guest invalidates_for_dropped_puts", " expected")


def main():
    binary = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory(prefix="ring-smoke-") as d:
        results = os.path.join(d, "latest.json")
        p = subprocess.run(
            [binary, "--sections", "put1", "--rounds", "1", "--extra_seconds",
             "0", "--corpus_pages", "128", "--results", results],
            capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            print(p.stdout, p.stderr)
            print("FAIL: exit status %d" % p.returncode)
            return 1
        sec = json.load(open(results))["benchmarks"]["ring"]
        rows = sec["rows"]
        ids = [r["id"] for r in rows]
        want = ["put-throughput-ring-1-guest-in-process-1-thread",
                "put-cpu-per-page-tmemd-worker-thread-in-process-put"]
        if ids != want:
            failures.append("row ids %r, want %r" % (ids, want))
        for r in rows:
            if r["verdict"] not in ("PASS", "FAIL", "INCONCLUSIVE"):
                failures.append("%s: verdict %r" % (r["id"], r["verdict"]))
            if not isinstance(r["value"], (int, float)) or r["value"] <= 0:
                failures.append("%s: value %r" % (r["id"], r["value"]))
            # The printed row: its name, its verdict.
            if not re.search(re.escape(r["name"]) + r"\s.*\s" + r["verdict"] +
                             r"\s", p.stdout):
                failures.append("%s: not printed with %s" % (r["id"],
                                                              r["verdict"]))
        for w in sec["warnings"] + re.findall(r"WARNING: [^;\n]*", p.stdout):
            if not any(ok in w for ok in LOAD_WARNINGS):
                failures.append("warning: " + w)
    for f in failures:
        print("FAIL:", f)
    if failures:
        print(p.stdout)
    else:
        print("ok: %d rows" % len(rows))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
