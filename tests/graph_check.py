"""Shared checks of the ``to_sequential`` tests: train a converted model next to the plain
one and compare losses, gradients and weights (used in one process and on several)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Sequence

import torch
from graph_models import example, loss_of, model_loss
from torch import Tensor, nn


def reference_loss(name: str, model: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any],
                   target: Tensor, chunks: int) -> Tensor:
    """The plain model's loss as a pipeline computes it: per micro-batch (BatchNorm
    normalises each on its own), weighted by micro-batch size."""
    n = target.shape[0]
    pieces = min(chunks, n)
    total = torch.zeros((), dtype=torch.double)
    for i, y in enumerate(torch.tensor_split(target, pieces)):
        cut = [torch.tensor_split(a, pieces)[i] for a in args]
        kw = {k: torch.tensor_split(v, pieces)[i] if isinstance(v, Tensor) else v
              for k, v in kwargs.items()}
        total = total + model_loss(name, model(*cut, **kw), y).double() * len(y) / n
    return total


def train_both(name: str, step: Callable[[Any, Tensor], Tensor], params: Dict[str, nn.Parameter],
               plain: nn.Module, chunks: int, expect: Callable[..., None],
               batches: Sequence[int] = (6, 5, 4)) -> None:
    """Three SGD steps (batch sizes ``batches``) of the converted model (``step(input,
    target) -> loss``, over ``params`` keyed by the plain model's names) and of ``plain``;
    ``expect(actual, wanted, what)`` compares losses, every gradient and every weight."""
    unique = list({id(p): p for p in params.values()}.values())  # a tie: stepped once
    opt = torch.optim.SGD(unique, lr=0.05, momentum=0.9)
    theirs = dict(plain.named_parameters(remove_duplicate=False))
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    for i, batch in enumerate(batches):
        args, kwargs, target = example(name, batch=batch, step=i)
        opt.zero_grad()
        loss = step((args, kwargs), target)
        ref_opt.zero_grad()
        ref = reference_loss(name, plain, args, kwargs, target, chunks)
        ref.backward()
        expect(loss.double(), ref.detach(), f"{name}: loss of step {i}")
        for key, param in params.items():
            expect(param.grad, theirs[key].grad, f"{name}: grad of {key}, step {i}")
        opt.step()
        ref_opt.step()
    for key, param in params.items():
        expect(param.detach(), theirs[key].detach(), f"{name}: {key} after the steps")


def close(tol: Dict[str, float]) -> Callable[[Tensor, Tensor, str], None]:
    """An ``expect(actual, wanted, what)`` for ``train_both`` within ``tol``."""
    def expect(actual: Tensor, wanted: Tensor, what: str) -> None:
        torch.testing.assert_close(actual, wanted, **tol, msg=what)
    return expect


__all__ = ["close", "reference_loss", "train_both", "loss_of"]
