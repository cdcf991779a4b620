#!/usr/bin/env python3
"""Runs a Type=notify service the way systemd would, where systemd is not
PID 1 (CI containers): reads the unit file, prepares RuntimeDirectory= and
StateDirectory= for User=/Group=, starts ExecStart= as that user with no
capabilities and no_new_privs (CapabilityBoundingSet=, NoNewPrivileges=),
and plays $NOTIFY_SOCKET (a datagram socket; the sender's pid is checked
with SO_PASSCRED, as NotifyAccess=main does).

Checks, each failing the run with a message:
  * READY=1 and a STATUS= line arrive from the main pid;
  * the process runs as User= with no effective capabilities;
  * with WatchdogSec=, WATCHDOG_USEC is set and WATCHDOG=1 keeps arriving
    at least twice per interval while the service runs;
  * each --after-ready command (with $MAINPID substituted) exits 0;
  * with --bad-reload-config, ExecReload= fails on a broken config with
    FILE:LINE, and the service is not signalled and keeps running;
  * ExecReload= (each line, as User=) exits 0, the service sends
    RELOADING=1 (never STOPPING=1) and READY=1 again from the same pid
    (tmemd execs itself in place);
  * SIGTERM (systemctl stop) gives STOPPING=1 and exit status 0; the
    runtime directory is then removed as systemd does on stop (the state
    directory stays, as with systemd).

Usage: notify_harness.py UNIT [--after-ready 'CMD ...']...
"""
import argparse
import grp
import os
import pwd
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

TIMEOUT_S = 30.0  # a start on a loaded 2-core machine; systemd's is 90 s


def fail(msg):
    print(f"notify_harness: FAIL: {msg}", flush=True)
    raise SystemExit(1)


def parse_unit(path):
    """[Service] settings: single values (last wins) and ExecReload lines."""
    service = {}
    reload_lines = []
    section = None
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line
                continue
            if section != "[Service]" or "=" not in line:
                continue
            key, value = line.split("=", 1)
            if key == "ExecReload":
                reload_lines.append(value)
            else:
                service[key] = value
    return service, reload_lines


