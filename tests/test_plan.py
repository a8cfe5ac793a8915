"""``seqpipe.distributed.plan``: the messages one call sends between two stages, in order.

Pure functions of the schedule and the skip layout, checked here without any process:
an exact list for a small case, then properties over both built-in clocks, 2 and 3 stages,
1, 4 and 7 micro-batches, training and forward-only calls, with and without skips; and
the pairs of stages a failure is relayed over (``Transport.abort`` on a faked
``torch.distributed``), for 2 to 8 stages.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpipe.distributed.plan import (
    OPENING,
    Planned,
    call_actions,
    channels,
    closer,
    messages,
    pipeline_channels,
)
from seqpipe.distributed.transport import Kind, Transport
from seqpipe.schedule import Action, Phase, forward_phase, get_schedule
from seqpipe.skip import Namespace, inspect_skip_layout, pop, skippable, stash
from seqpipe.skip.layout import Skip, SkipLayout

CLOCKS = ("fill_drain", "1f1b")
STAGES = (2, 3)
MICROBATCHES = (1, 4, 7)


@skippable(stash=["s"])
class StashS(nn.Module):
    def forward(self, x: Tensor) -> Any:
        yield stash("s", x)
        return x


@skippable(pop=["s"])
class PopS(nn.Module):
    def forward(self, x: Tensor) -> Any:
        s = yield pop("s")
        return x + s


def skip_model() -> nn.Sequential:
    """Layer 1 stashes ``s``, layer 4 pops it."""
    return nn.Sequential(nn.Identity(), StashS(), nn.Identity(), nn.Identity(), PopS(),
                         nn.Identity())


def no_skips(k: int) -> SkipLayout:
    return SkipLayout((1,) * k, ())


def crossing_skip(k: int) -> SkipLayout:
    """One skip from stage 0 to the last stage (0 -> 2 with 3 stages, 0 -> 1 with 2)."""
    balance = {2: [3, 3], 3: [2, 2, 2]}[k]
    layout = inspect_skip_layout(skip_model(), balance)
    (skip,) = layout.skips
    assert (skip.stash_partition, skip.pop_partition) == (0, k - 1)
    return layout


def two_skips() -> SkipLayout:
    """Two skips 0 -> 2, built directly; ``b`` is stashed first, so it comes first."""
    ns = Namespace()
    return SkipLayout((2, 2, 2), (Skip(ns, "a", 1, 5, 0, 2), Skip(ns, "b", 0, 4, 0, 2)))


LAYOUTS = {"no skips": no_skips, "one crossing skip": crossing_skip}


def actions_of(clock: str, k: int, m: int, grad: bool) -> List[List[Action]]:
    """What every stage runs in a call, as ``CallLifecycle.plan`` builds it."""
    schedule = get_schedule(clock)
    actions = [list(schedule.actions(s, k, m)) for s in range(k)]
    return actions if grad else [forward_phase(a) for a in actions]


def cases() -> List[Any]:
    return [pytest.param(clock, k, m, grad, layout,
                         id=f"{clock}-K{k}-M{m}-{'train' if grad else 'forward'}-{layout}")
            for clock in CLOCKS for k in STAGES for m in MICROBATCHES
            for grad in (True, False) for layout in LAYOUTS]


def kinds(plan: Sequence[Planned]) -> List[Tuple[str, int, int]]:
    return [(p.kind.name, p.microbatch, p.key) for p in plan]


# --------------------------------------------------------------------------- exact lists


def test_two_stages_three_microbatches_1f1b_exactly() -> None:
    # stage 0: F0 F1 B0 F2 B1 B2     stage 1: F0 B0 F1 B1 F2 B2
    actions = actions_of("1f1b", 2, 3, True)
    assert [str(a) for a in actions[0]] == ["F0", "F1", "B0", "F2", "B1", "B2"]
    assert [str(a) for a in actions[1]] == ["F0", "B0", "F1", "B1", "F2", "B2"]
    P = Planned
    assert messages(0, 1, actions, no_skips(2), True) == [
        P(Kind.STEP, -1, -1, -1, -1),
        P(Kind.ACTIVATION, 0, -1, 0, 0, 0),
        P(Kind.ACTIVATION, 1, -1, 1, 2, 0),
        P(Kind.ACTIVATION, 2, -1, 3, 4, 0),
        P(Kind.DONE, -1, -1, 6, 6),
    ]
    assert messages(1, 0, actions, no_skips(2), True) == [
        P(Kind.GRAD, 0, -1, 1, 2, 1),
        P(Kind.GRAD, 1, -1, 3, 4, 1),
        P(Kind.GRAD, 2, -1, 5, 5, 1),
        P(Kind.LOSS, -1, -1, 6, 6),
    ]
    # Forward only: the activations, and DONE from the last stage.
    forward = actions_of("1f1b", 2, 3, False)
    assert messages(0, 1, forward, no_skips(2), False) == [
        OPENING, P(Kind.ACTIVATION, 0, -1, 0, 0, 0), P(Kind.ACTIVATION, 1, -1, 1, 1, 0),
        P(Kind.ACTIVATION, 2, -1, 2, 2, 0)]
    assert messages(1, 0, forward, no_skips(2), False) == [P(Kind.DONE, -1, -1, 3, 3)]


def _named(orders: Sequence[Sequence[Action]]) -> List[str]:
    return [" ".join(f"{a.stage}{a.phase.letter}{a.microbatch}" for a in order)
            for order in orders]


def test_a_stages_last_backward_runs_as_i_then_w_where_another_rank_waits_on_it() -> None:
    # The upstream rank waits for that backward's input gradients to run its own last
    # backward: the weight half comes after they are sent (stage 0 has no upstream).
    assert _named(call_actions(get_schedule("1f1b"), 2, 3, True)) == [
        "0F0 0F1 0B0 0F2 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1I2 1W2"]
    assert _named(call_actions(get_schedule("fill_drain"), 2, 3, True)) == [
        "0F0 0F1 0F2 0B2 0B1 0B0", "1F0 1F1 1F2 1B2 1B1 1I0 1W0"]
    four = _named(call_actions(get_schedule("1f1b"), 4, 4, True))
    assert [order.split()[-2:] for order in four] == [
        ["0B2", "0B3"], ["1I3", "1W3"], ["2I3", "2W3"], ["3I3", "3W3"]]
    # stage s on rank s mod 2: every stage but 0 has its upstream on the other rank
    assert [order.split()[-4:] for order in
            _named(call_actions(get_schedule("interleaved_1f1b"), 2, 4, True))] == [
        ["2I3", "2W3", "0B2", "0B3"], ["3W3", "1B2", "1I3", "1W3"]]
    # forward only: nothing to split
    assert _named(call_actions(get_schedule("1f1b"), 2, 3, False))[1] == "1F0 1F1 1F2"
    # a middle stage's weight half runs after its last message: it tells stage 0 it is
    # done, so that a failure there still reaches every rank
    orders = call_actions(get_schedule("1f1b"), 3, 3, True)
    assert kinds(messages(1, 0, orders, no_skips(3), True))[-1] == ("DONE", -1, -1)
    assert kinds(messages(2, 0, orders, no_skips(3), True))[-1] == ("LOSS", -1, -1)


def test_fill_drain_gradients_come_in_reverse_microbatch_order() -> None:
    actions = actions_of("fill_drain", 2, 3, True)  # both: F0 F1 F2 B2 B1 B0
    assert kinds(messages(1, 0, actions, no_skips(2), True)) == [
        ("GRAD", 2, -1), ("GRAD", 1, -1), ("GRAD", 0, -1), ("LOSS", -1, -1)]
    assert [(p.sent_at, p.taken_at) for p in messages(1, 0, actions, no_skips(2), True)] == [
        (3, 3), (4, 4), (5, 5), (6, 6)]


def test_skips_go_before_the_activation_and_their_gradients_after_the_gradient() -> None:
    actions = actions_of("1f1b", 2, 2, True)
    layout = crossing_skip(2)  # 0 -> 1: the skip and the activation go to the same stage
    assert kinds(messages(0, 1, actions, layout, True)) == [
        ("STEP", -1, -1), ("SKIP", 0, 0), ("ACTIVATION", 0, -1), ("SKIP", 1, 0),
        ("ACTIVATION", 1, -1), ("DONE", -1, -1)]
    assert kinds(messages(1, 0, actions, layout, True)) == [
        ("GRAD", 0, -1), ("SKIP_GRAD", 0, 0), ("GRAD", 1, -1), ("SKIP_GRAD", 1, 0),
        ("LOSS", -1, -1)]


def test_three_stage_skip_goes_directly_and_in_layout_order() -> None:
    actions = actions_of("fill_drain", 3, 2, True)
    layout = two_skips()
    assert [s.name for s in layout] == ["b", "a"]  # ordered by stash layer
    assert kinds(messages(0, 2, actions, layout, True)) == [
        ("STEP", -1, -1), ("SKIP", 0, 0), ("SKIP", 0, 1), ("SKIP", 1, 0), ("SKIP", 1, 1),
        ("DONE", -1, -1)]
    assert kinds(messages(2, 0, actions, layout, True)) == [
        ("SKIP_GRAD", 1, 0), ("SKIP_GRAD", 1, 1), ("SKIP_GRAD", 0, 0), ("SKIP_GRAD", 0, 1),
        ("LOSS", -1, -1)]
    # Forward only: the skips, no gradients, no loss; DONE from the last stage.
    forward = actions_of("fill_drain", 3, 2, False)
    assert kinds(messages(2, 0, forward, layout, False)) == [("DONE", -1, -1)]
    assert kinds(messages(0, 1, actions, layout, True)) == [
        ("STEP", -1, -1), ("ACTIVATION", 0, -1), ("ACTIVATION", 1, -1), ("DONE", -1, -1)]


def test_one_stage_or_to_itself_sends_nothing() -> None:
    for clock in CLOCKS:
        for grad in (True, False):
            one = actions_of(clock, 1, 4, grad)
            assert messages(0, 0, one, no_skips(1), grad) == []
            three = actions_of(clock, 3, 4, grad)
            for s in range(3):
                assert messages(s, s, three, crossing_skip(3), grad) == []


def test_a_skip_inside_one_stage_sends_nothing_extra() -> None:
    layout = inspect_skip_layout(skip_model(), [1, 5])  # stashed and popped on stage 1
    assert [s.crosses for s in layout] == [False]
    actions = actions_of("1f1b", 2, 4, True)
    assert messages(0, 1, actions, layout, True) == messages(0, 1, actions, no_skips(2), True)
    assert messages(1, 0, actions, layout, True) == messages(1, 0, actions, no_skips(2), True)


def test_closer() -> None:
    assert closer(3, True) == 0 and closer(3, False) == 2 and closer(2, False) == 1


# --------------------------------------------------------------------------- properties


def expected_count(src: int, dst: int, k: int, m: int, grad: bool,
                   layout: SkipLayout) -> Dict[Kind, int]:
    """How many messages of each kind ``src`` sends ``dst``, counted from the rules."""
    skips = sum(1 for s in layout if s.crosses and (s.stash_partition, s.pop_partition)
                == (src, dst))
    back = sum(1 for s in layout if s.crosses and (s.pop_partition, s.stash_partition)
               == (src, dst))
    count = {
        Kind.STEP: int(src == 0),
        Kind.ACTIVATION: m * int(dst == src + 1),
        Kind.SKIP: m * skips,
        Kind.GRAD: m * int(grad and dst == src - 1),
        Kind.SKIP_GRAD: m * back * int(grad),
        Kind.LOSS: int(grad and src == k - 1),
        Kind.DONE: int(src == (0 if grad else k - 1)),
    }
    return {kind: n for kind, n in count.items() if n}


@pytest.mark.parametrize("clock, k, m, grad, layout_name", cases())
def test_plan_properties(clock: str, k: int, m: int, grad: bool, layout_name: str) -> None:
    layout = LAYOUTS[layout_name](k)
    actions = actions_of(clock, k, m, grad)
    position = [{a: n for n, a in enumerate(stage)} for stage in actions]
    total = 0
    for src in range(k):
        for dst in range(k):
            plan = messages(src, dst, actions, layout, grad)
            if src == dst:
                assert plan == []
                continue
            total += len(plan)
            what = f"{src} -> {dst}: {kinds(plan)}"
            # The sender sends them in this order.
            sent = [p.sent_at for p in plan]
            assert sent == sorted(sent), what
            # With these clocks every stage runs micro-batches in the same order, so the
            # receiver also takes them in sending order.
            taken = [p.taken_at for p in plan]
            assert taken == sorted(taken), what
            # How many of each kind: what the rules predict.
            counted: Dict[Kind, int] = {}
            for p in plan:
                counted[p.kind] = counted.get(p.kind, 0) + 1
            assert counted == expected_count(src, dst, k, m, grad, layout), what
            # No message twice.
            assert len({p.identity for p in plan}) == len(plan), what
            for p in plan:
                if p.kind is Kind.STEP:
                    assert p == OPENING and src == 0 and plan[0] == p, what
                elif p.kind in (Kind.LOSS, Kind.DONE):
                    assert (p.sent_at, p.taken_at) == (len(actions[src]), len(actions[dst]))
                    assert p.microbatch == -1, what
                else:
                    phase = Phase.FORWARD if p.kind in (Kind.ACTIVATION, Kind.SKIP) \
                        else Phase.BACKWARD
                    action = Action(phase, p.microbatch)
                    assert p.sent_at == position[src][action], (what, p)
                    assert p.taken_at == position[dst][action], (what, p)
                    if p.kind in (Kind.ACTIVATION, Kind.GRAD):
                        assert p.key == -1, (what, p)
                        assert dst == (src + 1 if p.kind is Kind.ACTIVATION else src - 1)
                    else:  # a skip: from its stash stage to its pop stage, and back
                        skip = list(layout)[p.key]
                        route = (skip.stash_partition, skip.pop_partition)
                        assert (src, dst) == (route if p.kind is Kind.SKIP else route[::-1])
            if not grad:
                assert not {Kind.GRAD, Kind.SKIP_GRAD, Kind.LOSS} & set(counted), what
                assert (Kind.DONE in counted) == (src == k - 1), what
            else:
                assert (Kind.DONE in counted) == (src == 0), what
            if k == 3 and 1 in (src, dst):  # the 0 -> 2 skip never touches stage 1
                assert not {Kind.SKIP, Kind.SKIP_GRAD} & set(counted), what
    assert total > 0
    assert_plan_runs(actions, layout, grad)


def assert_plan_runs(actions: List[List[Action]], layout: SkipLayout, grad: bool) -> None:
    """Replay the call: every stage runs an action once every message it takes there has
    been sent (its sender ran the action that sends it). The call must finish, and each
    message must be sent no later than it is taken: no stage waits forever.

    The close (LOSS, DONE) is left out: the last stage sends LOSS before waiting for DONE.
    """
    k = len(actions)
    plans = {(s, d): messages(s, d, actions, layout, grad)
             for s in range(k) for d in range(k) if s != d}
    done = [0] * k  # actions each stage has run
    progress = True
    while progress:
        progress = False
        for stage in range(k):
            n = done[stage]
            if n == len(actions[stage]):
                continue
            needs = [(s, p) for (s, d), plan in plans.items() if d == stage
                     for p in plan if p.taken_at == n]
            if all(p.sent_at < done[s] for s, p in needs):  # -1: sent at the opening
                done[stage] += 1
                progress = True
    assert done == [len(a) for a in actions], f"the replay stalled at {done}"


# --------------------------------------------------------------------------- failure relay


class FakeWork:
    """A send that completed at once."""

    def is_completed(self) -> bool:
        return True

    def wait(self, *args: Any) -> bool:
        return True


def any_skip(k: int) -> SkipLayout:
    """One skip from stage 0 to the last stage, built directly for any ``k``."""
    return SkipLayout((1,) * k, (Skip(Namespace(), "s", 0, k - 1, 0, k - 1),))


def aborts(k: int, clock: str, grad: bool, layout: SkipLayout
           ) -> Iterator[Tuple[int, int, Optional[int], List[int]]]:
    """Every way a stage can abort a call: ``(stage, its action where it fails, the stage
    it heard of the failure from, the stages the real ``Transport.abort`` sent to)``.

    Each stage's transport is told the call's plan, then sends (header-only stand-ins for)
    the messages it sends before that action; ``torch.distributed`` is faked in-process.
    """
    actions = actions_of(clock, k, 4, grad)
    sent: List[int] = []

    def isend(buffer: Tensor, dst: int, group: Any = None, tag: int = 0) -> FakeWork:
        sent.append(dst)
        return FakeWork()

    with mock.patch.object(dist, "isend", isend), \
            mock.patch.object(dist, "get_backend", lambda group=None: "gloo"):
        for s in range(k):
            plans = {d: messages(s, d, actions, layout, grad) for d in range(k) if d != s}
            senders = [d for d in range(k) if d != s and messages(d, s, actions, layout, grad)]
            for n in range(-1, len(actions[s]) + 1):
                for heard_from in (None, *senders):
                    with mock.patch.object(dist, "get_rank", return_value=s):
                        transport = Transport(None, torch.device("cpu"))
                    for d, planned in plans.items():
                        transport.will_send(d, planned)
                        for p in planned:
                            if p.sent_at < n:
                                transport.send(d, p.kind, p.microbatch, [], key=p.key,
                                               origin=p.origin)
                    sent.clear()
                    transport.abort("stage failed", heard_from, patience=timedelta(0))
                    yield s, n, heard_from, list(sent)


@pytest.mark.parametrize("k", range(2, 9))
def test_an_abort_uses_only_pairs_the_plan_uses(k: int) -> None:
    """A failure notice travels only between stages that exchange messages in the call
    (with NCCL, another pair would need a new communicator, which blocks), and reaches
    every stage that still expects a message from the aborting one, but the stage it heard
    the news from."""
    for clock in CLOCKS:
        for grad in (True, False):
            for layout in (no_skips(k), any_skip(k)):
                actions = actions_of(clock, k, 4, grad)
                used = channels(actions, layout, grad)
                assert used == channels(actions_of(clock, k, 1, grad), layout, grad)
                assert used <= pipeline_channels(get_schedule(clock), k, 2, layout)
                for s, n, heard_from, told in aborts(k, clock, grad, layout):
                    where = f"{clock} K={k} grad={grad} stage {s} at action {n}"
                    assert {(s, d) for d in told} <= used, (where, told, used)
                    assert heard_from not in told and len(set(told)) == len(told), where
                    waiting = {d for d in range(k) if d not in (s, heard_from) and any(
                        p.sent_at >= n for p in messages(s, d, actions, layout, grad))}
                    assert waiting <= set(told), (where, waiting, told)


def test_four_stages_never_talk_over_the_pairs_that_exchange_nothing() -> None:
    # 1 -> 3 and 2 -> 0 carry no message in a 4-stage call without skips: the old abort,
    # sent to every stage, used them (a new NCCL communicator, and a hang).
    for clock in CLOCKS:
        for grad in (True, False):
            used = channels(actions_of(clock, 4, 4, grad), no_skips(4), grad)
            assert (1, 3) not in used and (2, 0) not in used
            for s, _, _, told in aborts(4, clock, grad, no_skips(4)):
                assert not (s == 1 and 3 in told) and not (s == 2 and 0 in told), (s, told)


@pytest.mark.parametrize("k", range(2, 9))
def test_the_news_can_reach_every_stage(k: int) -> None:
    """The pairs a call uses connect every stage to every other (following the direction
    of the messages), so relaying along them reaches everyone."""
    for clock in CLOCKS:
        for grad in (True, False):
            used = channels(actions_of(clock, k, k, grad), no_skips(k), grad)
            for start in range(k):
                reached, frontier = {start}, [start]
                while frontier:
                    s = frontier.pop()
                    for src, dst in used:
                        if src == s and dst not in reached:
                            reached.add(dst)
                            frontier.append(dst)
                assert reached == set(range(k)), (clock, grad, start, reached)
