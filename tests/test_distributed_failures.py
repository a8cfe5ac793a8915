"""A failure anywhere in a DistributedPipe reaches every rank, named, and never hangs."""
from __future__ import annotations

import os
import pathlib
import re
import signal
import time
from datetime import timedelta
from typing import List, Tuple
from unittest import mock

import pytest
import test_loss_order as order
import torch
import torch.distributed as dist
from torch import nn

from distributed_harness import Failures, run_workers
from seqpipe.distributed import DistributedPipe, PeerError, inflight, rebuild
from seqpipe.distributed.data_parallel import GradientReducer


class Boom(nn.Module):
    """A linear layer that raises on its ``when``-th forward (or backward)."""

    def __init__(self, when: int, in_backward: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.when, self.in_backward, self.calls = when, in_backward, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.when and not self.in_backward:
            raise ZeroDivisionError("boom in layer")
        y = self.lin(x)
        if self.calls == self.when:
            y.register_hook(_raise_in_backward)
        return y


def _raise_in_backward(grad: torch.Tensor) -> torch.Tensor:
    raise ZeroDivisionError("boom in backward")


def _pipe(boom: nn.Module, schedule: str, group: object = None) -> DistributedPipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), boom, nn.Linear(4, 4))
    return DistributedPipe(model, chunks=4, balance=[1, 2, 1], schedule=schedule,
                           checkpoint="never", group=group)  # type: ignore[arg-type]


def _step(pipe: DistributedPipe, rank: int, world: int,
          loss_fn: object = nn.functional.mse_loss) -> torch.Tensor:
    x = torch.randn(8, 4) if rank == 0 else None
    y = torch.randn(8, 4) if rank == world - 1 else None
    return pipe.train_step(x, y, loss_fn)  # type: ignore[arg-type]


def _check_injected(exc: BaseException, rank: int, phase: str) -> None:
    if rank == 1:  # the failing stage: the original exception, with a note
        assert isinstance(exc, ZeroDivisionError), repr(exc)
        assert f"stage 1 failed in the {phase} of micro-batch 2" in " ".join(exc.__notes__)
    else:  # everyone else: who failed, where, and what this rank was waiting for
        assert isinstance(exc, PeerError), repr(exc)
        text = str(exc)
        assert f"stage 1 failed in the {phase} of micro-batch 2" in text, text
        assert "ZeroDivisionError: boom in" in text, text
        assert f"stage {rank} was at" in text and "waiting for the" in text, text


def _vector_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square()  # not reduced: a vector


