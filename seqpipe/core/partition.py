"""Split an ``nn.Sequential`` into partitions, by ``balance`` or by where its layers sit.

Partitions are ``nn.Sequential`` views over the user's own layer objects: nothing is
copied, so parameters keep their identity and an optimizer built before wrapping keeps
working.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from seqpipe.core.arguments import layer_counts

__all__ = ["Device", "check_balance", "check_devices", "refuse_meta", "verify_module",
           "split_by_balance", "split_by_placement", "layer_device", "default_devices"]

Device = Union[str, int, torch.device]


def verify_module(module: object) -> None:
    """Raise unless ``module`` is an ``nn.Sequential`` of distinct, initialized layers."""
    if not isinstance(module, nn.Sequential):
        mend = ("put its layers in nn.Sequential(*layers)" if isinstance(module, nn.ModuleList)
                else "convert a model with its own forward with seqpipe.to_sequential(model, "
                     "(example_input,)) (docs/models.md), or put its layers in "
                     "nn.Sequential(...)")
        raise TypeError(f"seqpipe needs an nn.Sequential, got {type(module).__name__}; {mend}")
    if len(module) == 0:
        raise ValueError("the nn.Sequential is empty; give it at least one layer")
    seen: dict = {}
    for name, layer in module._modules.items():  # named_children() hides repeated layers
        if id(layer) in seen:
            raise ValueError(
                f"layers '{seen[id(layer)]}' and '{name}' are the same module object; "
                f"a pipeline cannot place one layer in two positions — use separate copies")
        seen[id(layer)] = name
    lazy = [name for name, t in (*module.named_parameters(), *module.named_buffers())
            if isinstance(t, (UninitializedParameter, UninitializedBuffer))]
    if lazy:
        raise ValueError(
            f"{', '.join(lazy[:3])}{' and others' if len(lazy) > 3 else ''} not initialized "
            f"yet (a lazy module such as nn.LazyLinear); run the model once on a sample "
            f"batch to initialize them, then wrap it")


def refuse_meta(module: nn.Sequential) -> None:
    """Raise ``ValueError`` if a layer is on ``meta``: a partition there holds no values
    (training would "run" and fail only when a value is read)."""
    on_meta = [name for name, t in (*module.named_parameters(), *module.named_buffers())
               if t.is_meta]
    if on_meta:
        raise ValueError(
            f"{', '.join(on_meta[:3])}{' and others' if len(on_meta) > 3 else ''} are on the "
            f"meta device and hold no values; materialise the model first (e.g. "
            f"model.to_empty(device=...) and load a checkpoint or seqpipe.seeding.seed_layers"
            f"(model, seed)), or use seqpipe.distributed.DistributedPipe, which materialises "
            f"each stage on its own device")


def default_devices(count: int) -> List[torch.device]:
    """The visible CUDA devices, or ``cpu`` for every partition when there is no GPU."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")] * count


def check_devices(devices: Sequence[torch.device], what: str = "devices") -> None:
    """Refuse, before any layer moves, a device this machine cannot hold a layer on.

    ``ValueError`` naming the device and the mend: ``meta`` holds no values, and a CUDA
    device needs a CUDA build of torch and a visible GPU of that index (torch itself would
    fail later with a bare ``AssertionError: Torch not compiled with CUDA enabled``).
    """
    listed = [str(d) for d in devices]
    if any(d.type == "meta" for d in devices):
        raise ValueError(f"{what} {listed} include meta, where a partition holds no values; "
                         f"give real devices")
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return
    if not torch.backends.cuda.is_built():
        raise ValueError(
            f"{what} {listed} include CUDA devices, but this PyTorch build has no CUDA "
            f"support (torch {torch.__version__}); install a CUDA build of torch, or use "
            f"\"cpu\" for every partition (e.g. devices={['cpu'] * len(devices)})")
    count = torch.cuda.device_count()
    missing = sorted({str(d) for d in cuda if (d.index or 0) >= count})
    if missing and count == 0:
        raise ValueError(
            f"{what} {listed} include {', '.join(missing)}, but no CUDA device is visible "
            f"(check the driver and CUDA_VISIBLE_DEVICES), or use \"cpu\" devices")
    if missing:
        raise ValueError(
            f"{what} {listed} include {', '.join(missing)}, but this machine has {count} "
            f"visible CUDA device{'' if count == 1 else 's'}; give devices from cuda:0 to "
            f"cuda:{count - 1}")


def check_balance(module: nn.Sequential, balance: Sequence[int]) -> List[int]:
    """Validate layer counts per partition against ``module``."""
    return layer_counts(balance, len(module))


def split_by_balance(module: nn.Sequential, balance: Sequence[int],
                     devices: Optional[Sequence[Device]] = None,
                     ) -> Tuple[List[nn.Sequential], List[int], List[torch.device]]:
    """Cut ``module`` into ``len(balance)`` partitions and move each to its device."""
    balance = check_balance(module, balance)
    resolved = default_devices(len(balance)) if devices is None else [
        torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in devices]
    if len(resolved) < len(balance):
        raise IndexError(
            f"{len(balance)} partitions need {len(balance)} devices, got {len(resolved)}; "
            f"pass more devices or fewer balance entries")
    check_devices(resolved[:len(balance)])
    layers = list(module.children())
    partitions, start = [], 0
    for count, device in zip(balance, resolved):
        part = nn.Sequential(*layers[start:start + count])
        part.to(device)
        partitions.append(part)
        start += count
    return partitions, balance, resolved[:len(balance)]


def layer_device(layer: nn.Module, name: str = "") -> Optional[torch.device]:
    """The one device of a layer's parameters and buffers, ``None`` if it has neither."""
    devices = {t.device for t in (*layer.parameters(), *layer.buffers())}
    if len(devices) > 1:
        listed = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"layer '{name}' ({type(layer).__name__}) has parameters on several devices "
            f"({listed}); a layer must sit on one device — move it, or give balance and "
            f"devices to let Pipe place it")
    return devices.pop() if devices else None


def split_by_placement(module: nn.Sequential,
                       ) -> Tuple[List[nn.Sequential], List[int], List[torch.device]]:
    """Partition by existing placement: consecutive layers on one device form a partition.

    Layers without parameters or buffers (activations, pooling) join the partition of the
    layer before them, or of the first placed layer when they come first.
    """
    named = list(module.named_children())
    placed = [layer_device(layer, name) for name, layer in named]
    known = [d for d in placed if d is not None]
    current = known[0] if known else torch.device("cpu")
    groups: List[Tuple[torch.device, List[nn.Module]]] = []
    for (_, layer), device in zip(named, placed):
        device = device or current
        if not groups or groups[-1][0] != device:
            groups.append((device, []))
        groups[-1][1].append(layer)
        current = device
    partitions = [nn.Sequential(*layers) for _, layers in groups]
    return partitions, [len(layers) for _, layers in groups], [d for d, _ in groups]
