"""The unpipelined model ``python -m seqpipe`` times beside its pipelined run, and the
demo's data.

The plain model is timed twice: on whole mini-batches (what pipelining is compared with),
and in the pipeline's micro-batches with its recomputation, still unpipelined (the work
the pipeline does, without the pipeline), so that a user can tell the price of
micro-batches and checkpointing from the pipeline's own. In the local demo both copies
take a step after every pipelined step (``Beside``), on the same mini-batch, so that
whatever else the machine runs slows the three alike and the medians compare: timed
once before the run, as the demo used to, one busy second could make the plain model look
ten times slower or faster than the pipeline. On a CPU-only machine the report also says
why two ``cpu`` partitions cannot beat the plain model there.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

__all__ = ["Beside", "make_data", "plain_step", "unpipelined_rate"]

LossFn = Callable[[Tensor, Tensor], Tensor]


def make_data(steps: int, batch: int, num_classes: int = 10, noise: float = 1.0,
              seed: int = 0) -> Iterator[Tuple[Tensor, Tensor]]:
    """``steps`` mini-batches of noisy class prototypes: learnable, and needs no download.

    Each mini-batch is made when it is asked for, so a long run holds one at a time.
    """
    gen = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(num_classes, 3, 32, 32, generator=gen)
    for _ in range(steps):
        labels = torch.randint(num_classes, (batch,), generator=gen)
        images = prototypes[labels] + noise * torch.randn(batch, 3, 32, 32, generator=gen)
        yield images, labels


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
               images: Tensor, labels: Tensor, chunks: int = 1,
               checkpoint: str = "never") -> float:
    """One training step of the unpipelined ``model`` on (``images``, ``labels``), already
    on its device; returns the loss. With ``chunks`` and ``checkpoint``, the mini-batch runs
    as the pipeline runs it, one micro-batch after another with the same recomputation
    (``torch.utils.checkpoint``), but unpipelined."""
    optimizer.zero_grad()
    parts = list(zip(images.chunk(chunks), labels.chunk(chunks)))
    total = torch.zeros((), device=images.device)
    for i, (x, y) in enumerate(parts):
        recompute = checkpoint == "always" or (checkpoint == "except_last"
                                               and i < len(parts) - 1)
        out = (torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
               if recompute else model(x))
        loss = loss_fn(out, y) * (len(x) / len(images))
        loss.backward()
        total = total + loss.detach()
    optimizer.step()
    return total.item()


def unpipelined_rate(model: nn.Module, device: torch.device, args: argparse.Namespace,
                     steps: int = 3) -> float:
    """Samples/s of a copy of the CNN ``model``, unpipelined on ``device``, over ``steps``
    steps (after one warm-up) of the demo's data: what ``--processes`` compares with,
    measured before the ranks start (they would share the cores with it)."""
    plain = copy.deepcopy(model).to(device)
    optimizer = torch.optim.SGD(plain.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    batches = make_data(steps + 1, args.batch, seed=1)
    start, seen = 0.0, 0
    for step, (images, labels) in enumerate(batches):
        if step == 1:
            start = time.perf_counter()
        plain_step(plain, optimizer, loss_fn, images.to(device), labels.to(device))
        seen += len(images) if step else 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return seen / (time.perf_counter() - start)


class Beside:
    """Two unpipelined copies of ``model`` on ``device`` that take a training step after
    each pipelined one, on the same mini-batch: ``whole`` on whole mini-batches, ``same``
    in the pipeline's micro-batches with its recomputation (``args.chunks``,
    ``args.checkpoint``). Each starts from ``model``'s weights as they are now, with its
    own optimizer (``optimizer(parameters)``) and ``loss_fn``; their step times are kept
    (``times``) and their last losses (``losses``) for ``report``."""

    def __init__(self, model: nn.Module, device: torch.device, args: argparse.Namespace,
                 optimizer: Callable[..., torch.optim.Optimizer], loss_fn: LossFn) -> None:
        self.device, self.args, self.loss_fn = device, args, loss_fn
        self.models = {name: copy.deepcopy(model).to(device) for name in ("whole", "same")}
        self.optimizers = {name: optimizer(m.parameters()) for name, m in self.models.items()}
        self.times: Dict[str, List[float]] = {"whole": [], "same": []}
        self.losses = {"whole": float("nan"), "same": float("nan")}

    def step(self, images: Tensor, labels: Tensor) -> None:
        """A step of each copy on this mini-batch, timed."""
        images, labels = images.to(self.device), labels.to(self.device)
        work = {"whole": (1, "never"), "same": (self.args.chunks, self.args.checkpoint)}
        for name, (chunks, checkpoint) in work.items():
            start = time.perf_counter()
            self.losses[name] = plain_step(self.models[name], self.optimizers[name],
                                           self.loss_fn, images, labels, chunks, checkpoint)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.times[name].append(time.perf_counter() - start)

    def report(self, pipelined: Sequence[float], devices: Sequence[object]) -> None:
        """Print the median step of the pipeline and of the two copies, and how the
        pipeline's time splits into the work its settings ask for and the pipeline's own
        cost; on CPU-only machines, why the pipeline cannot win there."""
        args = self.args
        p, w, s = (statistics.median(t) for t in (pipelined, self.times["whole"],
                                                   self.times["same"]))
        chunks = min(args.chunks, args.batch)
        print("median step (the unpipelined model's steps taken between the pipelined "
              "ones, on the same mini-batches, so the machine's load slows all three alike):")
        print(f"  pipelined                     {p * 1e3:7.1f} ms  "
              f"{args.batch / p:7.1f} samples/s")
        print(f"  unpipelined                   {w * 1e3:7.1f} ms  "
              f"{args.batch / w:7.1f} samples/s  final loss {self.losses['whole']:.4f} "
              f"(on {self.device}, whole mini-batches)")
        print(f"  unpipelined, {chunks:2d} micro-batches {s * 1e3:7.1f} ms  "
              f"{args.batch / s:7.1f} samples/s  final loss {self.losses['same']:.4f} "
              f"(checkpoint={args.checkpoint!r}: the pipeline's work without the pipeline)")
        print(f"the pipelined step takes {p / w:.2f}x the unpipelined one: {s / w:.2f}x for "
              f"the micro-batches and recomputation these settings ask for, {p / s:.2f}x "
              f"for the pipeline itself (the pipelined run computes what the unpipelined "
              f"model computes in the same micro-batches, up to float rounding that the "
              f"steps of training amplify: compare their final losses)", flush=True)
        threads = torch.get_num_threads()
        if threads > 1 and all(str(d) == "cpu" for d in devices):
            print(f"(on CPU the {len(devices)} partitions share the cores that the "
                  f"unpipelined model already spreads each operation over, with {threads} "
                  f"intra-op threads: a pipeline adds micro-batches, recomputation and "
                  f"hand-overs, and has no idle device to fill; it pays with several "
                  f"devices)", flush=True)
