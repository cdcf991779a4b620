#!/usr/bin/env python3
"""Boots the stock Debian 12 guest (vm-images/stock/build.sh) under QEMU with
one swap device and runs swapcheck in it; prints one JSON object per run.

Swap devices (--backend):
  disk   virtio-blk on a sparse file on host disk (--disk-dir), cache=none,
         aio=native, discard=unmap
  cloud  the same throttled to a cloud volume: 3000 IOPS, 125 MB/s
  zram   guest zram (lz4, --zram-mib, --zram-limit-mib) with `disk` behind it
  qsd    qemu-storage-daemon exporting vhost-user-blk over a file on tmpfs
         (/dev/shm): the reference vhost-user-blk backend
  vhost  any vhost-user-blk socket (--socket), e.g. a tmemd swap device

Guest RAM is always a shared memfd (vhost-user needs it; the other backends
get the same so the rows compare). The guest switches swap on with discard
(`swapon -d`) and runs swapcheck with --wait after every phase: the runner
samples the host between phases (the swap file's allocated bytes, QEMU's and
the backend's CPU time) and, with --corrupt N, flips a byte in N swapped-out
pages of the swap file after the write phase (the negative control: the
guest must report those pages and no other).

Usage: swaptest.py --backend qsd [--mem 256] [--ws-mib N | --ws-ratio R]
         [--content 2x] [--passes 1] [--touch read|write] [--free-half]
         [--corrupt N] [--accel auto|tcg|kvm] [--timeout S] [--out FILE]
Exit status: 0 when the run completed and the guest verified every page
(with --corrupt: when it reported bad pages and all of them were corrupted
by the host), 1 otherwise.
"""
import argparse
import json
import os
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from vmtest import wait_for  # noqa: E402

PAGE = 4096
MAGIC = 0x314B484350415753  # swapcheck.c's "SWAPCHK1"
BACKENDS = ("disk", "cloud", "zram", "qsd", "vhost")
# A cloud volume's limits (a general-purpose SSD volume), by QEMU throttling.
CLOUD_THROTTLE = "throttling.iops-total=3000,throttling.bps-total=125000000"


def log(msg):
    print(f"[swaptest {time.strftime('%H:%M:%S', time.gmtime())}] {msg}",
          file=sys.stderr, flush=True)


