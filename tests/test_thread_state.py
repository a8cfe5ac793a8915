"""The caller's thread-local state reaches every stage, in forward, backward and recomputation.

Every stage but the first runs on a worker thread. Whatever the caller set for its own
thread (saved-tensor hooks, dispatch and function modes, the default device, autocast)
must be what each layer sees, exactly as in the unpipelined model: a probe layer records
the state it sees in each phase, and the records must equal the plain model's.
"""
from __future__ import annotations

import threading
import time
from contextlib import ExitStack, contextmanager
from typing import Any, Dict, Iterator, List, Set, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import seqpipe.local.thread_state as thread_state
from seqpipe import Pipe
from seqpipe.local.thread_state import stage_threads

CHUNKS = 4
State = Tuple[Any, ...]


def _user_modes(stack: List[Any]) -> Tuple[str, ...]:
    return tuple(type(m).__name__ for m in stack if not type(m).__module__.startswith("seqpipe"))


def seen_state() -> State:
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return (str(torch.get_default_device()),
            _user_modes(_get_current_function_mode_stack()),
            _user_modes(_get_current_dispatch_mode_stack()),
            None if hooks is None else hooks[0].__qualname__,
            torch.is_autocast_enabled("cpu"))


class _Record(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, records: List[Tuple[str, State]]) -> Tensor:  # type: ignore[override]
        ctx.records = records
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        ctx.records.append(("backward", seen_state()))
        return grad, None


