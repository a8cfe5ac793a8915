"""A pipe's layers are fixed once it is built: replacing or removing one is refused by name.

``Pipe`` and ``DistributedPipe`` register the ``nn.Sequential``'s layers under their own
names, so ``pipe.state_dict()`` and ``pipe.parameters()`` are the model's, and run them
through partitions made from those layers when the pipe was built (with their devices,
skip layout, checkpoint segments and deferred BatchNorms). Assigning another module to a
layer's name afterwards (``setattr(pipe, "4", head)``, ``pipe.add_module``,
``SyncBatchNorm.convert_sync_batchnorm(pipe)``, a quantization ``prepare``) changed what
``parameters()`` and ``state_dict()`` show, and the optimizer trained, while the
partitions kept running the old layer: silently. Changing a layer in place (its
submodules, parameters, hooks, parametrizations) is fine: the partitions hold the same
layer object.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from seqpipe.core.own_hooks import keep_hooks

__all__ = ["FixedLayers", "LAYER_FIXED"]

LAYER_FIXED = ("layer {name!r} of this {cls} cannot be {what} after the pipe is built: its "
               "partitions were made from the layers it was given (with their devices, "
               "skips and checkpoint segments) and would keep running the old one. Change "
               "the layer in the nn.Sequential before wrapping it (model[{name}] = ...), "
               "and build the pipe again; or change the layer in place (its submodules and "
               "parameters)")


class FixedLayers(nn.Module):
    """An ``nn.Module`` whose child modules (the pipe's layers), once registered, cannot be
    replaced or removed: a name is registered once, as the pipe is built (registering the
    same layer again changes nothing and is let through)."""

    def _refuse(self, name: str, what: str, value: Any = None) -> None:
        if name in self._modules and self._modules[name] is not value:  # (the same: no-op)
            raise TypeError(LAYER_FIXED.format(name=name, cls=type(self).__name__,
                                               what=what))

    def __setattr__(self, name: str, value: Any) -> None:
        self._refuse(name, "replaced", value)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        self._refuse(name, "removed")
        super().__delattr__(name)

    def add_module(self, name: str, module: Optional[nn.Module]) -> None:
        """``nn.Module.add_module``, refused for a name already registered (a layer)."""
        self._refuse(name, "replaced", module)
        super().add_module(name, module)

    def keep_hooks_of(self, module: nn.Module, *, calls: bool = True) -> None:
        """Run the hooks registered on the wrapped ``module`` itself: all of them, or (not
        ``calls``) its state-dict hooks, refusing its call hooks (``seqpipe.core.own_hooks``)."""
        keep_hooks(self, module, calls=calls)