def build_images():
    """Runs build.sh (cached) and returns {KERNEL, INITRD, KVER}."""
    out = subprocess.run([os.path.join(HERE, "build.sh")], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    images = {}
    for line in out.splitlines():
        k, _, v = line.partition("=")
        images[k] = v
    return images


def probe_kvm(images):
    """KVM only when the guest boots under it within 20 s (nested KVM hangs
    on some hosts); the answer is cached beside the kernel."""
    cache = os.path.join(os.path.dirname(images["KERNEL"]), "kvm-probe")
    if os.path.exists(cache):
        return open(cache).read().strip()
    result = "tcg"
    if os.access("/dev/kvm", os.R_OK | os.W_OK):
        try:
            r = subprocess.run(
                ["qemu-system-x86_64", "-machine", "pc,accel=kvm", "-m", "256",
                 "-nographic", "-no-reboot", "-net", "none",
                 "-kernel", images["KERNEL"], "-initrd", images["INITRD"],
                 "-append", "console=ttyS0 panic=-1 swaptest=probe"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, timeout=20)
            if b"SWAPTEST PROBE_OK" in r.stdout:
                result = "kvm"
        except subprocess.TimeoutExpired:
            pass
    log(f"KVM probe: using {result}")
    with open(cache, "w") as f:
        f.write(result + "\n")
    return result


def cpu_seconds(pid):
    """utime + stime of a live process, in seconds (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return None


def allocated_bytes(path):
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return None


def corrupt_swapped_pages(path, seed, count):
    """Flips a byte in the body of up to `count` pages of the swap file that
    hold a swapcheck page of this run (magic and seed match), lowest offset
    first (the first written: the longest swapped out). Returns the page
    indices (as swapcheck numbers them) that were corrupted."""
    hit = []
    with open(path, "r+b") as f:
        off = PAGE  # page 0 is the swap header
        while len(hit) < count:
            f.seek(off)
            chunk = f.read(256 * PAGE)
            if not chunk:
                break
            for i in range(0, len(chunk) - PAGE + 1, PAGE):
                magic, index, seedgen = struct.unpack_from("<QQQ", chunk, i)
                if magic != MAGIC or (seedgen >> 8) != seed:
                    continue
                pos = off + i + 2048
                f.seek(pos)
                f.write(bytes([chunk[i + 2048] ^ 0x5A]))
                hit.append(index)
                if len(hit) >= count:
                    break
            off += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return hit


class Run:
    """One guest boot with one swap backend."""

    def __init__(self, args, images, accel, on_wait=None):
        self.args = args
        # Called with the phase name while the guest waits after it (the
        # host may act on the backend then, e.g. restart it).
        self.on_wait = on_wait
        self.images = images
        self.accel = accel
        self.tmp = tempfile.mkdtemp(prefix="swaptest-")
        self.procs = []
        self.swap_file = None
        self.backend_pid = None
        self.result = {"backend": args.backend, "accel": accel,
                       "kernel": images.get("KVER"), "mem_mib": args.mem,
                       "ws_mib": args.ws_mib, "swap_mib": args.swap_mib,
                       "content": args.content, "passes": args.passes,
                       "touch": args.touch, "phases": [], "bad_pages": [],
                       "host": [], "completed": False}

    def cleanup(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.args.keep:
            log(f"kept {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if self.swap_file and not self.swap_file.startswith(self.tmp):
                try:
                    os.unlink(self.swap_file)
                except OSError:
                    pass

    def _sparse_file(self, directory):
        fd, path = tempfile.mkstemp(prefix="swaptest-", suffix=".img", dir=directory)
        os.ftruncate(fd, self.args.swap_mib << 20)
        os.close(fd)
        return path

    def _swap_args(self):
        a = self.args
        if a.backend in ("disk", "cloud", "zram"):
            self.swap_file = self._sparse_file(a.disk_dir)
            drive = (f"file={self.swap_file},format=raw,if=none,id=sw0,"
                     "cache=none,aio=native,discard=unmap")
            if a.backend == "cloud":
                drive += "," + CLOUD_THROTTLE
            return ["-drive", drive, "-device", "virtio-blk-pci,drive=sw0"]
        if a.backend == "qsd":
            self.swap_file = self._sparse_file(a.tmpfs_dir)
            sock = os.path.join(self.tmp, "qsd.sock")
            qsd = subprocess.Popen(
                ["qemu-storage-daemon",
                 "--blockdev", f"driver=file,filename={self.swap_file},"
                 "node-name=f,discard=unmap",
                 "--export", "type=vhost-user-blk,id=e,node-name=f,"
                 f"addr.type=unix,addr.path={sock},writable=on"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(self.tmp, "qsd.log"), "w"))
            self.procs.append(qsd)
            self.backend_pid = qsd.pid
            if not wait_for(lambda: os.path.exists(sock) or qsd.poll() is not None, 30) \
                    or qsd.poll() is not None:
                raise RuntimeError("qemu-storage-daemon did not start: " +
                                   open(os.path.join(self.tmp, "qsd.log")).read())
            return self._vhost_args(sock)
        if a.backend == "vhost":
            if not a.socket:
                raise RuntimeError("--backend vhost needs --socket")
            if a.swap_file:
                self.swap_file = a.swap_file
            self.backend_pid = a.backend_pid
            return self._vhost_args(a.socket)
        raise RuntimeError(f"unknown backend {a.backend}")

    def _vhost_args(self, sock):
        chardev = f"socket,id=sw0,path={sock}"
        if self.args.reconnect:
            chardev += ",reconnect=1"
        return ["-chardev", chardev,
                "-device", "vhost-user-blk-pci,chardev=sw0,num-queues=1"]

    def _cmdline(self):
        a = self.args
        sc = ["--mib", str(a.ws_mib), "--content", a.content, "--seed", str(a.seed),
              "--passes", str(a.passes), "--touch", a.touch,
              "--report-bad", str(a.report_bad)]
        if a.free_half:
            sc.append("--free-half")
        for ph in ["write"] + [f"pass{i}" for i in range(1, a.passes + 1)] + \
                (["free", "after-free"] if a.free_half else []):
            sc += ["--wait", ph]
        words = ["console=ttyS0", "panic=-1", "swaptest=run", "swaptest_disk=vda",
                 "swaptest_args=" + ",".join(sc)]
        if a.rotational:
            words.append("swaptest_nonrot=0")
        if a.backend == "zram":
            words += [f"swaptest_zram={a.zram_mib}",
                      f"swaptest_zram_limit={a.zram_limit_mib}"]
        return " ".join(words)

    def _host_sample(self, phase):
        s = {"phase": phase, "t": round(time.time() - self.t0, 3),
             "qemu_cpu_s": cpu_seconds(self.qemu.pid)}
        if self.backend_pid:
            s["backend_cpu_s"] = cpu_seconds(self.backend_pid)
        if self.swap_file:
            s["swap_file_allocated"] = allocated_bytes(self.swap_file)
        # A caller's own figures, taken while the guest waits (swap-bench.py:
        # tmemd's view of its swap device).
        probe = getattr(self.args, "host_probe", None)
        if probe:
            s.update(probe())
        return s

    def start(self):
        a = self.args
        swap = self._swap_args()
        cmd = ["qemu-system-x86_64",
               "-machine", f"pc,accel={self.accel},memory-backend=mem",
               "-object", f"memory-backend-memfd,id=mem,size={a.mem}M,share=on",
               "-m", f"{a.mem}M", "-smp", "1", "-nodefaults", "-no-reboot",
               "-display", "none", "-monitor", "none", "-net", "none",
               "-chardev", "stdio,id=ser0,signal=off", "-serial", "chardev:ser0",
               "-kernel", self.images["KERNEL"], "-initrd", self.images["INITRD"],
               "-append", self._cmdline()] + swap
        if self.accel == "tcg":
            cmd += ["-cpu", "max"]
        self.t0 = time.time()
        self.qemu = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self.procs.append(self.qemu)
        self.result["qemu_cmd"] = cmd

    def run(self):
        a = self.args
        self.start()
        serial = open(a.serial_log or os.path.join(self.tmp, "serial.log"), "wb")
        sel = selectors.DefaultSelector()
        sel.register(self.qemu.stdout, selectors.EVENT_READ)
        deadline = self.t0 + a.timeout
        buf = b""
        while True:
            left = deadline - time.time()
            if left <= 0:
                self.result["error"] = f"timeout after {a.timeout}s"
                break
            if not sel.select(min(left, 5)):
                continue
            chunk = os.read(self.qemu.stdout.fileno(), 65536)
            if not chunk:
                break
            serial.write(chunk)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self._line(line.decode(errors="replace").strip())
        serial.close()
        if self.qemu.poll() is None:
            self.qemu.kill()
        self.qemu.wait()
        self.result["elapsed_s"] = round(time.time() - self.t0, 1)
        self.result["serial_tail"] = open(
            a.serial_log or os.path.join(self.tmp, "serial.log"), "rb"
        ).read()[-3000:].decode(errors="replace") if not self.result["completed"] else ""
        return self.result

    def _line(self, line):
        r = self.result
        if line.startswith("SWAPTEST BOOT"):
            r["boot_s"] = round(time.time() - self.t0, 1)
            log(line)
        elif line.startswith("SWAPTEST SWAPS"):
            r.setdefault("swaps", []).append(line[len("SWAPTEST SWAPS "):])
        elif line.startswith("SWAPTEST DISK"):
            r["disk"] = line[len("SWAPTEST DISK "):]
        elif line.startswith("SWAPTEST ZRAM"):
            r["zram_mm_stat"] = line.split("mm_stat", 1)[1].split()
        elif line.startswith("SWAPTEST ERROR"):
            r["error"] = line
            log(line)
        elif line.startswith("SWAPTEST EXIT"):
            r["exit_rc"] = int(line.split("rc=")[1])
            r["completed"] = True
            if r["exit_rc"] == 137:
                r["oom_killed"] = True
        elif line.startswith("SWAPCHECK WAIT "):
            phase = line.split()[2]
            if phase == "write" and self.args.corrupt:
                r["corrupted_pages"] = corrupt_swapped_pages(
                    self.swap_file, self.args.seed, self.args.corrupt)
                log(f"corrupted {len(r['corrupted_pages'])} swapped-out pages")
            r["host"].append(self._host_sample(phase))
            if self.on_wait:
                self.on_wait(phase)
            self.qemu.stdin.write(b"\n")
            self.qemu.stdin.flush()
        elif line.startswith("SWAPCHECK BAD "):
            r["bad_pages"].append(json.loads(line[len("SWAPCHECK BAD "):]))
        elif line.startswith("SWAPCHECK START "):
            r["start"] = json.loads(line[len("SWAPCHECK START "):])
        elif line.startswith("SWAPCHECK DONE "):
            r["bad"] = json.loads(line[len("SWAPCHECK DONE "):])["bad"]
        elif line.startswith("SWAPCHECK {"):
            ph = json.loads(line[len("SWAPCHECK "):])
            r["phases"].append(ph)
            log(f"{ph['phase']}: {ph['pages']} pages, bad {ph['bad']}, {ph['ms']} ms, "
                f"{ph['MBps']} MB/s, pswpin {ph['pswpin']} pswpout {ph['pswpout']}")
        elif "Out of memory" in line or "Kernel panic" in line:
            r.setdefault("kernel_events", []).append(line)


def verdict(r, corrupt):
    """(ok, reason) for a finished run."""
    if not r.get("completed"):
        return False, r.get("error", "the guest did not finish")
    if r.get("oom_killed"):
        return False, "swapcheck was OOM-killed"
    if corrupt:
        hit = set(r.get("corrupted_pages", []))
        bad = [b["index"] for b in r["bad_pages"]]
        if not hit:
            return False, "no swapped-out page found in the swap file to corrupt"
        if r.get("bad", 0) == 0:
            return False, f"{len(hit)} pages corrupted on the device, the guest saw none"
        stray = [i for i in bad if i not in hit]
        if stray:
            return False, f"bad pages the host did not corrupt: {stray[:10]}"
        return True, f"guest caught {r['bad']} of {len(hit)} corrupted pages"
    if r.get("exit_rc") != 0 or r.get("bad", 1) != 0:
        return False, f"swapcheck exit {r.get('exit_rc')}, bad pages {r.get('bad')}"
    return True, "every page verified"


def summarize(r):
    """Totals over the touch passes: the benchmark's figures."""
    passes = [p for p in r["phases"] if p["phase"].startswith("pass")]
    if not passes:
        return
    pages = sum(p["pages"] for p in passes)
    ms = sum(p["ms"] for p in passes)
    swapped = sum(p["pswpin"] + p["pswpout"] for p in passes)
    busy = sum(p["cpu_busy_ms"] for p in passes)
    r["summary"] = {
        "touched_pages": pages, "ms": ms,
        "MBps": round(pages * PAGE / 1e6 / (ms / 1e3), 2) if ms else None,
        "pswpin": sum(p["pswpin"] for p in passes),
        "pswpout": sum(p["pswpout"] for p in passes),
        "guest_cpu_us_per_swapped_page": round(busy * 1e3 / swapped, 1) if swapped else None,
        "touch_ns_p50_last_pass": passes[-1]["touch_ns_p50"],
        "touch_ns_p99_last_pass": passes[-1]["touch_ns_p99"],
    }
    h = {s["phase"]: s for s in r["host"]}
    first, last = passes[0]["phase"], passes[-1]["phase"]
    prev = "write" if first == "pass1" else f"pass{int(first[4:]) - 1}"
    if prev in h and last in h:
        for key in ("qemu_cpu_s", "backend_cpu_s"):
            if h[prev].get(key) is not None and h[last].get(key) is not None:
                r["summary"][key.replace("_s", "_s_passes")] = round(
                    h[last][key] - h[prev][key], 2)
    # Host memory per swapped byte: what the backend's file holds against
    # what the guest has in swap, at the end of the touch passes (a tmpfs
    # file holds every byte: 1.0).
    used = passes[-1].get("swap_used_kb")
    held = h.get(last, {}).get("swap_file_allocated")
    if used and held is not None:
        r["summary"]["host_bytes_per_swapped_byte"] = round(held / (used * 1024), 3)
    if "free" in h and last in h:
        r["summary"]["swap_file_allocated_before_free"] = h[last].get("swap_file_allocated")
        after = [h[k].get("swap_file_allocated") for k in ("free", "after-free") if k in h]
        after = [x for x in after if x is not None]
        r["summary"]["swap_file_allocated_after_free"] = min(after) if after else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--socket", help="vhost-user-blk socket (--backend vhost)")
    p.add_argument("--swap-file", help="--backend vhost: the backend's image, for "
                   "--corrupt and the allocation samples")
    p.add_argument("--backend-pid", type=int, help="--backend vhost: its process, for CPU")
    p.add_argument("--reconnect", action="store_true",
                   help="chardev reconnect=1 (a backend that restarts)")
    p.add_argument("--rotational", action="store_true",
                   help="leave the guest's disk rotational (then Linux never "
                   "discards freed swap slots)")
    p.add_argument("--mem", type=int, default=256, help="guest RAM, MiB")
    p.add_argument("--ws-mib", type=int, help="working set, MiB")
    p.add_argument("--ws-ratio", type=float, default=1.5,
                   help="working set as a multiple of guest RAM (without --ws-mib)")
    p.add_argument("--swap-mib", type=int, help="swap device size (default ws + 256)")
    p.add_argument("--content", choices=("random", "2x", "zero"), default="2x")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--passes", type=int, default=1)
    p.add_argument("--touch", choices=("read", "write"), default="read")
    p.add_argument("--free-half", action="store_true")
    p.add_argument("--corrupt", type=int, default=0,
                   help="negative control: corrupt N swapped-out pages after the write")
    p.add_argument("--report-bad", type=int, default=64)
    p.add_argument("--zram-mib", type=int, default=128)
    p.add_argument("--zram-limit-mib", type=int, default=0)
    p.add_argument("--disk-dir", default=os.environ.get("TMEM_SWAP_DISK_DIR", "/var/tmp"),
                   help="host-disk directory for the disk/cloud/zram swap files")
    p.add_argument("--tmpfs-dir", default="/dev/shm", help="tmpfs for the qsd swap file")
    p.add_argument("--accel", choices=("auto", "tcg", "kvm"),
                   default=os.environ.get("TMEM_VM_ACCEL", "auto"))
    p.add_argument("--timeout", type=int, default=900, help="seconds for the whole boot")
    p.add_argument("--serial-log")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--keep", action="store_true", help="keep the temp directory")
    a = p.parse_args(argv)
    if a.ws_mib is None:
        a.ws_mib = int(a.mem * a.ws_ratio)
    if a.swap_mib is None:
        a.swap_mib = a.ws_mib + 256
    return a


def run_one(args, images=None, accel=None, on_wait=None):
    """Boots one guest; returns the result dict with "ok" and "verdict".
    on_wait(phase), if given, runs while the guest waits after a phase."""
    images = images or build_images()
    accel = accel or (probe_kvm(images) if args.accel == "auto" else args.accel)
    run = Run(args, images, accel, on_wait)
    try:
        r = run.run()
    except Exception as e:  # a backend that did not start: report, not crash
        r = run.result
        r["error"] = f"{type(e).__name__}: {e}"
    finally:
        run.cleanup()
    summarize(r)
    r["ok"], r["verdict"] = verdict(r, args.corrupt)
    return r


def main():
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    r = run_one(args)
    text = json.dumps(r, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    log(f"{args.backend}: {'PASS' if r['ok'] else 'FAIL'}: {r['verdict']}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
