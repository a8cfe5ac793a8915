"""``torchgpipe.GPipe`` on seqpipe's engine: torchgpipe's signature, structure and errors."""
from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn

from seqpipe.compat._legacy import LegacyKeys
from seqpipe.compat._peer import (
    PeerPipe,
    peer_arguments,
    recommend_auto_balance,
    verify_peer_module,
)
from seqpipe.compat.torchgpipe.batchnorm import convert_deferred_batch_norm
from seqpipe.core.microbatch import TensorOrTensors
from seqpipe.core.partition import Device, default_devices
from seqpipe.pipe import Pipe

__all__ = ["GPipe"]


def _recommend(message: str) -> str:
    return recommend_auto_balance(message, "seqpipe.compat.torchgpipe",
                                  "GPipe(model, balance, ...)")


class GPipe(PeerPipe, Pipe):
    """``seqpipe.Pipe`` with torchgpipe's constructor, module structure and errors.

    ``GPipe(module, balance, *, devices=None, chunks=1, checkpoint='except_last',
    deferred_batch_norm=False)`` splits ``module`` into ``len(balance)`` partitions on
    ``devices`` and trains it as torchgpipe did, with seqpipe's engine underneath:

    * ``partitions`` is an ``nn.ModuleList`` of ``nn.Sequential``s that keep each layer's
      name, so ``state_dict()`` keys are torchgpipe's (``"partitions.1.3.weight"``);
      ``load_state_dict`` also takes a plain ``nn.Sequential``'s keys (``"3.weight"``) and
      torchgpipe keys saved under another balance;
    * ``chunks`` and ``checkpoint`` go through ``int()``/``str()``; an empty
      ``nn.Sequential`` (``balance=[]``) returns its input; argument errors read as
      torchgpipe's;
    * ``devices`` defaults to the visible GPUs as in torchgpipe, and to the CPU for every
      partition on a machine without one (where torchgpipe failed);
    * ``.cuda()``, ``.cpu()`` and ``.to(device)`` raise :class:`~seqpipe.compat._moving.
      MovingDenied`, a ``TypeError`` as in torchgpipe (and a ``RuntimeError`` as in seqpipe).
    """

    placement_hint = "pass devices=[...] to GPipe"
    peer_name = "GPipe"

    def __init__(self, module: nn.Sequential, balance: Optional[Iterable[int]] = None, *,
                 devices: Optional[Sequence[Device]] = None, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False) -> None:
        chunks, checkpoint = peer_arguments(chunks, checkpoint)
        if balance is None:
            raise ValueError(_recommend("balance is required"))
        verify_peer_module(module)
        balance = _check_balance(module, balance, devices)
        if not balance:
            self._init_empty(chunks, checkpoint)
            return
        if deferred_batch_norm:
            convert_deferred_batch_norm(module, chunks)
        names = list(module._modules)
        super().__init__(module, chunks, checkpoint, balance=balance, devices=devices)
        starts = [sum(balance[:j]) for j in range(len(balance))]
        self._register_partitions(
            [[(name, module._modules[name]) for name in names[start:start + count]]
             for start, count in zip(starts, balance)])
        part_of = {name: j for j, start in enumerate(starts)
                   for name in names[start:start + balance[j]]}
        self.register_load_state_dict_pre_hook(LegacyKeys(_GPipeKeys(part_of)))

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:  # type: ignore[override]
        """Run the mini-batch through the pipeline; the output is on the last device."""
        if not self.devices:
            return self._empty_forward(input)
        return super().forward(input)


def _check_balance(module: nn.Sequential, balance: Iterable[int],
                   devices: Optional[Sequence[Device]]) -> List[int]:
    """torchgpipe's balance checks and messages (its ``BalanceError`` was a ValueError)."""
    counts = list(balance)
    if len(module) != sum(counts):
        raise ValueError(_recommend(
            f"module and sum of balance have different length (module: {len(module)}, sum "
            f"of balance: {sum(counts)})"))
    if any(count <= 0 for count in counts):
        raise ValueError(_recommend(
            f"all balance numbers must be positive integer (balance: {counts})"))
    available = default_devices(len(counts)) if devices is None else [
        torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]
    if len(counts) > len(available):
        raise IndexError(f"too few devices to hold given partitions (devices: "
                         f"{len(available)}, partitions: {len(counts)})")
    return counts


_PARTITION = re.compile(r"partitions\.\d+\.")


class _GPipeKeys:
    """Any torchgpipe key (another balance's too) or plain key -> this GPipe's key.

    torchgpipe kept each layer's name inside its partition, so the layer name says which
    partition of this GPipe holds it: ``partitions.0.3.w`` (saved with another balance) and
    ``3.w`` (a plain ``nn.Sequential``'s) both become ``partitions.<j>.3.w``.
    """

    def __init__(self, part_of: Dict[str, int]) -> None:
        self.part_of = part_of

    def __call__(self, key: str) -> str:
        match = _PARTITION.match(key)
        rest = key[match.end():] if match else key
        name = rest.split(".", 1)[0]
        return f"partitions.{self.part_of[name]}.{rest}" if name in self.part_of else key