def _first_forward_fails(rank: int, world: int) -> None:
    """Stage 0 fails in its first forward, before it told stage 2 that a step starts (it
    tells only stage 1, which its first forward feeds, before that forward): stage 2 hears
    of it in place of that message, and stage 1 while waiting for the activation."""
    torch.manual_seed(0)
    model = nn.Sequential(Boom(1), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = DistributedPipe(model, chunks=4, balance=[1, 2, 1], schedule="1f1b",
                           checkpoint="never", group=dist.new_group(list(range(world))))
    exc = _fails(pipe, rank, world, 0, "stage 0 failed in the forward of micro-batch 0")
    if rank != 0:
        waiting = ("stage 1 was at forward of micro-batch 0 on stage 1, waiting for the "
                   "activation from stage 0" if rank == 1 else
                   "stage 2 was at start of the step, waiting for the start of the step "
                   "from stage 0")
        assert waiting in str(exc), str(exc)


def _last_weight_half_fails(rank: int, world: int) -> None:
    """The middle stage's last backward runs as I then W (``plan.split_tails``): its
    weights' hook raises in W, after it sent stage 0 the last gradient, and every rank
    still raises, naming it (it tells stage 0 it is done after W, so stage 0 waits)."""
    boom = nn.Linear(4, 4)
    boom.weight.register_post_accumulate_grad_hook(_raise_in_weight_gradient)
    pipe = _pipe(boom, "1f1b", dist.new_group(list(range(world))))
    _fails(pipe, rank, world, 1, "stage 1 failed in the backward_weight of micro-batch 3")


def _fails(pipe: DistributedPipe, rank: int, world: int, failing: int,
           failure: str) -> BaseException:
    """A step of ``pipe`` raises on every rank, naming ``failure``: rank ``failing`` its own
    ``ZeroDivisionError`` (with the note), the others a ``PeerError``."""
    with pytest.raises(Exception) as info:
        _step(pipe, rank, world)
    exc = info.value
    if rank == failing:
        assert isinstance(exc, ZeroDivisionError) and failure in " ".join(exc.__notes__)
    else:
        assert isinstance(exc, PeerError) and failure in str(exc), repr(exc)
    return exc


def _raise_in_weight_gradient(param: torch.Tensor) -> None:
    raise ZeroDivisionError("boom in a weight gradient")


def _injected(rank: int, world: int) -> None:
    # Each scenario runs on a fresh process group, so nothing left over from a failed
    # step (an abort nobody read) can reach the next one.
    for schedule in ("fill_drain", "1f1b"):
        for in_backward in (False, True):
            pipe = _pipe(Boom(3, in_backward), schedule, dist.new_group(list(range(world))))
            with pytest.raises(Exception) as info:
                _step(pipe, rank, world)
            _check_injected(info.value, rank, "backward" if in_backward else "forward")
    _first_forward_fails(rank, world)
    _last_weight_half_fails(rank, world)
    pipe = _pipe(nn.Linear(4, 4), "1f1b", dist.new_group(list(range(world))))
    with pytest.raises(Exception) as info:
        _step(pipe, rank, world, _vector_loss)
    if rank == world - 1:
        assert isinstance(info.value, TypeError), repr(info.value)
        assert "scalar tensor" in str(info.value) and "shape (2, 4)" in str(info.value)
    else:
        assert isinstance(info.value, PeerError)
        assert "loss_fn must return a scalar tensor" in str(info.value)
    pipe = _pipe(nn.Linear(4, 4), "1f1b", dist.new_group(list(range(world))))
    with pytest.raises(Exception) as info:  # a target of 16 samples for an input of 8
        pipe.train_step(torch.randn(8, 4) if rank == 0 else None,
                        torch.randn(16, 4) if rank == world - 1 else None,
                        nn.functional.mse_loss)
    assert "the output has 2 samples but its slice of the target has 4" in str(info.value)
    pipe = _pipe(nn.Linear(4, 4), "1f1b", dist.new_group(list(range(world))))
    assert torch.isfinite(_step(pipe, rank, world))  # a fresh group works after failures
    _rebuilds_on_a_failed_group(rank, world)
    _loss_in_micro_batch_order(rank, world)


def _failing_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    raise ZeroDivisionError("boom in loss")


def _rebuild_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))


def _rebuilt_trains(group: object, rank: int, world: int, what: str) -> None:
    """A pipe on ``group``, where a call failed with messages still in flight (the last
    stage's loss_fn raises on micro-batch 0 under fill_drain: stage 1 has sent more
    activations than stage 2 took), then a new pipe on the same group, of other sizes
    (fewer micro-batches, another clock), trains as the plain model."""
    pipe = DistributedPipe(_rebuild_model(), chunks=4, balance=[1, 2, 1], schedule="fill_drain",
                           checkpoint="never", group=group)  # type: ignore[arg-type]
    with pytest.raises(Exception) as info:
        _step(pipe, rank, world, _failing_loss)
    assert isinstance(info.value, ZeroDivisionError if rank == world - 1 else PeerError), \
        f"{what}: {info.value!r}"
    pipe = DistributedPipe(_rebuild_model(), chunks=2, balance=[1, 2, 1], schedule="1f1b",
                           checkpoint="never", group=group)  # type: ignore[arg-type]
    plain = _rebuild_model()
    torch.manual_seed(1)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    expected = nn.functional.mse_loss(plain(x), y)
    expected.backward()
    loss = pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None,
                           nn.functional.mse_loss)
    torch.testing.assert_close(loss, expected.detach(), msg=what)
    grads = dict(plain.named_parameters())
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, msg=f"{what}: {name}")
    out = pipe(x if rank == 0 else None)  # and its forward
    if rank == world - 1:
        torch.testing.assert_close(out, plain(x), msg=what)


