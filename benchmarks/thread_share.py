"""Two ``cpu`` partitions at torch's default thread count: shared intra-op threads or not.

Issue 12, section 2: with torch's default intra-op thread count ``T`` (one per core), each
of ``K`` stage threads used to run ``T``-thread kernels, ``K × T`` busy threads on ``T``
cores. ``Pipe`` now gives each of the ``K`` concurrent CPU stages ``max(1, T // K)``
(``seqpipe/local/thread_state.py``). This script times, interleaved in one process (see
``_common``), a training step of the throughput model (8 × (Linear(1024) + ReLU), batch
256, two equal ``cpu`` partitions, ``chunks`` micro-batches) as

* ``plain``: the unwrapped model at ``T`` threads;
* ``shared``: ``Pipe`` at torch's default count, as a user gets it now;
* ``fixed share``: the same ``Pipe`` with every action at its share, also those during
  which no other stage can compute (the behaviour before ``IntraOp``: a stage alone in the
  pipeline's fill or drain used 1 of the 2 cores);
* ``fresh, fixed``: the same, and a new thread per stage and phase (the behaviour before
  ``seqpipe.local.pool``, which keeps stage threads warm between calls);
* ``T per stage``: the same ``Pipe`` with the split turned off (every stage ``T`` threads,
  the behaviour before the fix);
* ``1 thread``: the caller set ``torch.set_num_threads(1)`` (the issue's 188 ms regime);
* ``torchgpipe``: ``torchgpipe.GPipe`` at ``T`` threads, if installed.

Target: ``shared`` ≥ 1.0 × torchgpipe at the default count (without torchgpipe: report
``shared`` against ``1 thread`` and ``T per stage``).

Run: ``PYTHONPATH=. python benchmarks/thread_share.py`` (``--help`` for options).
"""
from __future__ import annotations

import argparse
import sys
import threading
from typing import Callable, Dict, List, Optional

import torch
from _common import clone, interleave, machine, make_model, paired_ratio, pin_malloc, train_step
from torch import nn

import seqpipe.local.thread_state as thread_state
from seqpipe import Pipe
from seqpipe.local import pool

DEFAULT_THREADS = torch.get_num_threads()

try:  # optional comparison
    from torchgpipe import GPipe
except ImportError:  # pragma: no cover - depends on the environment
    GPipe = None


def _pipe(model: nn.Sequential, chunks: int) -> Pipe:
    half = len(model) // 2
    return Pipe(model, chunks=chunks, checkpoint="never", balance=[half, len(model) - half],
                devices=["cpu", "cpu"])


def _fresh_thread(name: str, run: Callable[[], None], done: threading.Event) -> None:
    """``pool.start`` as it was before the pool: a new thread for every stage and phase."""
    def target() -> None:
        try:
            run()
        finally:
            done.set()
    threading.Thread(target=target, name=name, daemon=True).start()


def _at(threads: int, step: Callable[[], None], split: bool = True,
        alone: bool = True, fresh: bool = False) -> Callable[[], None]:
    def run() -> None:
        torch.set_num_threads(threads)
        default = thread_state._DEFAULT_THREADS
        intra_op = thread_state.ThreadState.intra_op
        start = pool.start
        if not split:  # the caller's count no longer looks like the default: kept per stage
            thread_state._DEFAULT_THREADS = -1
        if not alone:  # every action at its share, also where it computes alone
            thread_state.ThreadState.intra_op = lambda self, all_cpu: None  # type: ignore
        if fresh:
            pool.start = _fresh_thread  # type: ignore[assignment]
        try:
            step()
        finally:
            thread_state._DEFAULT_THREADS = default
            thread_state.ThreadState.intra_op = intra_op  # type: ignore[method-assign]
            pool.start = start  # type: ignore[assignment]
            torch.set_num_threads(DEFAULT_THREADS)
    return run


def variants(width: int, depth: int, batch: int, chunks: int) -> Dict[str, Callable[[], None]]:
    model = make_model(width, depth)
    x = torch.randn(batch, width)

    def stepper(module: nn.Module) -> Callable[[], None]:
        return lambda: train_step(module, x)

    out = {
        "plain": _at(DEFAULT_THREADS, stepper(clone(model))),
        "shared": _at(DEFAULT_THREADS, stepper(_pipe(clone(model), chunks))),
        "fixed share": _at(DEFAULT_THREADS, stepper(_pipe(clone(model), chunks)), alone=False),
        "fresh, fixed": _at(DEFAULT_THREADS, stepper(_pipe(clone(model), chunks)), alone=False,
                            fresh=True),
        "T per stage": _at(DEFAULT_THREADS, stepper(_pipe(clone(model), chunks)), split=False),
        "1 thread": _at(1, stepper(_pipe(clone(model), chunks))),
    }
    if GPipe is not None:
        half = len(model) // 2
        gpipe = GPipe(clone(model), balance=[half, len(model) - half], devices=["cpu", "cpu"],
                      chunks=chunks, checkpoint="never")
        out["torchgpipe"] = _at(DEFAULT_THREADS, stepper(gpipe))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-foreign", type=float, default=0.3,
                        help="keep only steps during which other processes used at most this "
                             "many cores (negative: keep every step)")
    parser.add_argument("--max-rounds", type=int, default=None)
    args = parser.parse_args(argv)
    pin_malloc()
    max_foreign = args.max_foreign if args.max_foreign >= 0 else None
    print(f"# {machine([DEFAULT_THREADS])}")
    print(f"# {args.depth} x (Linear({args.width}) + ReLU), batch {args.batch}, 2 cpu "
          f"partitions, chunks={args.chunks}, checkpoint='never', torch default threads "
          f"{DEFAULT_THREADS}")
    if GPipe is None:
        print("note: torchgpipe is not installed")
    samples = interleave(variants(args.width, args.depth, args.batch, args.chunks),
                         rounds=args.rounds, warmup=args.warmup, max_foreign=max_foreign,
                         max_rounds=args.max_rounds)
    quiet = {k: v.quiet(max_foreign) for k, v in samples.items()}
    if min(len(v.wall) for v in quiet.values()) < 3:
        print("note: fewer than 3 quiet steps for some variant; reporting every step")
        quiet = samples
    kept = min(len(v.wall) for v in quiet.values())
    print(f"# {kept} of {len(samples['plain'].wall)} steps per variant kept")
    print(f"{'variant':<12} {'median ms':>9} {'IQR ms':>7} {'samples/s':>9} {'cores':>5}")
    for name, s in quiet.items():
        print(f"{name:<12} {s.median * 1e3:>9.1f} {s.iqr * 1e3:>7.1f} "
              f"{args.batch / s.median:>9.0f} {s.cores_used:>5.2f}")
    for other in ("fixed share", "fresh, fixed", "T per stage", "1 thread", "torchgpipe", "plain"):
        if other in samples:
            ratio = paired_ratio(samples[other], samples["shared"], max_foreign=max_foreign)
            print(f"shared is {ratio:.2f}x as fast as {other} (median of paired rounds)")
    print(f"# load average at the end: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
