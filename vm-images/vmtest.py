"""Helpers shared by the QEMU-driving test scripts (ops-test.py,
migrate-test.py, tests/migration/qemu_migration_test.py): a minimal QMP
client and a polling wait."""
import json
import socket
import time


class Qmp:
    """One QMP connection: capabilities negotiated, events skipped."""

    def __init__(self, path, deadline=60.0):
        end = time.time() + deadline
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(path)
                break
            except OSError:
                if time.time() > end:
                    raise
                time.sleep(0.05)
        self.buf = b""
        self._read()  # greeting
        self.execute("qmp_capabilities")

    def _read(self):
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError("QMP connection closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def execute(self, cmd, **args):
        msg = {"execute": cmd}
        if args:
            msg["arguments"] = args
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        while True:
            r = self._read()
            if "event" not in r:
                return r

    def hmp(self, line):
        r = self.execute("human-monitor-command", **{"command-line": line})
        return r.get("return", "")


def wait_for(cond, seconds):
    """Polls cond() until it holds or `seconds` pass; returns its last value."""
    end = time.time() + seconds
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()