def _rebuilds_on_a_failed_group(rank: int, world: int) -> None:
    """docs/distributed.md's old crash: a new pipe on the default group after a failed call
    on it aborted inside gloo (a stale message met the new pipe's first receive). Now each
    pipe talks on its own tag; where tags do not keep messages apart (NCCL, forced here on
    gloo) a pipe built after a failed call talks on a fresh group of the same ranks."""
    _rebuilt_trains(None, rank, world, "default group")
    group = dist.new_group(list(range(world)))
    with mock.patch.object(rebuild, "fresh_needed", lambda g: True):
        _rebuilt_trains(group, rank, world, "fresh group (as on NCCL)")
        pipe = DistributedPipe(_rebuild_model(), chunks=2, balance=[1, 2, 1], group=group)
    assert pipe._transport.group is not group and pipe.group is group  # made after a failure
    healthy = dist.new_group(list(range(world)))
    with mock.patch.object(rebuild, "fresh_needed", lambda g: True):
        pipe = DistributedPipe(_rebuild_model(), chunks=2, balance=[1, 2, 1], group=healthy)
    assert pipe._transport.group is healthy  # no failed call there: no new group


def _loss_in_micro_batch_order(rank: int, world: int) -> None:
    """``tests/test_loss_order.py``'s check on ``DistributedPipe``: the returned loss is the
    plain sum of the micro-batch losses in micro-batch order, bit for bit."""
    for schedule in ("1f1b", "zb_h1"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(3)])
        pipe = DistributedPipe(model, chunks=len(order.VALUES), balance=[1, 1, 1],
                               schedule=schedule, checkpoint="never")
        loss = pipe.train_step(torch.ones(len(order.VALUES), 1) if rank == 0 else None,
                               order.targets() if rank == world - 1 else None,
                               order.target_loss, count_fn=order.one)
        assert torch.equal(loss, order.plain_sum()), (schedule, loss.item())


def test_exception_in_one_stage_raises_on_every_rank() -> None:
    """Forward and backward failures under both clocks (and in the weight half of a middle
    stage's last backward), and a bad loss_fn; then new pipes on the groups of failed
    calls, and the mini-batch loss's order of addition."""
    run_workers(_injected, 3, timeout=150)


PG_TIMEOUT = 30.0
"""The process group's timeout in these launches: a failure raised sooner did not wait it
out (a closed connection, an abort), whatever the machine's load."""


def _killed(rank: int, world: int) -> None:
    pipe = _pipe(nn.Linear(4, 4), "1f1b")
    late = _pipe(nn.Linear(4, 4), "1f1b", dist.new_group(list(range(world))))
    dist.barrier()  # every rank has connected its pipelines' groups before one dies
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies without a word
    started = time.monotonic()
    with pytest.raises(PeerError) as info:
        _step(pipe, rank, world)
    text = str(info.value)
    assert "lost stage 1" in text and f"stage {rank}" in text, text
    # The action is named: a micro-batch's, or the opening of the step when this rank's
    # first send to the dead rank already fails (a race with its exit, not a defect).
    assert "micro-batch" in text or "start of the step" in text, text
    assert time.monotonic() - started < PG_TIMEOUT, "waited out the group's timeout"
    # Stage 0 has (almost always) seen stage 1's connections close by now: it fails at
    # the opening of the next step, tells stage 2 (waiting for that opening) and ends at
    # once. Stage 2 must read that abort, not stage 0's closed connection: the exit
    # handler sees the abort out first. (Else stage 0 sends the opening, and stage 2
    # loses stage 1 itself: the same report.)
    with pytest.raises(PeerError) as info:
        _step(late, rank, world)
    assert "lost stage 1" in str(info.value), str(info.value)
    # Both end as a user's script does, through the harness's teardown and the exit
    # handlers (os._exit would skip the one that delivers the abort).


