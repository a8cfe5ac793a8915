"""Run a function on N gloo processes on loopback, with a hard timeout.

Each worker initialises a gloo process group over ``127.0.0.1`` with a short collective
timeout and one intra-op thread (the rendezvous goes through a file, so no port has to be
picked in advance, where another process could take it first), runs
``fn(rank, world_size, *args)``, tears the group down and ends normally, through the
interpreter's whole teardown, as a user's script under torchrun does (and checks that the
default group did not outlive ``destroy_process_group()``, which can make that teardown
abort). No worker skips that teardown (``os._exit`` would also skip the exit handler that
sees a failed call's news out, ``seqpipe.distributed.inflight``): the survivors of a failure
end normally, as a user's script does, and a test of a crash kills its rank for real
(``SIGKILL``, named in ``killed=``). The parent waits at most ``timeout`` seconds; a hang
kills every worker and fails the test instead of stalling CI. A worker's exception fails the
test with the worker's traceback, and so does a worker that ends with a non-zero status
or a signal after its function returned (an abort in the interpreter's teardown), or a
``killed`` rank that ends any other way than by ``SIGKILL``.

The workers are forks of one server process per test session, ``tests/worker_zygote.py``,
that has imported torch, seqpipe and what the tests use once (``PRELOAD``): a worker
starts in a fraction of a second instead of importing them itself (2-3 s of CPU each; 4 of
them on 2 cores took 4-6 s of every launch). A forked worker runs at the zygote script's
top level and ends as that script ends (see its docstring); unlike multiprocessing's
``forkserver``, which ends a child with ``os._exit``, nothing of the teardown is skipped.
One thing differs from a fresh interpreter: the modules are imported before the process
group exists. A test of the import order (``tests/test_exit.py``) asks for
``fresh_interpreter=True``: spawned workers that import what they use, late.
"""
from __future__ import annotations

import atexit
import datetime
import itertools
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

__all__ = ["run_workers", "free_port", "WorkerFailed"]

# What the zygote imports once, when the first launch starts it. None of them starts a
# thread at import (a fork would not copy it); one that fails to import is skipped, and a
# worker then imports it itself.
PRELOAD = ["torch", "torch._dynamo",  # activation checkpointing imports it at its first call
           "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor",
           "transformers", "seqpipe", "seqpipe.distributed", "seqpipe.graph"]
_ZYGOTE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_zygote.py")


