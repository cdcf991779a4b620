#!/usr/bin/env python3
"""The shell benchmarks' results writer (bench/results/record.py) follows
bench/results_file.h's rules: a record replaces its own section only, a
file that is not a results file is refused and kept, values not measured
are null, ids are the C++ writer's slugs, verdicts are the method's.

Usage: record_test.py RECORD_PY
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def main():
    record_py = sys.argv[1]
    spec = importlib.util.spec_from_file_location("record", record_py)
    record = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(record)
    with tempfile.TemporaryDirectory(prefix="record-test-") as d:
        path = os.path.join(d, "sub", "latest.json")
        rows = [{"id": "a", "name": "a", "value": 1.0, "verdict": "info"}]
        record.merge(path, {"benchmark": "ring", "rows": rows})
        record.merge(path, {"benchmark": "real-guest", "rows": rows})
        before = json.load(open(path))
        nan_rows = [{"id": "b", "name": "b", "value": math.nan,
                     "target": math.inf, "verdict": "N/A"}]
        record.merge(path, {"benchmark": "real-guest", "rows": nan_rows})
        after = json.load(open(path))
        check(after["benchmarks"]["ring"] == before["benchmarks"]["ring"],
              "another section changed")
        got = after["benchmarks"]["real-guest"]["rows"][0]
        check(got["value"] is None and got["target"] is None,
              "NaN/inf not null: %r" % got)
        check(sorted(os.listdir(os.path.dirname(path))) ==
              ["latest.json", "latest.json.lock"],
              "files left: %r" % os.listdir(os.path.dirname(path)))

        for garbage in ("not json {", "[1]", '{"schema": 1}'):
            with open(path, "w") as f:
                f.write(garbage)
            try:
                record.merge(path, {"benchmark": "ring", "rows": rows})
                failures.append("garbage %r overwritten" % garbage)
            except ValueError:
                pass
            check(open(path).read() == garbage, "garbage %r changed" % garbage)

        try:
            record.merge(path + "2", {"benchmark": "x", "rows": rows + rows})
            failures.append("repeated row ids accepted")
        except ValueError:
            pass

        # The program: rows from tab-separated lines, verdicts as the method
        # gives them.
        tsv = os.path.join(d, "rows.tsv")
        with open(tsv, "w") as f:
            f.write("seq re-read, cache=none\t0.98\tx\t>= 1.0\tn1\n"
                    "cloud\t1.05\tx\t> 1.0\tn2\n"
                    "control: 2nd / 1st\t1.02\tx\t0.97-1.03\tn3\n"
                    "rand\t-\tx\t>= 2.0\tn4\n"
                    "seq re-read, cache=none\t1.5\tx\t<= 2\tn5\n")
        out = os.path.join(d, "p.json")
        rc = subprocess.call([sys.executable, record_py, "--results", out,
                              "--benchmark", "real-guest", "--command", "c",
                              "--rows", tsv, "--warning", "w1"])
        check(rc == 0, "record.py exited %d" % rc)
        sec = json.load(open(out))["benchmarks"]["real-guest"]
        want = [("seq-re-read-cache-none", ">=", 1.0, "FAIL"),
                ("cloud", ">", 1.0, "PASS"),
                ("control-2nd-1st", "info", None, "info"),
                ("rand", ">=", 2.0, "N/A"),
                ("seq-re-read-cache-none-2", "<=", 2.0, "PASS")]
        got = [(r["id"], r["goal"], r["target"], r["verdict"])
               for r in sec["rows"]]
        check(got == want, "rows %r, want %r" % (got, want))
        check(sec["warnings"] == ["w1"], "warnings %r" % sec["warnings"])
        check(sec["rows"][2]["note"] == "expected 0.97-1.03; n3",
              "note %r" % sec["rows"][2]["note"])
        check(record.slug("put LZ4 path / LZ4_compress_default") ==
              "put-lz4-path-lz4-compress-default", "slug")
        check(record.slug("a\u00e9b") == "a-b", "slug of non-ASCII")

    for f in failures:
        print("FAIL:", f)
    if not failures:
        print("ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
