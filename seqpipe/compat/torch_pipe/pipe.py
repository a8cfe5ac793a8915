"""``torch.distributed.pipeline.sync.Pipe`` on seqpipe's engine.

torch's ``Pipe`` took a model whose layers the user had already placed, split it where the
device changes, and returned an ``RRef`` to the output. This ``Pipe`` does the same on
``seqpipe.Pipe``; how it reads the placement:

* each layer goes where its parameters and buffers are; :class:`WithDevice` pins a layer
  (typically a parameterless one) to a device and moves it there, as in torch;
* a layer without parameters or buffers runs on the device of the layer before it (torch ran
  it on the CPU unless it was wrapped in ``WithDevice``: a copy to the host and back that
  nobody wanted);
* an ``nn.Sequential`` child is looked into, as torch did: its layers are placed one by one,
  and skip connections may cross from one nested ``nn.Sequential`` to another;
* consecutive layers on one device run as one partition (torch gave each CPU layer its own).

What a user sees of the structure is torch's: ``partitions`` is an ``nn.ModuleList`` grouped
exactly as torch grouped it (nested ``nn.Sequential``s and ``WithDevice`` wrappers flattened,
layers renumbered from 0 in each partition), so ``state_dict()`` keys are torch's
``"partitions.<i>.<j>."`` keys, and ``len``, indexing and iteration go over those layers.
``load_state_dict`` also takes the wrapped ``nn.Sequential``'s own keys.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from seqpipe.compat._legacy import LegacyKeys
from seqpipe.compat._peer import PeerPipe, peer_arguments, verify_peer_module
from seqpipe.compat._skip import verify_skippables
from seqpipe.compat.torch_pipe.rref import LocalRRef
from seqpipe.compat.torchgpipe.batchnorm import convert_deferred_batch_norm
from seqpipe.core.microbatch import TensorOrTensors
from seqpipe.core.partition import Device, layer_device, verify_module
from seqpipe.pipe import Pipe as _SeqPipe

__all__ = ["Pipe", "PipeSequential", "WithDevice"]


def _as_device(device: Device) -> torch.device:
    """``torch.device(device)``, with an ``int`` meaning that CUDA device."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    return torch.device(device)


