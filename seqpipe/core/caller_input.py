"""The caller's input is never written: the first stage copies it when its layers would.

The first stage's micro-batches are views of the caller's input tensors, all sharing the
input's memory and its one version counter. A first layer that writes its input in place
(``nn.ReLU(inplace=True)``, ``x.add_(...)``, at the top level or nested) would then write
the caller's tensor, and each micro-batch's write would bump the counter the others'
saved tensors are checked against, so the backward raises "one of the variables needed
for gradient computation has been modified by an inplace operation" although no
micro-batch's own values changed.

So the first stage runs such layers on a copy of its micro-batch: the caller's input keeps
its values and its version in every checkpoint mode (a checkpointed micro-batch copies
anyway, for its recomputation), and each copy has a counter of its own. Which layers
write cannot be known before they run; the stage learns it from the copies' version
counters. Its first micro-batch in each training mode (the layers' ``train()``/``eval()``
flags, which switch ``Dropout(inplace=True)`` on and off) runs on a copy and looks; from
then on only a stage whose layers wrote copies, and a stage that does not write runs on
the views at no cost. A layer that writes only later (on some data only) is still seen,
at that call, through the view's version counter: that call writes the caller's input as
the plain model would, and its backward raises autograd's in-place error rather than
compute a wrong gradient; later calls copy.
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional, Sequence, Tuple

from torch import Tensor

__all__ = ["CallerInput", "versions"]


def versions(tensors: Sequence[Tensor]) -> Optional[Tuple[int, ...]]:
    """The tensors' version counters (``None`` for inference tensors, which have none)."""
    found = []
    for tensor in tensors:  # a loop, not generators: a call's fixed cost
        if tensor.is_inference():
            return None
        found.append(tensor._version)
    return tuple(found)


class CallerInput:
    """What the first stage has learned of its layers: whether they write their input.

    The stage (``Stage._run``) asks ``copies`` before a micro-batch, runs its layers on
    copies if so (or if it copies anyway), and reports the input's version counters from
    before and after the layers to ``saw``."""

    def __init__(self) -> None:
        self._writes: Dict[Hashable, bool] = {}  # training modes -> whether the layers wrote

    def copies(self, training: Hashable) -> bool:
        """Whether a micro-batch run with the layers in ``training`` modes (their
        ``.training`` flags) runs on a copy: until one has shown that they leave their input
        alone."""
        return self._writes.get(training, True)

    def saw(self, training: Hashable, copied: bool, before: Optional[Tuple[int, ...]],
            after: Optional[Tuple[int, ...]]) -> None:
        """Learn from one run in ``training`` modes, on copies (``copied``) or not, whose
        input had the version counters ``before`` and ``after`` the layers: they write it
        if the counters moved; they leave it alone once a copy came back unchanged."""
        if before is not None and after is not None:
            if before != after:
                self._writes[training] = True
            elif copied:
                self._writes.setdefault(training, False)
