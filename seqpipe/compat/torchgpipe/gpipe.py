"""``torchgpipe.GPipe`` on seqpipe's engine: torchgpipe's signature, ``seqpipe.Pipe``'s workings."""
from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence

from torch import nn

from seqpipe.compat._legacy import LegacyKeys
from seqpipe.compat._moving import DenyMoving
from seqpipe.partition import Device
from seqpipe.pipe import Pipe

__all__ = ["GPipe"]

_NO_BALANCE = """GPipe needs balance, the number of layers in each partition, e.g.
GPipe(model, [2, 2], chunks=8). To choose it by profiling:

    from seqpipe.compat.torchgpipe.balance import balance_by_time
    balance = balance_by_time(partitions, model, sample)
    model = GPipe(model, balance, chunks=8)

To keep the placement you already gave the layers instead, use seqpipe.Pipe(model, chunks=8)."""


class GPipe(DenyMoving, Pipe):
    """``seqpipe.Pipe`` with torchgpipe's constructor: ``balance`` second and positional.

    ``GPipe(module, balance, *, devices=None, chunks=1, checkpoint='except_last',
    deferred_batch_norm=False)`` splits ``module`` into ``len(balance)`` partitions on
    ``devices`` and trains it as torchgpipe did, with seqpipe's engine underneath:

    * ``devices`` defaults to the visible GPUs as in torchgpipe, and to the CPU for every
      partition on a machine without one (where torchgpipe failed);
    * ``state_dict()`` keys are those of the wrapped ``nn.Sequential`` (``"3.weight"``), where
      torchgpipe saved ``"partitions.1.3.weight"``; ``load_state_dict`` accepts both, so
      checkpoints saved by torchgpipe still load;
    * ``partitions`` is a list of ``nn.Sequential`` views over the user's layers (torchgpipe:
      a registered ``nn.ModuleList``); ``balance``, ``devices``, ``chunks``, ``checkpoint``,
      ``len``, indexing and iteration are as in torchgpipe;
    * ``.cuda()``, ``.cpu()`` and ``.to(device)`` raise :class:`~seqpipe.compat._moving.
      MovingDenied`, a ``TypeError`` as in torchgpipe (and a ``RuntimeError`` as in seqpipe).
    """

    placement_hint = "pass devices=[...] to GPipe"

    def __init__(self, module: nn.Sequential, balance: Optional[Iterable[int]] = None, *,
                 devices: Optional[Sequence[Device]] = None, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False) -> None:
        if balance is None:
            raise ValueError(_NO_BALANCE)
        super().__init__(module, chunks, checkpoint, deferred_batch_norm,
                         balance=list(balance), devices=devices)
        self.register_load_state_dict_pre_hook(LegacyKeys(_torchgpipe_key))


_PARTITION = re.compile(r"partitions\.\d+\.")


def _torchgpipe_key(key: str) -> str:
    """torchgpipe's ``partitions.<i>.<name>.rest`` -> ``<name>.rest``, whatever its balance.

    torchgpipe kept each layer's name inside its partition, so the partition index can be
    dropped: a checkpoint saved with another balance loads too.
    """
    match = _PARTITION.match(key)
    return key[match.end():] if match else key
