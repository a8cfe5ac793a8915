"""``seqpipe.trace.record()``: what real steps record, in both engines."""
from __future__ import annotations

import time
import tracemalloc
from collections import defaultdict
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

import seqpipe
from distributed_harness import run_workers
from seqpipe import Pipe
from seqpipe.schedule import FillDrain
from seqpipe.trace import Event, EventKind, Recording, hooks

_ACTIONS = (EventKind.FORWARD, EventKind.BACKWARD, EventKind.INPUT_GRAD,
            EventKind.WEIGHT_GRAD)


def _model(depth: int = 6, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(depth)])


def _actions(recording: Recording, rank: int, stage: int) -> List[str]:
    return [e.name for e in recording.events
            if e.kind in _ACTIONS and e.stage == stage and e.rank == rank]


def _step(pipe: Pipe, x: torch.Tensor) -> None:
    pipe(x).sum().backward()


class _Sleep(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def test_local_step_records_every_action_once_in_schedule_order() -> None:
    pipe = Pipe(_model(), chunks=4, checkpoint="never", balance=[2, 2, 2],
                devices=["cpu"] * 3)
    with seqpipe.trace.record() as rec:
        _step(pipe, torch.randn(8, 8))
    recording = rec.recording
    for s in range(3):
        expected = [f"{a.phase.letter}{a.microbatch}" for a in FillDrain().actions(s, 3, 4)]
        assert _actions(recording, 0, s) == expected
    assert all(e.start <= e.end for e in recording.events)
    sends = [(e.stage, e.peer, e.what, e.microbatch) for e in recording.events
             if e.kind is EventKind.SEND]
    assert sorted(sends) == sorted(
        [(s, s + 1, "activation", i) for s in range(2) for i in range(4)]
        + [(s, s - 1, "gradient", i) for s in (1, 2) for i in range(4)])
    assert not any(e.kind is EventKind.RECOMPUTE for e in recording.events)
    [step] = recording.steps
    assert (step.index, step.num_stages, step.num_ranks, step.num_microbatches,
            step.backward) == (0, 3, 3, 4, True)
    assert isinstance(step.schedule, FillDrain)
    assert step.start <= min(e.start for e in recording.events)
    assert step.end >= max(e.end for e in recording.events)


def test_steps_are_numbered_and_eval_steps_say_they_ran_no_backward() -> None:
    pipe = Pipe(_model(), chunks=2, balance=[3, 3], devices=["cpu"] * 2)
    with seqpipe.trace.record() as rec:
        _step(pipe, torch.randn(4, 8))
        with torch.no_grad():
            pipe(torch.randn(4, 8))
    steps = rec.recording.steps
    assert [(s.index, s.backward) for s in steps] == [(0, True), (1, False)]
    second = [e.name for e in rec.recording.events if e.step == 1 and e.kind in _ACTIONS]
    assert sorted(second) == ["F0", "F0", "F1", "F1"]


def test_checkpointed_microbatches_record_their_recomputation_inside_backward() -> None:
    pipe = Pipe(_model(), chunks=3, checkpoint="except_last", balance=[3, 3],
                devices=["cpu"] * 2)
    with seqpipe.trace.record() as rec:
        _step(pipe, torch.randn(6, 8))
    events = rec.recording.events
    recomputed = sorted((e.stage, e.microbatch) for e in events
                        if e.kind is EventKind.RECOMPUTE)
    assert recomputed == [(s, i) for s in range(2) for i in range(2)]  # not the last
    for e in events:
        if e.kind is EventKind.RECOMPUTE:
            [b] = [x for x in events if x.kind is EventKind.BACKWARD and
                   (x.stage, x.microbatch) == (e.stage, e.microbatch)]
            assert b.start <= e.start <= e.end <= b.end


def test_a_slow_stage_shows_as_a_wait_downstream() -> None:
    # a sleep long against a thread's scheduling delay under load (a shorter one let stage 1
    # reach its wait only after micro-batch 1 had arrived, on a loaded machine)
    model = nn.Sequential(_Sleep(0.2), nn.Linear(8, 8), nn.Linear(8, 8))
    pipe = Pipe(model, chunks=2, checkpoint="never", balance=[2, 1], devices=["cpu"] * 2)
    with seqpipe.trace.record() as rec:
        _step(pipe, torch.randn(4, 8))
    waits = [e for e in rec.recording.events if e.kind is EventKind.WAIT]
    slow = [e for e in waits if (e.stage, e.peer, e.what) == (1, 0, "activation")]
    assert sorted(e.microbatch for e in slow) == [0, 1]
    assert all(e.duration >= 0.1 for e in slow), [e.duration for e in slow]
    assert slow[0].name == "recv activation 0 ← stage 0"
    # and stage 0 was never kept waiting for longer than a sleep
    assert all(e.duration < 0.1 for e in waits if e.stage == 0)


def test_recordings_do_not_nest() -> None:
    with seqpipe.trace.record():
        with pytest.raises(RuntimeError, match="already open"):
            with seqpipe.trace.record():
                pass
    assert hooks.active is None


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "interleaved_1f1b"])
def test_local_train_step_records_its_schedule_once_in_order(schedule: str) -> None:
    """``Pipe.train_step`` records every action of its schedule (I and W apart where it
    splits), the loss on the last stage, and a step the simulator can replay."""
    from seqpipe.schedule import get_schedule, simulate
    from seqpipe.schedule.protocol import staged_orders

    balance = [1] * 6 if schedule == "interleaved_1f1b" else [2, 2, 2]
    pipe = Pipe(_model(), chunks=4, checkpoint="never", balance=balance,
                devices=["cpu"] * len(balance))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with seqpipe.trace.record() as rec:
        pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule)
    recording = rec.recording
    [step] = recording.steps
    orders = staged_orders(get_schedule(schedule), step.num_ranks, 4)
    for s in range(len(balance)):
        expected = [f"{a.phase.letter}{a.microbatch}" for rank in orders for a in rank
                    if a.stage == s]
        assert _actions(recording, 0, s) == expected
    losses = [e.microbatch for e in recording.events if e.kind is EventKind.LOSS]
    assert sorted(losses) == [0, 1, 2, 3]
    assert all(e.stage == len(balance) - 1 for e in recording.events
               if e.kind is EventKind.LOSS)
    assert (step.num_stages, step.num_microbatches) == (len(balance), 4)
    [summary] = rec.summary().steps
    assert summary.predicted is not None, summary.note  # replayed with the measured costs
    planned = simulate(step.schedule, step.num_ranks, step.num_microbatches)
    assert [[a for _, _, a in row] for row in summary.predicted.timeline] == \
        [[a for _, _, a in row] for row in planned.timeline]


