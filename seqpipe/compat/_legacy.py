"""Load checkpoints saved by torchgpipe or torch's ``Pipe`` into the compat classes.

seqpipe keeps a pipeline's ``state_dict`` keys exactly those of the wrapped
``nn.Sequential`` (``"3.weight"``). The peers did not, so their checkpoints carry keys that
a seqpipe pipeline does not have:

* both registered their partitions as an ``nn.ModuleList``: torchgpipe saved
  ``"partitions.1.3.weight"`` (partition 1, layer ``"3"``), torch's ``Pipe`` renumbered the
  layers inside each partition (``"partitions.1.0.weight"``);
* both made a ``@skippable`` layer a wrapper holding the user's layer as ``.module``:
  ``"3.module.lin.weight"`` where seqpipe has ``"3.lin.weight"``;
* both gave ``DeferredBatchNorm`` two extra buffers, ``sum`` and ``sum_squares`` (always
  zero between mini-batches), which seqpipe's deferred BatchNorm does not need.

:class:`LegacyKeys` is a ``load_state_dict`` pre-hook that rewrites such keys, so
``pipe.load_state_dict(torch.load(old_checkpoint))`` just works. It touches only keys the
pipeline does not have, and only rewrites a key into one it does have, so a checkpoint saved
by seqpipe (or by the plain model) loads exactly as before.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from seqpipe.skip import is_skippable

__all__ = ["LegacyKeys"]

_DEFERRED_BN_BUFFERS = ("sum", "sum_squares")


class LegacyKeys:
    """``load_state_dict`` pre-hook translating a peer's checkpoint keys into seqpipe's.

    Args:
        rename: maps a key (relative to the pipeline) to the key it has in the wrapped
            ``nn.Sequential`` when it names a layer the peer's way (``"partitions.1.0.w"``
            to ``"4.w"``), and returns any other key unchanged.
    """

    def __init__(self, rename: Callable[[str], str]) -> None:
        self.rename = rename

    def __call__(self, module: nn.Module, state_dict: Dict[str, Any], prefix: str,
                 *_: Any) -> None:
        expected = set(module.state_dict(keep_vars=True))
        for key in [k for k in state_dict if k.startswith(prefix)]:
            relative = key[len(prefix):]
            if relative in expected:
                continue
            translated = self.translate(module, relative)
            if translated is None:
                del state_dict[key]
            elif translated in expected and prefix + translated not in state_dict:
                state_dict[prefix + translated] = state_dict.pop(key)

    def translate(self, root: nn.Module, key: str) -> Optional[str]:
        """seqpipe's key for a peer's ``key``; ``None`` for a key to drop; else ``key``."""
        key = self.rename(key)
        parts = key.split(".")
        kept: List[str] = []
        module = root
        for part in parts[:-1]:
            if part == "module" and is_skippable(module) and "module" not in module._modules:
                continue  # the peer's skippable wrapper level
            child = module._modules.get(part)
            if child is None:
                return key  # not a path through this model: leave it for strict to report
            kept.append(part)
            module = child
        last = parts[-1]
        if (last in _DEFERRED_BN_BUFFERS and isinstance(module, _BatchNorm)
                and last not in module._buffers):
            return None
        return ".".join([*kept, last])
