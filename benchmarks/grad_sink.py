"""Cost of a stage's gradient sink: a training step plainly and through each sink.

A stage runs its partition through a sink (``seqpipe/core/sink.py``) and backpropagates into
``sink.weights``; the sums are then handed to autograd once. Without parameter hooks the
sink is a ``DirectSink`` (the layers run as in the plain model; nothing per torch
operation); with a hook it is an ``AliasSink``, whose ``TorchFunctionMode`` costs one Python
call per torch operation of the forward. This script times, interleaved in one process
(no threads, no micro-batches, one intra-op thread):

* ``plain``: the model's step; ``direct``: the same through ``open_sink`` (no hooks: a
  ``DirectSink``) under ``loss.backward()``, which backpropagates as the plain model does
  and leaves the sums in ``.grad`` (``GradSink.hold``); ``direct/inputs``: the same under
  ``torch.autograd.grad`` or a backward with ``inputs=`` (the stage's backward keeps its
  ``inputs=``, ``.grad`` is put aside and the sums handed over: what ``direct`` did before
  session 9); ``aliases``: through an ``AliasSink`` (what every model paid before the
  ``DirectSink``);
* ``plain+hook``, ``sink+hook``: the same with a no-op ``register_post_accumulate_grad_hook``
  on every parameter (``open_sink`` then gives an ``AliasSink``): the cost of keeping hooks
  exact;
* ``pipe``, ``pipe+hook``: a one-partition ``Pipe`` with ``chunks=1`` (forward,
  ``loss.backward()``), without and with the hooks. One micro-batch of one partition runs
  as the plain model (``seqpipe/local/direct.py``), hooks or not; ``pipe/engine``: the
  same call made to go through the engine (the sink, the worker machinery, the nested
  backward: what it did before); ``pipe/aliases``: the engine with an ``AliasSink``
  without hooks, as every call did before the ``DirectSink``.

The sums are set as ``.grad`` at the end (in a ``Pipe`` the outer backward accumulates
them, as it accumulates the plain model's gradients), so ``sink+hook`` skips the 48 no-op
hook calls that ``plain+hook`` makes (about 1 % of its step).

Two models: ``mlp``, ``benchmarks/overhead.py``'s (8 × (Linear(1024) + ReLU), batch 128:
few, large operations) and ``transformer``, four ``TransformerEncoderLayer(64, 4, 128)``
on an 8 × 32 × 64 batch (many small operations: the worst case for a per-operation cost).

With ``--stage``, two more: ``stage``, one micro-batch through the stage path that
``DistributedPipe.train_step`` runs (``StepGrads``, ``Stage.forward`` from a received input,
``Stage.backward`` without ``inputs=``, as without hooks), against ``plain-seeded``, the plain
step given the same output gradient and a leaf input.

Targets (issue 24), on the transformer: ``direct / plain`` ≤ 1.02, ``pipe / plain`` ≤ 1.03.
Ratios are medians of
per-round ratios, on process CPU time (what a loaded machine disturbs least) and wall.
Run: ``PYTHONPATH=. python benchmarks/grad_sink.py --model transformer --rounds 60``
(``--model mlp`` for the other).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable, List, Optional, Tuple

import torch
from _common import clone, interleave, make_model, paired_ratio, pin_malloc
from torch import Tensor, nn

from seqpipe import Pipe
from seqpipe.core.microbatch import Batch
from seqpipe.core.sink import AliasSink, GradSink, open_sink

TARGETS = {"direct": 1.02, "pipe": 1.03}


def model_and_batch(name: str) -> Tuple[nn.Module, Tensor]:
    if name == "mlp":
        return make_model(1024, 8), torch.randn(128, 1024)
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
              for _ in range(4)]
    return nn.Sequential(*layers), torch.randn(8, 32, 64)


def plain_step(model: nn.Module, x: Tensor) -> Callable[[], None]:
    def step() -> None:
        for p in model.parameters():
            p.grad = None
        model(x).sum().backward()
    return step


def sink_step(model: nn.Module, x: Tensor, make: Callable[[List[nn.Module]], GradSink],
              whole: bool = True) -> Callable[[], None]:
    """What a one-stage ``Pipe`` call does with its sink, without the engine around it,
    under ``loss.backward()`` (``whole``) or under ``torch.autograd.grad`` / a backward with
    ``inputs=`` (``GradSink.hold``)."""
    def step() -> None:
        for p in model.parameters():
            p.grad = None
        sink = make([model])
        out = sink.call(0, model, x)
        sink.hold(whole)  # (in a Pipe: when autograd reaches the pipe's Function)
        if sink.plain:
            torch.autograd.backward([out.sum()])
        else:
            torch.autograd.backward([out.sum()], inputs=sink.weights(0))
        for param, grad in sink.take():  # Pipe's autograd Function hands them over
            param.grad = grad
    return step


def stage_step(model: nn.Module, x: Tensor) -> Callable[[], None]:
    """One micro-batch through the stage path ``DistributedPipe.train_step`` runs on a
    stage (``StepGrads``' sink, ``Stage.forward`` from a received input that wants its
    gradient back, ``Stage.backward``: without hooks, no ``inputs=``), in one process."""
    from seqpipe.core.stage import Received, Stage
    from seqpipe.distributed.accumulate import StepGrads
    from seqpipe.skip.layout import inspect_skip_layout

    assert isinstance(model, nn.Sequential)
    layout = inspect_skip_layout(nn.Sequential(nn.Identity(), *model), [1, len(model)])
    stage = Stage(1, model, torch.device("cpu"), layout)

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        grads = StepGrads(stage, 0)
        received = Received(Batch((x.detach().requires_grad_(),), True), {}, (True,))
        sent, state = stage.forward(received, grad=True, sink=grads.sink_for(0))
        assert state is not None
        with grads.handing_over(0):
            stage.backward(state, [torch.ones_like(sent.outputs.tensors[0])], {},
                           sink=grads.sink_for(0))
    return step


def plain_seeded(model: nn.Module, x: Tensor) -> Callable[[], None]:
    """The plain model's step as ``stage_step`` seeds it: the output's gradient given, the
    input a leaf wanting its gradient."""
    def step() -> None:
        for p in model.parameters():
            p.grad = None
        out = model(x.detach().requires_grad_())
        out.backward(torch.ones_like(out))
    return step


def piped(model: nn.Module) -> Pipe:
    """A one-partition, one-chunk ``Pipe`` over ``model`` (an ``nn.Sequential``)."""
    assert isinstance(model, nn.Sequential)
    return Pipe(model, chunks=1, balance=[len(model)], devices=["cpu"])


def aliased(pipe: Pipe) -> Pipe:
    """``pipe``, its calls given an ``AliasSink`` even without hooks (the old way)."""
    partitions = list(pipe.partitions)
    pipe._pipeline.open_sink = lambda: AliasSink(partitions)  # type: ignore[method-assign]
    return pipe


def engine(pipe: Pipe) -> Pipe:
    """``pipe`` with the one-micro-batch direct call off: every call through the engine
    (``seqpipe.local.direct``; what every one-partition call did before)."""
    pipe._direct = None
    return pipe


def hooked(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: None)
    return model


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "transformer"), default="transformer")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--stage", action="store_true",
                        help="also time the distributed stage's path (stage / plain-seeded)")
    args = parser.parse_args(argv)
    pin_malloc()
    torch.set_num_threads(1)
    model, x = model_and_batch(args.model)
    direct = clone(model)
    assert type(open_sink([direct])).__name__ == "DirectSink"
    variants = {
        "plain": plain_step(clone(model), x),
        "direct": sink_step(direct, x, open_sink),
        "direct/inputs": sink_step(clone(model), x, open_sink, whole=False),
        "aliases": sink_step(clone(model), x, AliasSink),
        "plain+hook": plain_step(hooked(clone(model)), x),
        "sink+hook": sink_step(hooked(clone(model)), x, open_sink),
        "pipe": plain_step(piped(clone(model)), x),
        "pipe+hook": plain_step(hooked(piped(clone(model))), x),
        "pipe/aliases": plain_step(aliased(engine(piped(clone(model)))), x),
        "pipe/engine": plain_step(engine(piped(clone(model))), x),
    }
    pairs = [("direct", "plain"), ("direct/inputs", "plain"), ("aliases", "plain"),
             ("sink+hook", "plain+hook"), ("pipe", "plain"), ("pipe+hook", "plain+hook"),
             ("pipe/engine", "plain"), ("pipe/aliases", "plain"), ("pipe", "pipe/engine")]
    if args.stage:
        variants["plain-seeded"] = plain_seeded(clone(model), x)
        variants["stage"] = stage_step(clone(model), x)
        pairs.append(("stage", "plain-seeded"))
    samples = interleave(variants, rounds=args.rounds, warmup=args.warmup)
    print(f"# {args.model}, {args.rounds} interleaved rounds, one intra-op thread")
    for name, s in samples.items():
        print(f"{name:<14} median {s.median * 1e3:8.2f} ms  "
              f"cpu {statistics.median(s.cpu) * 1e3:8.2f} ms")
    for a, b in pairs:
        cpu = paired_ratio(samples[a], samples[b], cpu=True)
        wall = paired_ratio(samples[a], samples[b])
        print(f"{a} / {b}: CPU time {cpu:.4f}, wall {wall:.4f}")
    for name, target in TARGETS.items():
        cpu = paired_ratio(samples[name], samples["plain"], cpu=True)
        print(f"target {name} / plain <= {target} (CPU time): "
              f"{'MET' if cpu <= target else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
