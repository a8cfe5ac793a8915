"""What a pipeline call trains, and whether its parameters' hooks need a ``GradSink`` with
aliases: the walk ``seqpipe.core.sink.open_sink`` makes at every call.

Walked afresh at every call, so that a parameter added, replaced or frozen, and a hook
registered or removed, since the last call is seen; walked without ``nn.Module.parameters``'
nested generators and without generator expressions, since it is a call's fixed cost: four
small transformer layers (41 modules, 48 parameters) took ~70 µs through ``parameters()``
and ~20 µs this way, the hook check ~12 µs and ~6 µs.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Sequence, Set

import torch
from torch import Tensor, nn

from seqpipe.core.lazy_classes import loaded_class

__all__ = ["Trainable", "ddp_forward_running", "needs_aliases", "shared", "step_aware",
           "trainable"]

Trainable = List[List[nn.Parameter]]  # per partition, its parameters that require grad


def trainable(partitions: Sequence[nn.Module]) -> Trainable:
    """Per partition, its parameters that require grad (a parameter shared by two listed
    under both): ``[p for p in partition.parameters() if p.requires_grad]`` for each, in
    that order (see the module docstring)."""
    own: Trainable = []
    for partition in partitions:
        mine: List[nn.Parameter] = []
        _walk(partition, set(), set(), mine)
        own.append(mine)
    return own


def shared(own: Trainable) -> List[nn.Parameter]:
    """The parameters listed under more than one partition of ``own`` (tied weights, a
    module used by two partitions), each once, in order of first appearance."""
    if len(own) < 2:
        return []
    seen: Set[int] = set()
    out: Dict[int, nn.Parameter] = {}
    for mine in own:
        for param in mine:
            if id(param) in seen:
                out[id(param)] = param
        seen.update(id(param) for param in mine)
    return list(out.values())


def _walk(module: nn.Module, modules: Set[int], params: Set[int],
          out: List[nn.Parameter]) -> None:
    """``module.parameters()`` in its order (``named_modules``' pre-order, each module and
    each parameter once, ``None`` entries skipped), keeping those that require grad, into
    ``out``."""
    modules.add(id(module))
    for param in module._parameters.values():
        if param is not None and id(param) not in params:
            params.add(id(param))
            if param.requires_grad:
                out.append(param)  # type: ignore[arg-type]
    for child in module._modules.values():
        if child is not None and id(child) not in modules:
            _walk(child, modules, params, out)


# The attribute that marks a hook as ``step_aware``.
_STEP_AWARE = "_seqpipe_step_aware"


def step_aware(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a parameter hook that knows when a step's gradient is final (a data-parallel
    reducer armed for the stage's last backward) and may therefore fire once per
    micro-batch: it does not make ``needs_aliases`` true."""
    setattr(hook, _STEP_AWARE, True)
    return hook


def _has_hooks(param: Tensor) -> bool:
    for hooks in (param._backward_hooks, param._post_accumulate_grad_hooks):
        if hooks and not all(getattr(h, _STEP_AWARE, False) for h in hooks.values()):
            return True
    return False


def ddp_forward_running() -> bool:
    """Whether a ``DistributedDataParallel`` forward is running (its reducer then expects
    each parameter's gradient once, through hooks no Python attribute shows). Looked up,
    not imported: a process that never imported DDP runs none."""
    cls = loaded_class("torch.nn.parallel.distributed", "DistributedDataParallel")
    return getattr(cls, "_active_ddp_module", None) is not None


def needs_aliases(params: Iterable[Tensor]) -> bool:
    """Whether a step over ``params`` must keep its micro-batches' gradients away from the
    parameters (an ``AliasSink``): some parameter has a hook (``register_hook``,
    ``register_post_accumulate_grad_hook``) that is not ``step_aware``, or a
    ``DistributedDataParallel`` forward is running."""
    with torch._C.DisableTorchFunctionSubclass():  # a subclass's override sees no lookups
        for param in params:  # a loop, not a generator: a call's fixed cost
            if (param._backward_hooks or param._post_accumulate_grad_hooks) and \
                    _has_hooks(param):
                return True
    return ddp_forward_running()
