"""Stage threads outlive a call (``seqpipe.local.pool``): reused, holding nothing, joined."""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import weakref
from typing import List

import torch
from torch import Tensor, nn

import seqpipe.local.pipeline as pipeline
from seqpipe import Pipe
from seqpipe.local import pool


class _Where(nn.Module):
    """Records the thread it runs on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: List[threading.Thread] = []

    def forward(self, x: Tensor) -> Tensor:
        self.threads.append(threading.current_thread())
        return x


def _two_stages(where: nn.Module) -> Pipe:
    return Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), where), chunks=2,
                checkpoint="never", balance=[1, 2], devices=["cpu", "cpu"])


def test_the_next_call_runs_a_stage_on_the_same_idle_thread() -> None:
    where = _Where()
    pipe = _two_stages(where)
    for _ in range(2):
        pipe(torch.randn(4, 4)).sum().backward()
    assert len(where.threads) == 4  # stage 1's forwards, two per call
    assert len(set(where.threads)) == 1, "each call started a thread of its own"
    (thread,) = set(where.threads)
    assert thread is not threading.main_thread() and thread.is_alive()
    assert thread.name == pool.IDLE


def test_an_idle_thread_keeps_nothing_of_the_call(monkeypatch) -> None:
    """Once a call returns (or its backward ends), nothing of it is reachable from the idle
    workers: its ``LocalStep`` (mailbox, programs, tensors in flight) is freed at once,
    without a garbage collection."""
    steps: List[weakref.ref] = []

    class Recorded(pipeline.LocalStep):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            steps.append(weakref.ref(self))

    monkeypatch.setattr(pipeline, "LocalStep", Recorded)
    pipe = _two_stages(nn.Identity())
    gc.disable()
    try:
        out = pipe(torch.randn(4, 4))
        out.sum().backward()
        del out
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)
        assert len(steps) == 3 and pool.idle_workers() >= 1
        assert [ref() for ref in steps] == [None, None, None]
    finally:
        gc.enable()


def test_a_script_with_idle_stage_threads_exits_cleanly() -> None:
    script = textwrap.dedent("""
        import torch
        from torch import nn
        from seqpipe import Pipe
        from seqpipe.local import pool
        pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), chunks=2,
                    balance=[1, 1, 1], devices=["cpu"] * 3)
        pipe(torch.randn(4, 4)).sum().backward()
        assert pool.idle_workers() == 2, pool.idle_workers()
        print("ran")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "ran\n", "")
