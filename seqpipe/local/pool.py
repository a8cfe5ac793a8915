"""Stage threads that outlive a call: the next call reuses them instead of starting its own.

A call of the local engine runs every CPU stage but the first on a worker thread, once for
the forward and once for the backward. A thread started per stage and phase costs its start
and, worse, starts cold: its OpenMP team is created at its first parallel kernel, and its
first kernels run slower than the same kernels on a thread that has run them before (a
stage's two-thread backward: 20 ms on a fresh thread, 11 ms on a warm one; see
docs/benchmark-history.md, "Shared intra-op threads"). So a worker that has run its job
waits, idle, for the next one.

While it runs a job a worker is named ``seqpipe-stage-N`` (its stage), idle it is
``seqpipe-idle``. An idle worker holds nothing of the call it ran (its job, the job's
closure and any exception are dropped before it waits), runs no PyTorch code, and has its
thread-local state back as the job found it (the job enters the caller's state in a
``with`` block). At most ``MAX_IDLE`` wait; more finish. At interpreter exit the idle
workers are stopped and joined (``atexit``, after the interpreter has joined its own
non-daemon threads), so none is left when the interpreter tears down; a forked child
starts with none.
"""
from __future__ import annotations

import atexit
import os
import queue
import threading
from typing import Callable, List, Optional, Tuple

__all__ = ["IDLE", "MAX_IDLE", "start", "idle_workers"]

IDLE = "seqpipe-idle"
MAX_IDLE = 8

Job = Tuple[str, Callable[[], None], threading.Event]


class _Worker:
    """One pooled thread and its job queue (``None``: stop)."""

    def __init__(self) -> None:
        self.jobs: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=IDLE, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            name, run, done = job
            job = None  # nothing of the call stays referenced while idle
            self.thread.name = name
            returned = False
            try:
                run()
                returned = True
            finally:  # a job that raised ends its worker: it is not put back
                run = None  # type: ignore[assignment]
                self.thread.name = IDLE
                kept = returned and _release(self)
                done.set()
                done = None  # type: ignore[assignment]
            if not kept:
                return


_lock = threading.Lock()
_idle: List[_Worker] = []
_closed = False


def _release(worker: _Worker) -> bool:
    """Put ``worker`` back among the idle ones; False if it should finish instead."""
    with _lock:
        if _closed or len(_idle) >= MAX_IDLE:
            return False
        _idle.append(worker)
        return True


def start(name: str, run: Callable[[], None], done: threading.Event) -> None:
    """Run ``run`` on an idle worker (a new one if none is idle), as thread ``name``;
    ``done`` is set once it has returned and the worker is idle again. ``run`` must not
    raise (the engine's jobs keep their exceptions for the caller)."""
    with _lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        worker = _Worker()
    worker.jobs.put((name, run, done))


def idle_workers() -> int:
    """How many workers wait for a job."""
    with _lock:
        return len(_idle)


def _shutdown() -> None:
    global _closed
    with _lock:
        _closed = True
        workers = list(_idle)
        _idle.clear()
    for worker in workers:
        worker.jobs.put(None)
    for worker in workers:
        worker.thread.join()


def _forget_after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    _idle.clear()  # their threads do not exist in the child


atexit.register(_shutdown)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
