"""Pipelined training with one stage per process (DistributedPipe): the pattern to copy.

    torchrun --nproc-per-node=2 examples/train_distributed.py

On a cluster, start the same command on every node with ``--nnodes``, ``--node-rank`` and a
rendezvous endpoint (see docs/distributed.md). Every rank runs this same script.
"""
import os

import torch
import torch.distributed as dist
from torch import nn

from seqpipe.distributed import DistributedPipe


def main(steps: int = 20, batch: int = 32) -> float:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():                        # torchrun sets 1 thread
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    torch.manual_seed(0)                                     # the same model on every rank
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
        nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    pipe = DistributedPipe(model, chunks=4, schedule="1f1b")  # rank r holds stage r
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    prototypes = torch.randn(10, 64)                         # the same data on every rank

    for step in range(1, steps + 1):
        labels = torch.randint(10, (batch,))
        inputs = prototypes[labels] + 0.5 * torch.randn(batch, 64)
        optimizer.zero_grad()
        loss = pipe.train_step(inputs.to(pipe.device) if pipe.is_first else None,  # stage 0
                               labels.to(pipe.device) if pipe.is_last else None,   # last
                               loss_fn)
        optimizer.step()
        if step % 5 == 0 and dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    del pipe, optimizer                                      # let go of the group first
    dist.destroy_process_group()
    return loss.item()


if __name__ == "__main__":
    main()
