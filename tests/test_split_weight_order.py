"""A split backward's ``W`` computes the weights' gradients in a fixed order: the parameters
registered last first, as a plain backward does, the same on every replica (per-layer
reductions issued from parameter hooks must be issued in the same order everywhere)."""
from __future__ import annotations

from typing import List

import torch
from torch import nn

from seqpipe.core.entry import enter
from seqpipe.core.split_backward import SplitBackward


def test_weight_gradients_in_reverse_registration_order() -> None:
    """Eight layers on one stage, I then W: the post-accumulate hooks of W fire layer by
    layer from the last to the first (before, W followed the iteration order of a set of
    autograd nodes, their addresses), and the gradients are a plain backward's."""
    for seed in range(4):  # fresh graphs at fresh addresses: one order every time
        torch.manual_seed(seed)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(8)))
        params = list(model.parameters())
        fired: List[int] = []
        for n, layer in enumerate(model):
            for param in layer.parameters():
                param.register_post_accumulate_grad_hook(
                    lambda _, n=n, fired=fired: fired.append(n))
        x = torch.randn(4, 8, requires_grad=True)
        incoming = [x]
        entry = enter(incoming, [True], torch.device("cpu"))  # x as a stage receives it
        out = model(incoming[0])
        grad = torch.randn_like(out)
        split = SplitBackward([torch.autograd.graph.get_gradient_edge(out)], [grad],
                              entry.phony, entry.node)
        split.input()
        assert fired == [], "I must not reach the weights"
        split.weight(params)
        layers = [n for k, n in enumerate(fired) if k == 0 or fired[k - 1] != n]
        assert layers == list(range(7, -1, -1)), f"seed {seed}: W's layer order {layers}"
        got = [p.grad.clone() for p in params]
        model.zero_grad()
        torch.autograd.backward(model(x), grad)
        for mine, plain in zip(got, (p.grad for p in params)):
            torch.testing.assert_close(mine, plain)
