"""``checkpoint_every=N``: each run of N layers of a partition is checkpointed on its own.

Gradients are those of the unpipelined model (and bit for bit those of ``checkpoint="never"``
under dropout) for N = 1, 2 and the whole partition, in every mode, with private random
streams and the global ones, with skips between two segments of one partition and between
partitions, and with deferred BatchNorm; on ``DistributedPipe`` too, under 1F1B and a
split backward (ZB-H1). The backward recomputes one segment at a time (event order), so
its peak of live activations falls as N falls while the forward keeps one input per
segment (both measured); and a bad N is refused with a message saying what to pass.
"""
from __future__ import annotations

import copy
import ctypes
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks

from distributed_harness import Failures, run_workers
from seqpipe import Pipe, is_checkpointing, is_recomputing
from seqpipe.skip import pop, skippable, stash

MODES = ("always", "except_last", "never")
EVERY = (1, 2, None)  # None: the whole partition, as without checkpoint_every
DTYPE = torch.float64


def cpu_pipe(model: nn.Sequential, balance: List[int], **kwargs: Any) -> Pipe:
    return Pipe(model, balance=balance, devices=["cpu"] * len(balance), **kwargs)


Result = Tuple[Tensor, Tensor, List[Tensor]]


def train(module: nn.Module, seed: int, batch: int = 12) -> Result:
    """Output, input gradient and parameter gradients of one weighted-sum backward."""
    x = torch.linspace(-2, 2, batch * 8, dtype=DTYPE).view(batch, 8).requires_grad_()
    torch.manual_seed(seed)
    y = module(x)
    (y * torch.arange(y.numel(), dtype=DTYPE).view_as(y)).sum().backward()
    return y.detach(), x.grad, [p.grad for p in module.parameters()]


def assert_same(a: Result, b: Result, exact: bool) -> None:
    check: Callable[[Tensor, Tensor], Any] = (
        (lambda u, v: torch.testing.assert_close(u, v, atol=0, rtol=0)) if exact
        else torch.testing.assert_close)
    check(a[0], b[0])
    check(a[1], b[1])
    assert len(a[2]) == len(b[2])
    for g, h in zip(a[2], b[2]):
        check(g, h)


def dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.ReLU(inplace=True),
                         nn.Dropout(0.3), nn.Linear(16, 16), nn.Dropout(0.4), nn.Linear(16, 4),
                         nn.Dropout(0.2)).to(DTYPE)


# -- gradients ---------------------------------------------------------------------------

@pytest.mark.parametrize("every", EVERY)
@pytest.mark.parametrize("mode", MODES)
def test_private_streams_draw_what_never_draws(mode: str, every: Optional[int]) -> None:
    """Two partitions: each (stage, micro-batch) has its private stream, which the
    segments share in the forward and each recomputation rewinds to its segment's start
    (each partition draws in two segments at N = 1, 2). An in-place ReLU heads a segment
    (N = 1, 2): its input must survive for the recomputation."""
    base = dropout_model()
    never = train(cpu_pipe(copy.deepcopy(base), [4, 4], chunks=3, checkpoint="never"), 5)
    segmented = train(cpu_pipe(copy.deepcopy(base), [4, 4], chunks=3, checkpoint=mode,
                               checkpoint_every=every), 5)
    assert_same(segmented, never, exact=True)
    other = train(cpu_pipe(copy.deepcopy(base), [4, 4], chunks=3, checkpoint=mode,
                           checkpoint_every=every), 6)
    assert not torch.equal(other[0], never[0])  # dropout is on, and the seed matters


