"""Pipeline × data parallelism: the time of a 2×2 step against the same step without DP.

    python benchmarks/dist_data_parallel.py [--steps 20] [--width 512] [--layers 8]

Runs 2 stages on 2 processes (no data parallelism), then 2 stages × 2 replicas on 4
processes (the same per-replica mini-batch, gradients averaged over the replicas), gloo on
loopback, one intra-op thread per process. Prints the median step time of each, their
ratio, how much of the 2×2 step was spent waiting for the gradient all-reduce after
the last backward (the part the overlap did not hide), and what the step's verdict (the
8-byte all-reduce that tells replicas whether one failed) costs: alone, back to back, and
added to the stage's gradient all-reduce (with and without it, paired).

On a machine with fewer cores than processes the ratio also counts CPU contention (4
processes share the cores); the exposed-wait column isolates the communication cost.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from distributed_harness import free_port  # noqa: E402
from seqpipe.distributed import DistributedPipe, mesh_groups  # noqa: E402
from seqpipe.distributed.data_parallel import GradientReducer  # noqa: E402
from seqpipe.distributed.verdict import Verdict  # noqa: E402


def _model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    body: List[nn.Module] = []
    for _ in range(layers):
        body += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*body)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    if world == 4:
        from torch.distributed.device_mesh import init_device_mesh
        pp, dp = mesh_groups(init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")))
    else:
        pp, dp = None, None
    n = len(_model(args.width, args.layers))
    pipe = DistributedPipe(_model(args.width, args.layers), chunks=args.chunks,
                           balance=[n // 2, n - n // 2], group=pp, data_parallel_group=dp)
    waited: List[float] = []
    if pipe._reducer is not None:
        finish = GradientReducer.finish

        def timed(self: GradientReducer, where: str) -> None:
            start = time.perf_counter()
            finish(self, where)
            waited.append(time.perf_counter() - start)
        pipe._reducer.finish = timed.__get__(pipe._reducer)  # type: ignore[method-assign]
    x = torch.randn(args.batch, args.width)
    times: List[float] = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(x if pipe.is_first else None, x if pipe.is_last else None,
                        nn.functional.mse_loss)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if rank == 0:
        out["step"] = statistics.median(times)
        out["wait"] = statistics.median(waited[args.warmup:]) if waited else 0.0
    if dp is not None:
        alone, added = _verdict_costs(pipe, dp, args.verdicts)
        if rank == 0:
            out["verdict"], out["added"] = alone, added
    dist.destroy_process_group()


def _verdict_costs(pipe: DistributedPipe, dp: dist.ProcessGroup, n: int) -> tuple:
    """The step's verdict: its median time alone, back to back, and the median of what it
    adds to this stage's gradient all-reduce (the same buckets, with and without it, in
    alternating order, paired)."""
    flats = [torch.cat([p.grad.reshape(-1) for p in bucket] + [torch.ones(len(bucket))])
             for bucket in pipe._reducer.buckets]
    alone: List[float] = []
    added: List[float] = []
    for i in range(n):
        start = time.perf_counter()
        Verdict(dp, pipe.device).failures()
        alone.append(time.perf_counter() - start)
        took = {}
        for with_verdict in ((False, True) if i % 2 else (True, False)):
            dist.barrier(group=dp)
            start = time.perf_counter()
            works = [dist.all_reduce(f, group=dp, async_op=True) for f in flats]
            verdict = Verdict(dp, pipe.device) if with_verdict else None
            for work in works:
                work.wait()
            if verdict is not None:
                verdict.failures()
            took[with_verdict] = time.perf_counter() - start
        added.append(took[True] - took[False])
    return statistics.median(alone), statistics.median(added)


def _run(world: int, args: argparse.Namespace) -> Dict:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(world, free_port(), args, out), nprocs=world)
        return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--verdicts", type=int, default=200)
    args = parser.parse_args()
    alone = _run(2, args)
    both = _run(4, args)
    params = sum(p.numel() for p in _model(args.width, args.layers).parameters())
    print(f"model: {args.layers} x Linear({args.width}) ({params / 1e6:.2f} M params), "
          f"batch {args.batch} per replica, chunks {args.chunks}")
    print(f"2 stages x 1 replica : {alone['step'] * 1e3:8.1f} ms / step")
    print(f"2 stages x 2 replicas: {both['step'] * 1e3:8.1f} ms / step  "
          f"(ratio {both['step'] / alone['step']:.2f}x)")
    print(f"  exposed all-reduce wait after the last backward: {both['wait'] * 1e3:.1f} ms "
          f"({both['wait'] / both['step']:.1%} of the step)")
    print(f"  the step's verdict (8-byte all-reduce over the replicas), median of "
          f"{args.verdicts}: alone {both['verdict'] * 1e6:.0f} us; added to the stage's "
          f"gradient all-reduce {both['added'] * 1e6:.0f} us "
          f"({both['added'] / both['step']:.2%} of the step)")


if __name__ == "__main__":
    main()
