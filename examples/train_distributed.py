"""Pipelined training with one stage per process, launched by torchrun.

    torchrun --nproc-per-node=2 examples/train_distributed.py --chunks 8 --schedule 1f1b

On a cluster, start the same command on every node with ``--nnodes``, ``--node-rank`` and a
rendezvous endpoint (see docs/distributed.md). Every rank runs this same script.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from seqpipe.demo import parse_args, run_distributed


def main() -> None:
    args = parse_args()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    try:
        run_distributed(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
