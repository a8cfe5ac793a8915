"""Checkpointing in Pipe: modes, the is_checkpointing/is_recomputing flags, dropout replay,
determinism across worker threads, and a bound on what autograd keeps for backward."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from seqpipe import Pipe, is_checkpointing, is_recomputing
from seqpipe.core.stage import Stage

MODES = ["always", "except_last", "never"]


def cpu_pipe(model: nn.Sequential, balance, **kwargs) -> Pipe:
    return Pipe(model, balance=balance, devices=["cpu"] * len(balance), **kwargs)


# -- dropout and RNG ---------------------------------------------------------------------

def dropout_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.ReLU(),
                         nn.Dropout(0.3), nn.Linear(16, 4))


BALANCES = {1: [6], 2: [3, 3], 3: [2, 2, 2]}


def sample_input() -> torch.Tensor:
    return torch.linspace(-2, 2, 10 * 8).view(10, 8).requires_grad_()


def run_with_seed(base: nn.Sequential, balance, mode: str, seed: int, chunks: int = 4):
    """Output, input gradient and parameter gradients of a fresh copy of ``base``."""
    pipe = cpu_pipe(copy.deepcopy(base), balance, chunks=chunks, checkpoint=mode)
    x = sample_input()
    torch.manual_seed(seed)
    y = pipe(x)
    (y * torch.arange(y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, [p.grad for p in pipe.parameters()]


def assert_bitwise_equal(a, b) -> None:
    (ya, xa, pa), (yb, xb, pb) = a, b
    assert torch.equal(ya, yb)
    assert torch.equal(xa, xb)
    assert len(pa) == len(pb) and all(torch.equal(g, h) for g, h in zip(pa, pb))


@pytest.mark.parametrize("mode", ["always", "except_last"])
@pytest.mark.parametrize("partitions", [1, 2, 3])
def test_checkpointed_dropout_equals_never_exactly(partitions, mode):
    base = dropout_model()
    never = run_with_seed(base, BALANCES[partitions], "never", seed=5)
    checkpointed = run_with_seed(base, BALANCES[partitions], mode, seed=5)
    assert_bitwise_equal(checkpointed, never)
    without_dropout = copy.deepcopy(base).eval()(sample_input()).detach()
    assert not torch.allclose(never[0], without_dropout)  # dropout was active


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("partitions", [2, 3])
def test_same_seed_gives_identical_results_across_threads(partitions, mode):
    base = dropout_model()
    first = run_with_seed(base, BALANCES[partitions], mode, seed=11)
    second = run_with_seed(base, BALANCES[partitions], mode, seed=11)
    assert_bitwise_equal(first, second)
    other = run_with_seed(base, BALANCES[partitions], mode, seed=12)
    assert not torch.equal(other[0], first[0])  # the seed does matter


def test_dropout_masks_differ_between_micro_batches():
    """Private per-(stage, micro-batch) generators must not repeat one mask for all."""
    pipe = cpu_pipe(nn.Sequential(nn.Identity(), nn.Dropout(0.5)), [1, 1], chunks=4,
                    checkpoint="always")
    y = pipe(torch.ones(4, 64, requires_grad=True))
    masks = [row != 0 for row in y]
    assert len({tuple(m.tolist()) for m in masks}) == 4


# -- flags -------------------------------------------------------------------------------

class Probe(nn.Module):
    """Records ``(stage, micro-batch, checkpointing, recomputing)`` on every call.

    The input is an ``(h, ids)`` pair; ``ids[0] // rows`` is the micro-batch index.
    """

    def __init__(self, stage: int, log: list, rows: int) -> None:
        super().__init__()
        self.stage, self.log, self.rows = stage, log, rows
        self.linear = nn.Linear(3, 3)

    def forward(self, pair):
        h, ids = pair
        self.log.append((self.stage, int(ids[0]) // self.rows, is_checkpointing(),
                         is_recomputing()))
        return self.linear(h), ids


def probed_pipe(mode: str, log: list, stages: int = 3, chunks: int = 4) -> Pipe:
    layers = [Probe(s, log, rows=2) for s in range(stages)]
    return cpu_pipe(nn.Sequential(*layers), [1] * stages, chunks=chunks, checkpoint=mode)


def probe_input(batch: int = 8):
    return torch.randn(batch, 3, requires_grad=True), torch.arange(batch)


def output_loss(out) -> torch.Tensor:
    return out[0].sum()


def test_flags_are_false_outside_a_pipe():
    assert not is_checkpointing() and not is_recomputing()


def test_always_flags_checkpointing_then_recomputes_each_micro_batch_once():
    log: list = []
    pipe = probed_pipe("always", log)
    out = pipe(probe_input())
    assert sorted(log) == [(s, i, True, False) for s in range(3) for i in range(4)]
    log.clear()
    output_loss(out).backward()
    assert sorted(log) == [(s, i, False, True) for s in range(3) for i in range(4)]


def test_except_last_recomputes_all_but_the_last_micro_batch():
    log: list = []
    pipe = probed_pipe("except_last", log)
    out = pipe(probe_input())
    assert sorted(log) == [(s, i, i < 3, False) for s in range(3) for i in range(4)]
    log.clear()
    output_loss(out).backward()
    assert sorted(log) == [(s, i, False, True) for s in range(3) for i in range(3)]
    assert len(log) == 3 * (4 - 1)


def test_except_last_with_one_micro_batch_checkpoints_nothing():
    log: list = []
    pipe = probed_pipe("except_last", log, chunks=1)
    output_loss(pipe(probe_input())).backward()
    assert sorted(log) == [(s, 0, False, False) for s in range(3)]


def test_never_sets_no_flag():
    log: list = []
    pipe = probed_pipe("never", log)
    output_loss(pipe(probe_input())).backward()
    assert len(log) == 12
    assert not any(c or r for *_, c, r in log)


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_eval_mode_turns_checkpointing_off(mode):
    log: list = []
    pipe = probed_pipe(mode, log).eval()
    output_loss(pipe(probe_input())).backward()
    assert len(log) == 12  # one call per (stage, micro-batch): nothing recomputed
    assert not any(c or r for *_, c, r in log)


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_no_grad_turns_checkpointing_off(mode):
    log: list = []
    pipe = probed_pipe(mode, log)
    with torch.no_grad():
        out = pipe(probe_input())
    assert not out[0].requires_grad
    assert len(log) == 12
    assert not any(c or r for *_, c, r in log)


# -- what autograd keeps for backward ----------------------------------------------------

class SavedBytesMeter:
    """Sums the bytes of the distinct storages autograd saves while Pipe stages run forward.

    Saved-tensor hooks are thread-local, and the stages run on worker threads, so the hooks
    are installed around ``Stage.forward`` itself, in whichever thread runs it. They sit
    *outside* the stage's checkpoint, so they see what really stays alive until backward:
    every activation of a non-checkpointed micro-batch, and for a checkpointed one only
    what ``torch.utils.checkpoint`` saves itself (the partition's inputs). A hook inside a
    layer would instead sit inside the checkpoint, override its hooks and defeat it.
    Parameters are left out: they are alive anyway.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, params) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict = {}
        self.packs_per_stage: dict = {}
        original = Stage.forward
        meter = self

        def forward(stage, *args, **kwargs):
            def pack(tensor):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in meter.params:
                    meter.storages[storage.data_ptr()] = storage.nbytes()
                meter.packs_per_stage[stage.index] = meter.packs_per_stage.get(stage.index,
                                                                               0) + 1
                return tensor

            with saved_tensors_hooks(pack, lambda tensor: tensor):
                return original(stage, *args, **kwargs)

        monkeypatch.setattr(Stage, "forward", forward)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


