"""A tensor two partitions of a local ``Pipe`` use, one of them (or both) holding it outside
registration, gets its gradient in a fixed order, as a registered tie does.

``seqpipe.local.tie_order`` adds each stage's sum of a tied weight's micro-batch gradients,
then the stages' sums in stage order, for the parameters registered in two partitions. A
layer may instead hold another layer's ``nn.Parameter`` as a plain attribute (in a list, a
dict, ``__dict__``), or two layers may hold one tensor that is no parameter of the pipe (a
learned prompt, an adapter): two stage threads then added their contributions into one
``.grad`` in the order they reached it. The contributions below sum to another float32
number in each order (``tests/test_local_reproducible.py`` explains the rows): the plain
model gives 0; the threads' arrival order gave a number of the order of the ones. Each call
is run three times, and every run must give the plain model's bits.
"""
from __future__ import annotations

from typing import Callable, Dict

import pytest
import torch
from test_local_reproducible import check_stage_order
from torch import Tensor, nn

from seqpipe.core.held import held


class Scale(nn.Module):
    """``x[:, k] * w`` in place of column ``k``, ``w`` registered (``registered``) or held
    in a list attribute."""

    def __init__(self, weight: Tensor, column: int, registered: bool) -> None:
        super().__init__()
        if registered:
            self.weight = weight
        else:
            self.refs = [weight]  # a plain attribute: not a parameter of this layer
        self.column = column

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight if "weight" in self._parameters else self.refs[0]
        k = self.column
        return torch.cat([x[:, :k], x[:, k:k + 1] * w, x[:, k + 1:]], dim=1)


# How the two layers reach the tensor: (first registers it, second registers it, a Parameter)
HOLDINGS = {"first registers, second holds": (True, False, True),
            "first holds, second registers": (False, True, True),
            "both hold a parameter of nobody": (False, False, True),
            "both hold a tensor": (False, False, False)}


def _model(weight: Tensor, holding: str) -> nn.Sequential:
    first, second, _ = HOLDINGS[holding]
    return nn.Sequential(Scale(weight, 0, first), Scale(weight, 1, second))


@pytest.mark.parametrize("hooked", [False, True])  # True: the aliases' path (AliasSink)
@pytest.mark.parametrize("how", ["train_step", "backward"])
@pytest.mark.parametrize("holding", list(HOLDINGS))
def test_a_tensor_held_by_two_partitions_adds_each_stages_sum_in_stage_order(
        holding: str, how: str, hooked: bool) -> None:
    """As a registered tie (``tests/test_local_reproducible.py``). A parameter of the pipe
    has its hooks fire once per step; a tensor outside the pipe, once per micro-batch (as
    docs/pipe.md says of outside tensors)."""
    first, second, parameter = HOLDINGS[holding]
    weight = nn.Parameter(torch.ones(1)) if parameter else torch.ones(1, requires_grad=True)
    check_stage_order(weight, lambda w: _model(w, holding), how, hooked,
                      hooks_once=first or second)


class Holder(nn.Module):
    def __init__(self, value: object) -> None:
        super().__init__()
        self.value = value


def test_held_finds_tensors_outside_registration() -> None:
    """What ``held`` lists: leaves that require grad, in attributes, lists, tuples, dicts and
    modules held that way; not registered parameters, buffers, non-leaves or frozen ones."""
    free, frozen = torch.ones(2, requires_grad=True), torch.ones(2)
    other = nn.Linear(2, 2)
    nested: Dict[str, Callable[[], object]] = {
        "attribute": lambda: free, "list": lambda: [3, free], "tuple": lambda: (free,),
        "dict": lambda: {"w": free}, "module in a list": lambda: [other]}
    for name, make in nested.items():
        found = held(nn.Sequential(Holder(make())))
        want = list(other.parameters()) if name == "module in a list" else [free]
        assert [id(t) for t in found] == [id(t) for t in want], name
    layer = nn.Linear(2, 2)
    layer.register_buffer("extra", torch.ones(2))
    assert held(nn.Sequential(layer, Holder(frozen), Holder(free * 2))) == []
