"""Run a function on N gloo processes on loopback, with a hard timeout.

Each worker initialises a gloo process group over ``127.0.0.1`` with a short collective
timeout and one intra-op thread (the rendezvous goes through a file, so no port has to be
picked in advance, where another process could take it first), runs
``fn(rank, world_size, *args)``, tears the group down and ends normally, through the
interpreter's teardown (its first part, in a forked worker: below), as a user's script does
(and checks that the default group did not outlive ``destroy_process_group()``, which can
make that teardown abort). A worker that
must end without the collective teardown (its peer was killed) says so itself, with
``os._exit``. The parent waits at most
``timeout`` seconds; a hang kills every worker and fails the test instead of stalling CI.
A worker's exception fails the test with the worker's traceback.

The workers are forks of one server process per test session (multiprocessing's
``forkserver``) that has imported torch, seqpipe and what the tests use once (below):
a worker starts in a fraction of a second instead of importing them itself (2-3 s of CPU
each; 4 of them on 2 cores took 4-6 s of every launch). Two things differ from a fresh
interpreter. The modules are imported before the process group exists. And
multiprocessing ends a forked child with ``os._exit``, skipping the interpreter's
teardown, so a worker whose function returned does the teardown's first part itself: it
waits for its threads that are not daemons and runs the exit handlers (among them
seqpipe's, which delivers the messages a failed call left in flight); the check that the
default group is gone after ``destroy_process_group()`` still runs. A test of the import
order or of the teardown's end (``tests/test_exit.py``) asks for
``fresh_interpreter=True``: spawned workers that import what they use, late, and end
through the interpreter's whole teardown.
"""
from __future__ import annotations

import atexit
import datetime
import multiprocessing
import os
import shutil
import socket
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

__all__ = ["run_workers", "free_port"]

# What the fork server imports once, when the first launch starts it (set before any
# launch: it starts only once). Module names importable from the server's own sys.path (on
# Python 3.11 it does not get the parent's), so none of tests/; one that fails to import is
# skipped, and a worker then imports it itself. None of them starts a thread at import (a
# fork would not copy it).
multiprocessing.set_forkserver_preload([
    "torch", "torch._dynamo",  # activation checkpointing imports torch._dynamo at its first call
    "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor",
    "transformers", "seqpipe", "seqpipe.distributed", "seqpipe.graph"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _end_as_a_script_does() -> None:
    """What the interpreter's teardown does before it finalizes modules, for a forked
    worker (which multiprocessing ends with ``os._exit``): wait for the threads that are
    not daemons, then run the exit handlers."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()


def _entry(rank: int, world_size: int, store: str, pg_timeout: float, backend: str,
           forked: bool, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    # Every rank has connected to every other before any goes on: gloo's init returns on a
    # rank once its own side of each connection is up, and a rank that then ends at once
    # (nothing else to do) closed connections a slower peer was still opening, failing its
    # init_process_group with "Connection closed by peer" (3 of 40 launches of 4 workers
    # that do nothing, on a loaded machine; 0 of 40 with this barrier).
    dist.barrier()
    default = weakref.ref(dist.group.WORLD)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # The worker passed and ends as a user's script does: through the interpreter's
    # teardown. The default group must be gone by now (its gloo worker threads joined):
    # one that outlives destroy_process_group() reaches the teardown, where a worker
    # thread still letting go of a collective's tensors aborts the process.
    if default() is not None:
        raise AssertionError("the default process group outlived destroy_process_group(): "
                             "something still refers to it (see 'Ending a script' in "
                             "docs/distributed.md)")
    if forked:
        _end_as_a_script_does()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                pg_timeout: float = 30.0, backend: str = "gloo",
                fresh_interpreter: bool = False) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; raise on failure.

    ``backend="nccl"`` gives rank ``r`` the GPU ``cuda:r``. ``fresh_interpreter=True``
    spawns each worker as a new interpreter that imports only what ``fn``'s module imports
    and ends through the interpreter's teardown (seconds slower per launch); by default the
    workers fork from the preloaded server (see the module's docstring).
    """
    assert 1 <= world_size <= 4, "CI runs at most 4 processes"
    folder = tempfile.mkdtemp(prefix="seqpipe-test-pg-")
    store = os.path.join(folder, "store")
    context = mp.start_processes(_entry, args=(world_size, store, pg_timeout, backend,
                                               not fresh_interpreter, fn, args),
                                 nprocs=world_size, join=False,
                                 start_method="spawn" if fresh_interpreter else "forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} workers did not finish within {timeout} s "
                                   f"(a hang); killed them")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(folder, ignore_errors=True)


class Failures:
    """Mismatches found on one rank of a multi-process test, raised on every rank at the end.

    Collecting them instead of asserting at once keeps a rank that finds one from leaving
    the others waiting in a collective; ``finish`` gathers everyone's and fails everywhere.
    """

    def __init__(self, rank: int, tol: Optional[Dict[str, float]] = None) -> None:
        self.rank = rank
        self.tol = tol if tol is not None else dict(atol=1e-9, rtol=1e-7)
        self.items: List[str] = []

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.items.append(f"rank {self.rank}: {what}")

    def close(self, actual: Optional[Tensor], expected: Optional[Tensor], what: str) -> None:
        if actual is None or expected is None:
            self.expect(actual is None and expected is None,
                        f"{what}: one is None ({actual is None}, {expected is None})")
            return
        try:
            torch.testing.assert_close(actual, expected, **self.tol)
        except AssertionError as exc:
            lines = str(exc).splitlines()
            self.items.append(f"rank {self.rank}: {what}: {lines[0]} {lines[-1]}")

    def grads(self, pipe: nn.Module, ref: nn.Module, what: str,
              keys: Optional[Sequence[str]] = None) -> None:
        """Every local parameter's gradient equals the reference's, by its original name;
        with ``keys`` (the stage's layer names), the stage holds exactly their parameters."""
        mine = dict(pipe.named_parameters())
        theirs = dict(ref.named_parameters())
        self.expect(bool(mine), f"{what}: no parameters on this stage")
        if keys is not None:
            expected = [k for k in theirs if k.split(".")[0] in keys]
            self.expect(sorted(mine) == sorted(expected),
                        f"{what}: named_parameters {sorted(mine)} != {sorted(expected)}")
        for name, param in mine.items():
            if name in theirs:
                self.close(param.grad, theirs[name].grad, f"{what}: grad of {name}")

    def finish(self) -> None:
        everyone: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.items)
        found = [item for items in everyone for item in items]
        if found:
            raise AssertionError(f"{len(found)} mismatch(es):\n" + "\n".join(found))
