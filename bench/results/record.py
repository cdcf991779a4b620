#!/usr/bin/env python3
"""Records a benchmark's rows in the results file (bench/results/latest.json),
for the benchmarks written in shell (vm-images/bench.sh): the same file and
the same rules as the C++ programs' writer (bench/results_file.h).

merge(path, section) replaces section["benchmark"]'s section only, under an
exclusive flock on "<path>.lock", by writing a temporary file beside it and
renaming it over the old one; a file that is not a results file is refused,
never overwritten. NaN and infinities are written as null.

As a program:
  record.py --results PATH --benchmark ID --command TEXT --rows FILE
            [--warning TEXT ...]
FILE has one row per line, tab-separated: name, value ("-" or empty: not
measured), unit, target (">= 1.0", "> 1.0", "<= 30", "< 2", or anything
else: no verdict, shown as information, e.g. "0.97-1.03"), note. Each row
gets the verdict the benchmarks' method gives (bench/method.h): PASS or FAIL
against its target, N/A when not measured, info without a target. Exit 1 if
the file could not be written.
"""

import argparse
import datetime
import fcntl
import json
import math
import os
import re
import socket
import sys
import tempfile

SCHEMA = 1


def machine():
    u = os.uname()
    model = ""
    mem = 0
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "kernel": u.release,
            "cpus": os.sysconf("SC_NPROCESSORS_ONLN"), "cpu_model": model,
            "mem_bytes": mem}


def now_utc():
    return datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def slug(name):
    """RowSlug of bench/results_file.h: lower-case ASCII letters and digits,
    every other run of characters one '-'."""
    ascii_only = "".join(c if c < "\x80" else " " for c in name)
    return "-".join(re.findall(r"[a-z0-9]+", ascii_only.lower()))


def assign_ids(rows):
    seen = {}
    for r in rows:
        if not r.get("id"):
            r["id"] = slug(r["name"]) or "row"
        seen[r["id"]] = seen.get(r["id"], 0) + 1
        if seen[r["id"]] > 1:
            r["id"] = "%s-%d" % (r["id"], seen[r["id"]])


def _finite(v):
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def merge(path, section):
    """Replaces section["benchmark"]'s section of the results file at path."""
    name = section.get("benchmark", "")
    if not name:
        raise ValueError("empty benchmark id")
    ids = [r.get("id", "") for r in section["rows"]]
    if "" in ids or len(set(ids)) != len(ids):
        raise ValueError("%s: empty or repeated row id" % name)
    body = {
        "machine": section.get("machine") or machine(),
        "date": section.get("date") or now_utc(),
        "commit": section.get("commit") or os.environ.get("TMEM_COMMIT")
        or "unknown",
        "command": section.get("command", ""),
        "rows": [{
            "id": r["id"], "name": r["name"], "value": _finite(r.get("value")),
            "unit": r.get("unit", ""), "goal": r.get("goal", "info"),
            "target": _finite(r.get("target")), "verdict": r.get("verdict", ""),
            "note": r.get("note", "")} for r in section["rows"]],
        "warnings": list(section.get("warnings", [])),
    }
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        doc = {"schema": SCHEMA, "benchmarks": {}}
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    old = json.load(f)
            except ValueError:
                old = None
            if (not isinstance(old, dict) or old.get("schema", 0) < 1
                    or not isinstance(old.get("benchmarks"), dict)):
                raise ValueError("%s exists but is not a benchmark results "
                                 "file; not replaced" % path)
            doc = old
        doc["schema"] = SCHEMA
        doc["benchmarks"][name] = body
        fd, tmp = tempfile.mkstemp(dir=d, prefix=os.path.basename(path) + ".")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=2, sort_keys=True, ensure_ascii=False,
                          allow_nan=False)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


GOALS = {">=": lambda v, t: v >= t, ">": lambda v, t: v > t,
         "<=": lambda v, t: v <= t, "<": lambda v, t: v < t}


def row_from_fields(name, value, unit, target, note):
    """A row with its goal and verdict, as bench/method.h's VerdictOf."""
    v = None
    if value not in ("", "-"):
        try:
            v = float(value)
        except ValueError:
            v = None
    m = re.fullmatch(r"\s*(>=|<=|>|<)\s*([0-9.]+)\s*", target or "")
    row = {"name": name, "value": v, "unit": unit, "note": note}
    if not m:
        row.update(goal="info", target=None, verdict="info")
        if target:
            row["note"] = ("expected %s; " % target) + note
        return row
    goal, t = m.group(1), float(m.group(2))
    # ">" is not one of bench/method.h's goals; the results file keeps it.
    row.update(goal=goal, target=t)
    if v is None or not math.isfinite(v):
        row["verdict"] = "N/A"
    else:
        row["verdict"] = "PASS" if GOALS[goal](v, t) else "FAIL"
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True)
    ap.add_argument("--benchmark", required=True)
    ap.add_argument("--command", default="")
    ap.add_argument("--rows", required=True)
    ap.add_argument("--warning", action="append", default=[])
    a = ap.parse_args()
    rows = []
    with open(a.rows, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            fields = (line.split("\t") + [""] * 5)[:5]
            rows.append(row_from_fields(*fields))
    assign_ids(rows)
    try:
        root = os.environ.get("TMEM_REPO_ROOT", "")
        command = a.command.replace(root + "/", "") if root else a.command
        merge(a.results, {"benchmark": a.benchmark, "command": command,
                          "rows": rows, "warnings": a.warning})
    except (OSError, ValueError) as e:
        print("results not recorded: %s" % e, file=sys.stderr)
        return 1
    print('results recorded in %s (section "%s", %d rows)' % (
        a.results, a.benchmark, len(rows)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