class WithDevice(nn.Module):
    """Pins the wrapped layer to ``device`` inside a :class:`Pipe`.

    ``Pipe`` moves the wrapped module to ``device`` and runs it there. Useful for a layer
    whose device ``Pipe`` cannot read from parameters, e.g. a ``Dropout`` that should run on
    ``cuda:1`` rather than with the layer before it. Outside a ``Pipe`` it is transparent:
    ``forward`` calls the wrapped module.

    As in torch, the wrapped module is registered as ``_module``, so the model's
    ``state_dict`` keys of a wrapped layer with parameters read ``"<i>._module.weight"``.
    """

    def __init__(self, module: nn.Module, device: Device) -> None:
        super().__init__()
        self._module = module
        self._device = _as_device(device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module."""
        return self._module(*args, **kwargs)

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._module

    @property
    def device(self) -> torch.device:
        """The device the wrapped module runs on inside a ``Pipe``."""
        return self._device

    def extra_repr(self) -> str:
        return f"device={self._device}"


class PipeSequential(nn.Sequential):
    """An ``nn.Sequential`` that spreads a tuple into the next layer's positional arguments.

    torch's ``Pipe`` ran its partitions this way: a layer returning ``(a, b)`` feeds
    ``next_layer(a, b)``, and a multi-input ``pipe(x, y)`` calls ``first_layer(x, y)``. A
    single tensor is passed as it is.
    """

    def forward(self, *inputs: Any) -> Any:  # type: ignore[override]
        value: Any = inputs[0] if len(inputs) == 1 else inputs
        for layer in self:
            value = layer(*value) if isinstance(value, tuple) else layer(value)
        return value


@dataclass
class _Leaf:
    """One layer as the pipeline runs it, and where it sits in the user's model."""

    path: str  # its key prefix in the user's model, without the final "."
    layer: nn.Module
    pinned: Optional[torch.device]  # from a WithDevice around it (or around its Sequential)


class Pipe(PeerPipe, _SeqPipe):
    """``seqpipe.Pipe`` with the API of the removed ``torch.distributed.pipeline.sync.Pipe``.

    ``Pipe(module, chunks=1, checkpoint='except_last', deferred_batch_norm=False)`` takes an
    ``nn.Sequential`` whose layers are already on their devices, partitions it where the
    device changes (see the module docstring for the rules) and returns, from ``forward``,
    a :class:`~seqpipe.compat.torch_pipe.rref.LocalRRef` to the output: read it with
    ``.local_value()`` or ``.to_here()``, or call ``.backward()`` on a scalar one. No
    ``torch.distributed.rpc.init_rpc`` is needed; code that calls it may keep doing so.

    ``partitions`` (an ``nn.ModuleList``, torch's grouping), ``devices``, ``chunks`` and
    ``checkpoint`` are as in torch; ``balance`` (layers per partition as seqpipe runs them)
    is seqpipe's. ``.cuda()``, ``.cpu()`` and ``.to(device)`` raise a ``TypeError`` as in
    torch. Unlike torch's, it works under ``DistributedDataParallel`` with every checkpoint
    mode.
    """

    placement_hint = "place the layers (or wrap them in WithDevice) before wrapping the model"
    peer_name = "Pipe"

    def __init__(self, module: nn.Sequential, chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False) -> None:
        chunks, checkpoint = peer_arguments(chunks, checkpoint)
        verify_peer_module(module)
        if not len(module):
            self._init_empty(chunks, checkpoint)
            return
        verify_module(module)
        prefixes = _torch_prefixes(module)
        if deferred_batch_norm:
            convert_deferred_batch_norm(module, chunks)
        leaves = _leaves(module)
        flattened = any(leaf.path not in module._modules for leaf in leaves)
        runnable = (nn.Sequential(OrderedDict((str(i), leaf.layer)
                                              for i, leaf in enumerate(leaves)))
                    if flattened else module)
        verify_skippables(runnable)  # as torch's did, on the layers as they will run
        balance, devices = _placement(leaves)
        super().__init__(runnable, chunks, checkpoint, balance=balance, devices=devices)
        for partition in self.partitions:  # the engine's views: spread tuples as torch did
            partition.__class__ = PipeSequential
        self._register_partitions(_torch_groups(module, prefixes), PipeSequential)
        self.register_load_state_dict_pre_hook(LegacyKeys(_ModelKeys(prefixes)))

    def forward(self, *inputs: TensorOrTensors) -> LocalRRef[TensorOrTensors]:  # type: ignore[override]
        """Run the mini-batch through the pipeline; the output is on the last device.

        Several inputs are passed to the first layer as positional arguments, as in torch:
        tensors with the batch on dim 0 (cut into micro-batches), tensors wrapped in
        :class:`~seqpipe.compat.torch_pipe.microbatch.NoChunk` (given whole to every
        micro-batch) and non-tensor values (given unchanged to every micro-batch); at least
        one must be a tensor to cut. A non-tensor in the output comes back as the list of
        its micro-batches' values. An empty pipe returns its input.
        """
        if not inputs:
            raise TypeError("Pipe needs at least one input tensor, with the batch on dim 0")
        value = inputs[0] if len(inputs) == 1 else tuple(inputs)
        if not self.devices:
            return self._empty_forward(value)
        return LocalRRef(super().forward(value))  # type: ignore[arg-type]


def _children(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Children in order, repeats included (a repeat is reported by ``verify_module``)."""
    return [(name, child) for name, child in module._modules.items() if child is not None]


def _is_plain_sequential(module: nn.Module) -> bool:
    """An ``nn.Sequential`` (or ``PipeSequential``) with no ``forward`` of its own.

    Its layers can run one by one in a partition without changing what it computes; a
    subclass with its own ``forward`` runs as one layer.
    """
    return isinstance(module, nn.Sequential) and type(module).forward in (
        nn.Sequential.forward, PipeSequential.forward)


def _leaves(module: nn.Sequential) -> List[_Leaf]:
    """The layers to run, with nested Sequentials and ``WithDevice`` wrappers looked into.

    Moves each ``WithDevice``-wrapped module to its device, as torch's ``Pipe`` did.
    """
    leaves: List[_Leaf] = []
    for name, child in _children(module):
        path, pinned = name, None
        if isinstance(child, WithDevice):
            pinned = child.device
            child.module.to(pinned)
            path, child = f"{name}._module", child.module
        if _is_plain_sequential(child) and child._modules:
            leaves += [_Leaf(f"{path}.{sub_name}", sub, pinned)
                       for sub_name, sub in _children(child)]
        else:
            leaves.append(_Leaf(path, child, pinned))
    return leaves


def _resolved(device: torch.device) -> torch.device:
    """A CUDA device with its index, so it compares equal to where tensors report to be."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _placement(leaves: List[_Leaf]) -> Tuple[List[int], List[torch.device]]:
    """Layers per partition and each partition's device, from where the layers sit.

    A pinned layer goes to its pin; any other to its parameters' and buffers' device; a
    layer with neither joins the layer before it (the first placed one, for leading layers;
    the CPU when nothing is placed). Consecutive layers on one device form a partition.
    """
    found = [_resolved(leaf.pinned) if leaf.pinned is not None
             else layer_device(leaf.layer, leaf.path) for leaf in leaves]
    known = [device for device in found if device is not None]
    current = known[0] if known else torch.device("cpu")
    balance: List[int] = []
    devices: List[torch.device] = []
    for device in found:
        current = current if device is None else device
        if devices and devices[-1] == current:
            balance[-1] += 1
        else:
            balance.append(1)
            devices.append(current)
    return balance, devices


class _ModelKeys:
    """The wrapped model's own keys -> torch ``Pipe``'s ``partitions.<i>.<j>.`` keys."""

    def __init__(self, prefixes: Dict[str, str]) -> None:
        # Longest model prefix first, so "2._module.10." wins over "2._module.1".
        self.prefixes = sorted(((model, ours) for ours, model in prefixes.items()),
                               key=lambda pair: -len(pair[0]))

    def __call__(self, key: str) -> str:
        for model, ours in self.prefixes:
            if key.startswith(model):
                return ours + key[len(model):]
        return key


def _torch_groups(module: nn.Sequential,
                  prefixes: Dict[str, str]) -> List[List[Tuple[str, nn.Module]]]:
    """torch's partitions: per partition, ``(index, layer)`` in order, from ``prefixes``."""
    groups: List[List[Tuple[str, nn.Module]]] = []
    for ours, model in prefixes.items():
        _, partition, index, _ = ours.split(".")
        while len(groups) <= int(partition):
            groups.append([])
        groups[int(partition)].append((index, module.get_submodule(model.rstrip("."))))
    return groups


def _torch_prefixes(module: nn.Sequential) -> Dict[str, str]:
    """Key prefixes torch's ``Pipe`` saved (``partitions.<i>.<j>.``) -> the model's own.

    Follows torch's split: a layer's device was that of its first parameter, the CPU for a
    layer without parameters, or its ``WithDevice`` pin; a new partition began wherever the
    device changed and at every CPU layer; ``nn.Sequential`` children were flattened into
    their partition and the layers of each partition renumbered from 0.
    """
    prefixes: Dict[str, str] = {}
    partition, index = -1, 0
    current: Optional[torch.device] = None
    for name, child in _children(module):
        base = name
        if isinstance(child, WithDevice):
            device, base, child = child.device, f"{name}._module", child.module
        else:
            device = next((p.device for p in child.parameters()), torch.device("cpu"))
        if current is None or device != current or device.type == "cpu":
            partition, index = partition + 1, 0
        current = device
        paths = ([f"{base}.{sub}" for sub, _ in _children(child)]
                 if isinstance(child, nn.Sequential) else [base])
        for path in paths:
            prefixes[f"partitions.{partition}.{index}."] = f"{path}."
            index += 1
    return prefixes
