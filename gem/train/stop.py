"""Stopping a job on a signal: SIGTERM (what SLURM and Kubernetes send before they kill a job), SIGINT (Ctrl-C) and
SIGUSR1 (SLURM's `--signal=USR1@SECONDS`, sent ahead of the time limit so the job can requeue itself).

`StopSignals` records the first such signal; the training loop asks `StopVote.poll()` after every step whether any
rank has one, and every rank stops after the same step, writes the checkpoint of that step and leaves with
`exit_status` (0 for SIGUSR1, so a wrapper requeues; 128 + the signal's number otherwise, as a shell reports it).
A further signal aborts at once, also while that checkpoint is written (the previous complete checkpoint stays the
newest: saves are atomic).

The signal is noted by the C-level handler through a wake-up pipe and read by a thread, so it is seen even while the
main thread sits in a long collective or a file write. The vote is an all-reduce of one integer on a CPU (gloo)
group, started after step N and read after step N+1: the host never waits on it, and every rank reads the result of
the same collective, so all stop after the same step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_NUMBERS = frozenset(int(s) for s in SIGNALS)
_REPEAT_S = 1.0  # the same signal again within this: one event delivered twice (a terminal and torchrun both send)


def exit_status(name: str) -> int:
    """The documented exit status of a run stopped by the signal `name` (e.g. 'SIGTERM')."""
    sig = signal.Signals[name]
    return 0 if sig == signal.SIGUSR1 else 128 + int(sig)


class StopSignals:
    """The process's handlers for SIGNALS while a run trains (`install` / `uninstall`); `requested`: the first
    signal's name, or None."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._first_at = 0.0
        self._saving_step: int | None = None
        self._previous: dict = {}
        self._wakeup_fd = None
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def install(cls) -> StopSignals:
        """Handlers for SIGNALS (main thread only; elsewhere the returned object never requests a stop)."""
        self = cls()
        if threading.current_thread() is not threading.main_thread():
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, _noted)
        self._wakeup_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="gem-stop-signals", daemon=True)
        self._thread.start()
        return self

    def uninstall(self) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._wakeup_fd if self._wakeup_fd is not None else -1)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        r, w = self._pipe
        self._pipe = None
        os.write(w, b"\0")  # ends the watcher
        if self._thread is not None:
            self._thread.join(timeout=5)
        os.close(w)
        os.close(r)

    def _watch(self) -> None:
        r = self._pipe[0]
        while True:
            data = os.read(r, 64)
            for num in data:
                if num == 0 or self._pipe is None:
                    return
                if num in _NUMBERS:  # the wakeup fd also carries other handled signals (SIGCHLD, ...)
                    self.note(signal.Signals(num))

    def note(self, sig: signal.Signals) -> None:
        """One delivered signal: the first requests the stop; another aborts at once, also while the stop's
        checkpoint is written (an immediate repeat of the first is one event delivered twice, and ignored)."""
        now = time.monotonic()
        if self.requested is None:
            self.requested, self._first_at = sig.name, now
            return
        if sig.name == self.requested and now - self._first_at < _REPEAT_S:
            return
        if os.environ.get("RANK", "0") == "0":
            where = (f"while writing the checkpoint of step {self._saving_step}" if self._saving_step is not None
                     else "before the next step boundary")
            print(f"gem-train: aborted by {sig.name} {where}; the newest complete checkpoint before it is kept",
                  file=sys.stderr, flush=True)
        os._exit(128 + int(sig))

    @contextmanager
    def saving(self, step: int):
        """While the checkpoint of `step` is written, a stop-requesting run aborts on a further signal."""
        self._saving_step = step
        try:
            yield
        finally:
            self._saving_step = None


def _noted(signum, frame) -> None:
    """The Python-level handler: nothing to do here (the wake-up pipe carried the signal to the watcher thread);
    having a handler replaces the default actions (terminate, KeyboardInterrupt)."""


class StopVote:
    """Whether any rank has been asked to stop, agreed by every rank one step later (see the module doc)."""

    def __init__(self, signals: StopSignals | None, world_size: int) -> None:
        self.signals = signals
        self.world_size = world_size
        self._group = None
        self._work = None
        self._buf = None
        if signals is not None and world_size > 1:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")  # a CPU group: the vote never touches the GPU stream

    def _local(self) -> int:
        name = self.signals.requested if self.signals is not None else None
        return int(signal.Signals[name]) if name else 0

    def poll(self) -> str | None:
        """Called once after every step on every rank: the name of the signal every rank stops for now, or None."""
        if self.signals is None:
            return None
        if self._group is None:
            return self.signals.requested
        import torch
        import torch.distributed as dist

        agreed = 0
        if self._work is not None:
            self._work.wait()
            agreed = int(self._buf.item())
        self._buf = torch.tensor([self._local()], dtype=torch.int64)
        self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return signal.Signals(agreed).name if agreed else None

    def close(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self._group)
            self._group = None
