"""Cost of copying every checkpointed micro-batch's input (the in-place protection).

A checkpointed task keeps its input for the recomputation, and any layer of the partition
may write that input in place (``ReLU(inplace=True)`` nested in a block, a custom
``x.mul_()``), so ``Stage`` copies the inputs inside the checkpoint, in the forward and
again in the recomputation. This script times a training step of the same ``Pipe`` with
and without that copy (the copy switched off by patching the stage), interleaved.

Model: one partition of ``depth`` × (Linear(width) + ReLU), ``chunks=4``,
``checkpoint="always"`` (every micro-batch copies), batch 128, width 1024: the copy is a
pass over a 128 × 1024 activation per micro-batch, the partition's compute
``depth`` matrix products of that size. A narrower or shallower partition makes the copy
relatively dearer (``--width``, ``--depth``).

Target: none (the copy is needed for correctness); the figure is reported in
docs/pipe.md. Run: ``PYTHONPATH=. python benchmarks/inplace_copy.py``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import types
from typing import Any, List, Optional

import torch
from _common import (
    clone,
    interleave,
    make_model,
    paired_ratio,
    paired_ratios,
    pin_malloc,
    train_step,
)

from seqpipe import Pipe
from seqpipe.core.stage import Stage


def without_copy(pipe: Pipe) -> Pipe:
    """``pipe`` with its stages' input copy switched off (wrong for in-place layers)."""
    for stage in pipe._pipeline.stages:
        def call(self: Stage, tracker: Any, atomic: bool, protect: bool = False,
                 sink: Any = None) -> Any:
            return Stage._call(self, tracker, atomic, False, sink)
        stage._call = types.MethodType(call, stage)  # type: ignore[method-assign]
    return pipe


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4, help="Linear+ReLU pairs (default 4)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    pin_malloc()
    torch.set_num_threads(1)
    model = make_model(args.width, args.depth)
    x = torch.randn(args.batch, args.width)

    def pipe() -> Pipe:
        return Pipe(clone(model), chunks=4, balance=[len(model)], devices=["cpu"],
                    checkpoint="always")

    copying, plain = pipe(), without_copy(pipe())
    samples = interleave({"copy": lambda: train_step(copying, x),
                          "no copy": lambda: train_step(plain, x)},
                         rounds=args.rounds, warmup=args.warmup)
    wall = statistics.median(paired_ratios(samples["copy"], samples["no copy"]))
    cpu = paired_ratio(samples["copy"], samples["no copy"], cpu=True)
    print(f"# {args.depth} x (Linear({args.width}) + ReLU), batch {args.batch}, chunks 4, "
          f"checkpoint='always', {args.rounds} interleaved rounds")
    for name, s in samples.items():
        print(f"{name:<8} median {s.median * 1e3:8.2f} ms  "
              f"cpu {statistics.median(s.cpu) * 1e3:8.2f} ms")
    print(f"copy / no copy: wall {wall:.4f}, CPU time {cpu:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
