"""Partitions that draw no random numbers, and so need no private random streams.

Stages that run side by side draw from private generators (``seqpipe.core.rng``), handed to
random ops by a ``TorchDispatchMode``: one Python call per ATen operation of every forward
and recomputation. On the CNN of ``python -m seqpipe`` that mode cost about 1.2 ms per
micro-batch (forward and backward of batch 8, one thread; docs/benchmarks.md, "Session 9:
bnjob"), a tenth of the step, to isolate draws that such a model never makes.

So a call skips the private streams when nothing in it can draw: every module of every
partition is exactly one of the ``torch.nn`` layers in ``RANDOM_FREE`` (a subclass may
override ``forward``, so it does not count) or a BatchNorm that seqpipe made deferred; none
has a forward hook or pre-hook, nor is one registered globally; and no dispatch or function
mode is active on the caller's thread (one could turn an operation into a random one),
except ``torch.device``'s. Anything else — dropout, a user's own layer, a hook — keeps
the private streams, exactly as before. The result is the same either way (a model that
draws nothing has nothing to isolate); what changes is that a random-free model's call no
longer draws the tasks' seeds from the global generator.
"""
from __future__ import annotations

from typing import FrozenSet, Iterable

from torch import nn
from torch.nn.modules import module as module_hooks
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from seqpipe.core.batchnorm import DeferredBatchNorm

__all__ = ["RANDOM_FREE", "draws_no_random"]

RANDOM_FREE: FrozenSet[type] = frozenset({
    nn.Sequential, nn.Identity, nn.Flatten, nn.Unflatten,
    nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.GroupNorm,
    nn.LayerNorm, nn.RMSNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.LocalResponseNorm,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Sigmoid, nn.Tanh, nn.Softmax, nn.LogSoftmax, nn.Softplus, nn.Softsign,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Hardshrink, nn.Softshrink, nn.Tanhshrink,
    nn.Threshold, nn.GLU, nn.LogSigmoid,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.LPPool1d, nn.LPPool2d,
    nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle, nn.ChannelShuffle,
    nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d, nn.ConstantPad1d, nn.ConstantPad2d,
    nn.ConstantPad3d, nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReflectionPad3d,
    nn.ReplicationPad1d, nn.ReplicationPad2d, nn.ReplicationPad3d, nn.CircularPad1d,
    nn.CircularPad2d, nn.CircularPad3d,
})
"""``torch.nn`` layers whose forward never draws a random number (not ``Dropout``,
``RReLU``, ``FractionalMaxPool``, nor the Transformer layers, which apply dropout)."""


def _hooks_anywhere(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _random_free_class(module: nn.Module) -> bool:
    kind = type(module)
    if kind in RANDOM_FREE:
        return True
    # a BatchNorm converted by seqpipe: its class is the deferred mixin over the layer's own
    return isinstance(module, DeferredBatchNorm) and kind.__module__.startswith("seqpipe.")


def draws_no_random(partitions: Iterable[nn.Module]) -> bool:
    """Whether a call of ``partitions``, made now on this thread, cannot draw a random
    number in a forward or recomputation (see the module docstring): then stages may run
    side by side without private random streams."""
    if (module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks
            or _get_current_dispatch_mode_stack()):
        return False
    if any(not isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack()):
        return False
    for partition in partitions:
        for module in partition.modules():
            if not _random_free_class(module) or _hooks_anywhere(module):
                return False
    return True
