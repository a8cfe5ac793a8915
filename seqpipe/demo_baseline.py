"""The unpipelined baselines ``python -m seqpipe`` shows beside its pipelined rate, and the
demo's data.

The plain model is timed twice: on whole mini-batches (what pipelining is compared with),
and in the pipeline's micro-batches with its recomputation, still unpipelined (the work
the pipeline does, without the pipeline), so that a user can tell the price of
micro-batches and checkpointing from the pipeline's own. On a CPU-only machine it also
says why two ``cpu`` partitions cannot beat the plain model there.
"""
from __future__ import annotations

import argparse
import copy
import time
from typing import Callable, Iterator, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

__all__ = ["make_data", "print_baselines", "unpipelined_rate"]


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


def unpipelined_rate(model: nn.Module, device: torch.device, args: argparse.Namespace,
                     steps: int = 3, *, chunks: int = 1, checkpoint: str = "never",
                     data: Optional[Callable[[int], Iterator[Tuple[Tensor, Tensor]]]] = None,
                     loss_fn: Optional[Callable[[Tensor, Tensor], Tensor]] = None) -> float:
    """Samples/s of a copy of ``model``, unpipelined on ``device``, over ``steps`` steps
    (after one warm-up) of the demo's data: what pipelining is compared with.

    With ``chunks`` and ``checkpoint``, each mini-batch runs as the pipeline runs it, one
    micro-batch after another with the same recomputation (``torch.utils.checkpoint``), but
    still unpipelined: the same work without the pipeline, to tell its price from theirs.
    ``data(n)``: ``n`` mini-batches of another model's data (default: the CNN's images),
    and ``loss_fn`` its loss (default: cross-entropy)."""
    plain = copy.deepcopy(model).to(device)
    optimizer = torch.optim.SGD(plain.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss() if loss_fn is None else loss_fn
    batches = (make_data(steps + 1, args.batch, seed=1) if data is None
               else data(steps + 1))
    start, seen = 0.0, 0
    for step, (images, labels) in enumerate(batches):
        if step == 1:
            start = time.perf_counter()
        optimizer.zero_grad()
        parts = list(zip(images.to(device).chunk(chunks), labels.to(device).chunk(chunks)))
        for i, (x, y) in enumerate(parts):
            recompute = checkpoint == "always" or (checkpoint == "except_last"
                                                   and i < len(parts) - 1)
            out = (torch.utils.checkpoint.checkpoint(plain, x, use_reentrant=False)
                   if recompute else plain(x))
            (loss_fn(out, y) * (len(x) / len(images))).backward()
        optimizer.step()
        seen += len(images) if step else 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return seen / (time.perf_counter() - start)


def print_baselines(baseline: float, same_work: float, device: torch.device,
                    devices: Sequence[object], args: argparse.Namespace) -> None:
    """The unpipelined rates the pipelined one is shown beside, and on CPU-only machines
    why a pipeline cannot beat them there."""
    print(f"unpipelined on {device}: {baseline:.1f} samples/s; in the pipeline's "
          f"{min(args.chunks, args.batch)} micro-batches with checkpoint={args.checkpoint!r}, "
          f"still unpipelined: {same_work:.1f} samples/s")
    threads = torch.get_num_threads()
    if threads > 1 and all(str(d) == "cpu" for d in devices):
        print(f"(on CPU the {len(devices)} partitions share the cores that the unpipelined "
              f"model already spreads each operation over, with {threads} intra-op threads: "
              f"a pipeline adds micro-batches, recomputation and hand-overs, and has no idle "
              f"device to fill; it pays with several devices)", flush=True)
