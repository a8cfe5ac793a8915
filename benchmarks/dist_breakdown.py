"""Where a two-rank training step's time goes: seqpipe DistributedPipe vs torch pipelining.

A diagnostic companion of ``dist_vs_torch_pipelining.py`` (same model, ranks, micro-batches
and variants). Nothing in ``seqpipe`` is changed; the worker processes wrap a few functions
of both libraries (monkeypatching, in the worker only) to split each rank's step time into
self-time categories:

* seqpipe: ``Stage.forward`` (compute F), ``Stage.backward`` (compute B, which accumulates
  into ``.grad``), the loss, ``Transport.recv`` (waiting for a message, with posting the
  next receive, ``Transport._post``, split out), ``Transport.send`` (packing and posting a
  message), ``Transport._release`` (waiting for sends the receiver has taken),
  ``Transport.flush``;
* torch: ``forward_one_chunk``, ``backward_one_chunk``, the loss, ``_wait_batch_p2p``
  (waiting on sends and receives), ``_batch_p2p`` (posting them), ``perform_reduce_grad``
  (the ``1/M`` gradient scaling);

and whatever is left of the step ("rest": schedule bookkeeping, Python, the barrier exit).

*What-if* variants (``--what-if``): ``seqpipe <clock> lazy`` posts each receive only when
the message is needed instead of as soon as the previous one from that peer was taken
(``Transport.ahead = False``): what receiving ahead buys; ``seqpipe <clock> unsplit`` runs
each stage's last backward whole, as before session 9 (its plan built without
``plan.split_tails``): what splitting it buys; ``seqpipe <clock> packed`` copies every
payload into its message's one buffer, as before session 10 (``Transport.direct_bytes =
None``): what sending a large tensor apart from its header, uncopied, buys.

``--timeline NAME ...`` prints one step's events per rank for the named variants.

``--latency`` also times single gloo receives on loopback (2 KiB header and one
activation) when the send was posted well before the receive, with the sender idle or
busy computing: the price of one rendezvous (gloo's TCP transport moves an unbound
buffer only after the receiver has posted its receive and told the sender so).

Run: ``PYTHONPATH=. python benchmarks/dist_breakdown.py --latency`` (``--help`` for more).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as torch_schedules
from _common import make_model, pin_malloc
from dist_vs_torch_pipelining import (
    ONE,
    SEQ,
    TORCH,
    Variants,
    _busy_seconds,
    _init,
    _own_cpu,
    loss_fn,
    machine_line,
    spawn,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

import seqpipe.core.stage as seq_stage
import seqpipe.distributed.plan as seq_plan
from seqpipe.distributed import DistributedPipe
from seqpipe.distributed.transport import HEADER_SLOTS, Transport

WHAT_IFS = ("lazy", "unsplit", "packed")


# -- a self-time profiler --------------------------------------------------------------
class Clock:
    """Exclusive (self) time per label; nested wrapped calls are charged to the innermost.

    Only the main thread (the one running the step) is timed.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # wall time; ``time.thread_time`` for the thread's CPU
        self.totals: Dict[str, float] = defaultdict(float)
        self.counts: Dict[str, int] = defaultdict(int)
        self._stack: List[List[Any]] = []  # [label, start, time spent in children]
        self.events: Optional[List[Tuple[str, float, float, int]]] = None  # when recording

    def wrap(self, label: Callable[..., str] | str, fn: Callable[..., Any]) -> Callable[..., Any]:
        main = threading.main_thread()

        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not main:  # a receiver thread: off the step's path
                return fn(*args, **kwargs)
            name = label(*args, **kwargs) if callable(label) else label
            frame = [name, self.clock(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = self.clock() - frame[1]
                self.totals[name] += spent - frame[2]
                self.counts[name] += 1
                if self.events is not None:
                    self.events.append((name, frame[1], frame[1] + spent, len(self._stack)))
                if self._stack:
                    self._stack[-1][2] += spent
        return timed

    def reset(self) -> None:
        self.totals.clear()
        self.counts.clear()


CLOCK = Clock()


def instrument() -> None:
    """Wrap the functions whose time we split out (this process only)."""
    patches: List[Tuple[Any, str, Any]] = [
        (seq_stage.Stage, "forward", "compute F"),
        (seq_stage.Stage, "backward", "compute B"),
        (seq_stage.Stage, "backward_input", "compute B"),  # I, of a split last backward
        (seq_stage.Stage, "backward_weight", "compute W"),
        (seq_stage.Stage, "loss", "loss"),
        (Transport, "recv", "recv wait"),
        (Transport, "_post", "post recvs"),
        (Transport, "_release", "release sends"),
        (Transport, "send", "post sends"),
        (Transport, "flush", "wait sends (flush)"),
        (_PipelineStageBase, "forward_one_chunk", "compute F"),
        (_PipelineStageBase, "backward_one_chunk", "compute B"),
        (_PipelineStageBase, "perform_reduce_grad", "grad scaling"),
        (torch_schedules.PipelineScheduleSingle, "_maybe_compute_loss", "loss"),
        (torch_schedules, "_wait_batch_p2p", "p2p wait"),
        (torch_schedules, "_batch_p2p", "p2p post"),
    ]
    for owner, name, label in patches:
        setattr(owner, name, CLOCK.wrap(label, getattr(owner, name)))


# -- the what-if variants -------------------------------------------------------------
def what_if_steps(variants: Variants, rank: int, model: torch.nn.Sequential, chunks: int,
                  kinds: Sequence[str]) -> Dict[str, Callable[[], None]]:
    """seqpipe with receives posted only when a message is needed (as on NCCL), and with
    each stage's last backward run whole (not as I then W)."""
    half = len(model) // 2
    steps = {}
    for kind in kinds:
        for clock in ("fill_drain", "1f1b"):
            pipe = DistributedPipe(copy.deepcopy(model), chunks=chunks, balance=[half, half],
                                   schedule=clock, checkpoint="never", device="cpu")
            if kind == "lazy":
                pipe._transport.ahead = False
            elif kind == "packed":  # every payload copied into its message's one buffer
                pipe._transport.direct_bytes = None
            else:  # the plan of a call of ``chunks`` made (and kept) without the split
                with mock.patch.object(seq_plan, "split_tails",
                                       lambda actions, placement: [list(a) for a in actions]):
                    pipe._calls.plan(chunks, True)
            x = variants.x if rank == 0 else None
            y = variants.y if rank == 1 else None
            params = list(pipe.parameters())

            def step(pipe: DistributedPipe = pipe, params: List[Any] = params,
                     x: Any = x, y: Any = y) -> None:
                for p in params:
                    p.grad = None
                pipe.train_step(x, y, loss_fn)
            steps[f"seqpipe {clock} {kind}"] = step
    return steps


# -- the ranks -------------------------------------------------------------------------
def breakdown_rank(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    pin_malloc()
    _init(rank, port)
    instrument()
    model = make_model(args.width, args.depth)
    result: Dict[str, Any] = {}
    if args.latency:
        result["latency"] = latency(rank, args)
    variants = Variants(model, rank, args.chunks, args.micro_batch, args.width,
                        only=(*SEQ, *TORCH, ONE))
    steps = {name: variants.steps[name] for name in (*SEQ, *TORCH)}
    steps.update(what_if_steps(variants, rank, model, args.chunks, args.what_if))
    names = list(steps)
    for _ in range(args.warmup):
        for name in names:
            dist.barrier()
            steps[name]()
    dist.barrier()
    one = variants.steps[ONE]
    samples: Dict[str, List[Tuple[float, Dict[str, float]]]] = defaultdict(list)
    foreign: List[float] = []
    quiet = r = 0
    while quiet < args.rounds and r < args.max_rounds:
        dist.barrier()
        busy0, own0, w0 = _busy_seconds(), _own_cpu(), time.perf_counter()
        round_rows = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            CLOCK.reset()
            t0 = time.perf_counter()
            steps[name]()
            t1 = time.perf_counter()
            round_rows[name] = (t0, t1, dict(CLOCK.totals))
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            one()
            round_rows[ONE] = (t0, time.perf_counter(), {})
        dist.barrier()
        w1, own1, busy1 = time.perf_counter(), _own_cpu(), _busy_seconds()
        mine = torch.tensor([own1 - own0, busy1 - busy0, w1 - w0], dtype=torch.float64)
        both = [torch.zeros_like(mine) for _ in range(2)]
        dist.all_gather(both, mine)
        load = max(0.0, (float(both[0][1]) - float(both[0][0] + both[1][0])) / float(both[0][2]))
        r += 1
        if load > args.max_foreign:
            continue
        quiet += 1
        foreign.append(load)
        for name, (t0, t1, totals) in round_rows.items():
            samples[name].append((t0, t1, totals))
    timelines = {}
    for name in args.timeline:
        for _ in range(2):  # the second one is recorded
            dist.barrier()
            CLOCK.events = []
            steps[name]()
        timelines[name] = CLOCK.events
        CLOCK.events = None
    result["timelines"] = timelines
    result["samples"] = dict(samples)
    result["foreign"] = foreign
    result["rounds"] = r
    out.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def latency(rank: int, args: argparse.Namespace) -> Dict[str, List[float]]:
    """Receive times of a message whose send was posted 2 ms before the receive."""
    sizes = {"header 2 KiB": torch.zeros(HEADER_SLOTS, dtype=torch.int64),
             "activation": torch.zeros(args.micro_batch, args.width)}
    work = torch.randn(256, 1024), torch.randn(1024, 1024)
    out: Dict[str, List[float]] = defaultdict(list)
    for label, tensor in sizes.items():
        for busy in (False, True):
            for _ in range(40):
                dist.barrier()
                if rank == 0:
                    w = dist.isend(tensor, dst=1)
                    end = time.perf_counter() + 0.008
                    while busy and time.perf_counter() < end:
                        torch.mm(*work)
                    w.wait()
                else:
                    buf = torch.empty_like(tensor)
                    time.sleep(0.002)
                    t0 = time.perf_counter()
                    dist.recv(buf, src=0)
                    out[f"{label}, sender {'computing' if busy else 'idle'}"].append(
                        time.perf_counter() - t0)
    return dict(out)


# -- report ----------------------------------------------------------------------------
def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(answers: Dict[int, Dict[str, Any]], args: argparse.Namespace) -> List[str]:
    lines: List[str] = []
    if "latency" in answers[1]:
        lines += ["Gloo receive of a message sent 2 ms earlier (median of 40, rank 1):", ""]
        for label, values in answers[1]["latency"].items():
            lines.append(f"- {label}: {_med(values) * 1e6:.0f} µs (min {min(values) * 1e6:.0f})")
        lines.append("")
    s0, s1 = answers[0]["samples"], answers[1]["samples"]
    one = _med([t1 - t0 for t0, t1, _ in s0[ONE]])
    m = args.chunks
    ideal = 2 * m / (m + 1)
    lines += [f"M={m}, micro-batch {args.micro_batch}: {len(s0[ONE])} quiet rounds of "
              f"{answers[0]['rounds']}; foreign load median "
              f"{_med(answers[0]['foreign']):.2f} cores. 1 process: {one * 1e3:.1f} ms/step.",
              "", "Per rank, ms per step (median over rounds of each category's self time):", ""]
    labels = sorted({k for rows in (*s0.values(), *s1.values()) for _, _, t in rows for k in t})
    lines.append("| variant | step ms | efficiency | vs torch | rank | " + " | ".join(labels)
                 + " | rest |")
    lines.append("|---" * (len(labels) + 6) + "|")

    def walls(name: str) -> List[float]:
        return [max(a[1], b[1]) - min(a[0], b[0]) for a, b in zip(s0[name], s1[name])]

    for name in s0:
        if name == ONE:
            continue
        step = _med(walls(name))
        ratio = "-"
        if name.startswith("seqpipe"):  # paired with the torch schedule of the same clock
            ref = walls(TORCH[0] if "fill_drain" in name else TORCH[1])
            ratio = f"{_med([t / w for t, w in zip(ref, walls(name))]):.3f}×"
        for rank, rows in ((0, s0[name]), (1, s1[name])):
            cells = [_med([t.get(k, 0.0) for _, _, t in rows]) * 1e3 for k in labels]
            rest = _med([w - sum(t.values()) for w, (_, _, t) in zip(walls(name), rows)]) * 1e3
            head = (f"| {name} | {step * 1e3:.1f} | {one / step / ideal:.1%} | {ratio}"
                    if rank == 0 else "| | | |")
            lines.append(f"{head} | {rank} | " + " | ".join(f"{c:.1f}" for c in cells)
                         + f" | {rest:.1f} |")
    for name in args.timeline:
        lines += ["", f"Timeline of one step of {name} (ms from the first event; events of "
                  f"at least 0.05 ms; nested ones indented):", "", "```"]
        both = [answers[r]["timelines"][name] for r in (0, 1)]
        start = min(e[1] for events in both for e in events)
        for rank, events in enumerate(both):
            lines.append(f"rank {rank}:")
            for label, t0, t1, depth in sorted(events, key=lambda e: (e[1], e[3])):
                if t1 - t0 >= 5e-5:
                    lines.append(f"  {'  ' * depth}{(t0 - start) * 1e3:8.2f} "
                                 f"+{(t1 - t0) * 1e3:6.2f}  {label}")
        lines.append("```")
    return lines


def mlp_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    """The options of ``dist_vs_torch_pipelining.py``'s model at one ``M`` (``--chunks``),
    and how many timed and warm-up rounds (shared with ``dist_hops.py``)."""
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches per step (M)")
    parser.add_argument("--rounds", type=int, default=rounds, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mlp_arguments(parser, rounds=15)
    parser.add_argument("--max-foreign", type=float, default=0.3)
    parser.add_argument("--max-rounds", type=int, default=150)
    parser.add_argument("--latency", action="store_true", help="also time single receives")
    parser.add_argument("--timeline", nargs="*", default=[],
                        help="variants to print one step's timeline of, e.g. 'seqpipe 1f1b'")
    parser.add_argument("--what-if", nargs="*", default=["lazy"], choices=WHAT_IFS,
                        help="what-if variants: 'lazy' (receives posted only when needed), "
                             "'unsplit' (each stage's last backward whole), 'packed' (no "
                             "direct payloads); none: --what-if")
    args = parser.parse_args(argv)
    print(f"# {machine_line()} (at start)", file=sys.stderr, flush=True)
    answers = dict(spawn(breakdown_rank, args))
    print(f"Command: python {' '.join(sys.argv)}")
    print(f"Machine: {machine_line()} (at end)")
    print()
    print("\n".join(report(answers, args)))


if __name__ == "__main__":
    main()
