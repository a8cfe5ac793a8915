"""What ``inputs=`` costs a backward: the stage backward's form against the plain one.

    PYTHONPATH=. python benchmarks/backward_inputs.py [--rounds 150] [--model transformer]

A seqpipe stage runs its backward as ``torch.autograd.backward(roots, grads,
inputs=[its parameters, its received tensors])`` (``seqpipe/core/stage.py``), where the
plain model runs ``torch.autograd.backward(roots, grads)``; a ``DistributedPipe`` stage
without aliases runs the plain form (``GradSink.plain``, ``seqpipe/distributed/accumulate.py``).
This times three forms of the bare call (plain, ``inputs=``, ``torch.autograd.grad`` on the
same tensors) and ``Stage.backward`` itself as ``train_step`` runs it (the middle stage of
three, its sink from ``StepGrads``), with the sink's ``plain`` as chosen and forced off, on
``grad_sink.py``'s models, one intra-op thread, alternating in every round so that machine
load hits all alike; prints the median backward CPU time (``time.thread_time``) of each
(issue 24: part of the main-thread CPU seqpipe spends over torch pipelining per action).
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

from seqpipe.core.microbatch import Batch  # noqa: E402
from seqpipe.core.stage import Received, Stage  # noqa: E402
from seqpipe.distributed.accumulate import StepGrads  # noqa: E402
from seqpipe.skip.layout import inspect_skip_layout  # noqa: E402


def _stage(model: torch.nn.Sequential) -> Stage:
    """``model`` as the middle stage of three (its input wants its gradient back)."""
    full = torch.nn.Sequential(torch.nn.Identity(), *model, torch.nn.Identity())
    layout = inspect_skip_layout(full, [1, len(model), 1])
    return Stage(1, model, torch.device("cpu"), layout)


def _stage_backward(stage: Stage, x: torch.Tensor, plain: bool) -> float:
    grads = StepGrads(stage, 1)  # micro-batch 0 of 2: not the last
    grads.sink.plain = grads.sink.plain and plain
    received = Received(Batch((x.detach().requires_grad_(),), True, ()), {}, (True,))
    sent, state = stage.forward(received, grad=True, sink=grads.sink_for(0))
    grad = torch.ones_like(sent.outputs.tensors[0])
    start = time.thread_time()
    with grads.handing_over(0):
        stage.backward(state, [grad], {}, sink=grads.sink_for(0))
    return time.thread_time() - start


def _backward(model: torch.nn.Module, x: torch.Tensor, form: str) -> float:
    if form.startswith("Stage"):
        return _stage_backward(_stage(model), x, plain="plain" in form)  # type: ignore[arg-type]
    given = x.detach().requires_grad_()
    out = model(given)
    grad = torch.ones_like(out)
    wrt = [*model.parameters(), given]
    start = time.thread_time()
    if form == "plain":
        torch.autograd.backward([out], [grad])
    elif form == "inputs=":
        torch.autograd.backward([out], [grad], inputs=wrt)
    else:
        torch.autograd.grad([out], wrt, [grad])
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--model", choices=["transformer", "mlp"], default="transformer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, x = model_and_batch(args.model)
    times: Dict[str, List[float]] = {"plain": [], "inputs=": [], "autograd.grad": [],
                                     "Stage, plain": [], "Stage, inputs=": []}
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
        print(f"{form:15s} median {median * 1e3:7.3f} ms  ({median / plain:.3f}x plain)")


if __name__ == "__main__":
    main()
