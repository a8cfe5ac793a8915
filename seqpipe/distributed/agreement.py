"""What every rank of a pipeline must agree on, checked before it could cause a hang.

The ranks of a ``DistributedPipe`` each build the pipe from their own copy of the model and
arguments, and each call runs its own copy of the plan. If two ranks disagree — another
model, balance or schedule; ``train_step`` on one and ``forward`` on another — their plans
differ and both would wait for messages that never come. So the model and the settings are
compared once, at construction (one all-gather of a checksum), and each call's kind travels
with the opening message of the call, for every other rank to compare with its own.
"""
from __future__ import annotations

import zlib
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpipe.distributed.wire import Message

__all__ = ["call_kind", "check_same_call", "check_same_model", "gather_ints", "opened"]

_CALLS = {(1, 1): "train_step with a scaler", (1, 0): "train_step", (0, 0): "forward"}


def _fingerprint(module: nn.Sequential, config: Tuple[Any, ...]) -> int:
    """A checksum of the model's structure and the pipeline's settings."""
    parts = [repr(config)]
    for name, layer in module.named_children():
        shapes = [(n, tuple(t.shape), str(t.dtype))
                  for n, t in (*layer.named_parameters(), *layer.named_buffers())]
        parts.append(f"{name}:{type(layer).__qualname__}:{shapes}")
    return zlib.crc32("\n".join(parts).encode()) & 0x7FFFFFFF


def gather_ints(values: Sequence[int], group: Optional[dist.ProcessGroup],
                device: torch.device, tail: Optional[Tensor] = None) -> List[List[int]]:
    """Every rank's ``values`` (as many on each rank), in the order of ``group``'s ranks:
    one all-gather, which every rank of ``group`` calls together. ``tail``: int64 values
    already on ``device`` (as many on each rank), gathered after ``values`` in the same
    collective, without reading them on the host first."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    if tail is not None:
        mine = torch.cat([mine, tail])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def check_same_model(module: nn.Sequential, config: Tuple[Any, ...],
                     group: Optional[dist.ProcessGroup], device: torch.device,
                     who: str = "ranks", extra: Sequence[int] = ()
                     ) -> Tuple[int, List[List[int]]]:
    """Raise ``ValueError`` on every rank of ``group`` unless all built the same model with
    the same ``config``; return the shared checksum, and every rank's ``extra`` (as many on
    each rank), gathered in the same collective. ``who`` names the ranks in the message
    (``"stages"`` when each holds one stage)."""
    gathered = gather_ints([_fingerprint(module, config), *extra], group, device)
    values = [v[0] for v in gathered]
    odd = [r for r, v in enumerate(values) if v != values[0]]
    if odd:
        raise ValueError(
            f"{who} {odd} built a different model or pipeline settings than {who[:-1]} 0 "
            f"(layers, parameter shapes, balance, chunks, checkpoint or schedule differ); "
            f"every rank must construct DistributedPipe from the same model and arguments")
    return values[0], [v[1:] for v in gathered]


def call_kind(grad: bool, scaled: bool) -> Tuple[int, int]:
    """What a rank was asked to do: ``(train_step?, with a scaler?)``; the rank of stage 0
    sends it as a tensor with the call's opening message."""
    return int(grad), int(scaled)


def opened(opening: Message) -> Tuple[int, ...]:
    """The call kind the rank of stage 0 sent with ``opening`` (a forward if it did not say)."""
    if opening.tensors and opening.tensors[0] is not None:
        return tuple(opening.tensors[0].tolist())
    return (0, 0)


def check_same_call(theirs: Tuple[int, ...], ours: Tuple[int, int]) -> None:
    """Raise ``ValueError`` if the rank of stage 0 made another call than this rank."""
    if theirs != ours:
        raise ValueError(
            f"the rank of stage 0 called {_CALLS.get(theirs, theirs)} but this rank called "
            f"{_CALLS.get(ours, ours)}; every rank must make the same call (train_step or "
            f"forward, with a scaler on every rank or on none) each time")
