"""The stop signals' bookkeeping in one process: the first signal requests the stop, an immediate repeat of it (one
event delivered twice) is ignored, any later one aborts at once; the exit statuses."""

from __future__ import annotations

import signal

import pytest

from gem.train import stop


def test_first_requests_repeat_ignored_second_aborts(monkeypatch, capsys):
    def leave(code):
        raise SystemExit(code)

    monkeypatch.setattr(stop.os, "_exit", leave)
    monkeypatch.setenv("RANK", "0")
    s = stop.StopSignals()
    assert stop.StopVote(s, world_size=1).poll() is None
    s.note(signal.SIGUSR1)
    s.note(signal.SIGUSR1)  # the same event, delivered by torchrun and by the scheduler
    assert s.requested == "SIGUSR1" and stop.StopVote(s, world_size=1).poll() == "SIGUSR1"
    with pytest.raises(SystemExit) as e, s.saving(7):
        s.note(signal.SIGTERM)
    assert e.value.code == 143
    assert capsys.readouterr().err == ("gem-train: aborted by SIGTERM while writing the checkpoint of step 7; the newest "
                                       "complete checkpoint before it is kept\n")
    monkeypatch.setattr(stop, "_REPEAT_S", 0.0)
    with pytest.raises(SystemExit) as e:
        s.note(signal.SIGUSR1)  # again, later: not the same event
    assert e.value.code == 138 and "before the next step boundary" in capsys.readouterr().err


def test_exit_statuses():
    assert stop.exit_status("SIGUSR1") == 0
    assert stop.exit_status("SIGTERM") == 143
    assert stop.exit_status("SIGINT") == 130


def test_install_and_uninstall_restore_the_handlers():
    before = {sig: signal.getsignal(sig) for sig in stop.SIGNALS}
    s = stop.StopSignals.install()
    assert all(signal.getsignal(sig) is stop._noted for sig in stop.SIGNALS)
    signal.raise_signal(signal.SIGUSR1)
    for _ in range(200):  # the watcher thread notes it
        if s.requested:
            break
        import time

        time.sleep(0.01)
    s.uninstall()
    assert s.requested == "SIGUSR1"
    assert {sig: signal.getsignal(sig) for sig in stop.SIGNALS} == before


def test_other_handled_signals_neither_stop_nor_abort(monkeypatch):
    """The wakeup fd carries every signal with a Python handler: SIGCHLD (a finished subprocess) or SIGUSR2, twice,
    must not request a stop, let alone abort the process."""
    import time

    monkeypatch.setattr(stop.os, "_exit", lambda code: (_ for _ in ()).throw(AssertionError(f"_exit({code})")))
    previous = {sig: signal.signal(sig, lambda *a: None) for sig in (signal.SIGCHLD, signal.SIGUSR2)}
    s = stop.StopSignals.install()
    try:
        for sig in (signal.SIGCHLD, signal.SIGUSR2, signal.SIGCHLD, signal.SIGUSR2):
            signal.raise_signal(sig)
            time.sleep(0.05)
        signal.raise_signal(signal.SIGTERM)
        for _ in range(200):
            if s.requested:
                break
            time.sleep(0.01)
    finally:
        s.uninstall()
        for sig, h in previous.items():
            signal.signal(sig, h)
    assert s.requested == "SIGTERM"
