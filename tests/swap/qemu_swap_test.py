#!/usr/bin/env python3
"""tmemd's swap device (host-agent/swap) against a real QEMU 7.2.

  --case realize  QEMU (TCG, paused with -S) attaches vhost-user-blk-pci to
                  swap_test_server: the vhost-user handshake completes, the
                  device is realized (QMP query-pci lists virtio-blk 1af4:1001
                  on the bus), QEMU read the config space, and no session was
                  reset. QEMU quits: the server sees the disconnect and takes
                  a second QEMU (the device is reusable) with two vCPUs and
                  QEMU's default queue count (one per vCPU), which the
                  device's four queues satisfy.
  --case guest    the stock Debian 12 guest (vm-images/stock, kernel 6.1,
                  unmodified) swaps to the device through its own virtio-blk
                  driver: vm-images/stock/swap-test.py --case verified
                  (working set 1.5x guest RAM, read back in another order,
                  every page verified, half freed with discard). Checked on
                  the server side too: reads, writes and discards arrived,
                  and no request failed, no queue broke, no session reset.
                  Skipped (77) when vm-images/stock is not in this tree or
                  its images cannot be built.

Needs qemu-system-x86_64; skipped (exit 77) without it. TCG only.
"""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def log(msg):
    print(f"[qemu_swap_test] {msg}", file=sys.stderr, flush=True)


