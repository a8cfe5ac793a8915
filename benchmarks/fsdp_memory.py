"""Bytes per rank of a pipeline stage sharded with FSDP2, against the unsharded stage.

    python benchmarks/fsdp_memory.py [--shards 1,2,4] [--width 256] [--layers 8]

For each ``dp_shard`` in ``--shards``: 2 stages × ``dp_shard`` gloo processes on loopback
(2, 4, 8), each stage ``--layers`` × (Linear(width) + ReLU), each Linear then the stage
``fully_shard``-ed over the ranks of its ``dp`` dimension; two ``train_step``s (1F1B, 4
micro-batches) and two AdamW steps. Printed per rank of stage 0 (stage 1 is the same size),
in bytes:

* after the step, what a rank holds between steps: the parameters, their gradients and
  AdamW's state (each storage counted once, FSDP2's padding included), and their sum as a
  fraction of the unsharded stage's (the same pipe without FSDP2, measured the same way);
* during a step (the second), the peak of FSDP2's unsharded parameters (all-gathered) and
  of the unreduced unsharded gradients, sampled after every all-gather completes and before
  every parameter group's reduction, and the all-gathers this rank issued, with
  ``reshard_after_forward`` True and False.

The sizes are counted from the tensors, not from the allocator: exact and independent of
the machine's load.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dist_data_parallel import _model  # noqa: E402 - Linear(width) + ReLU blocks

from distributed_harness import free_port  # noqa: E402
from seqpipe.distributed import DistributedPipe, mesh_groups  # noqa: E402


def _bytes(tensors: Iterable[Optional[Tensor]]) -> int:
    """The bytes of the storages behind ``tensors`` (a ``DTensor``: its local shard's),
    each storage once; a freed one (FSDP2 resizes them to 0) counts 0."""
    seen: Dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        local = getattr(tensor, "_local_tensor", tensor)
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class _Peaks:
    """The peak bytes of this rank's unsharded FSDP2 parameters and gradients, sampled
    after each all-gather completes and before each parameter group's reduction; and the
    all-gathers counted."""

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group
        FSDPParamGroup = _fsdp_param_group.FSDPParamGroup
        self.groups: List[Any] = []
        self.params = self.grads = self.gathers = 0
        wait, post = FSDPParamGroup.wait_for_unshard, FSDPParamGroup.post_backward
        gather = _fsdp_param_group.foreach_all_gather

        def gathered(*args: Any, **kwargs: Any) -> Any:
            self.gathers += 1
            return gather(*args, **kwargs)
        _fsdp_param_group.foreach_all_gather = gathered

        def waited(group: Any, *args: Any, **kwargs: Any) -> Any:
            result = wait(group, *args, **kwargs)
            self.sample()
            return result

        def posted(group: Any, *args: Any, **kwargs: Any) -> Any:
            self.sample()
            return post(group, *args, **kwargs)
        FSDPParamGroup.wait_for_unshard = waited  # type: ignore[method-assign]
        FSDPParamGroup.post_backward = posted  # type: ignore[method-assign]

    def sample(self) -> None:
        fsdp_params = [p for group in self.groups for p in group.fsdp_params]
        unsharded = [getattr(p, "_unsharded_param", None) for p in fsdp_params]
        self.params = max(self.params, _bytes(
            t for p in fsdp_params for t in p.all_gather_outputs))
        self.grads = max(self.grads, _bytes(
            [u.grad for u in unsharded if u is not None]
            + [p.unsharded_accumulated_grad for p in fsdp_params]))


def _held(pipe: DistributedPipe, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    params = list(pipe.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {"params": _bytes(params), "grads": _bytes(p.grad for p in params),
            "adamw": _bytes(state)}


def _run(pipe: DistributedPipe, args: argparse.Namespace,
         peaks: Optional[_Peaks] = None) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width) if pipe.is_first else None
    y = torch.randn(args.batch, args.width) if pipe.is_last else None
    for _ in range(2):
        if peaks is not None:  # the last step's
            peaks.params = peaks.grads = peaks.gathers = 0
        optimizer.zero_grad()
        pipe.train_step(x, y, nn.functional.mse_loss)
        optimizer.step()
    return optimizer


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    shards = world // 2
    mesh = init_device_mesh("cpu", (2, shards), mesh_dim_names=("pp", "dp"))
    pp, _ = mesh_groups(mesh)
    n = args.layers * 2
    kw = dict(chunks=args.chunks, balance=[n, n], group=pp, schedule="1f1b")
    rows: Dict[str, Dict[str, int]] = {}
    if shards == 1:  # the unsharded stage, as a baseline
        pipe = DistributedPipe(_model(args.width, 2 * args.layers), **kw)
        rows["unsharded"] = _held(pipe, _run(pipe, args))
    peaks = _Peaks()
    for reshard in (True, False):
        pipe = DistributedPipe(_model(args.width, 2 * args.layers), **kw)
        for stage in pipe.stage_modules:
            for layer in stage:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard)
            fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=reshard)
        peaks.groups = [group for stage in pipe.stage_modules for module in stage.modules()
                        if hasattr(module, "_get_fsdp_state")
                        for group in module._get_fsdp_state()._fsdp_param_groups]
        optimizer = _run(pipe, args, peaks)
        rows[f"fsdp2 reshard={reshard}"] = dict(
            _held(pipe, optimizer), peak_params=peaks.params, peak_grads=peaks.grads,
            gathers=peaks.gathers)
    if rank < shards:  # stage 0's ranks
        out[rank] = rows
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,2,4", help="dp_shard sizes (2 x each ranks)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8, help="Linear layers per stage")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    per_rank: Dict[int, Dict[int, Dict[str, Dict[str, int]]]] = {}
    for shards in (int(s) for s in args.shards.split(",")):
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_worker, args=(2 * shards, free_port(), args, out), nprocs=2 * shards,
                     join=True)
            per_rank[shards] = {rank: dict(rows) for rank, rows in out.items()}
    base = per_rank.get(1, {}).get(0, {}).get("unsharded")
    stage = args.layers * (args.width * args.width + args.width)
    print(f"2 stages x dp_shard, stage = {args.layers} x (Linear({args.width}) + ReLU): "
          f"{stage} parameters, {4 * stage} bytes in float32; bytes per rank of stage 0")
    print(f"{'dp_shard':>8} {'rank':>4} {'setting':<20} {'params':>9} {'grads':>9} "
          f"{'AdamW':>9} {'total':>9} {'/unsharded':>10} {'peak unsharded params':>21} "
          f"{'peak unsharded grads':>20} {'all-gathers':>11}")
    for shards, ranks in per_rank.items():
        for rank in sorted(ranks):
            for setting, row in ranks[rank].items():
                total = row["params"] + row["grads"] + row["adamw"]
                base_total = base["params"] + base["grads"] + base["adamw"] if base else 0
                fraction = f"{total / base_total:.3f}" if base_total else "-"
                print(f"{shards:>8} {rank:>4} {setting:<20} {row['params']:>9} "
                      f"{row['grads']:>9} {row['adamw']:>9} {total:>9} {fraction:>10} "
                      f"{row.get('peak_params', '-'):>21} {row.get('peak_grads', '-'):>20} "
                      f"{row.get('gathers', '-'):>11}")


if __name__ == "__main__":
    main()
