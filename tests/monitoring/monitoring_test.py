#!/usr/bin/env python3
"""tmemd's /metrics against the real Prometheus tools (docs/monitoring.md).

1. The shipped monitoring files (docs/monitoring/): `promtool check config`
   on the sample scrape config, `promtool check rules` and `promtool test
   rules` on the rules, the Grafana dashboard is JSON.
2. A real tmemd (VMs g1, g2; g1 driven by tmem-guestsim) is scraped and
   `promtool check metrics` must find nothing to say; every metric the rules
   and the dashboard use is in that exposition.
3. A real Prometheus (the Debian binary, loopback port, temporary storage,
   1 s scrape and rule evaluation) scrapes that tmemd with the shipped rules:
   the target is up, every rule evaluates without error, the recording rule
   instance:tmem_memory_used:ratio equals used/cap as tmemd serves it,
   sum(tmem_puts_total) equals tmemd's host-wide total (no double counting),
   and the down and malformed-entries alerts are inactive.

Everything polls with generous deadlines (a loaded 2-core machine).
Usage: monitoring_test.py --tmemd BIN --tmemctl BIN --guestsim BIN --source DIR
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

DEADLINE_S = 120  # per wait; a loaded machine, nice 19


def fail(msg):
    print(f"monitoring_test: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def step(msg):
    print(f"\n=== monitoring_test: {msg}", flush=True)


def wait_for(what, probe, deadline_s=DEADLINE_S, interval_s=0.5):
    """Calls probe() until it returns a true value; that value."""
    end = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < end:
        try:
            last = probe()
        except (OSError, ValueError, KeyError) as e:  # not up yet
            last = e
            value = None
        else:
            value = last
        if value:
            return value
        time.sleep(interval_s)
    fail(f"timed out after {deadline_s} s waiting for {what} (last: {last!r})")


def run(argv, quiet=False, **kw):
    """Runs argv; prints its output (only on failure when quiet)."""
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    print(f"$ {' '.join(argv)}  -> rc {r.returncode}")
    out = (r.stdout + r.stderr).strip()
    if out and (not quiet or r.returncode != 0):
        print(out)
    return r


def http_get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_samples(text):
    """{(name, frozenset(labels)): value} of an exposition."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r'([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)', line)
        if not m:
            fail(f"unparsable sample line: {line}")
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m[2] or ""))
        out[(m[1], labels)] = float(m[3])
    return out


def metric_sum(samples, name):
    return sum(v for (n, _), v in samples.items() if n == name)


def metric_value(samples, name):
    vals = [v for (n, labels), v in samples.items() if n == name and not labels]
    if len(vals) != 1:
        fail(f"expected one unlabelled {name}, got {vals}")
    return vals[0]


def main():
    ap = argparse.ArgumentParser()
    for a in ("--tmemd", "--tmemctl", "--guestsim", "--source"):
        ap.add_argument(a, required=True)
    args = ap.parse_args()
    mon = os.path.join(args.source, "docs", "monitoring")
    for tool in ("promtool", "prometheus"):
        if not shutil.which(tool):
            fail(f"missing {tool} (Debian package prometheus; "
                 "scripts/install-deps.sh installs it)")

    work = tempfile.mkdtemp(prefix="tmemd-monitoring-test.")
    procs = []

    def cleanup():
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        shutil.rmtree(work, ignore_errors=True)

    try:
        test(args, mon, work, procs)
    finally:
        cleanup()
    print("\nmonitoring_test: PASS")


