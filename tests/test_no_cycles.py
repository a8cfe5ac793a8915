"""A step of ``Pipe`` or ``DistributedPipe`` leaves no reference cycle behind.

Objects caught in a cycle are freed only by the cyclic garbage collector, whenever it next
runs, or at interpreter shutdown. A cycle that holds tensors keeps a call's activations
alive for nothing; one that holds process groups or communication work destroys them
after ``destroy_process_group()``, during the interpreter's teardown, where gloo's C++
teardown can abort the process ("terminate called without an active exception") after
the script's work is done.

Each scenario runs once to warm up (first calls create lazily initialised objects, some in
cycles, once per process), then again with ``gc.DEBUG_SAVEALL``: a collection then keeps
everything it would have freed in ``gc.garbage``, which must hold nothing of seqpipe's
(objects of its classes, its functions and frames) and no tensor, autograd node, process
group or communication work. Construction is measured with the step, so a pipeline that
were itself in a cycle would be caught too.
"""
from __future__ import annotations

import functools
import gc
import types
from collections import Counter
from typing import Any, Callable, Iterator, List

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import Node

from distributed_harness import Failures, run_workers
from seqpipe import Pipe
from seqpipe.distributed import DistributedPipe
from seqpipe.skip import pop, skippable, stash

MODES = ("always", "except_last", "never")


def _is_seqpipe_name(name: object) -> bool:
    return isinstance(name, str) and (name == "seqpipe" or name.startswith("seqpipe."))


def _worth_reporting(obj: Any) -> bool:
    """Garbage that must not come from a pipeline step."""
    if _is_seqpipe_name(type(obj).__module__):
        return True
    if isinstance(obj, types.FunctionType):
        return _is_seqpipe_name(obj.__module__)
    if isinstance(obj, types.FrameType):
        return _is_seqpipe_name(obj.f_globals.get("__name__"))
    return isinstance(obj, (Tensor, Node, dist.Work, dist.ProcessGroup))


def _name(obj: Any) -> str:
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, types.FrameType):
        return f"frame of {obj.f_code.co_qualname} ({obj.f_globals.get('__name__')})"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def cyclic_garbage(scenario: Callable[[], Any]) -> List[str]:
    """What of interest a collection right after ``scenario()`` finds in cycles, counted."""
    scenario()  # warm-up: lazily initialised state is created once per process
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        scenario()
        gc.collect()
        found = Counter(_name(o) for o in gc.garbage if _worth_reporting(o))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return [f"{count} × {name}" for name, count in sorted(found.items())]


# ---------------------------------------------------------------------- the detector


def test_the_detector_finds_a_cycle_holding_a_tensor() -> None:
    """The check can fail: a tensor kept by a self-referencing frame is reported."""
    def leaky() -> None:
        x = torch.randn(3, requires_grad=True) * 2
        node = x.grad_fn  # a node is a Python object only once Python asked for it
        try:
            raise ValueError(x)
        except ValueError as exc:
            keep = exc  # exc -> traceback -> this frame -> keep -> exc
            assert keep is exc and node is not None

    found = cyclic_garbage(leaky)
    assert any("torch.Tensor" in f for f in found), found
    assert any("builtins.MulBackward0" in f for f in found), found


# ---------------------------------------------------------------------- local engine


@skippable(stash=["a"])
class _Stash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Iterator[Any]:
        h = self.lin(x)
        yield stash("a", h)
        return torch.tanh(h)


@skippable(pop=["a"])
class _Pop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Iterator[Any]:
        a = yield pop("a")
        return self.lin(x) * torch.sigmoid(a) + a


class _Boom(nn.Module):
    def __init__(self, in_backward: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.in_backward = in_backward

    def forward(self, x: Tensor) -> Tensor:
        if not self.in_backward:
            raise ZeroDivisionError("boom in the forward")
        y = self.lin(x)
        y.register_hook(_raise)
        return y


def _raise(grad: Tensor) -> Tensor:
    raise ZeroDivisionError("boom in the backward")


def _local_model(kind: str) -> nn.Sequential:
    if kind == "skips":
        return nn.Sequential(nn.Linear(4, 4), _Stash(), nn.Linear(4, 4), _Pop())
    if kind.startswith("failing"):
        return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 4),
                             _Boom(in_backward=kind == "failing-backward"))
    return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 4), nn.ReLU())


