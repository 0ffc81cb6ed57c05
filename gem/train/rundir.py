"""A run directory: its default name (unique per launch), the checks that it can be written, and the lock that keeps a
second job out of it while the first one lives.

The lock is an advisory POSIX record lock (`fcntl.lockf`, which NFSv4 and Lustre honour across hosts) on
`<run dir>/.gem-lock`, held by rank 0 for the whole job; the file says who holds it (host, pid, start time, run id).
The kernel (or the file server) drops the lock when its holder dies, so a lock file that can be locked again is
stale: the next job takes it over and says whose it was.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import time
from pathlib import Path

from gem.config import UserError

LOCK_FILE = ".gem-lock"


class RunDirError(UserError):
    """A run dir or checkpoint dir that cannot be used (not creatable, not writable, held by another job)."""


def new_run_id(now: float | None = None) -> str:
    """`<date>/<time>.<milliseconds>-<4 hex>`: sorts by start time, and two launches in the same millisecond still
    differ."""
    now = time.time() if now is None else now
    ms = int((now % 1) * 1000)
    return time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(now)) + f".{ms:03d}-{secrets.token_hex(2)}"


def check_writable(path: str | os.PathLike, key: str) -> None:
    """Raise RunDirError (naming `key` and the path) unless `path` is a directory that exists or can be created,
    and files can be created in it. Creates nothing that was not there: a probe directory made here is removed."""
    p = Path(os.path.abspath(path))
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise RunDirError(key, f"{existing} is not a directory", str(path))
    if existing == p:
        probe = p / f".gem-probe-{os.getpid()}-{secrets.token_hex(2)}"
        try:
            probe.touch()
            probe.unlink()
        except OSError as e:
            raise RunDirError(key, f"cannot write in {p}: {e.strerror or e}", str(path)) from None
        return
    top = existing / p.relative_to(existing).parts[0]  # the first directory that would be made
    try:
        p.mkdir(parents=True)
        (p / ".gem-probe").touch()
    except OSError as e:
        raise RunDirError(key, f"cannot create {p}: {e.strerror or e}", str(path)) from None
    finally:
        _remove_tree(top)


def _remove_tree(top: Path) -> None:
    import shutil

    shutil.rmtree(top, ignore_errors=True)


class RunDirLock:
    """The lock of one run dir (see the module doc). `acquire()` returns the stale holder it took over from (or
    None) and raises RunDirError naming the live holder; `release()` drops it."""

    def __init__(self, run_dir: str | os.PathLike, run_id: str = "") -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.run_id = run_id
        self._fd: int | None = None

    def holder(self, fd: int | None = None) -> dict | None:
        """The recorded holder; read through `fd` while this process holds the lock (closing any other descriptor
        of the file would drop a POSIX lock)."""
        try:
            text = os.pread(fd, 1 << 16, 0).decode() if fd is not None else self.path.read_text()
            data = json.loads(text or "null")
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    @staticmethod
    def describe(h: dict | None) -> str:
        if not h:
            return "another job (no holder recorded)"
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("start", 0)))
        return f"the job on host {h.get('host', '?')} pid {h.get('pid', '?')} started {started}"

    def acquire(self) -> dict | None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise RunDirError(str(self.path.parent), f"in use by {self.describe(self.holder())}; give this job "
                                  "its own hydra.run.dir (or wait for that job to end)") from None
            if e.errno == errno.ENOLCK:  # a filesystem without locks: run unguarded rather than not at all
                return None
            raise
        previous = self.holder(fd)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start": time.time(), "run_id": self.run_id}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return previous

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # no holder left behind
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None