def test(args, mon, work, procs):
    # --- 1. the shipped files ---------------------------------------------
    step("promtool check config / check rules / test rules; dashboard JSON")
    for argv in (["promtool", "check", "config", "prometheus.yml"],
                 ["promtool", "check", "rules", "tmemd-rules.yml"],
                 ["promtool", "test", "rules", "tmemd-rules.test.yml"]):
        if run(argv, cwd=mon).returncode != 0:
            fail(f"{' '.join(argv)} failed")
    with open(os.path.join(mon, "grafana-tmemd.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    if len(exprs) < 8:
        fail(f"dashboard has only {len(exprs)} queries")
    with open(os.path.join(mon, "tmemd-rules.yml")) as f:
        rules_text = f.read()

    # --- 2. a real tmemd, scraped, linted -----------------------------------
    step("tmemd with VMs g1 and g2; tmem-guestsim drives g1")
    sock_dir = os.path.join(work, "tmemd")
    os.makedirs(sock_dir)
    log_path = os.path.join(work, "tmemd.log")
    log = open(log_path, "w")
    procs.append(subprocess.Popen(
        [args.tmemd, "--socket-dir", sock_dir, "--memory-cap", "64MiB",
         "--workers", "1", "--metrics-port", "0", "--vm", "g1", "--vm", "g2"],
        stdout=log, stderr=subprocess.STDOUT))

    def metrics_port():
        if procs[0].poll() is not None:
            fail(f"tmemd exited: {open(log_path).read()}")
        m = re.search(r"event=control_ready .*metrics_port=(\d+)",
                      open(log_path).read())
        return int(m[1]) if m else None
    port = wait_for("tmemd's control_ready log line", metrics_port)
    print(f"tmemd serves /metrics on 127.0.0.1:{port}")
    ctl = [args.tmemctl, "-s", os.path.join(sock_dir, "control.sock")]
    # "always": every put reaches the store whatever the host's CPU load, so
    # the puts compared below are many, not zero.
    if run(ctl + ["set-mode", "g1", "always"]).returncode != 0:
        fail("tmemctl set-mode failed")
    # A quota and a swap quota on g2, so tmem_vm_quota_bytes and
    # tmem_vm_swap_quota_bytes (absent when unlimited) are served.
    if run(ctl + ["set-quota", "g2", "16MiB"]).returncode != 0:
        fail("tmemctl set-quota failed")
    if run(ctl + ["set-policy", "g2", "--swap-quota", "8MiB"]).returncode != 0:
        fail("tmemctl set-policy --swap-quota failed")
    r = run([args.guestsim, "--socket", os.path.join(sock_dir, "g1.sock"),
             "--progress-ms", "0", "--workload", "reread", "--pages", "300",
             "--ops", "3000", "--seed", "7"], quiet=True)
    if r.returncode != 0:
        fail("tmem-guestsim failed")

    url = f"http://127.0.0.1:{port}/metrics"
    exposition = http_get(url)
    path = os.path.join(work, "metrics.txt")
    with open(path, "w") as f:
        f.write(exposition)
    samples = parse_samples(exposition)
    print(f"scraped {len(exposition)} bytes, {len(samples)} samples")
    step("promtool check metrics")
    with open(path) as f:
        r = run(["promtool", "check", "metrics"], stdin=f)
    # promtool exits 0 on empty input: the sample count above guards that.
    if r.returncode != 0 or (r.stdout + r.stderr).strip():
        fail("promtool check metrics found problems")
    if len(samples) < 100:
        fail(f"only {len(samples)} samples")
    swap_quota = samples.get(("tmem_vm_swap_quota_bytes",
                              frozenset({("vm", "g2")})))
    if swap_quota != 8 * 1024 * 1024:
        fail(f"tmem_vm_swap_quota_bytes{{vm=\"g2\"}} is {swap_quota}, "
             "want 8388608")
    puts = metric_sum(samples, "tmem_puts_total")
    host_puts = metric_sum(samples, "tmem_host_puts_total")
    print(f"sum(tmem_puts_total) = {puts:.0f}, "
          f"sum(tmem_host_puts_total) = {host_puts:.0f}")
    if puts <= 0 or puts != host_puts:
        fail("per-VM puts do not add up to the host-wide total")

    step("every metric the rules and the dashboard use is served")
    names = {n for (n, _) in samples}
    used = set()
    for text in exprs + [rules_text]:
        # Metric names, not recording-rule names (level:metric:op) nor the
        # prefix of a regex matcher (tmem_channel_(...)).
        used |= set(re.findall(r"(?<![:\w])(tmem_[a-z0-9_]*[a-z0-9])(?![:\w(])",
                               text))
    missing = sorted(used - names)
    print(f"{len(used)} metric names used; missing: {missing}")
    if missing or len(used) < 15:
        fail(f"rules or dashboard use metrics tmemd does not serve: {missing}")

    # --- 3. a real Prometheus -----------------------------------------------
    step("Prometheus scraping tmemd with the shipped rules")
    prom_dir = os.path.join(work, "prometheus")
    os.makedirs(prom_dir)
    shutil.copy(os.path.join(mon, "tmemd-rules.yml"), prom_dir)
    with open(os.path.join(mon, "prometheus.yml")) as f:
        config = f.read()
    for old, new in (("scrape_interval: 15s", "scrape_interval: 1s"),
                     ("evaluation_interval: 15s", "evaluation_interval: 1s"),
                     ('"127.0.0.1:9477"', f'"127.0.0.1:{port}"')):
        if old not in config:
            fail(f"sample config lacks {old!r} (the test edits it)")
        config = config.replace(old, new)
    config_path = os.path.join(prom_dir, "prometheus.yml")
    with open(config_path, "w") as f:
        f.write(config)
    prom_port = free_port()
    prom_log_path = os.path.join(work, "prometheus.log")
    prom_log = open(prom_log_path, "w")
    procs.append(subprocess.Popen(
        ["prometheus", f"--config.file={config_path}",
         f"--storage.tsdb.path={os.path.join(prom_dir, 'data')}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=prom_log, stderr=subprocess.STDOUT))
    api = f"http://127.0.0.1:{prom_port}/api/v1"

    def ready():
        if procs[1].poll() is not None:
            fail(f"prometheus exited: {open(prom_log_path).read()[-3000:]}")
        return http_get(f"http://127.0.0.1:{prom_port}/-/ready", timeout=5)
    wait_for("Prometheus ready", ready)

    def query(expr):
        body = json.loads(http_get(
            f"{api}/query?{urllib.parse.urlencode({'query': expr})}"))
        if body["status"] != "success":
            fail(f"query {expr}: {body}")
        return body["data"]["result"]

    def target_up():
        targets = json.loads(http_get(f"{api}/targets"))["data"]["activeTargets"]
        return [t for t in targets if t["labels"].get("job") == "tmemd"
                and t["health"] == "up"]
    wait_for("the tmemd target up", target_up)
    print("target up")

    def rules_evaluated():
        groups = json.loads(http_get(f"{api}/rules"))["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        bad = [(r["name"], r.get("lastError")) for r in rules
               if r["health"] != "ok"]
        if bad:
            fail(f"rules with errors: {bad}")
        return rules if len(rules) >= 10 and all(
            not r["lastEvaluation"].startswith("0001") for r in rules) else None
    rules = wait_for("every rule evaluated", rules_evaluated)
    print(f"{len(rules)} rules evaluated, all healthy: "
          + ", ".join(f"{r['name']}={r.get('state', 'recorded')}"
                      for r in rules))

    def recorded_ratio_matches():
        result = query('instance:tmem_memory_used:ratio{job="tmemd"}')
        if len(result) != 1:
            return None
        recorded = float(result[0]["value"][1])
        now = parse_samples(http_get(url))
        expected = (metric_value(now, "tmem_memory_used_bytes")
                    / metric_value(now, "tmem_memory_cap_bytes"))
        # tmemd is idle now: used/cap stays put between the two reads.
        return (recorded, expected) if recorded > 0 and abs(
            recorded - expected) <= 1e-12 * expected else None
    recorded, expected = wait_for("instance:tmem_memory_used:ratio to equal "
                                  "used/cap from /metrics",
                                  recorded_ratio_matches)
    print(f"recording rule instance:tmem_memory_used:ratio = {recorded!r}, "
          f"tmemd's used/cap = {expected!r}")

    def sums_match():
        a = query('sum(tmem_puts_total{job="tmemd"})')
        b = query('sum(tmem_host_puts_total{job="tmemd"})')
        if not a or not b:
            return None
        a, b = float(a[0]["value"][1]), float(b[0]["value"][1])
        return (a, b) if a == b == puts else None
    a, b = wait_for("sum(tmem_puts_total) == sum(tmem_host_puts_total) == "
                    f"{puts:.0f} in Prometheus", sums_match)
    print(f"Prometheus: sum(tmem_puts_total) = {a:.0f} = "
          f"sum(tmem_host_puts_total) = {b:.0f}")
    # A healthy tmemd whose guest sent only well-formed entries: these two
    # stay quiet (the CPU and memory alerts depend on this machine's load).
    states = {r["name"]: r.get("state") for r in rules_evaluated()}
    for name in ("TmemdDown", "TmemGuestSendsMalformedEntries"):
        if states.get(name) != "inactive":
            fail(f"{name} is {states.get(name)} on a healthy tmemd")
    print("TmemdDown and TmemGuestSendsMalformedEntries inactive")
    if procs[0].poll() is not None:
        fail("tmemd died during the test")


if __name__ == "__main__":
    main()
