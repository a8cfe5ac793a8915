"""Where a local pipeline's stage adds up its parameters' gradients over micro-batches.

``Pipe`` must hand autograd each parameter's gradient once per backward, summed over the
micro-batches, so that hooks on the parameters (``DistributedDataParallel``'s reducer, a
user's ``register_hook``) fire once, as for the unpipelined model. A stage therefore
cannot backpropagate into ``.grad``; and asking autograd for each micro-batch's gradients
(``torch.autograd.grad``) before adding them up keeps a whole second set of the stage's
gradients alive at every micro-batch.

A ``GradSink`` avoids both. For one call it gives the pipeline's trainable parameters
leaf aliases (same storage, no copy); each partition runs with the aliases in place of its
parameters, so every micro-batch's backward accumulates into the aliases' ``.grad`` in
place, layer by layer, as plain autograd accumulates into ``.grad``, and no hook of the
real parameters fires. ``take`` then hands the sums over, once. A parameter used by two
partitions (tied weights) has one alias, into which both stages accumulate.

The aliases go in as ``torch.func.functional_call`` puts them in, by swapping the
modules' parameter entries while a partition runs, but through slots listed once per
call (``functional_call`` works them out on every call: 75-150 µs for 24 parameters,
several percent of a pipelined step). Stages run on their own threads, and a module may
belong to two partitions (shared inside two layers), so the swaps are counted: an entry
holds its alias while any partition that uses it runs.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Sequence, Tuple

from torch import Tensor, nn

__all__ = ["GradSink"]

_Slot = Tuple[Dict[str, Any], str, nn.Parameter, Tensor]  # entries, name, parameter, alias


class GradSink:
    """Leaf aliases of the trainable parameters of ``partitions``, for one pipeline call."""

    def __init__(self, partitions: Sequence[nn.Module]) -> None:
        self.params: List[nn.Parameter] = []
        self._aliases: Dict[int, Tensor] = {}  # id(parameter) -> its alias
        self._slots: List[List[_Slot]] = [self._slots_of(p) for p in partitions]
        self._leaves = [list({id(alias): alias for *_, alias in slots}.values())
                        for slots in self._slots]
        self._installed: Dict[Tuple[int, str], int] = {}
        self._lock = threading.Lock()

    def _slots_of(self, partition: nn.Module) -> List[_Slot]:
        slots = []
        for module in partition.modules():
            for name, param in module._parameters.items():
                if param is None or not param.requires_grad:
                    continue
                if id(param) not in self._aliases:
                    self._aliases[id(param)] = param.detach().requires_grad_()
                    self.params.append(param)
                slots.append((module._parameters, name, param, self._aliases[id(param)]))
        return slots

    @contextmanager
    def installed(self, stage: int) -> Iterator[None]:
        """Partition ``stage``'s parameters replaced by their aliases, inside the block."""
        with self._lock:
            for entries, name, _, alias in self._slots[stage]:
                key = (id(entries), name)
                if key not in self._installed:
                    entries[name] = alias
                self._installed[key] = self._installed.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                for entries, name, param, _ in self._slots[stage]:
                    key = (id(entries), name)
                    self._installed[key] -= 1
                    if not self._installed[key]:
                        del self._installed[key]
                        entries[name] = param

    def call(self, stage: int, partition: nn.Module, *args: Any) -> Any:
        """Run ``partition`` (number ``stage``) on ``args`` with its parameters' aliases."""
        with self.installed(stage):
            return partition(*args)

    def leaves(self, stage: int) -> List[Tensor]:
        """Partition ``stage``'s aliases, to backpropagate into (``inputs=``)."""
        return self._leaves[stage]

    def take(self) -> List[Tuple[nn.Parameter, Tensor]]:
        """Each parameter with its summed gradient, letting go of it here (so autograd can
        adopt the tensor as ``.grad`` instead of copying it)."""
        pairs = []
        for param in self.params:
            alias = self._aliases[id(param)]
            if alias.grad is not None:
                pairs.append((param, alias.grad))
                alias.grad = None
        return pairs
