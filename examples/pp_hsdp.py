"""Pipeline × HSDP on 8 CPU processes: 2 stages × (2 replicas × 2 shards), against one process.

    torchrun --nproc-per-node=8 examples/pp_hsdp.py        (or python -m torch.distributed.run)

Each of the 2 pipelines' stages is sharded with ``fully_shard`` on a 2-D ``(rep, shard)``
mesh (HSDP: parameters sharded over 2 ranks, the shards replicated twice), the recipe of
docs/distributed.md ("replicate, HSDP and the whole mesh"). Every rank also trains the
unpipelined model on the whole batch; rank 0 prints, per schedule and step, the loss, the
largest relative difference of any gradient and of the clipped gradient norm
(``pipe.clip_grad_norm_``) from the single-process model's. Three AdamW steps per schedule.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from seqpipe.distributed import DistributedPipe, mesh_groups


def build() -> nn.Sequential:
    """A small MLP: an input projection, 8 blocks (LayerNorm, Linear, GELU, Linear), a head."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
              for _ in range(8)]
    return nn.Sequential(nn.Linear(16, 32), *blocks, nn.Linear(32, 4)).double()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dist.get_world_size() != 8:
        raise SystemExit("run on 8 processes: torchrun --nproc-per-node=8 examples/pp_hsdp.py")
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "rep", "shard"))
    flat = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    pp, _ = mesh_groups(flat)  # the pipeline group (and its second group)
    replica = flat["dp"].get_local_rank()  # which quarter of the batch this pipeline reads
    for schedule in ("1f1b", "zb_h1", "interleaved_1f1b"):
        balance = [3, 2, 2, 3] if schedule == "interleaved_1f1b" else [5, 5]
        pipe = DistributedPipe(build(), chunks=4, balance=balance, schedule=schedule,
                               group=pp)
        for stage in pipe.stage_modules:
            for layer in stage:
                fully_shard(layer, mesh=mesh["rep", "shard"])
            fully_shard(stage, mesh=mesh["rep", "shard"])
        reference = build()
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)
            x, y = x.double(), y.double()
            mine = slice(8 * replica, 8 * replica + 8)
            opt.zero_grad()
            loss = pipe.train_step(x[mine] if pipe.is_first else None,
                                   y[mine] if pipe.is_last else None, nn.functional.mse_loss)
            norm = pipe.clip_grad_norm_(1.0)
            ref_opt.zero_grad()
            ref_loss = nn.functional.mse_loss(reference(x), y)
            ref_loss.backward()
            ref_norm = nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            theirs = dict(reference.named_parameters())
            worst = max(relative(p.grad.full_tensor() if isinstance(p.grad, DTensor)
                                 else p.grad, theirs[n].grad)
                        for n, p in pipe.named_parameters())
            worst_t = torch.tensor([worst, relative(norm, ref_norm.double())],
                                   dtype=torch.float64)
            dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
            dist.all_reduce(loss, group=flat["dp"].get_group())
            if dist.get_rank() == 0:
                print(f"{schedule:17s} step {step}: loss {float(loss) / 4:.10f} "
                      f"(one process {float(ref_loss.detach()):.10f}), largest relative gradient "
                      f"difference {float(worst_t[0]):.1e}, of the norm "
                      f"{float(worst_t[1]):.1e}", flush=True)
            opt.step()
            ref_opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