class Probe(nn.Module):
    """Records the thread-local state it sees in forward, recomputation and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.records: List[Tuple[str, State]] = []
        self.threads: Set[str] = set()

    def forward(self, x: Tensor) -> Tensor:
        in_backward = torch._C._current_graph_task_id() != -1
        self.records.append(("recompute" if in_backward else "forward", seen_state()))
        self.threads.add(threading.current_thread().name)
        return _Record.apply(x, self.records)


def probed() -> nn.Sequential:
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(8, 8), Probe(), nn.Tanh()]
    return nn.Sequential(*layers)


def phases(model: nn.Sequential) -> Dict[str, Set[State]]:
    out: Dict[str, Set[State]] = {}
    for layer in model:
        if isinstance(layer, Probe):
            for phase, state in layer.records:
                out.setdefault(phase, set()).add(state)
    return out


class Marker(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.lock = threading.Lock()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with self.lock:
            self.count += 1
        return func(*args, **(kwargs or {}))


def pack(t: Tensor) -> Tensor:
    return t


def unpack(t: Tensor) -> Tensor:
    return t


@contextmanager
def caller_state(kind: str) -> Iterator[None]:
    with ExitStack() as stack:
        if kind == "modes":
            stack.enter_context(torch.device("cpu"))
            stack.enter_context(Marker())
            stack.enter_context(OpCounter())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
        elif kind == "default_device":
            torch.set_default_device("cpu")
            stack.callback(torch.set_default_device, None)
        elif kind == "save_on_cpu":
            stack.enter_context(torch.autograd.graph.save_on_cpu())
        elif kind == "autocast":
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        yield


def train(model: nn.Module, x: Tensor, kind: str, checkpointed: bool) -> Tensor:
    with caller_state(kind):
        if isinstance(model, Pipe):
            out = model(x)
        else:  # the plain model, micro-batch by micro-batch, as the pipe checkpoints it
            parts = x.chunk(CHUNKS)
            out = torch.cat([checkpoint(model, p, use_reentrant=False) if checkpointed
                             else model(p) for p in parts])
        out.float().square().sum().backward()
    return out


@pytest.mark.parametrize("kind", ["modes", "default_device", "save_on_cpu", "autocast"])
@pytest.mark.parametrize("mode", ["never", "always"])
def test_every_stage_sees_the_callers_state_in_every_phase(kind, mode):
    plain, piped = probed(), probed()
    pipe = Pipe(piped, chunks=CHUNKS, checkpoint=mode, balance=[3, 3, 3],
                devices=["cpu"] * 3)
    x = torch.randn(16, 8)
    expected = train(plain, x.clone(), kind, checkpointed=mode == "always")
    got = train(pipe, x.clone(), kind, checkpointed=mode == "always")
    assert phases(piped) == phases(plain)
    assert (phases(piped).keys() == {"forward", "backward", "recompute"}) == (mode == "always")
    probes = [m for m in piped if isinstance(m, Probe)]
    assert len({name for p in probes for name in p.threads}) >= 2  # worker threads ran some
    tol = dict(atol=2e-2, rtol=2e-2) if kind == "autocast" else {}  # bf16 sums in other orders
    torch.testing.assert_close(got, expected, **tol)
    for a, b in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, **tol)


def test_the_states_probed_are_not_the_threads_defaults():
    """The probe would tell a worker thread's own defaults from the caller's state."""
    with caller_state("modes"):
        inside = seen_state()
    assert inside != seen_state()


def linear_stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 8), nn.Tanh())


@pytest.mark.parametrize("mode", ["never", "always"])
def test_flop_counter_counts_every_stage(mode):
    x = torch.randn(16, 16)
    totals = []
    for model in (linear_stack(), Pipe(linear_stack(), chunks=CHUNKS, checkpoint=mode,
                                       balance=[2, 2, 2], devices=["cpu"] * 3)):
        with FlopCounterMode(display=False) as counter:
            if isinstance(model, Pipe) or mode == "never":
                model(x).sum().backward()
            else:
                checkpoint(model, x, use_reentrant=False).sum().backward()
        totals.append(counter.get_total_flops())
    assert totals[0] > 0 and totals[1] == totals[0]


def test_saved_tensor_hooks_pack_and_unpack_in_every_stage():
    counts: Dict[str, int] = {"pack": 0, "unpack": 0}
    lock = threading.Lock()

    def counting(name: str) -> Any:
        def hook(t: Tensor) -> Tensor:
            with lock:
                counts[name] += 1
            return t
        return hook

    def run(model: nn.Module, x: Tensor) -> Dict[str, int]:
        counts.update(pack=0, unpack=0)
        with torch.autograd.graph.saved_tensors_hooks(counting("pack"), counting("unpack")):
            out = model(x)
            out.sum().backward()
        return dict(counts)

    x = torch.randn(16, 16)
    plain = run(linear_stack(), x[:4])  # one micro-batch's worth
    piped = run(Pipe(linear_stack(), chunks=CHUNKS, checkpoint="never", balance=[2, 2, 2],
                     devices=["cpu"] * 3), x)
    assert plain["pack"] > 0
    assert piped == {k: CHUNKS * v for k, v in plain.items()}


@pytest.mark.parametrize("caller, concurrent, default, share", [
    (2, 2, 2, 1), (8, 3, 8, 2), (2, 3, 2, 1), (4, 1, 4, 4),
    (3, 2, 2, 3),   # set by the user: kept for every stage
    (1, 2, 2, 1),
])
def test_concurrent_stages_share_the_default_intra_op_threads(caller, concurrent, default,
                                                               share):
    assert stage_threads(caller, concurrent, default) == share


Task = Tuple[str, int, float, float]  # thread, intra-op threads, start, end


def _overlap(a: Task, b: Task) -> bool:
    return a[0] != b[0] and a[2] < b[3] and b[2] < a[3]


@pytest.mark.parametrize("caller, share", [(2, 1), (3, 3)])  # default 2; 3 set by the user
def test_stage_threads_share_the_default_count_and_take_it_all_when_alone(
        monkeypatch, caller, share):
    """While another stage can compute, a stage thread runs at its share; an action during
    which none can (stage 0's first forward, stage 1's last, the ends of the backward) takes
    the caller's whole default count, whatever the machine's load; two actions at the same
    time never run more intra-op threads than the caller has. A count the user set is every
    stage's, throughout. The caller gets its own count back."""
    tasks: List[Task] = []

    def timed() -> Any:
        start = time.perf_counter()
        time.sleep(0.005)  # long enough for overlaps to show
        return threading.current_thread().name, torch.get_num_threads(), start, \
            time.perf_counter()

    class Threads(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            tasks.append(timed())
            return x

    class Backward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
            tasks.append(timed())
            return grad

    class Both(Threads):
        def forward(self, x: Tensor) -> Tensor:
            return Backward.apply(super().forward(x))

    monkeypatch.setattr(thread_state, "_DEFAULT_THREADS", 2)
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), Both(), nn.Linear(4, 4), Both()),
                chunks=4, balance=[2, 2], devices=["cpu", "cpu"], checkpoint="never")
    torch.set_num_threads(caller)
    try:
        pipe(torch.randn(8, 4)).sum().backward()
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(1)
    assert len(tasks) == 16  # two stages, four micro-batches, forward and backward
    assert after == caller
    if share == caller:
        assert {n for _, n, _, _ in tasks} == {share}
        return
    assert {n for _, n, _, _ in tasks} == {share, caller}
    assert tasks[0][:2] == ("MainThread", caller)  # stage 0's first forward runs alone
    for a in tasks:
        for b in tasks:
            if _overlap(a, b):
                assert a[1] + b[1] <= caller, (a, b)
