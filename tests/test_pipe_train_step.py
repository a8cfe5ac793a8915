"""``Pipe.train_step``: a whole training step of the local pipeline under a schedule.

Every schedule must give the loss and gradients of the plain ``nn.Sequential`` on the whole
batch (float64 models, so micro-batching changes nothing beyond rounding), in every
checkpoint mode, with skips that cross partitions, over ragged micro-batches. The memory
claim of 1F1B is checked by counting saved tensors alive per partition with
``saved_tensors_hooks`` (which the engine carries into its stage threads), not by timing.
"""
from __future__ import annotations

import copy
import threading
import weakref
from collections import defaultdict
from typing import Any, Dict, Iterator, List, Sequence

import pytest
import torch
from torch import Tensor, nn

from seqpipe import Pipe
from seqpipe.schedule import Action, B, F, ScheduleError
from seqpipe.skip import SkipTracker, pop, skippable, stash, use_skip_tracker

W = 6
MODES = ["always", "except_last", "never"]
SCHEDULES = ["fill_drain", "1f1b", "zb_h1", "zb_h2"]


@pytest.fixture(autouse=True)
def fresh_tracker() -> Iterator[None]:
    with use_skip_tracker(SkipTracker()):
        yield


@skippable(stash=["far"])
class StashFar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x: Tensor) -> Any:
        h = self.lin(x)
        yield stash("far", h)
        return torch.tanh(h)


@skippable(pop=["far"])
class PopFar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x: Tensor) -> Any:
        far = yield pop("far")
        return self.lin(x * torch.sigmoid(far))


def plain_model(skips: bool, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    body: List[nn.Module] = [nn.Linear(W, W) if n % 2 == 0 else nn.Tanh()
                             for n in range(layers - 2)]
    ends = [StashFar(), PopFar()] if skips else [nn.Linear(W, W), nn.Linear(W, W)]
    return nn.Sequential(ends[0], *body, ends[1]).double()


def data(n: int = 11) -> tuple:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(n, W, generator=gen, dtype=torch.float64),
            torch.randn(n, W, generator=gen, dtype=torch.float64))


def reference(model: nn.Sequential, x: Tensor, y: Tensor) -> tuple:
    plain = copy.deepcopy(model)
    loss = nn.functional.mse_loss(plain(x), y)
    loss.backward()
    return loss.detach(), [p.grad for p in plain.parameters()]


def assert_grads(params: Any, expected: Sequence[Tensor]) -> None:
    params = list(params)
    assert len(params) == len(expected)
    for p, g in zip(params, expected):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, g, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("skips", [False, True], ids=["plain", "skips"])
@pytest.mark.parametrize("balance", [[2, 3], [2, 1, 2]], ids=["K2", "K3"])
def test_loss_and_gradients_equal_the_plain_model(schedule: str, checkpoint: str, skips: bool,
                                                  balance: List[int]) -> None:
    model = plain_model(skips, sum(balance))
    x, y = data(11)  # 4 chunks: micro-batches of 3, 3, 3 and 2
    loss_ref, grads_ref = reference(model, x, y)
    params = list(model.parameters())
    pipe = Pipe(model, chunks=4, checkpoint=checkpoint, balance=balance,
                devices=["cpu"] * len(balance))
    loss = pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=0)
    assert not loss.requires_grad
    assert_grads(params, grads_ref)  # the user's own parameter objects, wrapped in place
    assert list(pipe.state_dict()) == list(plain_model(skips, sum(balance)).state_dict())


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "looped_bfs", "interleaved_zb",
                                      "zbv", "dualpipev"])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("skips", [False, True], ids=["plain", "skips"])
def test_several_stages_per_device(schedule: str, checkpoint: str, skips: bool) -> None:
    """Four partitions under a two-stages-per-rank schedule: two threads, each running the
    stages its placement gives it, in its order."""
    model = plain_model(skips, 8)
    x, y = data(11)
    loss_ref, grads_ref = reference(model, x, y)
    pipe = Pipe(model, chunks=4, checkpoint=checkpoint, balance=[2, 2, 2, 2],
                devices=["cpu"] * 4)
    threads = set()
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: threads.add(threading.current_thread().name) or t, lambda t: t):
        loss = pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule)
    assert len(threads) == 2  # the caller's (rank 0) and one stage thread (rank 1)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=0)
    assert_grads(model.parameters(), grads_ref)


