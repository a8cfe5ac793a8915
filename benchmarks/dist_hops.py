"""Hop latency on the 2-rank MLP: a sender's compute end to the receiver's compute start.

At K = 2, 1F1B's steady state can put a hop on the critical path at every action (rank 1
waiting for each activation, rank 0 for each gradient); where it does, what costs is a hop's
*latency*, not the CPU it takes. This benchmark measures which hops a rank waits for whole,
and their latency, for seqpipe's ``DistributedPipe`` and torch pipelining's ``Schedule1F1B``
alternately in one run, on ``dist_vs_torch_pipelining.py``'s model (``--depth`` ×
(Linear(``--width``) + ReLU), two stages, micro-batch 32, M = 8, MSE).

Each stage's layers are framed by two ``Mark`` layers (an identity whose forward and backward
record ``time.perf_counter``, one clock for both processes): the compute of an ``F`` runs
from the first mark's forward to the last one's, that of a ``B`` (or ``I``) from the last
mark's backward to the first one's (which reports the input's gradient). Both runtimes run
the same marked model. ``install`` records every point-to-point operation at the process
group (``ProcessGroup.send``/``recv``, which ``dist.isend``/``irecv`` call, so whatever
calls the group directly is recorded too), when it was issued and when its first ``wait``
began and returned (``hop_split``'s rows); the n-th data message (≥ ``--min-bytes``) from
one rank to the other meets the n-th such receive.

A hop is **on the path** when the receiver's previous compute ended before the sender's
did, so the receiver waited for all of it (a receiver that ends its previous compute during
the hop waits for its end only: not counted here). It splits into

* ``build``: the sender's compute end → its ``isend`` issued (the rest of the backward
  autograd runs after the input's gradient, the runtime's bookkeeping, packing);
* ``busy``: the ``isend`` → the receiver's wait start, when it began waiting only after
  the send (other waits first, posting, bookkeeping);
* ``wire``: the later of the ``isend`` and the receiver's wait start → the wait's return
  (gloo's write, the socket, waking the receiver);
* ``to layer``: the wait's return → the receiver's compute start (decoding, unpacking,
  posting the next receive, the runtime up to the layer);

and ``hop`` is their sum. Medians per direction (``0→1``: activations, ``1→0``: gradients)
over every on-path hop of the timed steps, and the on-path hops' count and total per step.

Run: ``PYTHONPATH=. python benchmarks/dist_hops.py`` (``--help`` for sizes; ~30 s).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import hop_split
import torch
import torch.distributed as dist
from _common import make_model, pin_malloc
from dist_breakdown import mlp_arguments
from dist_vs_torch_pipelining import SEQ, TORCH, Variants, _init, _med, machine_line, spawn
from torch import Tensor, nn

VARIANTS = (SEQ[1], TORCH[1])  # seqpipe 1f1b, torch 1F1B
PARTS = ("build", "busy", "wire", "to layer", "hop")
Event = Tuple[str, float]  # "F0"/"F1" (forward start/end), "B0"/"B1" (backward start/end), time
_EVENTS: List[Event] = []


class _Stamp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, first: bool) -> Tensor:  # type: ignore[override]
        ctx.first = first
        _EVENTS.append(("F0" if first else "F1", time.perf_counter()))
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        _EVENTS.append(("B1" if ctx.first else "B0", time.perf_counter()))
        return grad, None


class Mark(nn.Module):
    """An identity that records when its forward and its backward run (see the module doc)."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first

    def forward(self, x: Tensor) -> Tensor:
        return _Stamp.apply(x, self.first)


def marked_model(width: int, depth: int) -> nn.Sequential:
    """``make_model(width, depth)``, each half framed by a first and a last ``Mark``."""
    layers = list(make_model(width, depth))
    half = len(layers) // 2
    return nn.Sequential(Mark(True), *layers[:half], Mark(False),
                         Mark(True), *layers[half:], Mark(False))


def install() -> None:
    """Record every ``send``/``recv`` of this process's process groups in ``hop_split.LOG``
    (the peer as its rank in the group: the world rank on these 2-rank groups)."""
    group_class = dist.ProcessGroup
    for kind, name in (("send", "send"), ("recv", "recv")):
        op = getattr(group_class, name)

        def timed(group: Any, tensors: List[Tensor], peer: int, tag: int = 0, *,
                  _op: Any = op, _kind: str = kind) -> Any:
            row = [_kind, peer, sum(t.numel() * t.element_size() for t in tensors),
                   time.perf_counter(), None, None]
            work = _op(group, tensors, peer, tag)
            hop_split.LOG.append(row)
            return hop_split._TimedWork(work, row)
        setattr(group_class, name, timed)


