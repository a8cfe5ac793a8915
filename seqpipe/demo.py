"""The demo behind ``python -m seqpipe``: a short pipelined training run of a small CNN.

The data is synthetic but learnable (each class is a fixed random image plus noise), so the
loss visibly falls without any download. The model is split over the default devices — every
GPU if there are several, else two ``cpu`` partitions — with a balance chosen by profiling.
"""
from __future__ import annotations

import argparse
import time
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from seqpipe.balance import balance_by_params, balance_by_size, balance_by_time
from seqpipe.pipe import Pipe

__all__ = ["build_model", "make_data", "main", "parse_args", "run_distributed"]


def build_model(num_classes: int = 10, width: int = 16) -> nn.Sequential:
    """A small VGG-style CNN for 3×32×32 images, written as one ``nn.Sequential``."""
    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
        nn.Conv2d(w, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(inplace=True),
        nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.BatchNorm2d(4 * w), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(4 * w, num_classes),
    )


def make_data(steps: int, batch: int, num_classes: int = 10, noise: float = 1.0,
              seed: int = 0) -> List[Tuple[Tensor, Tensor]]:
    """``steps`` mini-batches of noisy class prototypes: learnable, and needs no download."""
    gen = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(num_classes, 3, 32, 32, generator=gen)
    data = []
    for _ in range(steps):
        labels = torch.randint(num_classes, (batch,), generator=gen)
        images = prototypes[labels] + noise * torch.randn(batch, 3, 32, 32, generator=gen)
        data.append((images, labels))
    return data


def default_split() -> Tuple[int, List[str]]:
    """Every visible GPU when there are two or more; two ``cpu`` partitions otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 1:
        n = torch.cuda.device_count()
        return n, [f"cuda:{i}" for i in range(n)]
    if torch.cuda.is_available():
        return 1, ["cuda:0"]
    return 2, ["cpu", "cpu"]


def choose_balance(how: str, partitions: int, model: nn.Sequential, sample: Tensor,
                   chunks: int) -> List[int]:
    """Pick the balance the way the user asked on the command line."""
    if how == "params":
        return balance_by_params(partitions, model)
    if how == "size":
        return balance_by_size(partitions, model, sample, chunks=chunks)
    return balance_by_time(partitions, model, sample[: max(1, len(sample) // chunks)],
                           timeout=0.5)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m seqpipe", description=__doc__)
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--batch", type=int, default=32, help="mini-batch size")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    parser.add_argument("--partitions", type=int, default=None,
                        help="number of partitions (default: GPUs, or 2 on CPU)")
    parser.add_argument("--checkpoint", default="except_last",
                        choices=["always", "except_last", "never"])
    parser.add_argument("--balance-by", default="time", choices=["time", "size", "params"])
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=0,
                        help="run DistributedPipe over this many local processes, one stage "
                             "each (gloo on CPU, NCCL when every process gets a GPU)")
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "fill_drain"],
                        help="the clock of the distributed run")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Train for a few steps and print the split, the loss and the throughput."""
    args = parse_args(argv)
    if args.processes:
        from seqpipe.launch import spawn_local

        spawn_local(args.processes, run_distributed, args)
        return float("nan")
    torch.manual_seed(args.seed)
    partitions, devices = default_split()
    if args.partitions is not None:
        partitions = args.partitions
        devices = (devices * partitions)[:partitions] if devices[0] == "cpu" else devices
    data = make_data(args.steps, args.batch, seed=args.seed)
    model = build_model()
    balance = choose_balance(args.balance_by, partitions, model, data[0][0], args.chunks)
    pipe = Pipe(model, chunks=args.chunks, checkpoint=args.checkpoint,
                deferred_batch_norm=True, balance=balance, devices=devices[:partitions])
    print(f"seqpipe demo: {len(model)} layers split as balance={pipe.balance} "
          f"(by {args.balance_by}) over {[str(d) for d in pipe.devices]}, chunks={args.chunks}, "
          f"checkpoint={args.checkpoint!r}")
    for i, part in enumerate(pipe.partitions):
        names = ", ".join(type(layer).__name__ for layer in part)
        print(f"  partition {i} on {pipe.devices[i]}: {names}")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    out_device = pipe.devices[-1]
    start, seen, loss_value = time.perf_counter(), 0, float("nan")
    for step, (images, labels) in enumerate(data, 1):
        optimizer.zero_grad()
        loss = loss_fn(pipe(images), labels.to(out_device))
        loss.backward()
        optimizer.step()
        seen += len(images)
        loss_value = loss.item()
        if step == 1 or step % 5 == 0 or step == len(data):
            rate = seen / (time.perf_counter() - start)
            print(f"step {step:3d}/{len(data)}  loss {loss_value:.4f}  {rate:8.1f} samples/s")
    elapsed = time.perf_counter() - start
    print(f"done: {seen} samples in {elapsed:.2f} s ({seen / elapsed:.1f} samples/s), "
          f"final loss {loss_value:.4f}")
    return loss_value


def run_distributed(args: argparse.Namespace) -> float:
    """The same training with ``DistributedPipe``: call on every rank of an initialised group.

    Rank 0 chooses the balance (profiling is not bit-identical between processes) and
    shares it; stage 0 reads the images, the last stage the labels.
    """
    import torch.distributed as dist

    from seqpipe.distributed import DistributedPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    torch.manual_seed(args.seed)
    data = make_data(args.steps, args.batch, seed=args.seed)
    model = build_model()
    balance = torch.zeros(world, dtype=torch.int64, device=device)
    if rank == 0:
        chosen = choose_balance(args.balance_by, world, model, data[0][0], args.chunks)
        balance.copy_(torch.tensor(chosen))
    dist.broadcast(balance, src=0)
    pipe = DistributedPipe(model, chunks=args.chunks, balance=balance.tolist(),
                           schedule=args.schedule, checkpoint=args.checkpoint,
                           deferred_batch_norm=True, device=device)
    if rank == 0:
        print(f"seqpipe distributed demo: {world} processes ({dist.get_backend()}), "
              f"balance={pipe.balance}, chunks={args.chunks}, schedule={args.schedule!r}, "
              f"checkpoint={args.checkpoint!r}", flush=True)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    start, seen, loss_value = time.perf_counter(), 0, float("nan")
    for step, (images, labels) in enumerate(data, 1):
        optimizer.zero_grad()
        loss = pipe.train_step(images if pipe.is_first else None,
                               labels.to(device) if pipe.is_last else None, loss_fn)
        optimizer.step()
        seen += len(images)
        loss_value = loss.item()
        if rank == 0 and (step == 1 or step % 5 == 0 or step == len(data)):
            rate = seen / (time.perf_counter() - start)
            print(f"step {step:3d}/{len(data)}  loss {loss_value:.4f}  {rate:8.1f} samples/s",
                  flush=True)
    if rank == 0:
        elapsed = time.perf_counter() - start
        print(f"done: {seen} samples in {elapsed:.2f} s ({seen / elapsed:.1f} samples/s), "
              f"final loss {loss_value:.4f}", flush=True)
    return loss_value