def test_gradients_accumulate_over_steps_like_backward() -> None:
    model = plain_model(True, 5)
    x, y = data(8)
    _, grads_ref = reference(model, x, y)
    pipe = Pipe(model, chunks=4, balance=[2, 3], devices=["cpu"] * 2)
    pipe.train_step(x, y, nn.functional.mse_loss)
    pipe.train_step(x, y, nn.functional.mse_loss, schedule="zb_h1")
    assert_grads(model.parameters(), [2 * g for g in grads_ref])


def test_input_gradient_and_batch_smaller_than_chunks() -> None:
    model = plain_model(False, 5)
    x, y = data(3)
    plain = copy.deepcopy(model)
    xr = x.clone().requires_grad_()
    nn.functional.mse_loss(plain(xr), y).backward()
    pipe = Pipe(model, chunks=8, balance=[2, 3], devices=["cpu"] * 2)
    xp = x.clone().requires_grad_()
    pipe.train_step(xp, y, nn.functional.mse_loss)
    torch.testing.assert_close(xp.grad, xr.grad)


def test_parameter_hooks_fire_once_per_step() -> None:
    model = plain_model(False, 5)
    pipe = Pipe(model, chunks=4, balance=[2, 3], devices=["cpu"] * 2)
    fired: Dict[int, int] = defaultdict(int)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.__setitem__(id(p), fired[id(p)] + 1))
    pipe.train_step(*data(8), nn.functional.mse_loss, schedule="zb_h2")
    assert sorted(fired.values()) == [1] * len(list(model.parameters()))


def test_dropout_masks_follow_the_task_not_the_schedule_or_checkpointing() -> None:
    """Private RNG streams: the same seed gives the same masks under any schedule, and a
    checkpoint's recomputation (once, for both I and W under zb) replays them."""
    def grads(schedule: str, checkpoint: str) -> List[Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(W, W), nn.Dropout(0.5), nn.Linear(W, W),
                              nn.Dropout(0.5), nn.Linear(W, W)).double()
        pipe = Pipe(model, chunks=4, checkpoint=checkpoint, balance=[2, 3],
                    devices=["cpu"] * 2)
        torch.manual_seed(5)
        pipe.train_step(*data(8), nn.functional.mse_loss, schedule=schedule)
        return [p.grad for p in model.parameters()]

    base = grads("fill_drain", "never")
    for schedule, checkpoint in [("1f1b", "always"), ("zb_h1", "always"), ("zb_h2", "never")]:
        for got, want in zip(grads(schedule, checkpoint), base):
            torch.testing.assert_close(got, want)


def test_deferred_batch_norm_matches_forward_backward() -> None:
    def run(step: bool) -> tuple:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(W, W), nn.BatchNorm1d(W), nn.Linear(W, W),
                              nn.BatchNorm1d(W)).double()
        pipe = Pipe(model, chunks=4, balance=[2, 2], devices=["cpu"] * 2,
                    deferred_batch_norm=True)
        x, y = data(12)
        if step:
            pipe.train_step(x, y, nn.functional.mse_loss, schedule="1f1b")
        else:
            nn.functional.mse_loss(pipe(x), y).backward()
        return ([p.grad for p in model.parameters()],
                [b.clone() for b in model.buffers()])

    for got, want in zip(*map(lambda r: r[0] + r[1], (run(True), run(False)))):
        torch.testing.assert_close(got, want)


# -- memory: live micro-batches per partition, counted by saved-tensor hooks -------------
class _Token:
    """Stands for one saved tensor; alive as long as autograd keeps the tensor saved.

    Detached: a tensor that is its node's output refers to the node, which refers to the
    token, a cycle that would outlive a backward leaving that node unrun (a split W).
    """

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor.detach()