@pytest.mark.parametrize("every", (1, 2, 3, None))
def test_one_partition_draws_what_the_plain_model_draws(every: Optional[int]) -> None:
    """One partition keeps the global generators, which each segment's checkpoint saves
    and restores: output and gradients are the plain model's, bit for bit (one
    micro-batch, so the masks are drawn for the same shape); with several micro-batches,
    "except_last" gives what "never" gives."""
    base = dropout_model()
    pipe = cpu_pipe(copy.deepcopy(base), [8], chunks=1, checkpoint="always",
                    checkpoint_every=every)
    assert_same(train(pipe, 5), train(copy.deepcopy(base), 5), exact=True)
    never = cpu_pipe(copy.deepcopy(base), [8], chunks=3, checkpoint="never")
    pipe = cpu_pipe(copy.deepcopy(base), [8], chunks=3, checkpoint="except_last",
                    checkpoint_every=every)
    assert_same(train(pipe, 5), train(never, 5), exact=True)


def stasher(name: str) -> type:
    @skippable(stash=[name])
    class Stash(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: Tensor) -> Any:
            h = self.lin(x)
            yield stash(name, h)
            return torch.tanh(h)

    return Stash


def popper(name: str) -> type:
    @skippable(pop=[name])
    class Pop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: Tensor) -> Any:
            skip = yield pop(name)
            skip.mul_(2)  # a layer may change what it popped, as in the plain model
            return self.lin(x) * torch.sigmoid(skip)

    return Pop


def skip_model(dropout: bool = True) -> nn.Sequential:
    """Partition 0 (layers 0-3): ``a`` from 0 to 3, ``c`` leaves it at 1 for 6. Partition 1
    (4-7): ``b`` from 4 to 5 (one segment at N = 2, two at N = 1), then ``c`` arrives."""
    torch.manual_seed(0)
    return nn.Sequential(stasher("a")(), stasher("c")(),
                         nn.Dropout(0.2) if dropout else nn.Identity(), popper("a")(),
                         stasher("b")(), popper("b")(), popper("c")(),
                         nn.Linear(8, 4)).to(DTYPE)


@pytest.mark.parametrize("every", EVERY)
@pytest.mark.parametrize("mode", ("always", "except_last"))
def test_skips_within_and_across_partitions(mode: str, every: Optional[int]) -> None:
    base = skip_model()
    never = train(cpu_pipe(copy.deepcopy(base), [4, 4], chunks=3, checkpoint="never"), 1)
    segmented = train(cpu_pipe(copy.deepcopy(base), [4, 4], chunks=3, checkpoint=mode,
                               checkpoint_every=every), 1)
    assert_same(segmented, never, exact=True)
    plain = train(skip_model(dropout=False), 1)  # without dropout: the plain model's values
    pipe = cpu_pipe(skip_model(dropout=False), [4, 4], chunks=3, checkpoint=mode,
                    checkpoint_every=every)
    assert_same(train(pipe, 1), plain, exact=False)


def test_a_skip_between_segments_is_kept_only_where_it_crosses_a_segment() -> None:
    pipe = cpu_pipe(skip_model(), [4, 4], checkpoint_every=2)
    stages = pipe._pipeline.stages
    assert [len(s.segments) for s in stages] == [2, 2]
    assert [sorted(name for _, name in s.between) for s in stages] == [["a"], []]
    pipe = cpu_pipe(skip_model(), [4, 4], checkpoint_every=1)
    assert [sorted(name for _, name in s.between) for s in pipe._pipeline.stages] == \
        [["a"], ["b"]]


def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8),
                         nn.BatchNorm1d(8), nn.Linear(8, 4)).to(DTYPE)