def test_killed_rank_raises_on_the_others() -> None:
    """A rank that dies is named by the others, within seconds; and the news that a rank
    relays about it before ending at once reaches its peer as sent (it once read "lost
    stage 0" there when stage 0 ended with ``os._exit`` before its abort went out)."""
    run_workers(_killed, 3, timeout=90, pg_timeout=PG_TIMEOUT, killed=[1])


STALL_TIMEOUT = 4.0
"""The process group's timeout in the stalled launch: a silent peer is given up on then."""
SILENCE = 60.0
"""How long the stalled rank stays silent at most (it ends as soon as both peers gave up):
a peer that raised sooner gave up on its own, at the group's timeout, not because the
silent rank ended (a closed connection)."""


def _stalled(rank: int, world: int, folder: str) -> None:
    pipe = _pipe(nn.Linear(4, 4), "fill_drain")
    gave_up = [os.path.join(folder, f"{peer}.gave-up") for peer in (0, 2)]
    if rank == 1:
        # alive but silent until both peers have given up on it (they say so in a file,
        # outside the group)
        deadline = time.monotonic() + SILENCE
        while not all(map(os.path.exists, gave_up)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return  # and ends as a script does: its peers gave up on it, the group lives on
    started = time.monotonic()
    with pytest.raises(PeerError) as info:
        _step(pipe, rank, world)
    elapsed = time.monotonic() - started
    assert f"stage {rank}" in str(info.value) and "stage 1" in str(info.value)
    # The group's timeout ended the wait: not sooner (nothing else could), and while
    # stage 1 was still silent (a hang would have lasted until it ended).
    assert STALL_TIMEOUT / 2 < elapsed < SILENCE, f"raised after {elapsed:.1f} s"
    open(gave_up[rank // 2], "w").close()
    # and ends as a user's script does, through destroy_process_group() and the whole
    # interpreter teardown, exit handlers included


def test_stalled_rank_raises_within_the_group_timeout(tmp_path: pathlib.Path) -> None:
    run_workers(_stalled, 3, str(tmp_path), timeout=SILENCE + 60, pg_timeout=STALL_TIMEOUT)


class Slow(nn.Module):
    """An identity that sleeps in its first forward."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.calls = seconds, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.seconds)
        return x


def _exits_at_once(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Boom(4), Slow(0.6), nn.Linear(4, 4))
    pipe = DistributedPipe(model, chunks=4, balance=[2, 2], schedule="fill_drain",
                           checkpoint="never")
    dist.barrier()
    if rank == 0:  # fails in its 4th forward, while stage 1 sleeps in its first
        with pytest.raises(ZeroDivisionError):
            _step(pipe, rank, world)
        return  # and ends at once, through the interpreter's teardown
    with pytest.raises(PeerError) as info:
        _step(pipe, rank, world)
    assert "stage 0 failed in the forward of micro-batch 3" in str(info.value), info.value


def test_the_news_arrives_when_the_failing_rank_exits_at_once() -> None:
    """The failing rank raises without waiting for its abort to go out; when its process
    then ends, the abort still arrives (kept alive: dropped, stage 1 would report a lost
    stage 0). It cannot go out before the exit: stage 1 is busy and has not posted the
    receive yet (it takes two earlier messages first)."""
    run_workers(_exits_at_once, 2, timeout=120)


def _sent_before_exit(rank: int, world: int) -> None:
    group = dist.new_group([0, 1])
    data = torch.full((4,), 7.0)
    if rank == 0:  # sends, keeps the send in flight, and ends before the peer posts
        inflight.keep([(dist.isend(data, 1, group=group), data)],
                      patience=timedelta(seconds=20), group=group)
        return
    time.sleep(2.0)  # rank 0's process has reached its exit by now
    received = torch.zeros(4)
    dist.irecv(received, 0, group=group).wait()
    assert torch.equal(received, data)


def test_what_is_kept_in_flight_is_delivered_at_exit() -> None:
    """A send kept by ``inflight.keep`` whose receiver posts only after the sender's
    script has ended still arrives: the exit waits for it (up to its patience)."""
    run_workers(_sent_before_exit, 2, timeout=120)


# -- pipeline x data parallelism: a failure in one replica reaches every replica --------
def _mesh() -> tuple:
    """Fresh groups of a 2 x 2 mesh, as ``mesh_groups`` lays it out: stage ``rank // 2``
    of replica ``rank % 2`` (a new pair per scenario: a failed step's groups are spent)."""
    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    stages = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return pipelines[rank % 2], stages[rank // 2]


def _raise_late(param: torch.Tensor) -> None:
    time.sleep(1.0)  # every other stage of the replica is done with its actions by now
    raise ZeroDivisionError("boom in a weight gradient")


def _count(y: torch.Tensor) -> int:
    return y.numel()


def _no_count(y: torch.Tensor) -> int:
    raise ZeroDivisionError("boom in count_fn")


def _replica_scenario(name: str, replica: int) -> tuple:
    """``(model, schedule, balance, loss_fn, count_fn)`` for scenario ``name``; replica 1
    fails."""
    torch.manual_seed(0)
    fails = replica == 1
    layers = [nn.Linear(4, 4) for _ in range(4)]
    loss_fn, count_fn = nn.functional.mse_loss, None
    schedule, balance = "1f1b", [2, 2]
    if name == "loss":  # the recipe: loss_fn raises on micro-batch 2
        calls = [0]

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if fails and calls[0] == 3:
                raise ZeroDivisionError("boom in loss")
            return nn.functional.mse_loss(out, y)
    elif name == "first forward":  # stage 0, its very first action
        layers[1] = Boom(1 if fails else 0)
    elif name == "middle stage":  # zbv: stage 1 of 4, on the replica's second rank
        schedule, balance = "zbv", [1, 1, 1, 1]
        layers[1] = Boom(2 if fails else 0)
    elif name == "last backward":  # stage 0's last backward, some buckets reducing
        layers = [nn.Linear(4, 4), Boom(4 if fails else 0, in_backward=True),
                  nn.Linear(4, 4), nn.Linear(4, 4)]
        balance = [3, 1]
    elif name == "quiet tail":  # the last W of stage 1, after stage 0 reduced everything
        schedule = "zb_h1"
        if fails:
            layers[3].weight.register_post_accumulate_grad_hook(_raise_late)
    elif name == "count":  # count_fn raises: replica 0's last stage waits in the count's sum
        count_fn = _no_count if fails else _count
    return nn.Sequential(*layers), schedule, balance, loss_fn, count_fn


def _conceded(reducer: GradientReducer) -> List[Tuple[int, int]]:
    """Records, each time ``reducer`` concedes a failure before the step's verdict, how
    many of its buckets' all-reduces had started, and of how many."""
    record: List[Tuple[int, int]] = []
    concede = reducer.concede

    def spy(text: str) -> None:
        if not reducer.concluded:
            record.append((len(reducer.works), len(reducer.buckets)))
        concede(text)
    reducer.concede = spy  # type: ignore[method-assign]
    return record


# scenario: (stage that fails, its action, (stage, what it was at) of a peer of its replica)
_REPLICA_FAILURES = {
    "loss": (1, "forward of micro-batch 2", None),
    "first forward": (0, "forward of micro-batch 0", None),
    "middle stage": (1, "forward of micro-batch 1", None),
    "last backward": (0, "backward of micro-batch 3", None),
    "quiet tail": (1, "backward_weight of micro-batch 3", (0, "was at end of the step")),
    "count": (1, "start of the step", None),
}


def _replica_fails(rank: int, world: int) -> None:
    failures = Failures(rank)
    for name, (stage, action, peer) in _REPLICA_FAILURES.items():
        pp, dp = _mesh()
        replica = dist.get_rank(dp)
        model, schedule, balance, loss_fn, count_fn = _replica_scenario(name, replica)
        pipe = DistributedPipe(model, chunks=4, balance=balance, schedule=schedule,
                               checkpoint="never", group=pp, data_parallel_group=dp)
        pipe._reducer.bucket_bytes = 1  # a bucket per parameter: several all-reduces
        conceded = _conceded(pipe._reducer)
        x = torch.randn(8, 4) if pipe.is_first else None
        y = torch.randn(8, 4) if pipe.is_last else None
        dist.barrier()
        started = time.monotonic()
        with pytest.raises(Exception) as info:
            pipe.train_step(x, y, loss_fn, count_fn=count_fn)
        raised = time.monotonic()  # the monotonic clock is the machine's: comparable
        failing = replica == 1 and pipe.rank == (1 if name == "middle stage" else stage)
        exc, what = info.value, f"{name}: rank {rank}"
        text = " ".join(getattr(exc, "__notes__", [])) if failing else str(exc)
        failures.expect(re.search(rf"stage {stage}( \(rank 1\))? of replica 1 failed in the "
                                  rf"{action}", text) is not None,
                        f"{what}: {type(exc).__name__}: {text}")
        if failing:
            failures.expect(isinstance(exc, ZeroDivisionError), f"{what}: {exc!r}")
        else:
            failures.expect(isinstance(exc, PeerError), f"{what}: {exc!r}")
        if replica == 0:  # heard it over the data-parallel group
            failures.expect("of replica 0 was at the end of the step" in text and
                            "heard it from replica 1" in text, f"{what}: {text}")
        if peer is not None and replica == 1 and pipe.rank == peer[0]:
            failures.expect(peer[1] in text, f"{what}: {text}")
            begun, total = conceded[0]  # it heard after reducing everything
            failures.expect(begun == total > 0, f"{what}: conceded at {conceded}")
        if name == "last backward" and failing:  # it failed while some buckets reduced
            begun, total = conceded[0]
            failures.expect(0 < begun < total, f"{what}: conceded at {conceded}")
        failures.expect(len(conceded) == replica, f"{what}: conceded {conceded}")
        times = [None] * world
        dist.all_gather_object(times, (raised - started, failing))
        elapsed = [t for t, _ in times]
        first_peer = min(t for t, f in times if not f)
        own = next(t for t, f in times if f)
        failures.expect(max(elapsed) < 15, f"{name}: raised after {elapsed} s")
        failures.expect(own <= first_peer + 1.0, f"{name}: the failing rank raised "
                                                 f"after {own:.2f} s, a peer after "
                                                 f"{first_peer:.2f} s")
    failures.finish()


def test_a_failure_in_one_replica_reaches_every_replica() -> None:
    """2 stages x 2 replicas; replica 1 fails in its loss, a first forward, a middle stage
    (zbv), a last backward with buckets already reducing, a last weight gradient once its
    replica's other stage has reduced everything, and its count_fn (before the count's sum
    over the replicas, the first collective of such a step). Every rank raises within seconds,
    naming the failing replica, stage and action; the failing rank first, with its own
    exception (it used to wait 2 s before raising). Replica 0 used to wait in the gradient
    all-reduce until replica 1's processes exited."""
    run_workers(_replica_fails, 4, timeout=300)
