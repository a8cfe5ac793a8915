"""Parameters that two or more layers on one rank share: still one parameter at each step.

Layers of one rank that share a parameter (a tied embedding and head on the first and last
stage, both on rank 0 under ``zbv`` or ``dualpipev``; or two layers of one stage) hold one
tensor, so autograd sums both uses into its one gradient and no tie sum is needed (see
``seqpipe.distributed.ties`` for copies on several ranks). FSDP2's ``fully_shard``, the
FSDP2-style ``replicate`` and ``parallelize_module`` break that sharing when they wrap the
layers apart: each gives the layer it wraps its own ``DTensor`` parameter, so the two
layers then train two parameters, each with its own use's gradient only, silently.

``LocalTies`` notes at construction which parameter slots of this rank's layers hold one
shared tensor, and ``check`` (at the start of every ``train_step``) raises ``ValueError``
naming them and the mend when they no longer do.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

__all__ = ["LocalTies"]

_Slot = Tuple[str, nn.Module, str]  # (the parameter's name in the model, owner, attribute)


class LocalTies:
    """The groups of parameter slots of this rank's layers that share one tensor."""

    def __init__(self, groups: Sequence[Sequence[_Slot]]) -> None:
        self.groups = [list(group) for group in groups]

    @staticmethod
    def of(module: nn.Module, layer_names: Sequence[str]) -> Optional["LocalTies"]:
        """The parameters that two or more of ``module``'s layers ``layer_names`` (this
        rank's, by their names in the model) share; ``None`` if there are none."""
        found: Dict[int, List[_Slot]] = {}
        for layer_name in layer_names:
            layer = module.get_submodule(layer_name)
            for owner_name, owner in layer.named_modules(remove_duplicate=False):
                for attribute, param in owner._parameters.items():
                    if param is not None:
                        name = ".".join(n for n in (layer_name, owner_name, attribute) if n)
                        found.setdefault(id(param), []).append((name, owner, attribute))
        groups = [slots for slots in found.values()
                  if len({name.split(".")[0] for name, _, _ in slots}) > 1]
        return LocalTies(groups) if groups else None

    def check(self) -> None:
        """Raise ``ValueError`` if the layers of a group no longer hold one tensor."""
        for slots in self.groups:
            held = {id(owner._parameters[attribute]) for _, owner, attribute in slots}
            if len(held) > 1:
                names = [name for name, _, _ in slots]
                raise ValueError(
                    f"the parameters {names} are one parameter in the model (tied), shared "
                    f"by layers on this rank, but are now {len(held)} different tensors: "
                    f"fully_shard, replicate or parallelize_module wrapped those layers "
                    f"apart, giving each its own copy, which would train as separate "
                    f"parameters (each with only its own use's gradient). Wrap the layers "
                    f"that share it in one unit (fully_shard([a, b], mesh=...) within one "
                    f"stage); or leave them unwrapped, the stages that hold them without a "
                    f"root unit, and average them with DistributedPipe("
                    f"data_parallel_group=...); or place their stages on different ranks "
                    f"(e.g. interleaved_1f1b rather than zbv), where seqpipe sums the "
                    f"copies of a tied parameter across ranks")
