"""Split backward (I/W) and several stages per rank: the data, the validator's refusals and
the simulator's accounting."""
from __future__ import annotations

import re

import pytest

from seqpipe.schedule import (
    Action,
    B,
    F,
    I,
    Phase,
    Placement,
    ScheduleError,
    StagedSchedule,
    W,
    backward_phase,
    forward_phase,
    get_schedule,
    simulate,
    validate_schedule,
)


def acts(text: str) -> list[Action]:
    """'F0 I0 W0' -> one-stage actions; '2F0 3I1' -> actions naming stage 2 and 3."""
    make = {"F": F, "B": B, "I": I, "W": W}
    out = []
    for tok in text.split():
        head, letter, mb = re.fullmatch(r"(\d*)([FBIW])(\d+)", tok).groups()
        out.append(make[letter](int(mb), int(head) if head else None))
    return out


class PerStage:
    """One stage per rank, one explicit list per stage."""

    def __init__(self, *stages: str) -> None:
        self.stages = [acts(s) for s in stages]

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        return self.stages[stage]


class PerRank:
    """Any placement, one explicit list per rank (the StagedSchedule protocol)."""

    def __init__(self, placement: Placement, *ranks: str) -> None:
        self._placement = placement
        self.ranks = [acts(r) for r in ranks]

    def placement(self, num_ranks: int) -> Placement:
        return self._placement

    def rank_actions(self, rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
        return self.ranks[rank]


class InterleavedFillDrain:
    """A user-written interleaved schedule: all forwards depth-first, then all backwards."""

    def placement(self, num_ranks: int) -> Placement:
        return Placement.looped(num_ranks, 2)

    def rank_actions(self, rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
        mine = [rank, rank + num_ranks]
        m = range(num_microbatches)
        return ([F(i, s) for i in m for s in mine]
                + [B(i, s) for i in m for s in reversed(mine)])


def refused(schedule, k: int, m: int) -> str:
    with pytest.raises(ScheduleError) as info:
        validate_schedule(schedule, k, m)
    return str(info.value)


# --- The data ---------------------------------------------------------------------------


def test_actions_with_stages_and_halves() -> None:
    assert I(3) == Action(Phase.BACKWARD_INPUT, 3) == Action("I", 3) == Action("backward_input", 3)
    assert W(2, 5) == Action.backward_weight(2, stage=5)
    assert str(F(3, 2)) == "2F3" and str(I(0)) == "I0" and str(W(1, 0)) == "0W1"
    assert repr([F(3, 2), W(1)]) == "[F(3, stage=2), W(1)]"
    assert F(1) != F(1, 0)  # a stage-less action is the one-stage-per-rank form
    assert I(1).sends_gradient and B(1).sends_gradient and not W(1).sends_gradient
    assert [p.letter for p in Phase] == ["F", "B", "I", "W"]
    order = acts("F0 F1 I0 W0 B1")
    assert forward_phase(order) == acts("F0 F1")
    assert backward_phase(order) == acts("I0 W0 B1")


@pytest.mark.parametrize(("args", "exc", "match"), [
    ((Phase.FORWARD, 0, -1), ValueError, "stage must be >= 0"),
    ((Phase.FORWARD, 0, 1.0), TypeError, "stage must be an int"),
    (("X", 0), TypeError, "phase must be a Phase"),
])
def test_bad_actions(args: tuple, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        Action(*args)


def test_placements() -> None:
    assert Placement.looped(2, 3).ranks == (0, 1, 0, 1, 0, 1)
    assert Placement.v_shape(3).ranks == (0, 1, 2, 2, 1, 0)
    assert Placement.v_shape(3).stages_of(1) == (1, 4)
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] hold no stage"):
        Placement((0, 0), 2)
    with pytest.raises(ValueError, match="stage 1 is placed on rank 2, but ranks are 0..1"):
        Placement((0, 2), 2)


def test_user_interleaved_schedule_validates_and_simulates() -> None:
    sched = InterleavedFillDrain()
    assert isinstance(sched, StagedSchedule)
    assert get_schedule(sched) is sched
    for k in (1, 2, 3, 4):
        for m in (1, 3, 5):
            validate_schedule(sched, k, m)
    sim = simulate(sched, 2, 2, forward_cost=1, backward_cost=1)
    assert sim.num_stages == 4 and sim.num_ranks == 2
    assert [str(a) for _, _, a in sim.timeline[1]] == \
        ["1F0", "3F0", "1F1", "3F1", "3B0", "1B0", "3B1", "1B1"]
    # Worked by hand: each rank waits for the other at every hop between its two stages.
    assert [(s, e) for s, e, _ in sim.timeline[0]] == \
        [(0, 1), (2, 3), (3, 4), (5, 6), (8, 9), (10, 11), (11, 12), (13, 14)]
    assert [(s, e) for s, e, _ in sim.timeline[1]] == \
        [(1, 2), (3, 4), (4, 5), (6, 7), (7, 8), (9, 10), (10, 11), (12, 13)]
    assert sim.peak_live_microbatches == [4, 4] and sim.peak_activation_memory == [2, 2]


# --- What the validator refuses ---------------------------------------------------------


def test_input_gradient_before_forward() -> None:
    message = refused(PerStage("F0 I0 F1 W0 I1 W1", "I0 F0 W0 F1 I1 W1"), 2, 2)
    assert message == "rank 1, stage 1: I0 (backward of micro-batch 0) comes before its forward F0"


def test_input_gradient_before_the_next_stage_can_send_it() -> None:
    # Rank 0 wants I0's gradient before it sends F1; rank 1 wants F1 before it runs I0.
    message = refused(PerStage("F0 I0 F1 I1 W0 W1", "F0 F1 I0 I1 W0 W1"), 2, 2)
    assert message == ("deadlock: rank 0 waits at I0 of stage 0 for I0 of stage 1 (rank 1); "
                       "rank 1 waits at F1 of stage 1 for F1 of stage 0 (rank 0)")


def test_weight_gradient_before_input_gradient() -> None:
    message = refused(PerStage("F0 W0 I0"), 1, 1)
    assert message == ("rank 0, stage 0: W0 (weight gradient of micro-batch 0) comes before "
                       "its input gradient I0")


@pytest.mark.parametrize(("order", "missing"), [
    ("F0 F1 I0 W0 I1", "W1"),
    ("F0 F1 W1 I0 W0", "I1"),
    ("F0 I0 W0", "F1, B1"),
])
def test_missing_half(order: str, missing: str) -> None:
    n = len(missing.split(", "))
    assert refused(PerStage(order), 1, 2) == \
        f"rank 0, stage 0: missing {n} action(s): {missing}"


def test_full_and_split_backward_of_one_microbatch() -> None:
    assert refused(PerStage("F0 B0 I0 W0"), 1, 1) == (
        "rank 0, stage 0: micro-batch 0 has both B0 and a split backward (I0/W0); run either "
        "B or I then W")


def test_mixed_full_and_split_backward_across_microbatches_is_fine() -> None:
    sched = PerStage("F0 F1 B0 I1 W1", "F0 I0 F1 B1 W0")
    validate_schedule(sched, 2, 2)
    assert simulate(sched, 2, 2).peak_live_microbatches == [2, 2]


def test_action_on_a_rank_that_does_not_hold_its_stage() -> None:
    sched = PerRank(Placement.looped(2, 2), "0F0 1F0 2F0 2B0 1B0 0B0", "3F0 3B0")
    assert refused(sched, 2, 1) == "rank 0 runs F0 of stage 1, but stage 1 is placed on rank 1"


def test_action_on_a_stage_that_does_not_exist() -> None:
    sched = PerRank(Placement.one_per_rank(1), "F0 9B0")
    assert refused(sched, 1, 1) == "rank 0: 9B0 names stage 9, but there are only 1 (0..0)"


def test_action_without_stage_on_a_rank_with_several() -> None:
    sched = PerRank(Placement.looped(1, 2), "F0 1F0 1B0 0B0")
    assert refused(sched, 1, 1) == (
        "rank 0 holds stages [0, 1], so its action F0 must name its stage (Action(..., stage=s))")


def test_repeated_action_names_rank_stage_and_positions() -> None:
    sched = PerRank(Placement.v_shape(1), "0F0 1F0 1I0 1W0 1F0 0I0 0W0")
    assert refused(sched, 1, 1) == \
        "rank 0, stage 1: F0 appears more than once (positions 1 and 4 of rank 0)"


def test_missing_stage_of_a_rank() -> None:
    sched = PerRank(Placement.looped(1, 2), "0F0 0B0")
    assert refused(sched, 1, 1) == "rank 0, stage 1: missing 2 action(s): F0, B0"


def test_deadlock_within_one_rank() -> None:
    # V-shape, K = 2: rank 1 holds stages 1 and 2, and runs stage 2's forward first.
    sched = PerRank(Placement.v_shape(2), "0F0 3F0 3B0 0B0", "2F0 1F0 2B0 1B0")
    assert refused(sched, 2, 1) == (
        "deadlock: rank 0 waits at F0 of stage 3 for F0 of stage 2 (rank 1); "
        "rank 1 waits at F0 of stage 2 for F0 of stage 1 (rank 1)")


def test_placement_for_another_pipeline_size() -> None:
    sched = PerRank(Placement.one_per_rank(3), "F0 B0")
    assert refused(sched, 2, 1) == "placement() is for 3 ranks, but the pipeline has 2"


@pytest.mark.parametrize(("name", "kwargs", "message"), [
    ("zb_h1", {"phases": "FB"},
     "rank 0, stage 0: I0 is a backward_input pass, but this engine runs only F, B: choose "
     "a schedule without the others, e.g. '1f1b'"),
    ("interleaved_1f1b", {"stages_per_rank": 1},
     "rank 0 holds 2 stages [0, 2], but this engine runs 1 per rank: choose a schedule with "
     "that many, e.g. '1f1b' for 1"),
])
def test_engine_restrictions(name: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ScheduleError) as info:
        validate_schedule(name, 2, 4, **kwargs)
    assert str(info.value) == message
    validate_schedule("1f1b", 2, 4, phases=[Phase.FORWARD, Phase.BACKWARD], stages_per_rank=1)


# --- The simulator with split costs -----------------------------------------------------


def test_zb_h1_timeline_by_hand() -> None:
    sim = simulate("zb_h1", 2, 2, forward_cost=1, input_cost=1, weight_cost=1)
    assert sim.timeline == [
        [(0, 1, F(0)), (1, 2, F(1)), (3, 4, I(0)), (4, 5, W(0)), (5, 6, I(1)), (6, 7, W(1))],
        [(1, 2, F(0)), (2, 3, I(0)), (3, 4, F(1)), (4, 5, I(1)), (5, 6, W(0)), (6, 7, W(1))],
    ]
    assert sim.makespan == 7 and sim.bubble_fraction == pytest.approx(1 / 7)
    assert sim.peak_live_microbatches == [2, 2]  # live until W, not until I


def test_live_until_weight_gradient() -> None:
    # I frees nothing: all three forwards stay live until their W.
    sim = simulate(PerStage("F0 F1 F2 I0 I1 I2 W0 W1 W2"), 1, 3)
    assert sim.peak_live_microbatches == [3]
    sim = simulate(PerStage("F0 I0 W0 F1 I1 W1 F2 I2 W2"), 1, 3)
    assert sim.peak_live_microbatches == [1]


def test_split_costs_default_to_half_a_backward() -> None:
    sim = simulate(PerStage("F0 I0 W0"), 1, 1, forward_cost=1, backward_cost=3)
    assert sim.timeline == [[(0, 1, F(0)), (1, 2.5, I(0)), (2.5, 4, W(0))]]


def test_per_stage_split_costs() -> None:
    sim = simulate("zbv", 1, 1, forward_cost=[1, 2], input_cost=[3, 4], weight_cost=[5, 6])
    assert [(s, e, str(a)) for s, e, a in sim.timeline[0]] == [
        (0, 1, "0F0"), (1, 3, "1F0"), (3, 7, "1I0"), (7, 13, "1W0"), (13, 16, "0I0"),
        (16, 21, "0W0")]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"input_cost": 1}, "give input_cost and weight_cost together"),
    ({"input_cost": 1, "weight_cost": 1, "backward_cost": 3},
     r"backward_cost \[3.0, 3.0\] differs from input_cost \+ weight_cost \[2.0, 2.0\]"),
    ({"weight_cost": [1, 1], "input_cost": [1]}, "input_cost needs 2 per-stage values, got 1"),
    ({"forward_cost": [1, 1, 1, 1]}, "forward_cost needs 2 per-stage values, got 4"),
])
def test_bad_split_costs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        simulate("zb_h1", 2, 2, **kwargs)


def test_costs_are_per_stage_not_per_rank() -> None:
    with pytest.raises(ValueError, match="forward_cost needs 4 per-stage values, got 2"):
        simulate("zbv", 2, 2, forward_cost=[1, 1])


def test_chart_names_stages() -> None:
    sim = simulate("looped_bfs", 1, 1, forward_cost=1, backward_cost=2)
    assert sim.chart() == "rank 0: 0F0 1F0 1B0 1B0 0B0 0B0"
