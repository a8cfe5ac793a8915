"""How long posting point-to-point operations takes inside seqpipe training steps.

Posting a gloo ``irecv``/``isend`` should take microseconds, but it writes a small notice
to the pair's socket and can stall behind traffic on it (see docs/benchmark-history.md,
"Diagnosis"). This runs ``--steps`` training steps of a 2-rank ``DistributedPipe`` (the
model of ``dist_vs_torch_pipelining.py``) and, on each rank, times every ``dist.irecv`` and
``dist.isend`` call the transport makes, after 3 warm-up steps: the total, and how many
took over 1 ms (and their sum).

Run: ``PYTHONPATH=. python benchmarks/dist_post_stalls.py [--schedule 1f1b] [--steps 20]``
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, List

import torch
import torch.distributed as dist
from _common import make_model, pin_malloc
from dist_vs_torch_pipelining import _init, machine_line, spawn

import seqpipe.distributed.transport as seq_transport
from seqpipe.distributed import DistributedPipe

WARMUP = 3


def _timed(fn: Callable[..., Any], into: List[float]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)
    return call


def rank_main(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    pin_malloc()
    _init(rank, port)
    model = make_model(args.width, args.depth)
    half = len(model) // 2
    pipe = DistributedPipe(model, chunks=args.chunks, balance=[half, half],
                           schedule=args.schedule, checkpoint="never", device="cpu")
    recvs: List[float] = []
    sends: List[float] = []
    seq_transport.dist.irecv = _timed(dist.irecv, recvs)  # type: ignore[attr-defined]
    seq_transport.dist.isend = _timed(dist.isend, sends)  # type: ignore[attr-defined]
    x = torch.randn(args.chunks * args.micro_batch, args.width)
    y = torch.randn(args.chunks * args.micro_batch, args.width)
    walls = []
    for step in range(WARMUP + args.steps):
        if step == WARMUP:
            recvs.clear()
            sends.clear()
        for p in pipe.parameters():
            p.grad = None
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(x if rank == 0 else None, y if rank == 1 else None,
                        torch.nn.functional.mse_loss)
        walls.append(time.perf_counter() - start)
    out.put((rank, statistics.median(walls[WARMUP:]), list(recvs), list(sends)))
    dist.barrier()
    dist.destroy_process_group()


def _line(label: str, times: List[float]) -> str:
    slow = [t for t in times if t > 1e-3]
    return (f"{label} {len(times)} calls, {sum(times) * 1e3:.1f} ms in all; "
            f"{len(slow)} over 1 ms ({sum(slow) * 1e3:.1f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    args = parser.parse_args()
    results = sorted(spawn(rank_main, args))
    print(f"Command: python {' '.join(sys.argv)}")
    print(f"Machine: {machine_line()}")
    print(f"{args.steps} steps of {args.schedule}, M={args.chunks}, after {WARMUP} warm-up:")
    for rank, wall, recvs, sends in results:
        print(f"rank {rank}: step median {wall * 1e3:.1f} ms; {_line('irecv', recvs)}; "
              f"{_line('isend', sends)}")


if __name__ == "__main__":
    main()