def _local_step(kind: str, mode: str) -> None:
    pipe = Pipe(_local_model(kind), chunks=2, checkpoint=mode, balance=[2, 2],
                devices=["cpu", "cpu"])
    x = torch.randn(4, 4, requires_grad=True)
    if kind == "eval":
        pipe.eval()
        pipe(x)
        with torch.no_grad():
            pipe(x)
        return
    if kind.startswith("failing"):
        with pytest.raises(ZeroDivisionError):
            pipe(x).sum().backward()
        return
    pipe(x).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["plain", "skips", "eval", "failing-forward",
                                  "failing-backward"])
def test_pipe_step_leaves_no_cycle(kind: str, mode: str) -> None:
    assert cyclic_garbage(lambda: _local_step(kind, mode)) == []


def _local_train_step(kind: str, schedule: str, mode: str) -> None:
    pipe = Pipe(_local_model(kind), chunks=2, checkpoint=mode, balance=[2, 2],
                devices=["cpu", "cpu"])
    x, y = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)
    if kind.startswith("failing"):
        with pytest.raises(ZeroDivisionError):
            pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule)
        return
    pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule)
    assert x.grad is not None


# _Boom registers a hook in its forward, which a split backward's checkpointed first pass
# runs without a graph: under zb_h1 it fails in the backward only without checkpointing.
_TRAIN_STEPS = [(kind, schedule, mode) for kind in ("plain", "skips", "failing-forward",
                                                    "failing-backward")
                for schedule in ("1f1b", "zb_h1") for mode in MODES
                if not (kind == "failing-backward" and schedule == "zb_h1" and mode != "never")]


@pytest.mark.parametrize("kind, schedule, mode", _TRAIN_STEPS)
def test_pipe_train_step_leaves_no_cycle(kind: str, schedule: str, mode: str) -> None:
    assert cyclic_garbage(lambda: _local_train_step(kind, schedule, mode)) == []


# ---------------------------------------------------------------------- distributed engine


def _distributed_step(rank: int, schedule: str, mode: str, call: str) -> None:
    torch.manual_seed(0)
    failing = call == "failing"
    last = _Boom(in_backward=False) if failing else nn.ReLU()
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 4), last)
    # A failed pipeline refuses further calls on its group: give each failing one its own.
    group = dist.new_group([0, 1]) if failing else None
    pipe = DistributedPipe(model, chunks=2, balance=[2, 2], schedule=schedule,
                           checkpoint=mode, group=group)
    x = torch.randn(4, 4) if rank == 0 else None
    y = torch.randn(4, 4) if rank == 1 else None
    if call == "forward":
        pipe(x)
    elif failing:
        with pytest.raises(Exception, match="boom in the forward"):
            pipe.train_step(x, y, nn.functional.mse_loss)
    else:
        pipe.train_step(x, y, nn.functional.mse_loss)
    everyone: List[Any] = [None, None]
    dist.all_gather_object(everyone, rank)  # what a script does next, before it ends


def _distributed(rank: int, world: int) -> None:
    failures = Failures(rank)
    scenarios = [(s, m, c) for s in ("fill_drain", "1f1b") for m in MODES
                 for c in ("train_step", "forward")]
    scenarios.append(("1f1b", "except_last", "failing"))
    for schedule, mode, call in scenarios:
        found = cyclic_garbage(functools.partial(_distributed_step, rank, schedule, mode, call))
        failures.expect(not found, f"{call} ({schedule}, {mode}) left in cycles: {found}")
    failures.finish()


def test_distributed_pipe_step_leaves_no_cycle() -> None:
    """Both schedules, every checkpoint mode, ``train_step`` and ``forward``, and a failure."""
    run_workers(_distributed, 2, timeout=180)
