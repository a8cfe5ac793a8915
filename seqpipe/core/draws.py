"""Which partitions provably draw no random numbers, so that their tasks need no private
random stream (``seqpipe.core.rng``).

Stages that run side by side in threads draw from private generators, handed to every
random op by a ``TorchDispatchMode``. That mode costs every aten op of the forward a trip
through Python, and more: a convolution under it takes 2-5 % longer, and the README's CNN
(five convolutions, 36 aten ops) paid ~1.9 ms of a ~19 ms forward for it, though it draws
nothing. A partition made only of modules whose forward cannot draw needs no stream: its
task then runs with the global generators untouched (``NO_DRAWS``: no mode, and no
checkpoint saves or restores their state, which another thread may be drawing from).

"Cannot draw" is decided per task, from what is there at that moment, and only where it
is certain: every module is exactly one of the ``torch.nn`` classes below, a dropout or
``RReLU`` in ``eval()`` mode (or a dropout of ``p=0``), or one of its BatchNorms made
deferred (a subclass, a parametrized module or a user's own class may do anything), none
has its own ``forward`` attribute or a forward hook, no global forward hook is registered,
and no ``TorchFunctionMode`` or ``TorchDispatchMode`` is active (the caller's modes are carried to
the workers, and one may draw). Anything else keeps the private stream.
"""
from __future__ import annotations

from typing import FrozenSet, Set, Type

import torch
from torch import nn
from torch.nn.modules import module as _module

from seqpipe.core.batchnorm import DeferredBatchNorm

__all__ = ["NO_DRAWS", "draws_nothing"]

# The seed of a task whose partition draws nothing (``draws_nothing``): never one that
# ``seqpipe.core.rng.draw_seeds`` draws (those are >= 0).
NO_DRAWS = -1

# Modules whose forward calls no random op, in training or not (no dropout, no RReLU,
# no fractional pooling; containers run their children, which are checked too).
_QUIET: FrozenSet[Type[nn.Module]] = frozenset({
    nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity, nn.Flatten, nn.Unflatten,
    nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus,
    nn.Softsign, nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.GLU, nn.Threshold,
    nn.LogSigmoid, nn.Tanhshrink, nn.Hardshrink, nn.Softshrink,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.LPPool1d, nn.LPPool2d, nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d,
    nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d, nn.ReflectionPad1d,
    nn.ReflectionPad2d, nn.ReplicationPad1d, nn.ReplicationPad2d, nn.Upsample,
    nn.PixelShuffle, nn.PixelUnshuffle, nn.ChannelShuffle,
})

# Modules that draw only in training mode: in ``eval()`` their forward is the identity
# (dropout) or a fixed slope (RReLU), with no random op; a dropout of ``p=0`` never draws.
_QUIET_UNLESS_TRAINING: FrozenSet[Type[nn.Module]] = frozenset({
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
    nn.FeatureAlphaDropout, nn.RReLU,
})


def draws_nothing(module: nn.Module) -> bool:
    """Whether running ``module`` certainly calls no random op (see the module docstring).
    Walked at every task, without generators (a task's fixed cost: a few µs)."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks or \
            torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        return False  # (a mode of the caller's, carried to the worker, may draw)
    return _quiet(module, set())


def _quiet_class(cls: Type[nn.Module]) -> bool:
    """One of ``_QUIET``, or one of its BatchNorms made deferred
    (``convert_deferred_batch_norm`` mixes ``DeferredBatchNorm`` into the layer's class,
    adding nothing else; its forward draws nothing)."""
    if cls in _QUIET:
        return True
    bases = cls.__bases__
    return len(bases) == 2 and bases[0] is DeferredBatchNorm and bases[1] in _QUIET and \
        "forward" not in cls.__dict__


def _quiet(module: nn.Module, seen: Set[int]) -> bool:
    seen.add(id(module))
    quiet = _quiet_class(module.__class__) or (module.__class__ in _QUIET_UNLESS_TRAINING and (
        not module.training or getattr(module, "p", None) == 0))  # (a dropout of p=0 draws not)
    if not quiet or module._forward_hooks or \
            module._forward_pre_hooks or "forward" in module.__dict__:
        return False
    for child in module._modules.values():
        if child is not None and id(child) not in seen and not _quiet(child, seen):
            return False
    return True
