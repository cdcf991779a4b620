#!/usr/bin/env python3
"""Live migration of a VM with a tmemd ivshmem-doorbell device, end to end.

Two "hosts" on this machine: two tmemd processes (own socket dirs and
control sockets) and two QEMU 7.2 processes (TCG), the destination started
with -incoming. Real parts only: the tmemd binary, QEMU, QMP over a UNIX
socket; the guest is QEMU's firmware (no guest OS: this test is about the
host side; the real-guest test boots the 5.10 kernel).

Checks:
  1. With tmemd as ivshmem peer 0 (the pre-v2 layout; the device cannot
     be master=on then), QEMU refuses to migrate ("peer mode"): the blocker
     this issue removes.
  2. With tmemd as peer 1 (the VM is peer 0, so the device can be
     master=on, which QEMU 7.2 needs to migrate it), migrate completes; the region arrives at the destination
     holding the source's header, and the destination tmemd recognises it
     as foreign and re-initializes it with its own generation (read back
     through the guest-physical BAR2 with HMP xp); the source tmemd drops
     the VM when the source QEMU quits.
  3. There and back three times.
  4. Hostile: a corrupt region (garbage written over BAR2 by the guest side
     through QMP) never crashes the destination tmemd.
Prints one BENCH line per migration (total time and downtime from
query-migrate), with and without the tmem device, for the benchmark table.

Usage: qemu_migration_test.py TMEMD_BIN [--bench-rounds N]
Exits 0 on success, 77 (skip) when qemu-system-x86_64 is missing.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "vm-images"))
from vmtest import Qmp  # noqa: E402

QEMU = shutil.which("qemu-system-x86_64")
HEADER_HOST_GENERATION = 48
HEADER_HOST_PEER_ID = 56
TMEM_ABI_MAGIC = 0x4D454D54


class Host:
    """One tmemd with its own socket dir and control socket."""

    def __init__(self, tmemd_bin, root, name, host_peer_id, vm):
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir)
        self.vm = vm
        self.log_path = os.path.join(self.dir, "tmemd.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [tmemd_bin, "--socket-dir", self.dir, "--control-socket",
             os.path.join(self.dir, "control.sock"), "--memory-cap", "64MiB",
             "--host-peer-id", str(host_peer_id), "--stats-interval", "1",
             "--vm", vm],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(lambda: os.path.exists(self.sock()), 20,
                 "tmemd socket " + self.sock())

    def sock(self):
        return os.path.join(self.dir, self.vm + ".sock")

    def text(self):
        with open(self.log_path) as f:
            return f.read()

    def last(self, event, key):
        value = None
        for line in self.text().splitlines():
            if "event=%s " % event not in line:
                continue
            if " vm=" in line and " vm=%s " % self.vm not in line:
                continue
            for field in line.split(" "):
                if field.startswith(key + "="):
                    value = field.split("=", 1)[1]
        return value

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=20)
        return self.proc.returncode


class Vm:
    def __init__(self, root, name, host, incoming=None, with_tmem=True,
                 master=True):
        self.qmp_path = os.path.join(root, name + ".qmp")
        self.log_path = os.path.join(root, name + ".log")
        argv = [QEMU, "-machine", "pc,accel=tcg", "-m", "128", "-nodefaults",
                "-display", "none", "-qmp",
                "unix:%s,server=on,wait=off" % self.qmp_path]
        if with_tmem:
            argv += ["-chardev", "socket,path=%s,id=tm0" % host.sock(),
                     "-device", "ivshmem-doorbell,chardev=tm0,vectors=1" +
                     (",master=on" if master else "")]
        if incoming:
            argv += ["-incoming", "unix:" + incoming]
        self.proc = subprocess.Popen(argv, stdout=open(self.log_path, "w"),
                                     stderr=subprocess.STDOUT)
        self.qmp = Qmp(self.qmp_path)

    def bar2(self):
        for bus in self.qmp.execute("query-pci")["return"]:
            for dev in bus["devices"]:
                if dev["id"]["vendor"] == 0x1AF4 and dev["id"]["device"] == 0x1110:
                    for bar in dev["regions"]:
                        if bar["bar"] == 2 and bar["address"] not in (0, -1, 0xFFFFFFFFFFFFFFFF):
                            return bar["address"]
        return None

    def read64(self, address):
        # "xp /1gx ADDR" prints "ADDR: 0xVALUE".
        out = self.qmp.hmp("xp /1gx 0x%x" % address)
        try:
            return int(out.split(":")[1].split()[0], 16)
        except (IndexError, ValueError):
            raise AssertionError("HMP xp at 0x%x answered %r" % (address, out))

    def quit(self):
        if self.proc.poll() is None:
            try:
                self.qmp.execute("quit")
            except (OSError, RuntimeError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_for(cond, seconds, what):
    end = time.time() + seconds
    while time.time() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)
    print("ok:", msg)


def migrate(src, dst_uri):
    """Returns query-migrate's final answer."""
    t0 = time.time()
    r = src.qmp.execute("migrate", uri="unix:" + dst_uri)
    if "error" in r:
        return {"error": r["error"]["desc"]}
    while True:
        q = src.qmp.execute("query-migrate")["return"]
        if q.get("status") in ("completed", "failed", "cancelled"):
            q["wall"] = time.time() - t0
            return q
        time.sleep(0.02)


