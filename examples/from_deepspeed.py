"""A DeepSpeed pipeline-parallel training script, ported to seqpipe.

DeepSpeed's pipeline example trains a small CNN written as a list of layers, wrapped in a
``PipelineModule`` and driven by ``engine.train_batch()``. Here is the same job on seqpipe:

    torchrun --nproc-per-node=2 examples/from_deepspeed.py
    python examples/from_deepspeed.py            # the same, on 2 local processes

DeepSpeed:

    layers = [LayerSpec(nn.Conv2d, 3, 64, 3), ...]
    net = PipelineModule(layers, num_stages=2, loss_fn=F.cross_entropy,
                         partition_method="type:Conv2d")
    engine, _, _, _ = deepspeed.initialize(model=net, config=...)
    loss = engine.train_batch(data_iter)

seqpipe:

    layers = [nn.Conv2d(3, 64, 3), ...]
    model = nn.Sequential(*layers)
    pipe = DistributedPipe(model, chunks=4,              # gradient_accumulation_steps
                           balance=balance_by_type(2, model, "Conv2d"))
    optimizer = torch.optim.Adam(pipe.parameters(), lr=...)
    loss = pipe.train_step(x, y, F.cross_entropy)        # x on the first stage, y on the last
    optimizer.step()

Every rank runs this script; the first stage reads the images, the last the labels (the
others pass ``None``), and every rank gets the loss back.
"""
from __future__ import annotations

import os
from typing import Iterator, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from seqpipe.balance import balance_by_type
from seqpipe.distributed import DistributedPipe

MICRO_BATCH, ACCUMULATION, STEPS, CLASSES = 8, 4, 20, 10


def vgg_layers(width: int = 16) -> List[nn.Module]:
    """A small VGG-like CNN as a flat list of layers, as DeepSpeed's example writes it."""
    w = width
    return [nn.Conv2d(3, w, 3, padding=1), nn.ReLU(), nn.Conv2d(w, w, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, CLASSES)]


def batches(seed: int = 0) -> Iterator[Tuple[Tensor, Tensor]]:
    """Synthetic, learnable CIFAR-shaped data: a colour and a texture per class, plus noise."""
    gen = torch.Generator().manual_seed(seed)
    prototypes = (torch.randn(CLASSES, 3, 1, 1, generator=gen)
                  + 0.5 * torch.randn(CLASSES, 3, 32, 32, generator=gen))
    while True:
        labels = torch.randint(CLASSES, (MICRO_BATCH * ACCUMULATION,), generator=gen)
        yield prototypes[labels] + torch.randn(len(labels), 3, 32, 32, generator=gen), labels


def train() -> float:
    """Train on every rank of the initialised process group; return the last loss."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(*vgg_layers())
    balance = balance_by_type(dist.get_world_size(), model, "Conv2d")  # "type:Conv2d"
    pipe = DistributedPipe(model, chunks=ACCUMULATION, balance=balance, schedule="1f1b")
    optimizer = torch.optim.Adam(pipe.parameters(), lr=3e-3)
    data = batches()
    loss = torch.tensor(float("nan"))
    for step in range(1, STEPS + 1):
        images, labels = next(data)
        optimizer.zero_grad()
        loss = pipe.train_step(images if pipe.is_first else None,
                               labels if pipe.is_last else None, F.cross_entropy)
        optimizer.step()
        if dist.get_rank() == 0 and (step == 1 or step % 5 == 0):
            print(f"step {step:2d}  loss {loss.item():.4f}", flush=True)
    if dist.get_rank() == 0:
        print(f"stages: balance={pipe.balance}", flush=True)
    return loss.item()


def _run(_: object = None) -> None:
    train()


if __name__ == "__main__":
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
        try:
            train()
        finally:
            dist.destroy_process_group()
    else:
        from seqpipe.launch import spawn_local

        spawn_local(2, _run, None)
