"""The local ``Pipe``'s fixed cost on the README's CNN: one and two partitions at one chunk.

With one micro-batch there is nothing to overlap, so what a second partition adds to a
step is the engine's own cost: the hand-off between the two stage threads, the stage
boundary (``_Receive``, the gradient sent back), the private random streams that
side-by-side stages draw from (``seqpipe/core/rng.py``; skipped since session 9 for a
partition that provably draws nothing, ``seqpipe/core/draws.py``) and the backward's
``inputs=`` (dropped under ``loss.backward()`` since session 9, ``seqpipe/local/direct.py``).
This script times, interleaved in one process, the demo's CNN (``seqpipe.demo.build_model``,
batch 32) trained with SGD:

* ``plain``: the model itself (forward, ``cross_entropy``, backward, ``opt.step()``);
* ``ts1``, ``ts2``: ``Pipe.train_step`` (1F1B, as ``python -m seqpipe`` runs it) over one
  partition and over two (``balance_by_size``), ``chunks=1``;
* ``fb2``: two partitions, ``pipe(x)`` then ``loss.backward()``;
* ``ts2/streams``: ``ts2`` with the private random streams forced on every task (what
  every two-partition step paid before ``seqpipe/core/draws.py``).

Ratios are medians of per-round ratios, of process CPU time and of wall time. With one
intra-op thread (the default here) the CPU time is what a loaded machine disturbs least.
Run: ``PYTHONPATH=. python benchmarks/local_step.py --rounds 30`` (``--threads 0``: torch's
default count).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from _common import interleave, load_average, paired_ratio, pin_malloc
from torch import nn

import seqpipe.core.stage
from seqpipe import Pipe
from seqpipe.balance import balance_by_size
from seqpipe.demo import build_model, make_data


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def pipe_step(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, balance: Sequence[int],
              train_step: bool) -> Callable[[], None]:
    pipe = Pipe(copy.deepcopy(model), chunks=1, balance=balance, devices=["cpu"] * len(balance))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        if train_step:
            pipe.train_step(x, y, F.cross_entropy)
        else:
            F.cross_entropy(pipe(x), y).backward()
        opt.step()
    return step


def with_streams(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with every task given its private random stream, as if no partition could
    be proven to draw nothing."""
    def run() -> None:
        quiet = seqpipe.core.stage.draws_nothing
        seqpipe.core.stage.draws_nothing = lambda module: False  # type: ignore[assignment]
        try:
            step()
        finally:
            seqpipe.core.stage.draws_nothing = quiet
    return run


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    pin_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model()
    x, y = next(make_data(1, args.batch))
    two = balance_by_size(2, model, x, chunks=1)
    variants = {
        "plain": plain_step(model, x, y),
        "ts1": pipe_step(model, x, y, [len(model)], train_step=True),
        "ts2": pipe_step(model, x, y, two, train_step=True),
        "fb2": pipe_step(model, x, y, two, train_step=False),
        "ts2/streams": with_streams(pipe_step(model, x, y, two, train_step=True)),
    }
    samples = interleave(variants, rounds=args.rounds, warmup=args.warmup)
    print(f"# CNN, batch {args.batch}, two partitions {two}, {args.rounds} interleaved rounds, "
          f"{torch.get_num_threads()} intra-op threads, load average {load_average()}")
    for name, s in samples.items():
        cpu = statistics.median(s.cpu) * 1e3
        print(f"{name:<11} median {s.median * 1e3:7.2f} ms  cpu {cpu:7.2f} ms")
    for a, b in [("ts1", "plain"), ("ts2", "plain"), ("fb2", "plain"), ("ts2", "ts1"),
                 ("ts2/streams", "plain"), ("ts2", "ts2/streams")]:
        print(f"{a} / {b}: CPU time {paired_ratio(samples[a], samples[b], cpu=True):.4f}, "
              f"wall {paired_ratio(samples[a], samples[b]):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