def parse_seconds(text):
    """WatchdogSec= values used here: '10', '10s', '500ms', '1min'."""
    for suffix, mult in (("ms", 0.001), ("min", 60.0), ("s", 1.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * mult
    return float(text)


class Notify:
    """$NOTIFY_SOCKET: collects (pid, fields) per datagram."""

    def __init__(self, directory):
        self.path = os.path.join(directory, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o777)  # the service runs as another user
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.messages = []  # (time, pid, {key: value})

    def pump(self, timeout):
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data, anc, _, _ = self.sock.recvmsg(
                4096, socket.CMSG_SPACE(12) + socket.CMSG_SPACE(4 * 64))
        except socket.timeout:
            return None
        pid = None
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("iII", payload[:12])[0]
            elif level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                # FDSTORE=1 descriptors: not kept here (no restart is played).
                for i in range(0, len(payload) - len(payload) % 4, 4):
                    os.close(struct.unpack("i", payload[i:i + 4])[0])
        fields = {}
        for line in data.decode(errors="replace").split("\n"):
            if "=" in line:
                k, v = line.split("=", 1)
                fields[k] = v
        msg = (time.monotonic(), pid, fields)
        self.messages.append(msg)
        print(f"notify_harness: pid {pid}: {data.decode(errors='replace')!r}",
              flush=True)
        return msg

    def wait_for(self, key, value, proc, since, timeout=TIMEOUT_S):
        deadline = time.monotonic() + timeout
        for t, pid, fields in self.messages:
            if t >= since and fields.get(key) == value:
                return pid, fields
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                fail(f"service exited with status {proc.returncode} before "
                     f"{key}={value}")
            msg = self.pump(min(0.2, deadline - time.monotonic()))
            if msg is not None and msg[2].get(key) == value:
                return msg[1], msg[2]
        fail(f"no {key}={value} within {timeout:.0f} s")


def run_pumping(notify, argv, **kwargs):
    """Runs a command to completion while reading $NOTIFY_SOCKET, as
    systemd keeps reading it: a datagram socket queues few messages
    (net.unix.max_dgram_qlen, 10 by default), and then the service's next
    sd_notify (WATCHDOG=1, FDSTORE=1, FDSTOREREMOVE=1) blocks whatever
    thread sends it."""
    p = subprocess.Popen(argv, **kwargs)
    while p.poll() is None:
        notify.pump(0.05)
    return p.returncode


def proc_status(pid):
    out = {}
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def bad_reload(config, reload_lines, as_user, env, notify, proc):
    """systemctl reload with a broken config: ExecReload= lines run in
    order and the first failure fails the reload (as systemd does); the
    service must not be signalled and keep running, and the error must
    name the file and line."""
    with open(config, encoding="utf-8") as f:
        original = f.read()
    since = time.monotonic()
    try:
        with open(config, "a", encoding="utf-8") as f:
            # A wrong type: the loader names the key's line.
            f.write("\n[libvirt]\ndetach_timeout_seconds = \"thirty\"\n")
        bad_line = original.count("\n") + 3
        failed = None
        for line in reload_lines:
            cmd = shlex.split(line.replace("$MAINPID", str(proc.pid)))
            r = subprocess.run(as_user + ["--"] + cmd, env=env, check=False,
                               capture_output=True, text=True)
            print(f"notify_harness: bad ExecReload: {' '.join(cmd)}: exit "
                  f"{r.returncode}: {r.stderr.strip()}", flush=True)
            if r.returncode != 0:
                failed = r
                break
        if failed is None:
            fail("a broken config did not fail ExecReload=")
        if f"{config}:{bad_line}" not in failed.stderr:
            fail(f"reload error does not name {config}:{bad_line}: "
                 f"{failed.stderr!r}")
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            notify.pump(0.1)
        if proc.poll() is not None:
            fail(f"service exited {proc.returncode} after a refused reload")
        # WATCHDOG=1 pings go on; a reload, stop or restart must not.
        if any(t >= since and ({"READY", "RELOADING", "STOPPING"} & f.keys())
               for t, p, f in notify.messages):
            fail("service reloaded or stopped after a refused reload")
        print("notify_harness: broken config refused by ExecReload=, "
              "service untouched", flush=True)
    finally:
        with open(config, "w", encoding="utf-8") as f:
            f.write(original)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("unit")
    ap.add_argument("--after-ready", action="append", default=[],
                    help="command run (as root) once READY=1 arrived; "
                         "$MAINPID is substituted")
    ap.add_argument("--bad-reload-config",
                    help="before the good reload, break this config file "
                         "(restored after) and check ExecReload= refuses")
    ap.add_argument("--watchdog-sec", type=float,
                    help="play WatchdogSec= with this value instead of the "
                         "unit's (a short one keeps the test short)")
    args = ap.parse_args()

    service, reload_lines = parse_unit(args.unit)
    if service.get("Type") != "notify":
        fail(f"Type={service.get('Type')}, expected notify")
    user = service.get("User", "root")
    group = service.get("Group", user)
    uid = pwd.getpwnam(user).pw_uid
    gid = grp.getgrnam(group).gr_gid
    start_argv = shlex.split(service["ExecStart"])

    # RuntimeDirectory= / StateDirectory=: owned by User=, mode 0755.
    for key, base in (("RuntimeDirectory", "/run"),
                      ("StateDirectory", "/var/lib")):
        if key in service:
            d = os.path.join(base, service[key])
            os.makedirs(d, mode=0o755, exist_ok=True)
            os.chown(d, uid, gid)
            os.chmod(d, 0o755)
    runtime_dir = (os.path.join("/run", service["RuntimeDirectory"])
                   if "RuntimeDirectory" in service else None)

    tmp = tempfile.mkdtemp(prefix="notify-harness.")
    os.chmod(tmp, 0o711)
    notify = Notify(tmp)
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "LANG": "C.UTF-8", "NOTIFY_SOCKET": notify.path,
           "INVOCATION_ID": "0" * 32}
    watchdog_s = None
    if "WatchdogSec" in service:
        watchdog_s = parse_seconds(service["WatchdogSec"])
        if args.watchdog_sec:
            print(f"notify_harness: WatchdogSec={watchdog_s:g} in the unit, "
                  f"playing {args.watchdog_sec:g}", flush=True)
            watchdog_s = args.watchdog_sec
        env["WATCHDOG_USEC"] = str(int(watchdog_s * 1e6))
    # User=/Group= with supplementary groups, CapabilityBoundingSet= empty,
    # NoNewPrivileges=yes.
    as_user = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups",
               "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    if service.get("CapabilityBoundingSet", "") not in ("", "~"):
        fail("harness plays an empty CapabilityBoundingSet= only, unit has "
             f"{service['CapabilityBoundingSet']!r}")

    proc = subprocess.Popen(as_user + ["--"] + start_argv, env=env)
    ok = False
    try:
        t0 = time.monotonic()
        pid, _ = notify.wait_for("READY", "1", proc, since=0)
        print(f"notify_harness: READY=1 after {time.monotonic() - t0:.2f} s",
              flush=True)
        if pid != proc.pid:
            fail(f"READY=1 from pid {pid}, main pid is {proc.pid}")
        statuses = [f["STATUS"] for _, p, f in notify.messages if "STATUS" in f]
        if not statuses:
            fail("no STATUS= line by READY=1")
        st = proc_status(proc.pid)
        uids = st["Uid"].split()
        if any(int(u) != uid for u in uids):
            fail(f"runs as uids {uids}, expected {user} ({uid})")
        if int(st["CapEff"], 16) != 0 or int(st["CapBnd"], 16) != 0:
            fail(f"capabilities: CapEff {st['CapEff']} CapBnd {st['CapBnd']}")
        if st.get("NoNewPrivs") != "1":
            fail("NoNewPrivs is not set")
        print(f"notify_harness: pid {proc.pid} runs as {user} ({uid}), "
              f"CapEff={st['CapEff']}, NoNewPrivs=1, STATUS={statuses[-1]!r}",
              flush=True)

        for cmd in args.after_ready:
            cmd = cmd.replace("$MAINPID", str(proc.pid))
            print(f"notify_harness: $ {cmd}", flush=True)
            rc = run_pumping(notify, cmd, shell=True)
            if rc != 0:
                fail(f"'{cmd}' exited {rc}")

        if watchdog_s is not None:
            window = 2.0 * watchdog_s
            start = time.monotonic()
            while time.monotonic() - start < window:
                if proc.poll() is not None:
                    fail(f"service exited {proc.returncode} during watchdog "
                         "window")
                notify.pump(0.1)
            pings = sorted(t for t, p, f in notify.messages
                           if f.get("WATCHDOG") == "1" and p == proc.pid
                           and t >= start)
            # systemd kills a service that misses WatchdogSec: every gap
            # between pings (and to the window's ends) must be shorter.
            edges = [start] + pings + [start + window]
            worst = max(b - a for a, b in zip(edges, edges[1:]))
            print(f"notify_harness: {len(pings)} WATCHDOG=1 in {window:.1f} s "
                  f"(WatchdogSec={watchdog_s:g}), longest gap {worst:.2f} s",
                  flush=True)
            if worst >= watchdog_s:
                fail(f"watchdog gap {worst:.2f} s >= WatchdogSec "
                     f"{watchdog_s:g} s: systemd would kill the service")

        if args.bad_reload_config:
            bad_reload(args.bad_reload_config, reload_lines, as_user, env,
                       notify, proc)

        for line in reload_lines:
            cmd = shlex.split(line.replace("$MAINPID", str(proc.pid)))
            since = time.monotonic()
            print(f"notify_harness: ExecReload: {' '.join(cmd)}", flush=True)
            r = subprocess.run(as_user + ["--"] + cmd, env=env, check=False)
            if r.returncode != 0:
                fail(f"ExecReload '{line}' exited {r.returncode}")
        if reload_lines:
            pid, _ = notify.wait_for("READY", "1", proc, since=since)
            if pid != proc.pid:
                fail(f"READY=1 after reload from pid {pid}, not {proc.pid}")
            during = [f for t, p, f in notify.messages if t >= since]
            # systemd takes STOPPING=1 in a reload as a stop (and SIGKILLs
            # the service after TimeoutStopSec=); RELOADING=1 keeps it up.
            if any(f.get("STOPPING") == "1" for f in during):
                fail("STOPPING=1 during reload")
            if not any(f.get("RELOADING") == "1" for f in during):
                fail("no RELOADING=1 before the reloaded READY=1")
            print("notify_harness: reloaded: READY=1 again from the same pid",
                  flush=True)

        since = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING", "1", proc, since=since)
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            fail("no exit within 30 s of SIGTERM")
        if rc != 0:
            fail(f"exit status {rc} after SIGTERM")
        print("notify_harness: STOPPING=1, exit status 0", flush=True)
        ok = True
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # systemctl stop removes RuntimeDirectory= (Preserve=restart keeps
        # it only across restarts).
        if runtime_dir is not None:
            shutil.rmtree(runtime_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print("notify_harness: PASS" if ok else "notify_harness: FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
