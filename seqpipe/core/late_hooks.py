"""Parameter hooks registered after a call's forward, kept out of its per-micro-batch backward.

A call whose parameters had no hooks when its forward ran records the parameters
themselves (``seqpipe.core.sink.DirectSink``): every micro-batch's backward accumulates
into ``.grad``. A hook registered between the forward and the backward
(``out = pipe(x); w.register_hook(clip); out.sum().backward()``) would then fire once per
micro-batch, with a share of the gradient (and once more with ``None`` when the sums are
handed to autograd), where the unpipelined model fires it once with the whole gradient:
a hook that clips, records or steps would silently see other values.

So, before the backward, ``hide`` empties the hook dictionaries of the parameters that
have hooks now (``register_hook``'s ``_backward_hooks`` and
``register_post_accumulate_grad_hook``'s ``_post_accumulate_grad_hooks``: autograd reads
them at each call, so an empty one fires nothing) and ``Hidden.restore`` puts the hooks
back, in their order, before the sums are handed to autograd, which fires each once.
Hooks marked ``step_aware`` are left as they are (they may fire per micro-batch). Nothing
else runs on the parameters during that backward: the pipeline's backward is one node of
the caller's graph, which autograd runs alone.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import nn

from seqpipe.core.trainable import _has_hooks

__all__ = ["Hidden", "hide"]


class Hidden:
    """The hooks ``hide`` took off some parameters, to put back with ``restore``."""

    def __init__(self, taken: List[Tuple[Dict[Any, Any], List[Tuple[Any, Any]]]]) -> None:
        self._taken = taken

    def __bool__(self) -> bool:
        return bool(self._taken)

    def restore(self) -> None:
        """Every hook back in its dictionary, before any registered since (once)."""
        taken, self._taken = self._taken, []
        for hooks, items in taken:
            later = list(hooks.items())
            hooks.clear()
            hooks.update(items)
            hooks.update(later)


def hide(params: Sequence[nn.Parameter]) -> Hidden:
    """Take the hooks off those of ``params`` that have any (not ``step_aware`` only);
    ``Hidden.restore`` puts them back. Costs one attribute test per parameter without."""
    taken: List[Tuple[Dict[Any, Any], List[Tuple[Any, Any]]]] = []
    with torch._C.DisableTorchFunctionSubclass():  # a subclass's override sees no lookups
        for param in params:
            if (param._backward_hooks or param._post_accumulate_grad_hooks) and \
                    _has_hooks(param):
                for hooks in (param._backward_hooks, param._post_accumulate_grad_hooks):
                    if hooks:
                        taken.append((hooks, list(hooks.items())))
                        hooks.clear()
    return Hidden(taken)