def wait_for(cond, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


class Server:
    def __init__(self, binary, sock, mib, queues=1, extra=()):
        self.sock = sock
        self.proc = subprocess.Popen(
            [binary, "--socket", sock, "--mib", str(mib),
             "--queues", str(queues), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError("swap_test_server did not start: " + line +
                               self.proc.stderr.read())

    def stats(self):
        self.proc.send_signal(signal.SIGUSR1)
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("swap_test_server exited")
            if line.startswith("STATS "):
                return json.loads(line[len("STATS "):])

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=30)
        if err:
            log("server events:\n" + err.strip())
        return self.proc.returncode


class Qmp:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.connect(path)
        self.f = self.s.makefile("rw")
        json.loads(self.f.readline())  # greeting
        self.cmd("qmp_capabilities")

    def cmd(self, name, **args):
        self.f.write(json.dumps({"execute": name, "arguments": args}) + "\n")
        self.f.flush()
        while True:
            r = json.loads(self.f.readline())
            if "return" in r:
                return r["return"]
            if "error" in r:
                raise RuntimeError(f"{name}: {r['error']}")


def start_qemu(tmp, sock, qmp_path, smp=1, num_queues=1):
    queues = f",num-queues={num_queues}" if num_queues else ""
    args = ["qemu-system-x86_64", "-accel", "tcg", "-S", "-nodefaults",
            "-display", "none", "-m", "256", "-smp", str(smp),
            "-object", "memory-backend-memfd,id=mem,size=256M,share=on",
            "-machine", "pc,memory-backend=mem",
            "-chardev", f"socket,id=sw0,path={sock}",
            "-device", f"vhost-user-blk-pci,chardev=sw0,id=swap0{queues}",
            "-qmp", f"unix:{qmp_path},server=on,wait=off"]
    err = open(os.path.join(tmp, "qemu.log"), "w")
    q = subprocess.Popen(args, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=err)
    if not wait_for(lambda: os.path.exists(qmp_path) or q.poll() is not None,
                    60) or q.poll() is not None:
        q.kill()
        raise RuntimeError("QEMU did not start: " +
                           open(os.path.join(tmp, "qemu.log")).read())
    return q


def case_realize(a, tmp):
    sock = os.path.join(tmp, "vm1.swap.sock")
    # Four queues: QEMU 7.2 asks for one per vCPU unless num-queues is
    # given, and refuses a device that offers fewer.
    server = Server(a.server, sock, 64, queues=4)
    ok = True
    for attempt, smp, nq in ((1, 1, 1), (2, 2, None)):
        qmp_path = os.path.join(tmp, f"qmp{attempt}.sock")
        q = start_qemu(tmp, sock, qmp_path, smp=smp, num_queues=nq)
        try:
            qmp = Qmp(qmp_path)
            devices = [d for bus in qmp.cmd("query-pci")
                       for d in bus["devices"]]
            blk = [d for d in devices
                   if d["id"]["vendor"] == 0x1af4 and
                   d["id"]["device"] in (0x1001, 0x1042) and
                   d.get("qdev_id") == "swap0"]
            log(f"QEMU {attempt}: virtio-blk functions {blk and blk[0]['id']}")
            if not blk:
                log("FAIL: vhost-user-blk-pci not on the PCI bus")
                ok = False
            qmp.cmd("quit")
        finally:
            q.wait(timeout=30)
        if not wait_for(lambda: server.stats()["client_disconnects"] >= attempt,
                        30):
            log("FAIL: the server did not see QEMU go")
            ok = False
    st = server.stats()
    log("server: " + json.dumps({k: v for k, v in st.items() if v}))
    for key, want in (("clients_accepted", 2), ("config_reads", 2)):
        if st[key] < want:
            log(f"FAIL: {key}={st[key]}, expected >= {want}")
            ok = False
    for key in ("session_resets", "messages_malformed", "messages_unsupported",
                "clients_rejected_busy"):
        if st[key] != 0:
            log(f"FAIL: {key}={st[key]}")
            ok = False
    if server.stop() != 0:
        ok = False
    return 0 if ok else 1


def case_guest(a, tmp):
    script = os.path.join(ROOT, "vm-images", "stock", "swap-test.py")
    if not os.path.exists(script):
        log(f"SKIP: {script} is not in this tree")
        return SKIP
    build = subprocess.run([os.path.join(ROOT, "vm-images", "stock", "build.sh")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    if build.returncode != 0:
        log("SKIP: the stock guest images cannot be built here:\n" +
            build.stderr[-2000:])
        return SKIP
    sock = os.path.join(tmp, "vm1.swap.sock")
    # The working set (1.5 x 256 MiB) plus room: 1 GiB of device.
    extra = []
    if a.backing == "tmem":
        # The store over a real TmemStore; a quota below the working set
        # makes part of it spill to the image on disk.
        extra = ["--backing", "tmem", "--image-dir", tmp,
                 "--quota-mib", str(a.quota_mib)]
    server = Server(a.server, sock, 1024, extra=extra)
    ok = True
    try:
        r = subprocess.run(
            [sys.executable, script, "--case", "verified",
             "--out", os.path.join(tmp, "verified.json"), "--",
             "--backend", "vhost", "--socket", sock,
             "--backend-pid", str(server.proc.pid)],
            timeout=a.timeout)
        if r.returncode != 0:
            log(f"FAIL: swap-test.py exited {r.returncode}")
            ok = False
        st = server.stats()
    finally:
        rc = server.stop()
    log("server: " + json.dumps({k: v for k, v in st.items() if v}))
    for key in ("reads", "writes", "discards", "bytes_written"):
        if st[key] == 0:
            log(f"FAIL: no {key} reached the device")
            ok = False
    for key in ("session_resets", "backing_errors", "queues_broken",
                "requests_bad_layout", "requests_out_of_range",
                "requests_unsupported", "messages_malformed"):
        if st[key] != 0:
            log(f"FAIL: {key}={st[key]}")
            ok = False
    if a.backing == "tmem":
        for key in ("tmem_writes_stored", "tmem_reads_store"):
            if st[key] == 0:
                log(f"FAIL: {key}=0: the store served nothing")
                ok = False
        if a.quota_mib > 0 and st["tmem_spilled_quota"] == 0:
            log("FAIL: nothing spilled at the quota")
            ok = False
        for key in ("tmem_pages_lost", "tmem_store_errors",
                    "tmem_store_misses", "tmem_image_write_errors",
                    "tmem_image_read_errors", "tmem_image_punch_errors",
                    "tmem_image_io_errors"):
            if st[key] != 0:
                log(f"FAIL: {key}={st[key]}")
                ok = False
    return 0 if ok and rc == 0 else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=("realize", "guest"), required=True)
    p.add_argument("--server", required=True, help="swap_test_server binary")
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--backing", choices=("memory", "tmem"), default="memory",
                   help="the server's backing (guest case)")
    p.add_argument("--quota-mib", type=int, default=0,
                   help="tmem backing: the VM's store quota (0: none)")
    a = p.parse_args()
    if shutil.which("qemu-system-x86_64") is None:
        log("SKIP: qemu-system-x86_64 is not installed (Debian package "
            "qemu-system-x86)")
        return SKIP
    tmp = tempfile.mkdtemp(prefix="qemu-swap-")
    os.chmod(tmp, 0o700)
    try:
        if a.case == "realize":
            return case_realize(a, tmp)
        return case_guest(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
