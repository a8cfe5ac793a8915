"""``run_workers``' workers end as a user's script ends, and a failure there fails the test.

A script under torchrun ends through the interpreter's whole teardown (``Py_FinalizeEx``):
exit handlers, then module finalization and the collection of what is left, whose
destructors run last. A worker that aborts there must fail ``run_workers`` with a message
that names the signal, as a user would see the abort (multiprocessing's ``forkserver``
ended its workers with ``os._exit`` after the exit handlers, so this passed). The worker
also leaves no process behind: the zygote reaps each one.
"""
from __future__ import annotations

import os
import time

import pytest

import distributed_harness as harness
from distributed_harness import WorkerFailed, run_workers


class _AbortsWhenFinalized:
    """Aborts the process when deleted: at module finalization, past the exit handlers."""

    def __del__(self) -> None:
        os.abort()


_doomed = None


def _abort_at_teardown(rank: int, world: int) -> None:
    global _doomed
    _doomed = _AbortsWhenFinalized()  # kept by this module until the teardown clears it


def _raises_while_its_peer_hangs(rank: int, world: int) -> None:
    if rank == 1:
        raise ZeroDivisionError("rank one's own failure")
    time.sleep(600)  # killed when rank 1 fails


def _children(pid: int) -> list:
    """The processes whose parent is ``pid`` (zombies included), as (pid, state)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:  # ended while we looked
                continue
            if int(fields[1]) == pid:
                found.append((int(entry), fields[0]))
    return found


def test_a_worker_that_aborts_in_the_interpreter_teardown_fails_the_call() -> None:
    with pytest.raises(WorkerFailed) as info:
        run_workers(_abort_at_teardown, 1, timeout=60)
    text = str(info.value)
    assert "rank 0 was killed by signal SIGABRT (6) after its function returned" in text, text
    assert "in the interpreter's teardown" in text, text
    assert _children(harness._zygote.process.pid) == []  # reaped: no zombie


def test_a_worker_exception_fails_the_call_and_its_hung_peer_is_killed_and_reaped() -> None:
    started = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        run_workers(_raises_while_its_peer_hangs, 2, timeout=60)
    assert time.monotonic() - started < 30  # not the timeout: at rank 1's failure
    text = str(info.value)
    assert "rank 1 raised (it then ended with status 1)" in text, text
    assert "ZeroDivisionError: rank one's own failure" in text, text
    assert _children(harness._zygote.process.pid) == []  # rank 0 killed and reaped
