"""The job of the two-node test: launched by torchrun on each "node" (see test_multinode.py).

2 pipeline stages × 2 replicas on 4 ranks: node 0 holds stage 0's replicas, node 1 stage 1's,
so activations and gradients cross between the nodes. Each rank checks its gradients
against one process on the global batch and writes the verdict to ``--out``/rank<N>.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from seqpipe.distributed import DistributedPipe, mesh_groups  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    verdict = "error"
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp, dp = mesh_groups(mesh)
        replica = dist.get_rank(dp)
        torch.manual_seed(0)
        reference = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(),
                                  nn.Linear(8, 2)).double()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(),
                              nn.Linear(8, 2)).double()
        pipe = DistributedPipe(model, chunks=2, balance=[2, 3], group=pp,
                               data_parallel_group=dp)
        x = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        y = torch.randn(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        half = slice(replica * 4, replica * 4 + 4)
        pipe.train_step(x[half] if pipe.is_first else None, y[half] if pipe.is_last else None,
                        nn.functional.mse_loss)
        nn.functional.mse_loss(reference(x), y).backward()
        expected = dict(reference.named_parameters())
        same = all(torch.allclose(p.grad, expected[n].grad, atol=1e-12)
                   for n, p in pipe.named_parameters())
        verdict = f"ok node={os.environ.get('GROUP_RANK')} stage={pipe.stage_index}" if same \
            else "gradients differ"
    finally:
        with open(os.path.join(args.out, f"rank{rank}"), "w") as file:
            file.write(verdict)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
