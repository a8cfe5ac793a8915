"""3-D parallelism: pipeline × FSDP2 × tensor parallelism on one DeviceMesh, as torchtitan
builds it, with a small transformer language model.

    torchrun --nproc-per-node=8 examples/train_3d.py          # gloo on CPU works too

8 ranks as a mesh ("pp", "dp", "tp") = (2, 2, 2): 2 pipeline stages, each sharded over 2
ranks with FSDP2 (``fully_shard``) and each block split over 2 ranks with tensor
parallelism (``parallelize_module``: attention heads and the MLP's hidden units). The
recipe: build the ``DistributedPipe``, then for this rank's ``pipe.stage_modules`` apply TP,
then FSDP2, then train with ``train_step``. Every rank also trains the same model in one
process on the whole batch and prints both losses: they agree (to float64 rounding).
"""
import os

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from seqpipe.distributed import DistributedPipe, mesh_groups

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 16


class Block(nn.Module):
    """A pre-norm transformer block. Its head count follows the width of ``qkv``'s output,
    so the same code runs whole and with its heads split over the tensor-parallel ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(b, s, -1, DIM // HEADS).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))  # -1: this rank's heads
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


def make_model() -> nn.Sequential:
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    return nn.Sequential(nn.Embedding(VOCAB, DIM), *(Block() for _ in range(4)),
                         nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


TP_PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
           "o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


def main(steps: int = 3, batch: int = 8) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)  # so that the comparison below is exact to
    # rounding: in float32, AdamW turns rounding noise in a gradient that is zero in exact
    # arithmetic (the key projection's bias, to which softmax is blind) into whole steps
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp, _ = mesh_groups(mesh)  # the pipeline group; FSDP2 reduces over "dp" itself

    pipe = DistributedPipe(make_model(), chunks=4, balance=[3, 4], group=pp, schedule="zb_h1")
    whole = sum(p.numel() for p in pipe.parameters())
    for stage in pipe.stage_modules:
        for layer in stage:                      # 1. tensor parallelism on "tp"
            if isinstance(layer, Block):
                parallelize_module(layer, mesh["tp"], TP_PLAN)
        for layer in stage:                      # 2. FSDP2 on "dp": each block a unit ...
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])      # ... and the stage as the root
    held = sum(p.to_local().numel() for p in pipe.parameters())
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)

    reference = make_model()                     # the same model, in one process
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    replica, share = mesh["dp"].get_local_rank(), batch // 2
    rank = dist.get_rank()
    if rank == 0:
        print(f"rank 0 holds {held} of its stage's {whole} parameter values", flush=True)
    for step in range(1, steps + 1):
        gen = torch.Generator().manual_seed(step)  # the same batch on every rank
        tokens = torch.randint(VOCAB, (batch, SEQ + 1), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        mine = slice(replica * share, (replica + 1) * share)  # this replica's share
        optimizer.zero_grad()
        loss = pipe.train_step(x[mine] if pipe.is_first else None,
                               y[mine] if pipe.is_last else None, lm_loss)
        optimizer.step()
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # the replicas' mean
        ref_optimizer.zero_grad()
        ref_loss = lm_loss(reference(x), y)
        ref_loss.backward()
        ref_optimizer.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item() / 2:.10f} "
                  f"(single process {ref_loss.item():.10f})", flush=True)

    theirs = dict(reference.named_parameters())
    with torch.no_grad():
        worst = max(float((p.full_tensor() if isinstance(p, DTensor) else p).sub(theirs[n])
                          .abs().max()) for n, p in pipe.named_parameters())
    print(f"rank {rank}: parameters after {steps} steps differ from the single-process "
          f"model's by at most {worst:.2e}", flush=True)
    del pipe, optimizer                          # let go of the groups first
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        raise SystemExit("run with: torchrun --nproc-per-node=8 examples/train_3d.py")
    main()