def _spans(events: List[Event]) -> List[Tuple[float, float]]:
    """The computations (start, end) of one rank, in order; ``B`` without an end (stage 0's
    input needs no gradient) ends at the next computation's start or, last, at its own."""
    spans: List[Tuple[float, float]] = []
    start: Optional[Tuple[str, float]] = None
    for kind, at in events:
        if kind in ("F0", "B0"):
            if start is not None:  # a B0 with no B1 (stage 0): ends where the next starts
                spans.append((start[1], at))
            start = (kind, at)
        elif start is not None:
            spans.append((start[1], at))
            start = None
    if start is not None:
        spans.append((start[1], start[1]))
    return spans


def split_hops(logs: List[List[hop_split.Row]], events: List[List[Event]],
               min_bytes: int) -> Dict[str, List[Dict[str, float]]]:
    """Every on-path hop of one step, per direction (see the module doc)."""
    spans = [_spans(e) for e in events]
    out: Dict[str, List[Dict[str, float]]] = {}
    for src, dst in ((0, 1), (1, 0)):
        sends = [r for r in logs[src] if r[0] == "send" and r[1] == dst]
        recvs = [r for r in logs[dst] if r[0] == "recv" and r[1] == src]
        hops = out.setdefault(f"{src}→{dst}", [])
        for send, recv in zip(sends, recvs):
            if send[2] < min_bytes or recv[5] is None:
                continue
            ended = [e for _, e in spans[src] if e <= send[3]]
            begun = [s for s, _ in spans[dst] if s >= recv[5]]
            before = [e for _, e in spans[dst] if e <= recv[5]]
            if not ended or not begun:
                continue
            end, start = ended[-1], begun[0]
            if before and before[-1] >= end:  # the receiver was still busy: not on the path
                continue
            build, wire = send[3] - end, recv[5] - max(send[3], recv[4])
            hops.append({"build": build, "busy": max(0.0, recv[4] - send[3]), "wire": wire,
                         "to layer": start - recv[5],
                         "hop": start - end})
    return out


def bench_rank(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    pin_malloc()
    _init(rank, port)
    install()
    try:
        variants = Variants(marked_model(args.width, args.depth), rank, args.chunks,
                            args.micro_batch, args.width, only=VARIANTS)
        hops: Dict[str, Dict[str, List[Dict[str, float]]]] = {n: {} for n in VARIANTS}
        steps: Dict[str, List[float]] = {n: [] for n in VARIANTS}
        for r in range(args.warmup + args.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for name in order:
                dist.barrier()
                hop_split.LOG.clear()
                _EVENTS.clear()
                t0 = time.perf_counter()
                variants.steps[name]()
                t1 = time.perf_counter()
                mine = (list(hop_split.LOG), list(_EVENTS), t0, t1)
                both: List[Any] = [None, None]
                dist.all_gather_object(both, mine)
                if r < args.warmup or rank != 0:
                    continue
                steps[name].append(max(b[3] for b in both) - min(b[2] for b in both))
                split = split_hops([b[0] for b in both], [b[1] for b in both], args.min_bytes)
                for way, found in split.items():
                    hops[name].setdefault(way, []).extend(found)
                    hops[name].setdefault(f"{way} per step", []).append(
                        {"count": float(len(found)), "sum": sum(h["hop"] for h in found)})
        if rank == 0:
            queue.put(("hops", rank, {"hops": hops, "steps": steps}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def report(result: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    lines = ["| variant | step ms | direction | on-path hops per step | ms per step on them | "
             + " | ".join(f"{p} µs" for p in PARTS) + " |",
             "|---|---|---|---|---|" + "---|" * len(PARTS)]
    for name in VARIANTS:
        step = _med(result["steps"][name]) * 1e3
        for way in ("0→1", "1→0"):
            found = result["hops"][name].get(way, [])
            per = result["hops"][name].get(f"{way} per step", [])
            parts = " | ".join(f"{_med([h[p] for h in found]) * 1e6:.0f}" for p in PARTS)
            lines.append(f"| {name} | {step:.1f} | {way} | {_med([p['count'] for p in per]):.0f}"
                         f" | {_med([p['sum'] for p in per]) * 1e3:.2f} | {parts} |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mlp_arguments(parser, rounds=20)
    parser.add_argument("--min-bytes", type=int, default=64 << 10,
                        help="messages at least this large are data (the rest: control)")
    args = parser.parse_args(argv)
    print(f"# {machine_line()} (at start)", file=sys.stderr, flush=True)
    result = next(r for kind, _, r in spawn(bench_rank, args) if kind == "hops")
    print(f"Command: python {' '.join(sys.argv)}")
    print(f"Machine: {machine_line()} (at end)")
    print(f"Model: {args.depth} × (Linear({args.width}) + ReLU), 2 stages, each framed by two "
          f"marks; micro-batch {args.micro_batch}; M={args.chunks}; {args.rounds} rounds; "
          f"medians")
    print()
    print("\n".join(report(result, args)))


if __name__ == "__main__":
    main()
