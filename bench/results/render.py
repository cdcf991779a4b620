#!/usr/bin/env python3
"""Writes bench/results/latest.md from bench/results/latest.json.

latest.json holds each benchmark's last recorded run (bench/results_file.h:
machine, date, commit, command and its verdict rows). The page gives every
benchmark a section with that header and a table of its rows, and every row
an anchor, "<benchmark>--<row id>", so SPECIFICATION.md can link a promise
to its last measurement (latest.md#ring--put-throughput-ring-1-guest-...).

The same data always gives the same page, byte for byte: benchmarks in a
fixed order (unknown ones after, by name), rows in recorded order, numbers
formatted as the tables print them.

Usage: render.py [--in latest.json] [--out latest.md] (defaults: beside
this script). Exit 1 if the input is not a results file.
"""

import argparse
import json
import math
import os
import sys

SCHEMA = 1

# Section order and titles; a benchmark not listed comes after, by name.
BENCHMARKS = [
    ("scenario", "The valve: scenario benchmark", "tmem-scenario"),
    ("scenario-deferred", "Deferred compression: scenario benchmark",
     "tmem-scenario --modes ...,deferred"),
    ("micro", "Backend store: micro-benchmark summary", "bench/run_micro.sh"),
    ("micro-gbench", "Backend store: micro-benchmark, Google Benchmark mode",
     "bench/run_micro.sh --gbench"),
    ("ring", "Data plane: ring benchmark", "bench/run_ring.sh"),
    ("isolation", "Tenant isolation benchmark", "tmem-isolation-bench"),
    ("isolation-smoke", "Tenant isolation benchmark, smoke run",
     "tmem-isolation-bench --smoke"),
    ("fleet-propagation", "Fleet policy propagation",
     "fleet_propagation_bench"),
    ("real-guest", "Real guest (TCG)", "vm-images/bench.sh"),
    ("swap", "Swap devices: stock 6.1 guest, side by side",
     "vm-images/stock/swap-bench.py --results"),
]
ORDER = {b[0]: i for i, b in enumerate(BENCHMARKS)}
TITLES = {b[0]: (b[1], b[2]) for b in BENCHMARKS}


def num(v):
    """A number as the benchmark tables print it: enough digits, no more."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    a = abs(v)
    if a >= 1000:
        return "%.0f" % v
    if a >= 100:
        return "%.1f" % v
    if a >= 10:
        return "%.2f" % v
    return "%.3f" % v


def target_num(v):
    """A target as SPECIFICATION.md writes it: 0.8, 30, 1.25."""
    return "%g" % v


def with_unit(text, unit):
    if not unit or text == "n/a":
        return text
    if unit in ("x", "%"):
        return text + unit
    return text + " " + unit


def cell(text):
    """Text safe inside a Markdown table cell."""
    text = str(text).replace("\r", " ").replace("\n", " ")
    return text.replace("\\", "\\\\").replace("|", "\\|")


def anchor(benchmark, row_id):
    return "%s--%s" % (benchmark, row_id)


def mem_text(b):
    if not b:
        return "?"
    return "%.1f GiB" % (b / float(1 << 30))


def render(doc):
    if (not isinstance(doc, dict) or doc.get("schema", 0) < SCHEMA
            or not isinstance(doc.get("benchmarks"), dict)):
        raise ValueError("not a benchmark results file")
    out = []
    w = out.append
    w("# Latest benchmark results")
    w("")
    w("Generated from `latest.json` by `bench/results/render.py`; do not edit. "
      "Each section is its benchmark's last recorded run (`--results`; the "
      "scripts record into `bench/results/latest.json`), with the machine, "
      "date and commit it ran on. The promises these rows enforce are in "
      "SPECIFICATION.md; earlier runs are archived in bench/RESULTS.md.")
    w("")
    names = sorted(doc["benchmarks"], key=lambda n: (ORDER.get(n, len(ORDER)), n))
    if names:
        w("| benchmark | date | commit | verdicts |")
        w("| --- | --- | --- | --- |")
        for name in names:
            sec = doc["benchmarks"][name]
            title = TITLES.get(name, (name, ""))[0]
            w("| [%s](#%s) | %s | %s | %s |" % (
                cell(title), name, cell(sec.get("date", "?")),
                cell(sec.get("commit", "?")), cell(tally(sec.get("rows", [])))))
        w("")
    else:
        w("No benchmark has recorded a run yet.")
        w("")
    for name in names:
        sec = doc["benchmarks"][name]
        title, how = TITLES.get(name, (name, ""))
        w('<a id="%s"></a>' % name)
        w("")
        w("## %s (`%s`)" % (title, name))
        w("")
        m = sec.get("machine", {})
        w("- machine: %s, %s CPUs (%s), %s, kernel %s" % (
            m.get("hostname", "?"), m.get("cpus", "?"),
            m.get("cpu_model", "?") or "?", mem_text(m.get("mem_bytes")),
            m.get("kernel", "?")))
        w("- date: %s" % sec.get("date", "?"))
        w("- commit: %s" % sec.get("commit", "?"))
        w("- command: `%s`" % str(sec.get("command", "")).replace("`", "'"))
        if how:
            w("- run by: `%s`" % how)
        w("")
        if not sec.get("rows"):
            w("No rows recorded.")
            w("")
        else:
            w("| row | value | target | verdict | note |")
            w("| --- | ---: | --- | --- | --- |")
        for r in sec.get("rows", []):
            unit = r.get("unit", "")
            goal = r.get("goal", "info")
            if goal == "info" or r.get("target") is None:
                target = "-"
            else:
                target = "%s %s" % (goal, with_unit(target_num(r["target"]), unit))
            verdict = r.get("verdict", "")
            if verdict in ("PASS", "FAIL", "INCONCLUSIVE"):
                verdict = "**%s**" % verdict
            w('| <a id="%s"></a>%s | %s | %s | %s | %s |' % (
                anchor(name, r.get("id", "")), cell(r.get("name", "")),
                cell(with_unit(num(r.get("value")), unit)), cell(target),
                verdict, cell(r.get("note", ""))))
        if sec.get("rows"):
            w("")
        warnings = sec.get("warnings", [])
        if warnings:
            w("Warnings:")
            w("")
            for text in warnings:
                w("- %s" % cell(text))
            w("")
    return "\n".join(out).rstrip("\n")


def tally(rows):
    counts = {}
    for r in rows:
        counts[r.get("verdict", "")] = counts.get(r.get("verdict", ""), 0) + 1
    parts = []
    for v in ("PASS", "FAIL", "INCONCLUSIVE", "N/A"):
        if counts.get(v):
            parts.append("%d %s" % (counts[v], v))
    targets = sum(n for v, n in counts.items() if v != "info")
    return ("%d of %d targets met" % (counts.get("PASS", 0), targets)
            + (" (" + ", ".join(parts) + ")" if parts else ""))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--in", dest="src", default=os.path.join(here, "latest.json"))
    ap.add_argument("--out", default=os.path.join(here, "latest.md"))
    a = ap.parse_args()
    try:
        with open(a.src, encoding="utf-8") as f:
            doc = json.load(f)
        text = render(doc)
    except (OSError, ValueError) as e:
        print("render.py: %s: %s" % (a.src, e), file=sys.stderr)
        return 1
    tmp = a.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
