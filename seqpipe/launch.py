"""Start a process group on this machine without ``torchrun``: for demos and quick tries.

Real jobs, and anything across nodes, should use ``torchrun``; see ``docs/distributed.md``.
"""
from __future__ import annotations

import datetime
import os
import signal
import socket
import time
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn_local"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: Any) -> None:
    use_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if use_gpus:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if use_gpus else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=5))
    try:
        fn(args)
    except KeyboardInterrupt:
        # Ctrl-C reached every process of the terminal's group: the peers are stopping
        # too, so the group is left as it is (tearing it down would wait for them), and a
        # second signal must not interrupt this process's exit. The parent says it once.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return
    dist.destroy_process_group()


def spawn_local(processes: int, fn: Callable[..., Any], args: Any) -> None:
    """Run ``fn(args)`` on ``processes`` local ranks of a fresh process group.

    NCCL with one GPU per rank when there are enough GPUs, else gloo on CPU with the
    machine's cores shared out between the ranks. On Ctrl-C it waits for the ranks to stop
    (3 seconds, then ends them: a rank blocked in a
    collective cannot see the signal) and raises ``KeyboardInterrupt`` with nothing printed.
    """
    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    context = mp.start_processes(_entry, args=(processes, _free_port(), fn, args),
                                 nprocs=processes, start_method="spawn", join=False)
    try:
        while not context.join():
            pass
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: still a clean exit
        _stop(context.processes)
        raise


def _stop(children: List[Any], grace: float = 3.0) -> None:
    """Wait up to ``grace`` seconds for interrupted ranks to exit, then terminate the rest,
    so none outlives the launcher (or is interrupted again while it exits)."""
    deadline = time.monotonic() + grace
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            child.terminate()
            child.join()