def _forbid_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("a trace hook was entered")
    monkeypatch.setattr(hooks._Span, "__init__", refuse)


def test_tracing_off_enters_no_hook_and_allocates_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = Pipe(_model(), chunks=3, checkpoint="except_last", balance=[3, 3],
                devices=["cpu"] * 2)
    x = torch.randn(6, 8)
    _step(pipe, x)  # warm up
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(3):
            _step(pipe, x)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    only_trace = [tracemalloc.Filter(True, "*/seqpipe/trace/*")]
    grown = after.filter_traces(only_trace).compare_to(
        before.filter_traces(only_trace), "filename")
    assert sum(stat.size_diff for stat in grown) == 0, grown
    assert sum(stat.count for stat in after.filter_traces(only_trace).statistics("filename")) \
        == sum(stat.count for stat in before.filter_traces(only_trace).statistics("filename"))
    _forbid_spans(monkeypatch)
    _step(pipe, x)  # no span is even created
    with pytest.raises(AssertionError, match="a trace hook was entered"):
        with seqpipe.trace.record():
            _step(pipe, x)


def test_an_untraced_untimed_computation_enters_one_shared_no_op() -> None:
    """Every task of a step is wrapped in ``Tasks._computing``; with tracing off and no
    ``schedule="auto"`` timer it hands back the one shared no-op (no generator context per
    task), and under ``record()`` a context that records the span."""
    from seqpipe.core.tasks import Tasks
    from seqpipe.schedule import Phase

    tasks = Tasks()
    assert tasks._computing(Phase.FORWARD, 0, 1) is hooks.OFF
    assert tasks._computing(Phase.BACKWARD, 1, 0, EventKind.LOSS) is hooks.OFF
    with seqpipe.trace.record() as rec:
        with tasks._computing(Phase.FORWARD, 0, 1):
            pass
    assert [(e.kind, e.stage, e.microbatch) for e in rec.recording.events] == \
        [(EventKind.FORWARD, 0, 1)]


