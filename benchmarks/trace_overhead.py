"""Cost of recording a step with ``seqpipe.trace.record()``, against the same step untraced.

The model is ``overhead.py``'s (8 × Linear(1024) + ReLU, batch 128, one intra-op thread),
here split in two stages with 4 micro-batches, so every kind of event occurs: forwards,
backwards, recomputations (``checkpoint="except_last"``), waits and sends. Each traced
step runs in its own ``record()`` block (entering and leaving it are paid every step).
Untraced and traced steps alternate (see ``_common.interleave``) on the same pipe, and the
verdict is the median of per-round ratios ``traced / untraced``. For ``DistributedPipe``
the blocks do not gather (``gather=False``): the gather of both ranks' events to rank 0,
with its clock exchange, is paid once per block, not per step, and is timed on its own
(median of ``--rounds`` gathers). As a
check that does not depend on a quiet machine, the script also counts one step's events
and times the recorder's cost per event (a span entered and left with a recording open),
and prints their product as a share of the untraced step.

Target: ≤ 2 % (ratio ≤ 1.02).

Run: ``PYTHONPATH=. python benchmarks/trace_overhead.py`` (local ``Pipe``, two CPU stages);
``--engine distributed`` runs the same model as a two-process ``DistributedPipe`` (gloo,
1F1B) and reports rank 0's timings.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
from _common import Samples, interleave, machine, make_model, paired_ratio, pin_malloc, train_step
from torch import nn

import seqpipe
from seqpipe import Pipe
from seqpipe.trace import EventKind, hooks

TARGET = 0.02


def traced(step: Callable[[], None], gather: bool = True) -> Callable[[], None]:
    """``step`` inside its own ``record()`` block."""
    def run() -> None:
        with seqpipe.trace.record(gather=gather):
            step()
    return run


def local_variants(args: argparse.Namespace) -> Dict[str, Callable[[], None]]:
    model = make_model(args.width, args.depth)
    pipe = Pipe(model, chunks=args.chunks, balance=[len(model) // 2, len(model) - len(model) // 2],
                devices=["cpu", "cpu"])
    x = torch.randn(args.batch, args.width)

    def step() -> None:
        train_step(pipe, x)
    return {"untraced": step, "traced": traced(step)}


def per_event_cost(n: int = 20000) -> float:
    """Seconds one span costs with a recording open (entered, timed, left, stored)."""
    with seqpipe.trace.record():
        t0 = time.perf_counter()
        for i in range(n):
            with hooks.span(EventKind.FORWARD, 0, i):
                pass
        return (time.perf_counter() - t0) / n


def events_per_step(step: Callable[[], None]) -> int:
    with seqpipe.trace.record() as rec:
        step()
    return len(rec.recording.events)


def report(samples: Dict[str, Samples], args: argparse.Namespace, engine: str,
           events: int) -> float:
    ratio = paired_ratio(samples["traced"], samples["untraced"])
    cpu_ratio = paired_ratio(samples["traced"], samples["untraced"], cpu=True)
    print(f"# {machine([torch.get_num_threads()])}")
    print(f"# {engine}: {args.depth} x (Linear({args.width}) + ReLU), batch {args.batch}, "
          f"2 stages, chunks {args.chunks}, {args.rounds} interleaved rounds")
    for name, s in samples.items():
        print(f"{name:<9} median {s.median * 1e3:8.2f} ms  IQR {s.iqr * 1e3:6.2f} ms  "
              f"min {min(s.wall) * 1e3:8.2f} ms")
    print(f"traced/untraced (median of per-round ratios): wall {ratio:.4f}, "
          f"CPU {cpu_ratio:.4f}")
    verdict = "MET" if ratio - 1 <= TARGET else "NOT MET"
    print(f"tracing overhead: {(ratio - 1) * 100:+.2f} % by wall time "
          f"(target <= {TARGET * 100:.0f} %: {verdict})")
    cost = per_event_cost()
    print(f"events per step: {events}; recorder cost per event {cost * 1e6:.2f} us; "
          f"so {events * cost * 1e3:.3f} ms per step = "
          f"{events * cost / samples['untraced'].median * 100:.3f} % of the untraced step")
    return ratio


def _distributed(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from seqpipe.distributed import DistributedPipe

    torch.set_num_threads(args.threads)
    model = make_model(args.width, args.depth)
    pipe = DistributedPipe(model, args.chunks,
                           balance=[len(model) // 2, len(model) - len(model) // 2])
    x = torch.randn(args.batch, args.width)

    def step() -> None:
        for p in pipe.parameters():
            p.grad = None
        pipe.train_step(x if pipe.is_first else None, x if pipe.is_last else None,
                        nn.functional.mse_loss)
    samples = interleave({"untraced": step, "traced": traced(step, gather=False)},
                         rounds=args.rounds, warmup=args.warmup)
    events = events_per_step(step)
    gathers = []
    for _ in range(args.rounds):
        with seqpipe.trace.record(gather=False) as rec:
            step()
        t0 = time.perf_counter()
        rec.gather(pipe)
        gathers.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        report(samples, args, "DistributedPipe over 2 gloo processes (1F1B), rank 0", events)
        print(f"gather at the end of a block (once per block): median "
              f"{statistics.median(gathers) * 1e3:.2f} ms, min {min(gathers) * 1e3:.2f} ms")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("local", "distributed"), default="local")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    pin_malloc()
    if args.engine == "distributed":
        from seqpipe.launch import spawn_local

        spawn_local(2, _distributed, args)
        return 0
    torch.set_num_threads(args.threads)
    variants = local_variants(args)
    samples = interleave(variants, rounds=args.rounds, warmup=args.warmup)
    ratio = report(samples, args, "local Pipe", events_per_step(variants["untraced"]))
    return 0 if ratio - 1 <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