class WorkerFailed(AssertionError):
    """A worker raised, or ended with a non-zero status or a signal."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, store: str, pg_timeout: float, backend: str,
           fn: Callable[..., Any], args: tuple) -> None:
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


class _Zygote:
    """The parent's end of ``tests/worker_zygote.py``: started on first use, ended (its
    connection closed, the process reaped) when the test session's interpreter exits."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, _ZYGOTE_SCRIPT, str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send((list(sys.path), PRELOAD))
        self.launches = itertools.count()
        atexit.register(self.close)

    def close(self) -> None:
        self.conn.close()  # the zygote kills what still runs, reaps it and exits
        self.process.wait(timeout=60)

    def _next(self, launch: int, kind: str, timeout: Optional[float]) -> Optional[tuple]:
        """The next message of this launch (earlier launches' are stale), or None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.conn.poll(wait):
                return None
            message = self.conn.recv()
            if message[0] == kind and message[1] == launch:
                return message

    def run(self, jobs: List[tuple], timeout: float, what: str,
            killed: Sequence[int] = ()) -> Dict[int, int]:
        """Fork one worker per job; return {rank: exit code} once every one has ended, or
        at the first that failed (the others killed); a rank in ``killed`` that ends by
        ``SIGKILL`` has not failed. Raise TimeoutError after ``timeout`` seconds, every
        worker killed and reaped."""
        launch = next(self.launches)
        common = dict(env=dict(os.environ), cwd=os.getcwd(), sys_path=list(sys.path))
        deadline = time.monotonic() + timeout
        self.conn.send(("start", launch, common, jobs))
        started = self._next(launch, "started", None)
        assert started is not None
        rank_of = {pid: rank for rank, pid in enumerate(started[2])}
        codes: Dict[int, int] = {}
        try:
            while len(codes) < len(jobs) and not any(_failed(codes, killed)):
                message = self._next(launch, "exited", deadline - time.monotonic())
                if message is None:
                    running = sorted(set(rank_of.values()) - set(codes))
                    raise TimeoutError(f"{what} did not finish within {timeout} s (a hang: "
                                       f"ranks {running} still ran); killed them")
                codes[rank_of[message[2]]] = message[3]
        finally:
            if len(codes) < len(jobs):
                self.conn.send(("kill", launch))
                while len(codes) < len(jobs):  # SIGKILLed: reaped at once
                    message = self._next(launch, "exited", 60)
                    assert message is not None, "the zygote did not reap a killed worker"
                    codes.setdefault(rank_of[message[2]], message[3])
        return codes


_zygote: Optional[_Zygote] = None


def _failed(codes: Dict[int, int], killed: Sequence[int]) -> List[int]:
    """The ranks whose exit code is a failure: not 0, or for a rank in ``killed`` (a test
    of a crash), not ``SIGKILL``."""
    return [rank for rank, code in codes.items()
            if code != (-signal.SIGKILL if rank in killed else 0)]


def _exit_status(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name} ({-code})"
    return f"ended with status {code}"


def _run_forked(world_size: int, folder: str, entry_args: tuple, timeout: float,
                killed: Sequence[int]) -> None:
    global _zygote
    if _zygote is None:
        _zygote = _Zygote()
    files = [(os.path.join(folder, f"{rank}.error"), os.path.join(folder, f"{rank}.done"))
             for rank in range(world_size)]
    jobs = [(pickle.dumps((_entry, (rank, *entry_args))), *files[rank])
            for rank in range(world_size)]
    codes = _zygote.run(jobs, timeout, f"{world_size} workers", killed)
    failed = _failed(codes, killed)
    if not failed:
        return
    rank = failed[0]
    error_file, done_file = files[rank]
    status = _exit_status(codes[rank])
    if rank in killed and codes[rank] == 0:
        raise WorkerFailed(f"rank {rank} was to be killed by SIGKILL, but {status}")
    if os.path.exists(error_file):
        with open(error_file) as file:
            raise WorkerFailed(f"rank {rank} raised (it then {status}):\n{file.read()}")
    if os.path.exists(done_file):
        raise WorkerFailed(f"rank {rank} {status} after its function returned and its "
                           f"process group was destroyed: in the interpreter's teardown "
                           f"(a user's script would end the same way)")
    raise WorkerFailed(f"rank {rank} {status} while running its function (its output "
                       f"above may say why)")


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                pg_timeout: float = 30.0, backend: str = "gloo",
                fresh_interpreter: bool = False, killed: Sequence[int] = ()) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; raise on failure.

    ``fn`` and ``args`` must pickle (a module-level function). ``backend="nccl"`` gives
    rank ``r`` the GPU ``cuda:r``. ``fresh_interpreter=True`` spawns each worker as a new
    interpreter that imports only what ``fn``'s module imports (seconds slower per launch);
    by default the workers fork from the preloaded zygote (see the module's docstring).
    Either way a worker ends through the interpreter's whole teardown, and a failure there
    fails the call (``WorkerFailed``, naming the signal or status). ``killed``: ranks that
    ``fn`` kills with ``SIGKILL`` (a test of a crash); each must end that way (forked
    workers only).
    """
    assert not (killed and fresh_interpreter), "killed= needs the forked workers"
    assert 1 <= world_size <= 4, "CI runs at most 4 processes"
    folder = tempfile.mkdtemp(prefix="seqpipe-test-pg-")
    store = os.path.join(folder, "store")
    try:
        if not fresh_interpreter:
            _run_forked(world_size, folder, (world_size, store, pg_timeout, backend, fn, args),
                        timeout, killed)
            return
        context = mp.start_processes(_entry, args=(world_size, store, pg_timeout, backend,
                                                   fn, args),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} workers did not finish within "
                                       f"{timeout} s (a hang); killed them")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
    finally:
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