def test_torch_profiler_shows_the_pipeline_actions() -> None:
    pipe = Pipe(_model(), chunks=2, checkpoint="never", balance=[3, 3], devices=["cpu"] * 2)
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(experimental_config=config) as prof:
        _step(pipe, torch.randn(4, 8))
    names = {e.name for e in prof.events()}
    assert {"F0", "F1", "B0", "B1", "send activation 0 → stage 1",
            "send gradient 1 → stage 0"} <= names, sorted(names)


def test_events_travel_as_tensors_and_come_back_the_same() -> None:
    from seqpipe.trace.gather import decode, encode

    events = [Event(EventKind.WAIT, 2, 1.5, 2.25, 3, rank=1, peer=1, what="gradient", step=4),
              Event(EventKind.REDUCE, 0, 3.0, 3.5, what="tied weights"),
              Event(EventKind.FORWARD, 1, 0.125, 0.5, 0)]
    times, fields = encode(events)
    assert (times.dtype, fields.dtype) == (torch.float64, torch.int64)
    assert decode(times, fields) == events
    assert decode(*encode([])) == []


def test_offsets_are_clamped_to_what_the_messages_allow() -> None:
    from seqpipe.trace.align import causal_offsets

    # rank 1's clock is 10 s ahead; rank 0 sent at 1.0, rank 1 had the message at 11.0001
    # (its clock) and sent a gradient back at 11.002, which rank 0 had at 1.0025
    events = [Event(EventKind.SEND, 0, 1.0, 1.00001, 0, rank=0, peer=1, what="activation"),
              Event(EventKind.FORWARD, 1, 11.0001, 11.001, 0, rank=1),
              Event(EventKind.SEND, 1, 11.002, 11.00201, 0, rank=1, peer=0, what="gradient"),
              Event(EventKind.WAIT, 0, 1.001, 1.0025, 0, rank=0, peer=1, what="gradient")]
    # allowed: 11.002 - 1.0025 = 9.9995 <= offset <= 11.0001 - 1.0 = 10.0001
    assert causal_offsets([0.0, 10.0], [0, 1], events) == [0.0, 10.0]  # fine as it is
    assert causal_offsets([0.0, 10.002], [0, 1], events) == pytest.approx([0.0, 10.0001])
    assert causal_offsets([0.0, 9.99], [0, 1], events) == pytest.approx([0.0, 9.9995])
    assert causal_offsets([0.0, 9.99], [0, 1], events[:2]) == pytest.approx([0.0, 9.99])


# -- distributed ---------------------------------------------------------------------------
def _expected(pipe: object, m: int) -> Dict[Tuple[int, int], List[str]]:
    from seqpipe.distributed.plan import call_actions

    out: Dict[Tuple[int, int], List[str]] = defaultdict(list)
    for rank, actions in enumerate(call_actions(pipe.schedule, pipe.num_ranks, m, True)):
        for a in actions:
            out[(rank, a.stage)].append(f"{a.phase.letter}{a.microbatch}")
    return out


def _matching_send(events: list, wait: object) -> object:
    [send] = [e for e in events if e.kind is EventKind.SEND and e.stage == wait.peer
              and e.peer == wait.stage and e.what == wait.what
              and e.microbatch == wait.microbatch and e.step == wait.step]
    return send