def wait_running(vm):
    wait_for(lambda: vm.qmp.execute("query-status")["return"]["status"] == "running",
             30, "destination VM running")


def bar2_ready(vm):
    wait_for(lambda: vm.bar2() is not None, 30, "firmware to map BAR2")
    return vm.bar2()


def main():
    if QEMU is None:
        print("SKIP: qemu-system-x86_64 not installed")
        return 77
    tmemd_bin = sys.argv[1]
    bench_rounds = 3
    if "--bench-rounds" in sys.argv:
        bench_rounds = int(sys.argv[sys.argv.index("--bench-rounds") + 1])
    root = tempfile.mkdtemp(prefix="tmemd-mig-")
    hosts, vms = [], []
    try:
        # 1. Peer mode (tmemd peer 0) blocks migration.
        h = Host(tmemd_bin, root, "legacy", 0, "vm1"); hosts.append(h)
        v = Vm(root, "legacy-src", h, master=False); vms.append(v)
        r = v.qmp.execute("migrate", uri="unix:" + os.path.join(root, "nowhere"))
        check("error" in r and "peer mode" in r["error"]["desc"],
              "tmemd as peer 0: migration blocked (%s)" % r.get("error", {}).get("desc"))
        v.quit(); h.stop()

        # 2./3. tmemd as peer 1: migratable; there and back three times.
        a = Host(tmemd_bin, root, "hostA", 1, "vm1"); hosts.append(a)
        b = Host(tmemd_bin, root, "hostB", 1, "vm1"); hosts.append(b)
        src = Vm(root, "vm-on-A-0", a); vms.append(src)
        base = bar2_ready(src)
        check(src.read64(base) & 0xFFFFFFFF == TMEM_ABI_MAGIC, "source BAR2 holds tmemd's header")
        check(src.read64(base + HEADER_HOST_PEER_ID) & 0xFFFFFFFF == 1, "header says tmemd is peer 1")
        here, there = a, b
        for hop in range(6):
            gen_src = src.read64(base + HEADER_HOST_GENERATION)
            mig = os.path.join(root, "mig-%d.sock" % hop)
            dst = Vm(root, "vm-on-%s-%d" % ("B" if here is a else "A", hop + 1),
                     there, incoming=mig); vms.append(dst)
            foreign_before = int(there.last("vm_stats", "foreign_regions") or 0)
            q = migrate(src, mig)
            check(q.get("status") == "completed",
                  "hop %d: migration completed (%s)" % (hop, q.get("error", q.get("status"))))
            wait_running(dst)
            # The destination tmemd saw another host's header and reset it.
            wait_for(lambda: int(there.last("vm_stats", "foreign_regions") or 0) > foreign_before,
                     15, "destination tmemd to count a foreign region")
            dbase = dst.bar2()
            gen_dst = dst.read64(dbase + HEADER_HOST_GENERATION)
            check(gen_dst != gen_src and dst.read64(dbase) & 0xFFFFFFFF == TMEM_ABI_MAGIC,
                  "hop %d: destination re-initialized the region (generation %x -> %x)"
                  % (hop, gen_src, gen_dst))
            check(there.last("vm_stats", "connected") == "true",
                  "hop %d: destination tmemd serves the VM" % hop)
            print("BENCH migration with_tmem=1 total_ms=%s downtime_ms=%s setup_ms=%s"
                  % (q.get("total-time"), q.get("downtime"), q.get("setup-time")))
            # The source QEMU quits (libvirt does this after success): the
            # source tmemd drops the VM's channel state and pages.
            src.quit()
            wait_for(lambda: here.last("vm_stats", "connected") == "false", 15,
                     "source tmemd to see its VM go")
            check(here.last("vm_stats", "pages") == "0", "hop %d: source holds no pages" % hop)
            check(here.proc.poll() is None and there.proc.poll() is None, "both tmemds alive")
            src, base = dst, dbase
            here, there = there, here

        # 4. Hostile region content arriving.
        # A hostile guest can write anything into the region (BAR2 is its
        # memory): fill it with random bytes through QEMU's own mapping.
        # The source tmemd rewrites its header within a tick, but the rings
        # and slots stay garbage, and that is what migrates.
        with open("/proc/%d/maps" % src.proc.pid) as maps:
            regions = [l for l in maps if "memfd:tmem-vm1" in l]
        check(len(regions) >= 1, "QEMU maps the tmem memfd")
        start = int(regions[0].split("-")[0], 16)
        with open("/proc/%d/mem" % src.proc.pid, "r+b") as mem:
            mem.seek(start)
            mem.write(os.urandom(65536))
        mig = os.path.join(root, "mig-hostile.sock")
        dst = Vm(root, "vm-hostile", there, incoming=mig); vms.append(dst)
        foreign_before = int(there.last("vm_stats", "foreign_regions") or 0)
        q = migrate(src, mig)
        check(q.get("status") == "completed", "hostile region: migration completed")
        wait_running(dst)
        wait_for(lambda: int(there.last("vm_stats", "foreign_regions") or 0) > foreign_before,
                 15, "destination tmemd to reset the garbage region")
        dbase = dst.bar2()
        check(dst.read64(dbase) & 0xFFFFFFFF == TMEM_ABI_MAGIC,
              "garbage region re-initialized by the destination")
        time.sleep(1.5)
        check(there.proc.poll() is None, "destination tmemd survived a garbage region")
        src.quit()

        # Benchmark: the same firmware-only VM migrated without a tmem device.
        for i in range(bench_rounds):
            s = Vm(root, "plain-src-%d" % i, None, with_tmem=False); vms.append(s)
            mig = os.path.join(root, "plain-%d.sock" % i)
            d = Vm(root, "plain-dst-%d" % i, None, incoming=mig, with_tmem=False); vms.append(d)
            time.sleep(0.5)
            q = migrate(s, mig)
            check(q.get("status") == "completed", "plain VM migrated")
            print("BENCH migration with_tmem=0 total_ms=%s downtime_ms=%s setup_ms=%s"
                  % (q.get("total-time"), q.get("downtime"), q.get("setup-time")))
            s.quit(); d.quit()
        print("PASS")
        return 0
    except AssertionError as e:
        print("FAIL:", e)
        for h in hosts:
            print("---- %s\n%s" % (h.log_path, h.text()[-4000:]))
        return 1
    finally:
        for v in vms:
            v.quit()
        for h in hosts:
            h.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
