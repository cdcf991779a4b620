#!/usr/bin/env python3
"""tmemd restart and upgrade under a real 5.10 guest (TCG), keeping the device.

The guest (vm-images/guest/init.sh, tmemtest=ops) writes files larger than
its RAM, reads them back through tmem, and at each "WAIT_HOST_RESTART N"
keeps reading and verifying every page while the host restarts tmemd:
  round 1: SIGHUP: tmemd execs itself in place (planned upgrade);
  round 2: SIGKILL, then a new tmemd recovers the channel from the fd store;
  round 3: SIGTERM, then a new tmemd recovers it from the fd store.
This script plays systemd (NOTIFY_SOCKET fd store, LISTEN_FDS on restart).
The guest must see each new host generation, stay attached (no re-plug),
put and hit again, and verify every page; tmemd must log guests_kept=1.
tmemd runs as ivshmem peer 1 (its default), so the device is master=on.

Usage: vm-images/ops-test.py --tmemd PATH [--pages N] [--files N] [--mem MIB]
Prints BENCH lines: signal to the first request the new tmemd served.
"""
import argparse
import array
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

VM_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, VM_DIR)
from vmtest import wait_for  # noqa: E402


class FakeSystemd:
    """NOTIFY_SOCKET with an fd store, and LISTEN_FDS for restarts."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.setblocking(False)
        self.store = {}
        self.ready = 0

    def pump(self):
        while True:
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(64 * 4))
            except BlockingIOError:
                return
            fds = array.array("i")
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % 4])
            kv = dict(l.split("=", 1) for l in data.decode().split("\n") if "=" in l)
            if kv.get("READY") == "1":
                self.ready += 1
            if kv.get("FDSTORE") == "1" and len(fds) == 1 and kv.get("FDNAME"):
                old = self.store.pop(kv["FDNAME"], None)
                if old is not None:
                    os.close(old)
                self.store[kv["FDNAME"]] = fds[0]
                continue
            if kv.get("FDSTOREREMOVE") == "1" and kv.get("FDNAME") in self.store:
                os.close(self.store.pop(kv["FDNAME"]))
            for fd in fds:
                os.close(fd)

    def start(self, argv, log, pass_store):
        self.pump()
        env = {k: v for k, v in os.environ.items()
               if k != "NOTIFY_SOCKET" and not k.startswith("LISTEN_")}
        env["NOTIFY_SOCKET"] = self.path
        names = sorted(self.store) if pass_store else []
        high = [os.dup(self.store[n]) for n in names]  # inheritable copies

        def place():
            # In the child: fds 3.. in store order.
            moved = [os.dup(fd) for fd in high]
            for i, fd in enumerate(moved):
                os.dup2(fd, 3 + i)
        cmd = [shlex.quote(a) for a in argv]
        if names:
            env["LISTEN_FDS"] = str(len(names))
            env["LISTEN_FDNAMES"] = ":".join(names)
            # $$ is the shell's pid, which exec hands to tmemd.
            shell = "LISTEN_PID=$$ exec " + " ".join(cmd)
        else:
            shell = "exec " + " ".join(cmd)
        proc = subprocess.Popen(["/bin/sh", "-c", shell], env=env, stdout=log,
                                stderr=subprocess.STDOUT, close_fds=False,
                                preexec_fn=place)
        for fd in high:
            os.close(fd)
        return proc


def last_value(text, event, key):
    value = None
    for line in text.splitlines():
        if "event=%s " % event in line:
            m = re.search(r" %s=(-?\d+)" % key, line)
            if m:
                value = int(m.group(1))
    return value


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tmemd", required=True)
    ap.add_argument("--pages", type=int, default=12000)
    ap.add_argument("--files", type=int, default=3)
    ap.add_argument("--mem", type=int, default=160)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    images = subprocess.run([os.path.join(VM_DIR, "build-all.sh")], check=True,
                            stdout=subprocess.PIPE, text=True).stdout
    img = {}
    for line in images.splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            img[k] = shlex.split(v)[0] if v else ""
    work = tempfile.mkdtemp(prefix="tmem-ops.")
    systemd = FakeSystemd(os.path.join(work, "notify.sock"))
    disk = os.path.join(work, "disk.img")
    subprocess.run(["truncate", "-s", "1G", disk], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", disk], check=True)
    tmemd_argv = [args.tmemd, "--vm", "guest", "--socket-dir", work,
                  "--control-socket", "", "--stats-interval", "2",
                  "--mode", "always"]
    logs = []

    def start(pass_store):
        path = os.path.join(work, "tmemd%d.log" % (len(logs) + 1))
        logs.append(path)
        before = systemd.ready
        p = systemd.start(tmemd_argv, open(path, "w"), pass_store)
        ok = wait_for(lambda: (systemd.pump(), systemd.ready > before)[1] or p.poll() is not None, 30)
        if not ok or p.poll() is not None:
            print(open(path).read())
            raise SystemExit("tmemd did not become ready")
        return p

    tmemd = start(False)
    serial = os.path.join(work, "serial.log")
    open(serial, "w").close()
    qemu = subprocess.Popen(
        [os.path.join(VM_DIR, "run-guest.sh"), "--socket", os.path.join(work, "guest.sock"),
         "--disk", disk, "--mem", str(args.mem), "--smp", "2", "--serial", serial,
         "--timeout", "1500", "--append",
         # The test checks that hits resume after each restart: the driver
         # must not stand aside because a TCG round trip costs more than a
         # disk read here (miss_cost_ns=0: never).
         "tmemtest=ops tmemtest_pages=%d tmemtest_files=%d tmem_ivshmem.miss_cost_ns=0"
         % (args.pages, args.files)],
        env=dict(os.environ, KERNEL=img["KERNEL"], INITRD=img["INITRD"]))
    fails = []
    rounds_done = 0
    shown = 0
    t_boot = time.time()
    while qemu.poll() is None:
        time.sleep(0.5)
        systemd.pump()
        lines = open(serial, errors="replace").read().splitlines()
        for l in lines[shown:]:
            if "TMEMTEST" in l or "tmem_ivshmem" in l:
                print("[guest %3ds] %s" % (time.time() - t_boot, l.strip()), flush=True)
        shown = len(lines)
        waits = [l for l in lines if "TMEMTEST WAIT_HOST_RESTART" in l]
        if len(waits) > rounds_done:
            rounds_done += 1
            kind = {1: "sighup-exec", 2: "sigkill+fdstore", 3: "sigterm+fdstore"}[rounds_done]
            print("[host] round %d: %s" % (rounds_done, kind), flush=True)
            t0 = time.time()
            served_before = sum(open(l).read().count("event=first_request_after_restore")
                                for l in logs)
            if rounds_done == 1:
                tmemd.send_signal(signal.SIGHUP)
                wait_for(lambda: "event=restart_recovered" in open(logs[-1]).read(), 30)
            else:
                tmemd.send_signal(signal.SIGKILL if rounds_done == 2 else signal.SIGTERM)
                tmemd.wait()
                tmemd = start(True)
            ok = wait_for(lambda: sum(open(l).read().count("event=first_request_after_restore")
                                      for l in logs) > served_before, 60)
            text = open(logs[-1]).read()
            kept = last_value(text, "restart_recovered", "guests_kept")
            if kept != 1:
                fails.append("round %d: guests_kept=%s" % (rounds_done, kept))
            print("BENCH real-guest restart kind=%s signal_to_first_request_ms=%s"
                  % (kind, int((time.time() - t0) * 1000) if ok else "none"), flush=True)
    text = open(serial, errors="replace").read()
    if "TMEMTEST DONE fails=0" not in text:
        fails.append("guest did not finish with fails=0")
    if re.search(r"BUG:|WARNING:|Oops|Kernel panic", text):
        fails.append("guest kernel logged BUG/WARNING/Oops")
    if rounds_done != 3:
        fails.append("only %d restart rounds reached" % rounds_done)
    if tmemd.poll() is None:
        tmemd.send_signal(signal.SIGTERM)
        tmemd.wait()
    final = open(logs[-1]).read()
    hits = last_value(final, "vm_stats", "gets_hit") or 0
    if hits <= 0:
        fails.append("the last tmemd served no hits")
    passes = len(re.findall(r"TMEMTEST CHECK \S+ PASS", text))
    print("[host] guest checks passed: %d; last tmemd gets_hit=%d" % (passes, hits))
    for f in fails:
        print("FAIL:", f)
    if fails or args.keep:
        print("kept", work)
    else:
        subprocess.run(["rm", "-rf", work])
    print("RESULT:", "FAIL" if fails else "PASS")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