def _stage_of_thread() -> int:
    name = threading.current_thread().name
    return int(name.rsplit("-", 1)[1]) if name.startswith("seqpipe-stage-") else 0


def live_microbatches(schedule: str, k: int, m: int) -> List[float]:
    """Per partition, the peak number of micro-batches whose saved tensors are alive."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(W, W), nn.Tanh()) for _ in range(k)]).double()
    pipe = Pipe(model, chunks=m, checkpoint="never", balance=[1] * k, devices=["cpu"] * k)
    lock = threading.Lock()
    live, peak, packed = [0] * k, [0] * k, [0] * k

    def pack(tensor: Tensor) -> _Token:
        s = _stage_of_thread()
        token = _Token(tensor)
        with lock:
            live[s] += 1
            packed[s] += 1
            peak[s] = max(peak[s], live[s])

        def release() -> None:
            with lock:
                live[s] -= 1
        weakref.finalize(token, release)
        return token

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda token: token.tensor):
        pipe.train_step(*data(2 * m), nn.functional.mse_loss, schedule=schedule)
    assert live == [0] * k  # everything freed by the end of the step
    per_microbatch = [n / m for n in packed]
    return [p / n for p, n in zip(peak, per_microbatch)]


@pytest.mark.parametrize("k", [2, 3])
def test_1f1b_keeps_at_most_k_minus_s_microbatches_alive(k: int) -> None:
    m = 6
    peaks = live_microbatches("1f1b", k, m)
    assert peaks == [k - s for s in range(k)]
    assert max(peaks) <= k < m


@pytest.mark.parametrize("k", [2, 3])
def test_zero_bubble_memory_is_that_of_the_papers(k: int) -> None:
    """ZB-H1 keeps no more than 1F1B's peak (K, on the first partition) anywhere; ZB-H2 at
    most 2K-1-s on partition s (its W deferred). Later partitions hold less than whole
    micro-batches: after ``I`` only what ``W`` needs stays (the input path is freed)."""
    m = 6
    zb_h1, zb_h2 = live_microbatches("zb_h1", k, m), live_microbatches("zb_h2", k, m)
    assert zb_h1[0] == k and max(zb_h1) <= max(live_microbatches("1f1b", k, m)) == k
    assert zb_h2[0] == 2 * k - 1
    assert all(p <= 2 * k - 1 - s for s, p in enumerate(zb_h2))
    assert all(p < 2 * k - 1 - s for s, p in enumerate(zb_h2) if s > 0)  # input path freed


@pytest.mark.parametrize("k", [2, 3])
def test_fill_drain_keeps_every_microbatch_alive(k: int) -> None:
    m = 6
    assert live_microbatches("fill_drain", k, m) == [m] * k


# -- errors --------------------------------------------------------------------------------
def test_failure_in_a_microbatch_loss_names_it_and_the_pipe_recovers() -> None:
    model = plain_model(False, 5)
    x, y = data(8)
    pipe = Pipe(model, chunks=4, balance=[2, 3], devices=["cpu"] * 2)
    calls = []

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        calls.append(len(calls))
        if len(calls) == 3:
            raise ArithmeticError("bad sample")
        return nn.functional.mse_loss(out, target)

    with pytest.raises(ArithmeticError, match="bad sample") as info:
        pipe.train_step(x, y, loss_fn, schedule="1f1b")
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "stage 1" in notes and "forward of micro-batch 2" in notes
    assert not [t for t in threading.enumerate() if t.name.startswith("seqpipe-stage-")]
    model.zero_grad()
    _, grads_ref = reference(model, x, y)
    pipe.train_step(x, y, nn.functional.mse_loss, schedule="1f1b")
    assert_grads(model.parameters(), grads_ref)


def test_loss_fn_must_return_a_scalar() -> None:
    pipe = Pipe(plain_model(False, 5), chunks=2, balance=[2, 3], devices=["cpu"] * 2)
    with pytest.raises(TypeError, match="scalar tensor"):
        pipe.train_step(*data(4), lambda out, y: (out - y) ** 2)


def test_target_of_another_batch_size_is_refused() -> None:
    pipe = Pipe(plain_model(False, 5), chunks=2, balance=[2, 3], devices=["cpu"] * 2)
    x, y = data(4)
    with pytest.raises(ValueError, match="same batch size"):
        pipe.train_step(x, y[:3], nn.functional.mse_loss)


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zbv"])
def test_several_stages_per_device_need_a_multiple_of_partitions(name: str) -> None:
    pipe = Pipe(plain_model(False, 5), chunks=2, balance=[2, 2, 1], devices=["cpu"] * 3)
    with pytest.raises(ValueError, match=f"'{name}' cannot place 3 partitions: it puts 2 "
                                         f"stages on each device.*'1f1b'"):
        pipe.train_step(*data(4), nn.functional.mse_loss, schedule=name)
    assert all(p.grad is None for p in pipe.parameters())


def test_unknown_and_malformed_schedules_are_refused() -> None:
    pipe = Pipe(plain_model(False, 5), chunks=2, balance=[2, 3], devices=["cpu"] * 2)
    with pytest.raises(ValueError, match="unknown schedule 'ifib'"):
        pipe.train_step(*data(4), nn.functional.mse_loss, schedule="ifib")

    class ForgetsABackward:
        def actions(self, stage: int, num_stages: int, m: int) -> List[Action]:
            return [F(i) for i in range(m)] + [B(i) for i in range(m - 1)]

    with pytest.raises(ScheduleError):
        pipe.train_step(*data(4), nn.functional.mse_loss, schedule=ForgetsABackward())
    assert all(p.grad is None for p in pipe.parameters())  # refused before running
    with pytest.raises(ValueError, match="schedule='auto' is DistributedPipe's.*name one"):
        pipe.train_step(*data(4), nn.functional.mse_loss, schedule="auto")
    assert all(p.grad is None for p in pipe.parameters())


def test_a_user_schedule_runs() -> None:
    class BackwardsFirstLast:
        """Fill-drain, backwards in micro-batch order (not reversed)."""

        def actions(self, stage: int, num_stages: int, m: int) -> List[Action]:
            return [F(i) for i in range(m)] + [B(i) for i in range(m)]

    model = plain_model(True, 5)
    x, y = data(7)
    loss_ref, grads_ref = reference(model, x, y)
    pipe = Pipe(model, chunks=3, balance=[2, 3], devices=["cpu"] * 2)
    torch.testing.assert_close(pipe.train_step(x, y, nn.functional.mse_loss,
                                               schedule=BackwardsFirstLast()), loss_ref)
    assert_grads(model.parameters(), grads_ref)


def test_train_step_under_no_grad_is_refused() -> None:
    pipe = Pipe(plain_model(False, 5), chunks=2, balance=[2, 3], devices=["cpu"] * 2)
    with torch.no_grad(), pytest.raises(RuntimeError, match="gradients are disabled"):
        pipe.train_step(*data(4), nn.functional.mse_loss)


def test_ddp_argument_must_wrap_this_pipe() -> None:
    pipe = Pipe(plain_model(False, 5), chunks=2, balance=[2, 3], devices=["cpu"] * 2)
    with pytest.raises(ValueError, match="wraps this pipe"):
        pipe.train_step(*data(4), nn.functional.mse_loss, ddp=nn.Linear(1, 1))


# -- CUDA (skipped without a GPU) ------------------------------------------------------------
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CUDA_DEVICES = [["cpu", "cuda:0"], ["cuda:0", "cuda:0"]] + (
    [["cuda:0", "cuda:1"]] if GPUS >= 2 else [])


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("devices", CUDA_DEVICES, ids=lambda d: "-".join(d))
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cuda_partitions(devices: List[str], schedule: str) -> None:
    model = plain_model(True, 5)
    x, y = data(11)
    loss_ref, grads_ref = reference(model, x, y)
    pipe = Pipe(model, chunks=4, balance=[2, 3], devices=devices)
    loss = pipe.train_step(x.to(devices[0]), y.to(devices[-1]), nn.functional.mse_loss,
                           schedule=schedule)
    assert loss.device == torch.device(devices[-1])
    torch.testing.assert_close(loss.cpu(), loss_ref)
    for p, g in zip(model.parameters(), grads_ref):
        torch.testing.assert_close(p.grad.cpu(), g, rtol=1e-9, atol=1e-11)


class Scaled(nn.Module):
    """A first layer that takes ``(x, scale, flag)``: a whole-batch tensor and a value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, inputs: tuple) -> Tensor:
        x, scale, flag = inputs
        assert flag == "on"  # the non-tensor value reaches every micro-batch unchanged
        return self.lin(x) * scale.sum()


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_train_step_takes_nochunk_tensors_and_values(schedule: str) -> None:
    """Non-tensor values and a ``NoChunk`` tensor reach every micro-batch's first layer under a
    schedule as under ``forward``; the ``NoChunk`` tensor's gradient is the whole batch's."""
    from seqpipe import NoChunk

    torch.manual_seed(0)
    model = nn.Sequential(Scaled(), nn.Tanh(), nn.Linear(W, W)).double()
    x, y = data()
    scale = torch.rand(3, dtype=torch.float64, requires_grad=True)
    plain = copy.deepcopy(model)
    nn.functional.mse_loss(plain((x, scale, "on")), y).backward()
    expected_scale = scale.grad
    scale.grad = None
    pipe = Pipe(model, chunks=4, balance=[1, 2])
    loss = pipe.train_step((x, NoChunk(scale), "on"), y, nn.functional.mse_loss,
                           schedule=schedule)
    assert torch.allclose(loss, nn.functional.mse_loss(plain((x, scale, "on")), y))
    assert_grads(pipe.parameters(), [p.grad for p in plain.parameters()])
    assert torch.allclose(scale.grad, expected_scale)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_train_step_checkpoints_every_n_layers(schedule: str) -> None:
    """``checkpoint_every`` composes with the schedules' own recomputation."""
    model = plain_model(skips=True, layers=8)
    x, y = data()
    expected_loss, expected = reference(model, x, y)
    pipe = Pipe(model, chunks=4, balance=[4, 4], checkpoint="always", checkpoint_every=2)
    loss = pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule)
    assert torch.allclose(loss, expected_loss)
    assert_grads(pipe.parameters(), expected)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_weight_tied_across_partitions_gets_both_uses_gradients(schedule: str) -> None:
    """A parameter two partitions share (an embedding tied to the output layer) gets the sum
    of both uses' gradients, as in the plain model."""
    torch.manual_seed(0)
    first, last = nn.Linear(W, W), nn.Linear(W, W)
    last.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(W, W), last).double()
    x, y = data()
    expected_loss, expected = reference(model, x, y)
    pipe = Pipe(model, chunks=4, balance=[2, 2])
    loss = pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule)
    assert len(list(pipe.parameters())) == 5  # the tied weight once
    assert torch.allclose(loss, expected_loss)
    assert_grads(pipe.parameters(), expected)


def test_a_builtin_schedules_actions_are_worked_out_once_per_shape(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``local_actions`` checks a built-in named by a string once per (partitions,
    micro-batches) and hands out new lists of the same actions; a schedule object every call."""
    import seqpipe.local.train_step as module
    from seqpipe.schedule import OneFOneB

    checked: List[Any] = []
    validate = module.validate_schedule

    def watch(schedule: Any, *args: Any) -> None:
        checked.append(schedule)
        validate(schedule, *args)
    monkeypatch.setattr(module, "validate_schedule", watch)
    monkeypatch.setattr(module, "_BUILT", {})
    first = module.local_actions("zb_h1", 2, 5)
    again = module.local_actions("ZB-H1", 2, 5)
    assert again == first and again is not first and again[0] is not first[0]
    assert len(checked) == 1
    module.local_actions("zb_h1", 2, 6)
    assert len(checked) == 2
    for _ in range(2):
        module.local_actions(OneFOneB(), 2, 5)
    assert len(checked) == 4
    with pytest.raises(ValueError, match="cannot place 3 partitions"):
        module.local_actions("interleaved_1f1b", 3, 4)
