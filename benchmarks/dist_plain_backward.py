"""A DistributedPipe step with its stages' plain backward against the ``inputs=`` form.

    PYTHONPATH=. python benchmarks/dist_plain_backward.py [--schedule 1f1b] [--rounds 20]

Without aliases, a ``DistributedPipe`` stage runs each ``B`` as ``torch.autograd.backward(
roots, grads)``, where it used to pass ``inputs=`` (its parameters and received tensors;
``seqpipe/distributed/accumulate.py``). This runs ``dist_transformer_vs_torch.py``'s GPT-style
model (same defaults) on 2 ranks, gloo, one intra-op thread each, and alternates in every
round a step with the plain backward (``plain``) and one with it switched off (``inputs=``,
what every step did before), the order flipped each round so that machine load hits both.
It checks that both give the same gradients, then prints per rank the median main-thread
CPU time per step (``time.thread_time``, the figure issue 24 compares with torch
pipelining) and the median wall time of a step, and the median of the per-round ratios.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_transformer_vs_torch import balance_of, loss_fn, make_gpt  # noqa: E402
from dist_vs_torch_pipelining import _init, spawn  # noqa: E402

import seqpipe.distributed.accumulate as accumulate  # noqa: E402
from seqpipe.distributed import DistributedPipe  # noqa: E402

_INIT = accumulate.StepGrads.__init__


def _with_inputs(grads: accumulate.StepGrads, stage: Any, last: int) -> None:
    """A step whose backwards pass ``inputs=`` (what every step did before session 9)."""
    _INIT(grads, stage, last)
    grads.sink.plain = grads.sink_for(last).plain = False


FORMS = {"plain": _INIT, "inputs=": _with_inputs}


def bench_rank(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    _init(rank, port)
    try:
        model = make_gpt(args.vocab, args.width, args.heads, args.blocks, args.length)
        pipe = DistributedPipe(model, chunks=args.chunks, balance=balance_of(args.blocks, 2),
                               schedule=args.schedule, checkpoint="never", device="cpu")
        gen = torch.Generator().manual_seed(1234)
        shape = (args.chunks * args.micro_batch, args.length)
        x = torch.randint(args.vocab, shape, generator=gen)
        y = torch.randint(args.vocab, shape, generator=gen)
        cpu: Dict[str, List[float]] = {form: [] for form in FORMS}
        wall: Dict[str, List[float]] = {form: [] for form in FORMS}
        grads: Dict[str, List[torch.Tensor]] = {}
        for r in range(args.warmup + args.rounds):
            for form in (list(FORMS) if r % 2 == 0 else list(FORMS)[::-1]):
                accumulate.StepGrads.__init__ = FORMS[form]  # type: ignore[method-assign]
                for param in pipe.parameters():
                    param.grad = None
                dist.barrier()
                c0, t0 = time.thread_time(), time.perf_counter()
                pipe.train_step(x, y, loss_fn)
                t1, c1 = time.perf_counter(), time.thread_time()
                grads.setdefault(form, [p.grad.clone() for p in pipe.parameters()])
                if r >= args.warmup:
                    cpu[form].append(c1 - c0)
                    wall[form].append(t1 - t0)
        for a, b in zip(grads["plain"], grads["inputs="]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        queue.put((rank, cpu, wall))
    finally:
        accumulate.StepGrads.__init__ = _INIT  # type: ignore[method-assign]
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", help="a schedule without split backward")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args()
    for rank, cpu, wall in sorted(spawn(bench_rank, args), key=lambda r: r[0]):
        for what, times in (("main-thread CPU", cpu), ("wall", wall)):
            ratio = statistics.median(a / b for a, b in zip(times["plain"], times["inputs="]))
            line = ", ".join(f"{form} {statistics.median(t) * 1e3:.1f} ms"
                             for form, t in times.items())
            print(f"rank {rank} {what} per step: {line}; plain/inputs= {ratio:.3f}")


if __name__ == "__main__":
    main()