def _two_ranks(rank: int, world: int) -> None:
    from seqpipe.distributed import DistributedPipe
    from seqpipe.trace.gather import clock_offsets

    skew = time.perf_counter if rank == 0 else lambda: time.perf_counter() - 1000.0
    offsets = clock_offsets(None, torch.device("cpu"), skew)
    recordings = {}
    for schedule, checkpoint in (("1f1b", "never"), ("zb_h1", "always")):
        pipe = DistributedPipe(_model(), chunks=4, balance=[3, 3], schedule=schedule,
                               checkpoint=checkpoint)
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        _untraced_step_creates_no_span(pipe, x, y)
        with seqpipe.trace.record(clock=skew) as rec:
            for _ in range(2):
                pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                                nn.functional.mse_loss)
        recordings[(schedule, checkpoint)] = (pipe, rec.recording)
    if rank != 0:  # its own events, on its own clock
        assert all({e.rank for e in r.events} == {1} for _, r in recordings.values())
        return
    assert offsets[0] == 0.0 and abs(offsets[1] + 1000.0) < 0.05, offsets  # NTP alone
    for (schedule, checkpoint), (pipe, recording) in recordings.items():
        _check_merged(pipe, recording, schedule, checkpoint)


def _untraced_step_creates_no_span(pipe: object, x: torch.Tensor, y: torch.Tensor) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("a trace hook was entered")
    original = hooks._Span.__init__
    hooks._Span.__init__ = refuse  # type: ignore[method-assign]
    try:
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        nn.functional.mse_loss)
    finally:
        hooks._Span.__init__ = original  # type: ignore[method-assign]


def _check_merged(pipe: object, recording: Recording, schedule: str, checkpoint: str) -> None:
    events = recording.events
    assert {(e.rank, e.stage) for e in events} == {(0, 0), (1, 1)}
    for step in (0, 1):
        for (r, s), names in _expected(pipe, 4).items():
            got = [e.name for e in events if e.kind in _ACTIONS and e.step == step
                   and (e.rank, e.stage) == (r, s)]
            assert got == names, (schedule, step, r, s, got, names)
    losses = [e for e in events if e.kind is EventKind.LOSS]
    assert sorted((e.step, e.stage, e.microbatch) for e in losses) == [
        (t, 1, i) for t in (0, 1) for i in range(4)]
    recomputed = {(e.stage, e.microbatch) for e in events if e.kind is EventKind.RECOMPUTE}
    assert recomputed == ({(s, i) for s in (0, 1) for i in range(4)}
                          if checkpoint == "always" else set())
    waits = [e for e in events if e.kind is EventKind.WAIT and e.what in
             ("activation", "gradient")]
    assert any(e.rank == 1 for e in waits) and any(e.rank == 0 for e in waits)
    for wait in waits:  # one clock: no message is waited for after it arrived
        assert _matching_send(events, wait).start <= wait.end, (schedule, wait)
    assert [s.index for s in recording.steps] == [0, 1]
    assert recording.steps[0].num_microbatches == 4
    for step in recording.steps:
        inside = [e for e in events if e.step == step.index]
        assert step.start <= min(e.start for e in inside)
        assert max(e.end for e in inside) <= step.end


def test_two_rank_recording_merges_on_one_clock() -> None:
    run_workers(_two_ranks, 2, timeout=180, pg_timeout=60)


def _replicas(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from seqpipe.distributed import DistributedPipe, mesh_groups

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh_groups(mesh)
    pipe = DistributedPipe(_model(2), chunks=2, balance=[2], group=pp,
                           data_parallel_group=dp)
    with seqpipe.trace.record() as rec:
        pipe.train_step(torch.randn(4, 8), torch.randn(4, 8), nn.functional.mse_loss)
    reductions = [e for e in rec.recording.events if e.kind is EventKind.REDUCE]
    assert [(e.name, e.rank) for e in reductions] == [("reduce data parallel", rank)]
    pipe.eval()
    with seqpipe.trace.record() as rec:
        pipe(torch.randn(4, 8))
    [step] = rec.recording.steps
    assert (step.backward, step.num_microbatches) == (False, 2)
    assert [e.name for e in rec.recording.events if e.kind in _ACTIONS] == ["F0", "F1"]
    del pp, dp
    dist.barrier()


def test_data_parallel_replicas_record_their_reduction() -> None:
    run_workers(_replicas, 2, timeout=120, pg_timeout=60)
