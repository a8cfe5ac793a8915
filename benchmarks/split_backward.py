"""What splitting a backward into ``I`` and ``W`` costs, per micro-batch, on transformer blocks.

    PYTHONPATH=. python benchmarks/split_backward.py [--rounds 60] [--blocks 4]

The stage is ``dist_transformer_vs_torch.py``'s rank 1 under ``zb_h1`` (its model and sizes:
``--blocks`` pre-norm blocks of width 128, 4 heads, then the tied head and the loss, a
micro-batch of 4 sequences of 64 tokens), the one stage there whose backward is split (stage
0's input is token ids: its ``I`` is empty). Each round times, one intra-op thread, main
thread CPU (``time.thread_time``), alternating so that machine load hits all alike:

* ``plain``: the plain model's ``torch.autograd.backward(loss)`` (inputs requiring grad);
* ``Stage B``: ``Stage.forward`` + ``Stage.loss`` then ``Stage.backward`` as
  ``DistributedPipe`` runs them under ``1f1b`` (its sink from ``StepGrads``);
* ``Stage I + W``: the same forward with ``split=True`` (saved tensors in releasable
  holders) then ``backward_input`` and ``backward_weight``, as under ``zb_h1``.

It prints the median forward and backward of each and what the split costs over ``Stage B``
(forward + backward), per micro-batch; ``--profile`` adds cProfile's top entries of the
split (issue 24: the split's share of rank 1's main-thread CPU per step).

Figures (20:28-20:31, load average 3.2-3.8 from other sessions' tests, ``--rounds 40``,
main and this change alternating, two runs each; docs/benchmarks.md, "The split
backward's cost"), ``I + W`` over ``Stage B`` per micro-batch:

* main at ``1d9ba5f``: +8.01 / +5.59 ms (1.405× / 1.334× B's 19.78 / 16.71 ms);
* this change: +3.72 / +3.84 ms (1.249× / 1.239× B's 14.97 / 16.02 ms).

Session 12 (``zb2``: one walk for the leaves too, the holders read in one loop), ``--rounds
40``, 06:42-06:46, load average 4.5-4.7, alternating with ``main`` at ``f6996e0``: +3.22 /
+3.49 / +3.20 ms against +3.28 / +4.00 / +3.54 (docs/benchmark-history.md, "Session 12: zb2").

``--against TREE`` also times another tree's split (its ``saved.py`` and ``split_backward.py``
swapped into ``Stage`` round by round, in this process) and prints the median of per-round
differences: separate processes differ by ±1 ms in memory layout alone, which this cancels.
Session 13 (``zb3``, docs/benchmark-history.md "Session 13: zb3"): ``--rounds 60 --against`` main at
``92088f2``, 09:21, load average 2.1-2.3: I + W over ``Stage B`` +3.33 ms, −0.68 ms against
main's split in the same rounds.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.util
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import pin_malloc  # noqa: E402
from dist_transformer_vs_torch import loss_fn, make_gpt  # noqa: E402 - the same model

from seqpipe.core.microbatch import Batch  # noqa: E402
from seqpipe.core.stage import Received, Stage  # noqa: E402
from seqpipe.distributed.accumulate import StepGrads  # noqa: E402
from seqpipe.skip.layout import inspect_skip_layout  # noqa: E402

Timing = Tuple[float, ...]  # forward, then each backward phase, in seconds


def _last_stage(blocks: int) -> Stage:
    """The last ``blocks // 2`` blocks and the head of a ``blocks``-block GPT, as the last
    stage of two (its input wants its gradient back)."""
    gpt = make_gpt(512, 128, 4, blocks, 64)
    part = nn.Sequential(*list(gpt)[1 + blocks // 2:])
    layout = inspect_skip_layout(nn.Sequential(nn.Identity(), *part), [1, len(part)])
    return Stage(1, part, torch.device("cpu"), layout)


def _forward(stage: Stage, grads: StepGrads, x: Tensor, y: Tensor, split: bool) -> Tuple:
    received = Received(Batch((x.detach().requires_grad_(),), True, ()), {}, (True,))
    sent, state = stage.forward(received, grad=True, sink=grads.sink_for(0), split=split)
    assert state is not None
    loss = stage.loss(state, sent, lambda out: loss_fn(out.tensors[0], y))
    return state, torch.ones_like(loss)


def _plain(model: nn.Module, x: Tensor, y: Tensor) -> Timing:
    start = time.thread_time()
    loss = loss_fn(model(x.detach().requires_grad_()), y)
    mid = time.thread_time()
    torch.autograd.backward([loss])
    return mid - start, time.thread_time() - mid


def _whole(stage: Stage, x: Tensor, y: Tensor) -> Timing:
    grads = StepGrads(stage, 1)  # micro-batch 0 of 2: not the last
    start = time.thread_time()
    state, one = _forward(stage, grads, x, y, split=False)
    mid = time.thread_time()
    with grads.handing_over(0):
        stage.backward(state, [one], {}, sink=grads.sink_for(0))
    return mid - start, time.thread_time() - mid


def _split(stage: Stage, x: Tensor, y: Tensor) -> Timing:
    grads = StepGrads(stage, 1)
    start = time.thread_time()
    state, one = _forward(stage, grads, x, y, split=True)
    mid = time.thread_time()
    stage.backward_input(state, [one], {})
    half = time.thread_time()
    with grads.handing_over(0):
        stage.backward_weight(state, sink=grads.sink_for(0))
    return mid - start, half - mid, time.thread_time() - half


def _against(tree: str) -> Callable[[Callable[[], Timing]], Timing]:
    """Run a split with ``tree``'s ``seqpipe/core/saved.py`` and ``split_backward.py`` (a
    ``git archive`` of another commit) in place of this tree's, in this process, so the
    two alternate round by round under the same load (separate processes differ by
    ±1 ms in their memory layouts alone). Only for trees whose ``SplitBackward`` frees
    the input path itself in ``input()`` (``main`` before session 13)."""
    import seqpipe.core.stage as stage_module

    def load(name: str) -> Any:
        spec = importlib.util.spec_from_file_location(
            f"against_{name}", Path(tree) / "seqpipe" / "core" / f"{name}.py")
        assert spec is not None and spec.loader is not None, tree
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (dataclasses look their module up there)
        spec.loader.exec_module(module)
        return module
    saved, split = load("saved"), load("split_backward")
    theirs = {"SavedTensors": saved.SavedTensors,
              "SplitBackward": lambda *a, cheap=True, **k: split.SplitBackward(*a, **k)}

    def run(form: Callable[[], Timing]) -> Timing:
        ours = {name: getattr(stage_module, name) for name in theirs}
        free = stage_module.Stage.__dict__["free_input_path"]  # the staticmethod itself
        try:
            for name, value in theirs.items():
                setattr(stage_module, name, value)
            stage_module.Stage.free_input_path = staticmethod(lambda state: None)
            return form()
        finally:
            for name, value in ours.items():
                setattr(stage_module, name, value)
            stage_module.Stage.free_input_path = free
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--blocks", type=int, default=8, help="of the whole model (2 stages)")
    parser.add_argument("--profile", action="store_true", help="cProfile the split too")
    parser.add_argument("--against", metavar="TREE", help="also time TREE's split, alternating "
                        "(a checkout of main before session 13, e.g. git archive into /tmp)")
    args = parser.parse_args()
    pin_malloc()  # as dist_transformer_vs_torch.py: no page faults from malloc's adaptive mmap
    torch.set_num_threads(1)
    stage = _last_stage(args.blocks)
    x, y = torch.randn(4, 64, 128), torch.randint(512, (4, 64))
    forms: Dict[str, Callable[[], Timing]] = {
        "plain": lambda: _plain(stage.partition, x, y),
        "Stage B": lambda: _whole(stage, x, y),
        "Stage I + W": lambda: _split(stage, x, y)}
    if args.against:
        theirs = _against(args.against)
        forms["against I + W"] = lambda: theirs(lambda: _split(stage, x, y))
    times: Dict[str, List[Timing]] = {name: [] for name in forms}
    for warm in (True, False):
        for r in range(5 if warm else args.rounds):
            names = list(forms)[r % len(forms):] + list(forms)[:r % len(forms)]
            for name in names:
                stage.partition.zero_grad(set_to_none=True)
                took = forms[name]()
                if not warm:
                    times[name].append(took)
    medians = {}
    for name, rows in times.items():
        parts = [statistics.median(col) * 1e3 for col in zip(*rows)]
        total = statistics.median(sum(row) for row in rows) * 1e3
        medians[name] = parts, total
        shown = "  ".join(f"{label} {ms:6.2f}" for label, ms in
                          zip(("F", "I" if len(parts) == 3 else "B", "W"), parts))
        print(f"{name:12s} {shown}   F+backward {total:6.2f} ms")
    (_, b, *_), whole = medians["Stage B"]
    (_, i, w), split = medians["Stage I + W"]
    print(f"split: I + W = {i + w:.2f} ms against B {b:.2f} ms (+{i + w - b:.2f} ms, "
          f"{(i + w) / b:.3f}x); F+backward +{split - whole:.2f} ms per micro-batch")
    if args.against:
        paired = [(mine[1] + mine[2]) - (other[1] + other[2]) for mine, other in
                  zip(times["Stage I + W"], times["against I + W"])]
        print(f"I + W, this tree - {args.against}: median of per-round differences "
              f"{statistics.median(paired) * 1e3:+.2f} ms per micro-batch")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(20):
            _split(stage, x, y)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
