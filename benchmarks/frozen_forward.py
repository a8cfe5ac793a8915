"""What ``pipe(x)`` on a frozen pipe costs: inference, and grad mode with nothing to record.

    PYTHONPATH=. python benchmarks/frozen_forward.py [--rounds 9] [--calls 300]

Since session 13 (branch ``gaps``) a call on a pipe none of whose parameters requires grad,
given an input that wants none, runs with grad on under grad mode (a tensor a layer holds
may require grad, as an adapter beside a frozen base does; the plain model records a graph
exactly then) and joins the caller's graph only if its output requires grad. Under
``torch.no_grad()`` and ``inference_mode`` nothing changed. This times, per call, the
process CPU (worker threads included) of four frozen ``Linear(64, 64)`` on a 16 × 64 batch,
one intra-op thread, as a one-partition pipe of one micro-batch (the direct call) and as two
``cpu`` partitions over 4 micro-batches, under ``no_grad``, ``inference_mode`` and grad mode
in ``eval()`` and ``train()`` (where ``checkpoint="except_last"`` applies); the modes
alternate, rotating, in every round, and the minimum over rounds is printed (the least
disturbed by other processes). Compare two trees by running it with each on
``PYTHONPATH``, back to back.
"""
from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, ContextManager, Dict, List

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine  # noqa: E402

from seqpipe import Pipe  # noqa: E402

MODES: Dict[str, Callable[[], ContextManager[object]]] = {
    "no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
    "grad, eval()": nullcontext, "grad, train()": nullcontext}


def _frozen() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).requires_grad_(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipes = {"1 partition, 1 micro-batch": Pipe(_frozen(), chunks=1, balance=[4],
                                                devices=["cpu"]),
             "2 partitions, 4 micro-batches": Pipe(_frozen(), chunks=4, balance=[2, 2],
                                                   devices=["cpu", "cpu"])}
    x = torch.randn(16, 64)
    print(machine([1]))
    for label, pipe in pipes.items():
        times: Dict[str, List[float]] = {mode: [] for mode in MODES}
        names = list(MODES)
        for r in range(args.rounds + 1):  # round 0: warm-up
            for mode in names[r % len(names):] + names[:r % len(names)]:
                pipe.train(mode == "grad, train()")
                with MODES[mode]():
                    start = time.process_time()
                    for _ in range(args.calls):
                        pipe(x)
                    if r:
                        times[mode].append((time.process_time() - start) / args.calls)
        print(label + ": " + ", ".join(f"{mode} {min(t) * 1e6:.0f} µs"
                                       for mode, t in times.items()))


if __name__ == "__main__":
    main()
