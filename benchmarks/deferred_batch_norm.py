"""Cost of ``deferred_batch_norm=True``, and the main job's step against the plain model.

The model is ``python -m seqpipe``'s (``seqpipe.demo.build_model``: five conv + BatchNorm2d
blocks, batch 32 of 3×32×32), trained by ``Pipe.train_step`` as the demo trains it
(``1f1b``, ``except_last``). Timed interleaved in one process, at torch's default thread
count (what the demo runs with):

* ``layer`` / ``layer+dbn``: forward and backward of one BatchNorm2d(16) on the demo's first
  activation (32×16×32×32) split into 4 micro-batches, plain and deferred (with its commit):
  the layer's own cost, nothing else in the step;
* ``plain``: the unpipelined model's step (forward, loss, backward);
* ``p1c1``: a ``Pipe`` of 1 partition, chunks 1 (the direct call);
* ``p2c1``, ``p2c1+dbn``: 2 ``cpu`` partitions, chunks 1, without and with deferred BatchNorm;
* ``p2c4``, ``p2c4+dbn``: 2 partitions, chunks 4, without and with it: ``p2c4+dbn`` is the
  main job.

With ``--breakdown``, where the rest of the main job's step goes, a factor at a time:

* ``plain/4``: the plain model over the same 4 micro-batches, one after another
  (smaller kernels: the price of micro-batches, inherent);
* ``plain/4+ck``: the same with ``torch.utils.checkpoint`` on the first 3, as
  ``except_last`` recomputes them (inherent to the checkpoint mode);
* ``p1c4+dbn``: a ``Pipe`` of 1 partition doing that work (seqpipe's own per-micro-batch
  cost, against ``plain/4+ck``); ``p2c4+dbn`` against it: the second partition on the same
  cores (hand-overs, and the bubble where one thread waits).

With ``--accuracy`` (no timing): the relative error of the running variance, against
float64 truth, of a deferred BatchNorm2d over 4 micro-batches and of a plain one over the
whole batch, for activations whose mean is 0, 100 and 10^5 times their spread.

Printed: each variant's median wall and process-CPU milliseconds per step, and the paired
ratios (medians of per-round ratios) that say what deferred BatchNorm costs
(``layer+dbn / layer``, ``p2c1+dbn / p2c1``, ``p2c4+dbn / p2c4``) and where the main job
stands against the plain model. Run it on main and on a branch to compare them:
``PYTHONPATH=. python benchmarks/deferred_batch_norm.py --rounds 30``.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from _common import clone, interleave, machine, pin_malloc, print_ratios
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from seqpipe import Pipe
from seqpipe.core.batchnorm import convert_deferred_batch_norm
from seqpipe.demo import build_model, make_data

PAIRS = [("layer+dbn", "layer"), ("p2c1+dbn", "p2c1"), ("p2c4+dbn", "p2c4"),
         ("p1c1", "plain"), ("p2c1", "plain"), ("p2c4", "plain"), ("p2c4+dbn", "plain")]
BREAKDOWN = [("plain/4", "plain"), ("plain/4+ck", "plain/4"), ("p1c4+dbn", "plain/4+ck"),
             ("p2c4+dbn", "p1c4+dbn")]


def layer_step(deferred: bool, x: Tensor) -> Callable[[], None]:
    """Forward and backward of one BatchNorm2d over ``x``'s 4 micro-batches."""
    bn = nn.BatchNorm2d(x.shape[1])
    if deferred:
        convert_deferred_batch_norm(bn)
    x = x.detach().requires_grad_()

    def step() -> None:
        x.grad = None
        torch.cat([bn(part) for part in x.chunk(4)]).sum().backward()
        if deferred:
            bn.commit()  # type: ignore[operator]
    return step


def plain_step(model: nn.Module, x: Tensor, y: Tensor, chunks: int = 1,
               recompute: bool = False) -> Callable[[], None]:
    """The unpipelined step, over ``chunks`` micro-batches one after another (all but the
    last under ``torch.utils.checkpoint`` with ``recompute``)."""
    def step() -> None:
        for p in model.parameters():
            p.grad = None
        parts = list(zip(x.chunk(chunks), y.chunk(chunks)))
        for i, (xs, ys) in enumerate(parts):
            out = (checkpoint(model, xs, use_reentrant=False)
                   if recompute and i < len(parts) - 1 else model(xs))
            (F.cross_entropy(out, ys) * (len(xs) / len(x))).backward()
    return step


def pipe_step(model: nn.Sequential, x: Tensor, y: Tensor, partitions: int, chunks: int,
              deferred: bool) -> Callable[[], None]:
    """The demo's step: ``train_step`` under ``1f1b`` with ``except_last``."""
    balance = [len(model)] if partitions == 1 else [7, len(model) - 7]
    pipe = Pipe(model, chunks=chunks, checkpoint="except_last", balance=balance,
                devices=["cpu"] * partitions, deferred_batch_norm=deferred)

    def step() -> None:
        for p in pipe.parameters():
            p.grad = None
        pipe.train_step(x, y, F.cross_entropy, schedule="1f1b")
    return step


def accuracy() -> None:
    """The running variance's relative error against float64 truth (see ``--accuracy``)."""
    torch.manual_seed(0)
    for mean, std in ((0.0, 1.0), (100.0, 1.0), (1000.0, 0.01)):
        x = torch.randn(32, 16, 16, 16) * std + mean
        truth = x.double().var((0, 2, 3), unbiased=True)
        deferred = convert_deferred_batch_norm(nn.BatchNorm2d(16, momentum=1.0))
        for part in x.chunk(4):
            deferred(part)
        deferred.commit()  # type: ignore[operator]
        plain = nn.BatchNorm2d(16, momentum=1.0)
        plain(x)
        errors = [((bn.running_var.double() - truth).abs() / truth).max().item()
                  for bn in (deferred, plain)]
        print(f"mean {mean:g}, std {std:g}: running_var max relative error: deferred "
              f"{errors[0]:.1e}, plain BatchNorm on the whole batch {errors[1]:.1e}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the main job's step a factor at a time")
    parser.add_argument("--accuracy", action="store_true",
                        help="print the running variance's error instead of timing")
    args = parser.parse_args(argv)
    if args.accuracy:
        accuracy()
        return 0
    pin_malloc()
    torch.manual_seed(0)
    model = build_model()
    x, y = next(make_data(1, args.batch))
    activation = model[0](x).detach()
    variants: Dict[str, Callable[[], None]] = {
        "layer": layer_step(False, activation),
        "layer+dbn": layer_step(True, activation),
        "plain": plain_step(clone(model), x, y),
        "p1c1": pipe_step(clone(model), x, y, 1, 1, False),
        "p2c1": pipe_step(clone(model), x, y, 2, 1, False),
        "p2c1+dbn": pipe_step(clone(model), x, y, 2, 1, True),
        "p2c4": pipe_step(clone(model), x, y, 2, 4, False),
        "p2c4+dbn": pipe_step(clone(model), x, y, 2, 4, True),
    }
    pairs = list(PAIRS)
    if args.breakdown:
        variants["plain/4"] = plain_step(clone(model), x, y, 4)
        variants["plain/4+ck"] = plain_step(clone(model), x, y, 4, recompute=True)
        variants["p1c4+dbn"] = pipe_step(clone(model), x, y, 1, 4, True)
        pairs += BREAKDOWN
    samples = interleave(variants, rounds=args.rounds, warmup=args.warmup)
    print(f"# the demo CNN, batch {args.batch}, {args.rounds} interleaved rounds; {machine()}")
    print_ratios(samples, pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
