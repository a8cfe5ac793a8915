"""What ``inputs=`` costs a backward: the stage backward's form against the plain one.

    PYTHONPATH=. python benchmarks/backward_inputs.py [--rounds 150] [--model transformer]

A seqpipe stage runs its backward as ``torch.autograd.backward(roots, grads,
inputs=[its parameters, its received tensors])`` (``seqpipe/core/stage.py``), where the
plain model runs ``torch.autograd.backward(roots, grads)``. This times the three forms
(plain, ``inputs=``, ``torch.autograd.grad`` on the same tensors) on ``grad_sink.py``'s
models, one intra-op thread, alternating in every round so that machine load hits all
three; prints the median backward time of each (issue 24: part of the main-thread CPU
seqpipe spends over torch pipelining per action).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grad_sink import model_and_batch  # noqa: E402 - the same models


def _backward(model: torch.nn.Module, x: torch.Tensor, form: str) -> float:
    given = x.detach().requires_grad_()
    out = model(given)
    grad = torch.ones_like(out)
    wrt = [*model.parameters(), given]
    start = time.perf_counter()
    if form == "plain":
        torch.autograd.backward([out], [grad])
    elif form == "inputs=":
        torch.autograd.backward([out], [grad], inputs=wrt)
    else:
        torch.autograd.grad([out], wrt, [grad])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--model", choices=["transformer", "mlp"], default="transformer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, x = model_and_batch(args.model)
    times: Dict[str, List[float]] = {"plain": [], "inputs=": [], "autograd.grad": []}
    for warm in (True, False):
        for _ in range(10 if warm else args.rounds):
            for form in times:
                model.zero_grad(set_to_none=True)
                took = _backward(model, x, form)
                if not warm:
                    times[form].append(took)
    plain = statistics.median(times["plain"])
    for form, values in times.items():
        median = statistics.median(values)
        print(f"{form:14s} median {median * 1e3:7.3f} ms  ({median / plain:.3f}x plain)")


if __name__ == "__main__":
    main()