@pytest.mark.parametrize("every", (1, 2))
def test_deferred_batch_norm_counts_each_micro_batch_once(every: int) -> None:
    base = bn_model()
    never = cpu_pipe(copy.deepcopy(base), [3, 3], chunks=4, checkpoint="never",
                     deferred_batch_norm=True)
    segmented = cpu_pipe(copy.deepcopy(base), [3, 3], chunks=4, checkpoint="always",
                         deferred_batch_norm=True, checkpoint_every=every)
    assert_same(train(segmented, 0), train(never, 0), exact=True)
    plain = copy.deepcopy(base)
    plain(torch.linspace(-2, 2, 12 * 8, dtype=DTYPE).view(12, 8))  # the whole batch at once
    norms = [[m for m in model if isinstance(m, nn.BatchNorm1d)]
             for model in (segmented, never, plain)]
    for layer, expected in zip(norms[0], norms[1]):  # statistics of each micro-batch once
        assert int(layer.num_batches_tracked) == 1
        torch.testing.assert_close(layer.running_mean, expected.running_mean)
        torch.testing.assert_close(layer.running_var, expected.running_var)
    # the first one sees the plain model's input: its statistics are the whole batch's
    torch.testing.assert_close(norms[0][0].running_mean, norms[2][0].running_mean)
    torch.testing.assert_close(norms[0][0].running_var, norms[2][0].running_var)


# -- flags and order of the recomputations -------------------------------------------------

class _Mark(torch.autograd.Function):
    """Identity whose backward logs that the backward has gone through it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, log: list, index: int) -> Tensor:  # type: ignore[override]
        ctx.log, ctx.index = log, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:  # type: ignore[override]
        ctx.log.append(("B", ctx.index))
        return grad, None, None


class Logged(nn.Module):
    """Logs its forwards (``F`` checkpointing, ``R`` recomputing) and, at its input, the end
    of its backward. It saves a tensor, so every recomputation runs through it."""

    def __init__(self, index: int, log: list) -> None:
        super().__init__()
        self.index, self.log = index, log
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        if is_checkpointing():
            self.log.append(("F", self.index))
        if is_recomputing():
            self.log.append(("R", self.index))
        return torch.tanh(self.lin(_Mark.apply(x, self.log, self.index)))


@pytest.mark.parametrize("every, expected", [
    (1, "R3 B3 R2 B2 R1 B1 R0 B0"),
    (2, "R2 R3 B3 B2 R0 R1 B1 B0"),
    (None, "R0 R1 R2 R3 B3 B2 B1 B0"),
])
def test_the_backward_recomputes_one_segment_at_a_time(every: Optional[int],
                                                       expected: str) -> None:
    log: list = []
    pipe = cpu_pipe(nn.Sequential(*(Logged(i, log) for i in range(4))), [4],
                    checkpoint="always", checkpoint_every=every)
    pipe(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert [f"{k}{i}" for k, i in log if k == "F"] == ["F0", "F1", "F2", "F3"]
    assert " ".join(f"{k}{i}" for k, i in log if k != "F") == expected


def test_never_and_the_last_micro_batch_are_not_checkpointed() -> None:
    log: list = []
    pipe = cpu_pipe(nn.Sequential(*(Logged(i, log) for i in range(4))), [4], chunks=2,
                    checkpoint="except_last", checkpoint_every=1)
    pipe(torch.randn(4, 4, requires_grad=True)).sum().backward()
    assert sum(k == "F" for k, _ in log) == 4 and sum(k == "R" for k, _ in log) == 4
    log.clear()
    pipe = cpu_pipe(nn.Sequential(*(Logged(i, log) for i in range(4))), [4], chunks=2,
                    checkpoint="never", checkpoint_every=1)
    pipe(torch.randn(4, 4, requires_grad=True)).sum().backward()
    assert not any(k in ("F", "R") for k, _ in log)


@pytest.mark.parametrize("every", (1, 2))
def test_the_partitions_own_hooks_run_around_its_segments(every: int) -> None:
    """Hooks registered on a partition module run once per micro-batch around its
    segments, as around the partition, and what they change reaches the output and the
    gradients as under checkpoint="never" (a segment's recomputation recomputes the
    segment, after the hooks). FSDP2's hooks on a stage sharded as a whole gather its
    parameters there (tests/test_fsdp.py). Calling the segments alone skipped them."""
    def hooked(checkpoint: str, every: Optional[int]) -> Tuple[Result, List[str]]:
        calls: List[str] = []
        pipe = cpu_pipe(dropout_model(), [4, 4], chunks=3, checkpoint=checkpoint,
                        checkpoint_every=every)
        partition = pipe.partitions[1]
        partition.register_forward_pre_hook(
            lambda module, args: (calls.append("pre"), (args[0] * 2,))[1])
        partition.register_forward_hook(
            lambda module, args, out: (calls.append("post"), out + 1)[1])
        return train(pipe, 5), calls

    result, calls = hooked("always", every)
    assert calls == ["pre", "post"] * 3  # once per micro-batch, not per segment
    assert_same(result, hooked("never", None)[0], exact=True)


# -- memory --------------------------------------------------------------------------------

class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _bytes_in_use() -> Callable[[], int]:
    """glibc's count of bytes malloc handed out (every thread, every tensor: PyTorch's CPU
    allocator takes its memory from malloc), as in benchmarks/memory.py."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc's mallinfo2")

    def in_use() -> int:
        info = libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)
    return in_use


