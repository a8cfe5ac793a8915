"""What the FSDP2 verdicts cost: a pp=2 × fsdp=2 step with and without them, interleaved.

    python benchmarks/dist_fsdp_verdicts.py [--rounds 20] [--width 256] [--layers 8]
                                            [--no-reshard]

4 gloo processes on loopback, one intra-op thread each: 2 stages, each sharded with
``fully_shard`` (each Linear, then the stage) over 2 ranks, ``reshard_after_forward=True``
unless ``--no-reshard`` (the setting with the most all-gathers, so the most verdicts: one per
communicating all-gather, and per group at the end of a step; see
seqpipe/distributed/fsdp_verdict.py).
Rounds alternate A (as shipped) and B (the verdicts' ``check`` made a no-op on every rank),
so machine load hits both; prints the median step time of each, the median of the per-round
ratios A/B, and the number of verdicts per step.
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

from dist_data_parallel import _model  # noqa: E402 - the same model

import seqpipe.distributed.fsdp_verdict as fsdp_verdict  # noqa: E402
from distributed_harness import free_port  # noqa: E402
from seqpipe.distributed import DistributedPipe, mesh_groups  # noqa: E402


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, _ = mesh_groups(mesh)
    n = 2 * args.layers
    pipe = DistributedPipe(_model(args.width, args.layers), chunks=args.chunks,
                           balance=[n // 2, n - n // 2], group=pp)
    for stage in pipe.stage_modules:
        for layer in stage:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=args.reshard)
        fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=args.reshard)
    x = torch.randn(args.batch, args.width) if pipe.is_first else None
    y = torch.randn(args.batch, args.width) if pipe.is_last else None
    check = fsdp_verdict.ShardedVerdicts.check
    calls = [0]

    def counted(self: fsdp_verdict.ShardedVerdicts, groups: List, before: str) -> None:
        calls[0] += len(groups)
        check(self, groups, before)

    def step() -> float:
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(x, y, nn.functional.mse_loss)
        dist.barrier()
        return time.perf_counter() - start

    fsdp_verdict.ShardedVerdicts.check = counted  # type: ignore[method-assign]
    step()  # warm up (FSDP2's lazy init), and count the verdicts of one step
    verdicts = calls[0]
    times: Dict[str, List[float]] = {"A": [], "B": []}
    for _ in range(args.rounds):
        for name in ("A", "B"):
            fsdp_verdict.ShardedVerdicts.check = (  # type: ignore[method-assign]
                check if name == "A" else lambda self, groups, before: None)
            pipe.zero_grad()
            times[name].append(step())
    fsdp_verdict.ShardedVerdicts.check = check  # type: ignore[method-assign]
    if rank == 0:
        out.update(times=times, verdicts=verdicts)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--no-reshard", dest="reshard", action="store_false",
                        help="reshard_after_forward=False: all-gathers at first use only")
    args = parser.parse_args()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(4, free_port(), args, out), nprocs=4, join=True)
        times, verdicts = dict(out["times"]), out["verdicts"]
    a, b = times["A"], times["B"]
    ratios = [x / y for x, y in zip(a, b)]
    print(f"pp=2 x fsdp=2, width {args.width}, {args.layers} Linear layers, {args.chunks} "
          f"micro-batches of {args.batch // args.chunks}, reshard_after_forward="
          f"{args.reshard}, {args.rounds} rounds")
    print(f"verdicts per step on rank 0: {verdicts}")
    print(f"step with verdicts    (A): median {statistics.median(a) * 1e3:.1f} ms")
    print(f"step without verdicts (B): median {statistics.median(b) * 1e3:.1f} ms")
    print(f"A/B: median of per-round ratios {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
