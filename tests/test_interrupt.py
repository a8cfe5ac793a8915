"""Ctrl-C during a ``Pipe`` call stops every stage thread before the call raises.

A worker thread left running after ``KeyboardInterrupt`` would still be inside PyTorch
when the interpreter shuts down, and a thread that needs the GIL then aborts the process
("terminate called without an active exception").
"""
from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
from torch import Tensor, nn

from seqpipe import Pipe


class _InterruptCaller(nn.Module):
    """On its first call (in stage 1's thread), sends SIGINT to the main thread, as Ctrl-C
    does, once the main thread is done with stage 0 and waits for the stage threads."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.finished = threading.Event()

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == 1:
            time.sleep(0.3)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
            time.sleep(0.3)  # still busy when the interrupt lands
        self.finished.set()
        return x * 2


def _stage_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("seqpipe-stage-")]


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="SIGINT reaches the main thread only")
def test_ctrl_c_joins_every_stage_thread() -> None:
    layer = _InterruptCaller()
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), layer), chunks=4, checkpoint="never",
                balance=[1, 1], devices=["cpu", "cpu"])
    with pytest.raises(KeyboardInterrupt):
        pipe(torch.randn(8, 4))
    assert layer.finished.is_set()
    assert layer.calls == 1, "stage 1 went on with the next micro-batch after Ctrl-C"
    assert _stage_threads() == [], "a stage thread outlived the interrupted call"
    assert pipe(torch.randn(8, 4)).shape == (8, 4)  # and the pipe still works


def test_ctrl_c_on_the_multi_process_demo_is_one_line_and_status_130() -> None:
    """Ctrl-C in a terminal interrupts every process of its group: the launcher and each
    rank. The launcher waits for the ranks and says so once; no rank prints a traceback."""
    import os
    import pathlib
    import selectors
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    demo = subprocess.Popen(
        [sys.executable, "-m", "seqpipe", "--processes", "2", "--steps", "10000", "--batch",
         "8", "--balance-by", "params"], cwd=root, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(root)})
    try:
        selector = selectors.DefaultSelector()
        selector.register(demo.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        deadline, line = time.monotonic() + 240, ""
        while not line.startswith("step "):  # training: every rank is inside a step
            assert selector.select(deadline - time.monotonic()), "the demo never trained"
            line = demo.stdout.readline()  # type: ignore[union-attr]
            assert line, f"the demo ended first: {demo.stderr.read()}"  # type: ignore[union-attr]
        os.killpg(demo.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        _, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert err.strip().splitlines() == ["seqpipe: interrupted"], err
    assert demo.returncode == 130
