"""Whether each ``W`` of a split schedule fills a wait: the per-action timeline of 2 ranks.

    PYTHONPATH=. python benchmarks/zb_timeline.py [--schedules 1f1b zb_h1 auto] [--steps 6]

The model and split are ``dist_transformer_vs_torch.py``'s (a GPT-style stack, ``--blocks``
blocks, 2 ranks, M = ``--chunks``, one intra-op thread per rank). Each schedule's pipe
trains ``--steps`` recorded steps (after 3 unrecorded) under ``seqpipe.trace.record()``,
and rank 0 reads every rank's events on one clock. Per step it reports:

* each rank's busy time (``F``, ``B``, ``I``, ``W``) and its waits for messages;
* for each ``W``: how much of it **filled a wait**, the part before the message that the
  rank's next action receives arrived (the sender's ``send`` event end). Without the
  ``W`` there, the rank would have idled that long; the rest of the ``W`` only delays
  the next action; and the ``W``s **in the drain** (after the rank's last ``I`` or ``B``:
  they run while the ranks upstream finish their backwards, which the gradient sent
  before them let start);
* for each ``I`` that sends a gradient: what ran between its end and the send's start
  (the gradient is to leave first).

``--show`` prints the last step's timeline of each rank (ms from the step's start; each
``W`` with the wait it filled). For ``auto`` (``schedule="auto"``: the first of the
unrecorded steps measures) the pick's line is printed first: which backwards it splits.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import pin_malloc  # noqa: E402
from dist_transformer_vs_torch import balance_of, loss_fn, make_gpt  # noqa: E402
from dist_vs_torch_pipelining import _init, spawn  # noqa: E402

import seqpipe.trace as trace  # noqa: E402
from seqpipe.distributed import DistributedPipe  # noqa: E402

# kind, rank, micro-batch, start, end, what, step
Row = Tuple[str, int, Any, float, float, Any, int]


def _rank(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    pin_malloc()
    _init(rank, port)
    try:
        model = make_gpt(args.vocab, args.width, args.heads, args.blocks, args.length)
        gen = torch.Generator().manual_seed(1234)
        shape = (args.chunks * args.micro_batch, args.length)
        x = torch.randint(args.vocab, shape, generator=gen)
        y = torch.randint(args.vocab, shape, generator=gen)
        out: Dict[str, List[Row]] = {}
        picks: Dict[str, str] = {}
        for name in args.schedules:
            pipe = DistributedPipe(copy.deepcopy(model), chunks=args.chunks,
                                   balance=balance_of(args.blocks, 2), schedule=name,
                                   checkpoint="never", device="cpu")
            for _ in range(3):
                pipe.train_step(x, y, loss_fn)
            with trace.record() as rec:
                for _ in range(args.steps):
                    dist.barrier()
                    pipe.train_step(x, y, loss_fn)
            out[name] = [(e.kind.value, e.rank, e.microbatch, e.start, e.end, e.what, e.step)
                         for e in rec.recording.events]
            if pipe.auto_choice is not None:  # schedule="auto": what it picked, and why
                picks[name] = pipe.auto_choice.describe(None)
        if rank == 0:
            queue.put((out, picks))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _filled(mine: Sequence[Row], n: int, sends: Dict[Any, Row]) -> float:
    """Seconds of the ``W`` at ``mine[n]`` (one rank's actions and waits, in order) before
    the message its rank's next action waits for arrived: the wait it filled."""
    _, rank, _, start, end, _, _ = mine[n]
    later = [r for r in mine[n + 1:] if r[0] == "wait" and r[5] in
             ("activation", "gradient")][:1]
    nxt = [r for r in mine[n + 1:] if r[0] != "wait"][:1]
    if not (later and nxt and later[0][4] <= nxt[0][3]):  # not the next action's message
        return 0.0
    sent = sends.get((1 - rank, later[0][5], later[0][2]))
    arrived = sent[4] if sent is not None else later[0][4]
    return max(0.0, min(end, arrived) - start)


def _step(rows: Sequence[Row]) -> Dict[str, float]:
    """One step's figures (ms): per rank busy and waits, W filling waits, I to its send."""
    got: Dict[str, float] = defaultdict(float)
    got["step"] = (max(r[4] for r in rows) - min(r[3] for r in rows)) * 1e3
    sends = {(r[1], r[5], r[2]): r for r in rows if r[0] == "send"}
    for rank in (0, 1):
        mine = [r for r in rows if r[1] == rank and r[0] in ("F", "B", "I", "W", "wait")]
        for n, (kind, _, mb, start, end, what, _) in enumerate(mine):
            if kind == "wait":
                if what in ("activation", "gradient"):
                    got[f"rank {rank} wait"] += (end - start) * 1e3
                continue
            got[f"rank {rank} {kind}"] += (end - start) * 1e3
            if kind == "W":
                got[f"rank {rank} W total"] += (end - start) * 1e3
                got[f"rank {rank} W filled"] += _filled(mine, n, sends) * 1e3
                if all(r[0] in ("W", "wait") for r in mine[n + 1:]):  # after the last I/B
                    got[f"rank {rank} W in drain"] += (end - start) * 1e3
            if kind == "I":
                sent = sends.get((rank, "gradient", mb))
                if sent is not None:
                    got[f"rank {rank} I to send"] += max(0.0, sent[3] - end) * 1e3
    return got


def _show(rows: Sequence[Row]) -> None:
    """Each rank's actions (ms from the step's start; a ``W`` with the wait it filled)."""
    t0 = min(r[3] for r in rows)
    sends = {(r[1], r[5], r[2]): r for r in rows if r[0] == "send"}
    for rank in (0, 1):
        words = []
        mine = [r for r in sorted(rows, key=lambda r: r[3])
                if r[1] == rank and r[0] in ("F", "B", "I", "W", "wait")]
        for n, (kind, _, mb, start, end, what, _) in enumerate(mine):
            if kind in ("F", "B", "I", "W"):
                fill = f" filled {_filled(mine, n, sends) * 1e3:.1f}" if kind == "W" else ""
                words.append(f"{kind}{mb}[{(start - t0) * 1e3:.0f}-{(end - t0) * 1e3:.0f}"
                             f"{fill}]")
            elif kind == "wait" and end - start > 3e-4 and what in ("activation", "gradient"):
                words.append(f"(wait {what} {mb}: {(end - start) * 1e3:.1f})")
        print(f"  rank {rank}: " + " ".join(words))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb_h1"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--show", action="store_true", help="print the last step's timeline")
    args = parser.parse_args()
    ((result, picks),) = spawn(_rank, args)
    for name, rows in result.items():
        if name in picks:
            print(picks[name])
        steps = sorted({r[6] for r in rows})
        figures = [_step([r for r in rows if r[6] == s]) for s in steps]
        keys = sorted({k for f in figures for k in f})
        print(f"{name}: medians over {len(steps)} steps, ms")
        for key in keys:
            print(f"  {key:18s} {statistics.median(f.get(key, 0.0) for f in figures):7.1f}")
        if args.show:
            _show([r for r in rows if r[6] == steps[-1]])


if __name__ == "__main__":
    main()
