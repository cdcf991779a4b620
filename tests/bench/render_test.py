#!/usr/bin/env python3
"""The results renderer's page is stable: testdata/results.json renders to
testdata/results.md byte for byte, and so does the same data with its keys
and benchmarks in another order; every row has its anchor.

Usage: render_test.py RENDER_PY TESTDATA_DIR
"""

import importlib.util
import json
import os
import sys


def main():
    render_py, data = sys.argv[1], sys.argv[2]
    spec = importlib.util.spec_from_file_location("render", render_py)
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    with open(os.path.join(data, "results.json"), encoding="utf-8") as f:
        doc = json.load(f)
    with open(os.path.join(data, "results.md"), encoding="utf-8") as f:
        want = f.read()
    failures = []
    got = render.render(doc) + "\n"
    if got != want:
        failures.append("render(results.json) differs from results.md:\n" + got)

    # The same data, every object's keys and the benchmarks reversed.
    def reverse(o):
        if isinstance(o, dict):
            return {k: reverse(o[k]) for k in reversed(list(o))}
        if isinstance(o, list):
            return [reverse(x) for x in o]
        return o
    again = render.render(json.loads(json.dumps(reverse(doc)))) + "\n"
    if again != want:
        failures.append("key order changed the page:\n" + again)

    for name, sec in doc["benchmarks"].items():
        for r in sec["rows"]:
            a = '<a id="%s--%s"></a>' % (name, r["id"])
            if a not in got:
                failures.append("no anchor " + a)

    try:
        render.render({"schema": 1, "benchmarks": []})
        failures.append("a file without a benchmarks object was rendered")
    except ValueError:
        pass

    for f in failures:
        print("FAIL:", f)
    if not failures:
        print("ok: page stable, %d anchors" % sum(
            len(s["rows"]) for s in doc["benchmarks"].values()))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