WIDTH, BATCH, CHUNKS = 64, 32, 4
BOUNDARY = BATCH * WIDTH * 4  # one float32 activation of the whole mini-batch at a boundary


def deep_model(depth: int) -> nn.Sequential:
    """Two partitions of ``depth`` Linear+ReLU pairs each."""
    layers = []
    for _ in range(2 * depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def saved_bytes(monkeypatch, mode: str, depth: int) -> SavedBytesMeter:
    model = deep_model(depth)
    meter = SavedBytesMeter(monkeypatch, model.parameters())
    pipe = cpu_pipe(model, [2 * depth, 2 * depth], chunks=CHUNKS, checkpoint=mode)
    out = pipe(torch.randn(BATCH, WIDTH, requires_grad=True))
    monkeypatch.undo()
    out.sum().backward()  # the recomputation saves again, but that is not kept until backward
    return meter


def test_always_saves_one_boundary_activation_per_stage_whatever_the_depth(monkeypatch):
    always = {d: saved_bytes(monkeypatch, "always", d) for d in (4, 16)}
    never = {d: saved_bytes(monkeypatch, "never", d) for d in (4, 16)}

    for meter in (*always.values(), *never.values()):
        assert set(meter.packs_per_stage) == {0, 1}  # both stages' threads were measured
    # checkpoint="always": only the checkpoint's own saved inputs, one per (stage, mb)
    assert always[4].packs_per_stage == always[16].packs_per_stage == {0: CHUNKS, 1: CHUNKS}
    assert always[4].nbytes == always[16].nbytes
    assert always[16].nbytes <= 2 * BOUNDARY  # one mini-batch activation per stage
    assert always[16].nbytes <= 0.25 * never[16].nbytes
    # without checkpointing the bill grows with depth (the meter does measure something)
    assert never[16].nbytes > 3 * never[4].nbytes
    assert never[16].nbytes >= 2 * 16 * BOUNDARY


def test_except_last_saves_between_always_and_never(monkeypatch):
    bills = {mode: saved_bytes(monkeypatch, mode, 4).nbytes for mode in MODES}
    assert bills["always"] < bills["except_last"] < bills["never"]
    # the last micro-batch keeps its activations: about 1/CHUNKS of "never"
    assert bills["except_last"] <= bills["always"] + bills["never"] / CHUNKS