class _Read(torch.autograd.Function):
    """Identity whose backward reads the bytes in use."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, readings: list, in_use: Callable[[], int]
                ) -> Tensor:  # type: ignore[override]
        ctx.readings, ctx.in_use = readings, in_use
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:  # type: ignore[override]
        ctx.readings.append(ctx.in_use())
        return grad, None, None


class Block(nn.Module):
    """A Linear and four Tanh: five activations saved inside, one at its boundary."""

    def __init__(self, width: int, readings: list, in_use: Callable[[], int]) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.readings, self.in_use = readings, in_use

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(_Read.apply(x, self.readings, self.in_use))
        for _ in range(4):
            h = torch.tanh(h)
        return h


WIDTH, ROWS, BLOCKS = 256, 512, 8
UNIT = WIDTH * ROWS * 4  # one activation, float32


def measure(every: Optional[int]) -> Tuple[int, int, int]:
    """(bytes autograd saves in the stage's forward, as saved-tensor hooks see them;
    bytes the forward leaves in use; the most bytes in use during the backward), on one
    stage, in the second of two steps (the first warms the allocator up)."""
    in_use, readings, packed = _bytes_in_use(), [], [0]
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(WIDTH, readings, in_use) for _ in range(BLOCKS)))
    pipe = cpu_pipe(model, [BLOCKS], checkpoint="never" if every == 0 else "always",
                    checkpoint_every=every or None)

    def pack(tensor: Tensor) -> Tensor:
        if not isinstance(tensor, nn.Parameter):
            packed[0] += tensor.numel() * tensor.element_size()
        return tensor

    x = torch.randn(ROWS, WIDTH)
    for _ in range(2):
        readings.clear()
        packed[0] = 0
        base = in_use()
        with saved_tensors_hooks(pack, lambda tensor: tensor):  # the call's forward
            out = pipe(x)
        kept = in_use() - base
        out.sum().backward()
        del out
    return packed[0], kept, max(readings) - base


def test_the_backward_peak_falls_as_n_falls_and_the_forward_keeps_one_input_per_segment(
        ) -> None:
    runs = {every: measure(every) for every in (1, 2, 4, None, 0)}  # 0: never
    saved = {every: run[0] for every, run in runs.items()}
    kept = {every: run[1] for every, run in runs.items()}
    peak = {every: run[2] for every, run in runs.items()}
    # What autograd saves in the forward: each segment's input (its checkpoint's), the
    # first being the stage's own input; everything without checkpointing.
    assert saved == {1: BLOCKS * UNIT, 2: BLOCKS // 2 * UNIT, 4: 2 * UNIT, None: UNIT,
                     0: saved[0]}
    assert saved[0] >= BLOCKS * 5 * UNIT
    # Really in use after the forward: those inputs (but the caller's, which exists
    # anyway) and the output, give or take the allocator's bookkeeping.
    for every, segments in ((1, 8), (2, 4), (4, 2), (None, 1)):
        assert abs(kept[every] - segments * UNIT) < UNIT / 4, (every, kept)
    # The backward brings back one segment at a time: its peak falls with N (measured
    # about 8.7, 10.7, 17.7 and 31.7 activations for N = 1, 2, 4, 8), though the forward
    # keeps more inputs.
    assert peak[1] + UNIT < peak[2] and peak[2] + 4 * UNIT < peak[4]
    assert peak[4] + 8 * UNIT < peak[None]
    assert peak[None] > 0.9 * peak[0]  # the whole partition back at once, as never keeps it
    assert peak[1] < 0.5 * peak[None]


# -- arguments -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_a_bad_checkpoint_every_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"checkpoint_every must be a positive int .* got "
                                         rf"{repr(bad)}"):
        cpu_pipe(nn.Sequential(nn.Linear(2, 2)), [1], checkpoint_every=bad)  # type: ignore


def test_an_index_like_checkpoint_every_is_an_int() -> None:
    pipe = cpu_pipe(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), [2],
                    checkpoint_every=torch.tensor(1))  # type: ignore[arg-type]
    assert pipe.checkpoint_every == 1 and type(pipe.checkpoint_every) is int


# -- DistributedPipe -----------------------------------------------------------------------

def _distributed(rank: int, world: int) -> None:
    from seqpipe.distributed import DistributedPipe

    failures = Failures(rank)
    x = torch.linspace(-2, 2, 12 * 8, dtype=DTYPE).view(12, 8)
    y = torch.linspace(1, -1, 12 * 4, dtype=DTYPE).view(12, 4)

    def step(pipe: DistributedPipe, seed: int) -> Tuple[Tensor, Dict[str, Tensor]]:
        torch.manual_seed(seed)
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               F.mse_loss)
        return loss, {n: p.grad.clone() for n, p in pipe.named_parameters()}

    def build(schedule: str, mode: str, every: Optional[int], dropout: bool = True
              ) -> DistributedPipe:
        return DistributedPipe(skip_model(dropout), chunks=3, balance=[4, 4],
                               schedule=schedule, checkpoint=mode, checkpoint_every=every)

    plain = skip_model(dropout=False)
    plain_loss = F.mse_loss(plain(x), y)
    plain_loss.backward()
    for schedule in ("1f1b", "zb_h1"):
        never = step(build(schedule, "never", None), 3)  # dropout: the same masks
        failures.expect(not torch.equal(step(build(schedule, "never", None), 4)[0], never[0]),
                        f"{schedule}: another seed gave the same loss (dropout inactive?)")
        for mode in ("always", "except_last"):
            for every in (1, 2):
                what = f"{schedule}/{mode}/every {every}"
                loss, grads = step(build(schedule, mode, every), 3)
                failures.close(loss, never[0], f"{what}: loss")
                for name, grad in never[1].items():
                    failures.close(grads[name], grad, f"{what}: {name}")
                pipe = build(schedule, mode, every, dropout=False)
                loss, _ = step(pipe, 0)
                failures.close(loss, plain_loss.detach(), f"{what}, no dropout: loss")
                failures.grads(pipe, plain, f"{what}, no dropout")
    try:
        DistributedPipe(skip_model(), chunks=3, balance=[4, 4], checkpoint_every=0)
        failures.expect(False, "checkpoint_every=0 was accepted")
    except ValueError as exc:
        failures.expect("checkpoint_every must be a positive int" in str(exc), str(exc))
    failures.finish()


def test_distributed_pipe_under_1f1b_and_zb_h1() -> None:
    """Two ranks: the same losses and gradients as without checkpointing (dropout) and as
    the plain model (without), skips within a stage across segments and across stages."""
    run_workers(_distributed, 2, timeout=240, pg_timeout=60)
