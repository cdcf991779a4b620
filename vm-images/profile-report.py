#!/usr/bin/env python3
"""Guest kernel tick profiles of a bench row, with tmem beside without.

Usage: profile-report.py SYSTEM_MAP WITH_PROFILE WITHOUT_PROFILE [TOP]

The profiles are /proc/profile copies (vm-images/bench.sh --profile): a
u32 sample step (bytes per bucket), then one u32 count per bucket from
_stext on. Ticks outside the kernel's text (the tmem_ivshmem module among
them) land in the last bucket, reported as "[outside kernel text]". User
mode ticks are not recorded, so the shares are of the kernel's time.

Prints the TOP symbols by the change in their share of the ticks, so what
tmem adds (or takes away) from the guest kernel's work per tick stands out,
and each profile's total: a tick is 1 ms of guest time (HZ=1000) whatever
the symbol, so totals compare the kernel time of the two windows.
"""
import bisect
import struct
import sys


def load_map(path):
    addrs, names = [], []
    stext = None
    with open(path, encoding="ascii", errors="replace") as f:
        for line in f:
            parts = line.split()
            if len(parts) != 3 or parts[1] not in "tTwW":
                continue
            addr = int(parts[0], 16)
            if parts[2] == "_stext":
                stext = addr
            addrs.append(addr)
            names.append(parts[2])
    if stext is None:
        sys.exit(f"{path}: no _stext: not a System.map")
    order = sorted(range(len(addrs)), key=addrs.__getitem__)
    return stext, [addrs[i] for i in order], [names[i] for i in order]


def load_profile(path, stext, addrs, names):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8 or len(data) % 4:
        sys.exit(f"{path}: {len(data)} bytes: not a /proc/profile copy")
    step = struct.unpack_from("<I", data, 0)[0]
    counts = struct.unpack_from(f"<{len(data) // 4 - 1}I", data, 4)
    by_symbol = {}
    last = len(counts) - 1
    for i, n in enumerate(counts):
        if not n:
            continue
        if i == last:
            name = "[outside kernel text]"
        else:
            j = bisect.bisect_right(addrs, stext + i * step) - 1
            name = names[j] if j >= 0 else "?"
        by_symbol[name] = by_symbol.get(name, 0) + n
    return by_symbol


def main():
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    top = int(sys.argv[4]) if len(sys.argv) == 5 else 15
    stext, addrs, names = load_map(sys.argv[1])
    with_p = load_profile(sys.argv[2], stext, addrs, names)
    without_p = load_profile(sys.argv[3], stext, addrs, names)
    tw, to = sum(with_p.values()), sum(without_p.values())
    print(f"kernel ticks: with tmem {tw}, without {to}")
    if not tw or not to:
        return
    rows = []
    for name in set(with_p) | set(without_p):
        a, b = with_p.get(name, 0), without_p.get(name, 0)
        rows.append((a - b * tw / to, name, a, b))
    rows.sort(key=lambda r: -abs(r[0]))
    print("| symbol | ticks with | ticks without | share with | share without |")
    print("| --- | --- | --- | --- | --- |")
    for _, name, a, b in rows[:top]:
        print(f"| {name} | {a} | {b} | {100 * a / tw:.1f}% | {100 * b / to:.1f}% |")


if __name__ == "__main__":
    main()
