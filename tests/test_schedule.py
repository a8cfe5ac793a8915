"""Tests for seqpipe.schedule with one stage per rank and F/B actions: fill-drain and 1F1B
orders, validation, simulation and lookup (the other built-ins: test_schedule_builtins.py;
split backward and several stages per rank: test_schedule_split.py)."""
from __future__ import annotations

import re

import pytest

from seqpipe.schedule import (
    Action,
    B,
    F,
    FillDrain,
    OneFOneB,
    Phase,
    Schedule,
    ScheduleError,
    backward,
    backward_phase,
    forward,
    forward_phase,
    get_schedule,
    simulate,
    validate_schedule,
)

SHAPES = [(k, m) for k in range(1, 7) for m in range(1, 11)]


def acts(text: str) -> list[Action]:
    """'F0 F1 B0' -> [F(0), F(1), B(0)]."""
    return [(F if tok[0] == "F" else B)(int(tok[1:])) for tok in text.split()]


class PerStage:
    """A user-written schedule given as one explicit list per stage."""

    def __init__(self, *stages: list) -> None:
        self.stages = stages

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list:
        return self.stages[stage]


class ForwardsThenBackwardsInOrder:
    """A custom schedule: every forward, then every backward in forward order."""

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        m = range(num_microbatches)
        return [Action.forward(i) for i in m] + [Action.backward(i) for i in m]


# --- Actions ----------------------------------------------------------------------------


def test_action_constructors_and_text() -> None:
    assert F(3) == forward(3) == Action.forward(3) == Action(Phase.FORWARD, 3)
    assert B(3) == backward(3) == Action.backward(3) == Action("backward", 3)
    assert str(F(3)) == "F3" and str(B(12)) == "B12"
    assert repr([F(0), B(1)]) == "[F(0), B(1)]"
    assert F(1).is_forward and not B(1).is_forward
    assert len({F(1), F(1), B(1)}) == 2


@pytest.mark.parametrize(
    ("phase", "mb", "exc"),
    [("sideways", 0, TypeError), (Phase.FORWARD, -1, ValueError),
     (Phase.FORWARD, 1.0, TypeError), (Phase.FORWARD, True, TypeError)],
)
def test_action_rejects_bad_fields(phase: object, mb: object, exc: type) -> None:
    with pytest.raises(exc):
        Action(phase, mb)  # type: ignore[arg-type]


def test_phase_filters_keep_order() -> None:
    order = acts("F0 F1 B0 F2 B1 B2")
    assert forward_phase(order) == acts("F0 F1 F2")
    assert backward_phase(order) == acts("B0 B1 B2")


# --- Built-in orders --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "m", "expected"),
    [
        (1, 3, ["F0 F1 F2 B2 B1 B0"]),
        (2, 4, ["F0 F1 F2 F3 B3 B2 B1 B0"] * 2),
        (3, 4, ["F0 F1 F2 F3 B3 B2 B1 B0"] * 3),
    ],
)
def test_fill_drain_order(k: int, m: int, expected: list[str]) -> None:
    assert [FillDrain().actions(s, k, m) for s in range(k)] == [acts(e) for e in expected]


@pytest.mark.parametrize(
    ("k", "m", "expected"),
    [
        (1, 3, ["F0 B0 F1 B1 F2 B2"]),
        (2, 4, ["F0 F1 B0 F2 B1 F3 B2 B3",
                "F0 B0 F1 B1 F2 B2 F3 B3"]),
        (3, 4, ["F0 F1 F2 B0 F3 B1 B2 B3",
                "F0 F1 B0 F2 B1 F3 B2 B3",
                "F0 B0 F1 B1 F2 B2 F3 B3"]),
        (4, 2, ["F0 F1 B0 B1",  # M < K: warm-up capped at M
                "F0 F1 B0 B1",
                "F0 F1 B0 B1",
                "F0 B0 F1 B1"]),
    ],
)
def test_one_f_one_b_order(k: int, m: int, expected: list[str]) -> None:
    assert [OneFOneB().actions(s, k, m) for s in range(k)] == [acts(e) for e in expected]


@pytest.mark.parametrize(("k", "m"), [(k, m) for k in range(1, 9) for m in range(1, 17)])
def test_one_f_one_b_shape(k: int, m: int) -> None:
    for s in range(k):
        order = OneFOneB().actions(s, k, m)
        assert forward_phase(order) == [F(i) for i in range(m)]
        assert backward_phase(order) == [B(i) for i in range(m)]
        warm = min(k - s, m)  # forwards before the first backward
        assert order[:warm] == [F(i) for i in range(warm)] and order[warm] == B(0)
        steady = order[warm - 1: 2 * m - warm + 1]  # alternates F, B, F, B, ..., B
        assert [a.phase for a in steady] == [Phase.FORWARD, Phase.BACKWARD] * (m - warm + 1)


@pytest.mark.parametrize("sched", [FillDrain(), OneFOneB()])
def test_builtins_reject_bad_arguments(sched: Schedule) -> None:
    with pytest.raises(ValueError, match="stage must be in 0..1"):
        sched.actions(2, 2, 4)
    with pytest.raises(ValueError, match="num_microbatches >= 1"):
        sched.actions(0, 2, 0)


# --- Validation of the built-ins --------------------------------------------------------


@pytest.mark.parametrize(("k", "m"), SHAPES)
@pytest.mark.parametrize("name", ["fill_drain", "1f1b"])
def test_builtins_validate(name: str, k: int, m: int) -> None:
    validate_schedule(get_schedule(name), k, m)


@pytest.mark.parametrize(("k", "m"), [(64, 64), (4, 1024)])
@pytest.mark.parametrize("name", ["fill_drain", "1f1b"])
def test_builtins_validate_with_the_most_ranks_or_micro_batches(name: str, k: int,
                                                                  m: int) -> None:
    """Untimed: the largest pipeline, and the most micro-batches, each at a size that costs
    little. How fast validation is at both at once (64 x 1024) is a benchmark, not a test
    (it failed under load as a 5 s bound here): ``benchmarks/validate_schedule.py``."""
    validate_schedule(get_schedule(name), k, m)


# --- Simulation -------------------------------------------------------------------------


def test_simulated_timeline_by_hand() -> None:
    sim = simulate(FillDrain(), 2, 2, forward_cost=1, backward_cost=2)
    assert sim.timeline == [
        [(0, 1, F(0)), (1, 2, F(1)), (5, 7, B(1)), (7, 9, B(0))],
        [(1, 2, F(0)), (2, 3, F(1)), (3, 5, B(1)), (5, 7, B(0))],
    ]
    assert sim.makespan == 9 and sim.busy_time == [6, 6]
    assert sim.bubble_fraction == pytest.approx(1 / 3)


def test_per_stage_costs_by_hand() -> None:
    sim = simulate(OneFOneB(), 2, 2, forward_cost=[1, 3], backward_cost=[2, 6])
    assert sim.timeline == [
        [(0, 1, F(0)), (1, 2, F(1)), (10, 12, B(0)), (19, 21, B(1))],
        [(1, 4, F(0)), (4, 10, B(0)), (10, 13, F(1)), (13, 19, B(1))],
    ]
    assert sim.makespan == 21
    assert sim.bubble_fraction == pytest.approx(1 - 24 / 42)


COSTS = [(1.0, 2.0), (1.0, 1.0), (0.5, 1.7), (2, 3)]


@pytest.mark.parametrize(("k", "m"), SHAPES)
@pytest.mark.parametrize(("f", "b"), COSTS)
def test_fill_drain_bubble_formula(k: int, m: int, f: float, b: float) -> None:
    sim = simulate(FillDrain(), k, m, forward_cost=f, backward_cost=b)
    assert sim.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))
    assert sim.makespan == pytest.approx((m + k - 1) * (f + b))
    assert sim.peak_live_microbatches == [m] * k


@pytest.mark.parametrize(("k", "m"), SHAPES)
@pytest.mark.parametrize(("f", "b"), COSTS)
def test_one_f_one_b_bubble_matches_fill_drain(k: int, m: int, f: float, b: float) -> None:
    one = simulate(OneFOneB(), k, m, forward_cost=f, backward_cost=b)
    fill = simulate(FillDrain(), k, m, forward_cost=f, backward_cost=b)
    assert one.bubble_fraction == pytest.approx(fill.bubble_fraction)
    assert one.makespan == pytest.approx(fill.makespan)
    assert one.peak_live_microbatches == [min(k - s, m) for s in range(k)]


def test_uniform_per_stage_sequences_match_scalars() -> None:
    sim = simulate("gpipe", 4, 6, forward_cost=[1.5] * 4, backward_cost=(3.0,) * 4)
    assert sim.bubble_fraction == pytest.approx(3 / 9)


def test_single_stage_has_no_bubble() -> None:
    for sched in (FillDrain(), OneFOneB()):
        assert simulate(sched, 1, 5).bubble_fraction == pytest.approx(0.0)


def test_zero_costs_give_zero_makespan_and_bubble() -> None:
    sim = simulate(OneFOneB(), 3, 4, forward_cost=0, backward_cost=0)
    assert sim.makespan == 0 and sim.bubble_fraction == 0.0


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"forward_cost": [1, 2]}, ValueError, "forward_cost needs 3 per-stage values, got 2"),
        ({"backward_cost": -1}, ValueError, "backward_cost must be finite and >= 0"),
        ({"forward_cost": float("nan")}, ValueError, "forward_cost must be finite"),
        ({"forward_cost": ["1", 1, 1]}, TypeError, "forward_cost must be a number"),
    ],
)
def test_simulate_rejects_bad_costs(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        simulate(FillDrain(), 3, 2, **kwargs)


def test_chart() -> None:
    sim = simulate(FillDrain(), 2, 2, forward_cost=1, backward_cost=1)
    assert sim.chart() == (
        "rank 0: F0 F1 .  .  B1 B0\n"
        "rank 1: .  F0 F1 B1 B0 ."
    )
    with pytest.raises(ValueError, match="unit"):
        sim.chart(unit=0)


# --- User-defined schedules -------------------------------------------------------------


def test_user_schedule_validates_and_simulates() -> None:
    sched = ForwardsThenBackwardsInOrder()
    assert isinstance(sched, Schedule)
    for k, m in SHAPES:
        validate_schedule(sched, k, m)
    sim = simulate(sched, 2, 2, forward_cost=1, backward_cost=2)
    assert sim.timeline[0] == [(0, 1, F(0)), (1, 2, F(1)), (5, 7, B(0)), (7, 9, B(1))]
    assert sim.timeline[1] == [(1, 2, F(0)), (2, 3, F(1)), (3, 5, B(0)), (5, 7, B(1))]
    assert sim.peak_live_microbatches == [2, 2]


def test_user_schedule_may_return_any_iterable() -> None:
    class Generator:
        def actions(self, stage: int, num_stages: int, num_microbatches: int):
            yield from FillDrain().actions(stage, num_stages, num_microbatches)

    validate_schedule(Generator(), 3, 4)


# --- Validation errors ------------------------------------------------------------------


def test_missing_action() -> None:
    sched = PerStage(acts("F0 F1 B0"), acts("F0 F1 B1 B0"))
    with pytest.raises(ScheduleError, match=r"^rank 0, stage 0: missing 1 action\(s\): B1$"):
        validate_schedule(sched, 2, 2)


def test_many_missing_actions_are_abbreviated() -> None:
    match = r"^rank 0, stage 0: missing 20 action\(s\): F0, B0, .*, \.\.\.$"
    with pytest.raises(ScheduleError, match=match):
        validate_schedule(PerStage([]), 1, 10)


def test_duplicate_action() -> None:
    sched = PerStage(acts("F0 F1 B1 B0"), acts("F0 F1 F0 B1 B0"))
    match = r"^rank 1, stage 1: F0 appears more than once \(positions 0 and 2 of rank 1\)$"
    with pytest.raises(ScheduleError, match=match):
        validate_schedule(sched, 2, 2)


def test_backward_before_forward() -> None:
    sched = PerStage(acts("F0 F1 F2 B2 B1 B0"), acts("F0 F1 B2 F2 B1 B0"))
    match = r"^rank 1, stage 1: B2 \(backward of micro-batch 2\) comes before its forward F2$"
    with pytest.raises(ScheduleError, match=match):
        validate_schedule(sched, 2, 3)


def test_microbatch_out_of_range() -> None:
    sched = PerStage(acts("F0 F5 B0 B5"))
    match = r"^rank 0, stage 0: F5 refers to micro-batch 5, but there are only 2 \(0..1\)$"
    with pytest.raises(ScheduleError, match=match):
        validate_schedule(sched, 1, 2)


def test_cross_stage_deadlock() -> None:
    # Stage 0 wants B0 from stage 1 before sending F1; stage 1 wants F1 before it runs F0/B0.
    sched = PerStage(acts("F0 B0 F1 B1"), acts("F1 F0 B0 B1"))
    expected = (
        "deadlock: rank 0 waits at B0 of stage 0 for B0 of stage 1 (rank 1); "
        "rank 1 waits at F1 of stage 1 for F1 of stage 0 (rank 0)"
    )
    with pytest.raises(ScheduleError, match=f"^{re.escape(expected)}$"):
        validate_schedule(sched, 2, 2)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(sched, 2, 2)


def test_deadlock_names_every_blocked_stage() -> None:
    ok = acts("F0 B0 F1 B1")
    sched = PerStage(ok, acts("F1 F0 B0 B1"), ok)
    with pytest.raises(ScheduleError) as info:
        validate_schedule(sched, 3, 2)
    assert str(info.value) == (
        "deadlock: rank 0 waits at B0 of stage 0 for B0 of stage 1 (rank 1); "
        "rank 1 waits at F1 of stage 1 for F1 of stage 0 (rank 0); "
        "rank 2 waits at F0 of stage 2 for F0 of stage 1 (rank 1)"
    )


def test_deadlock_after_partial_progress() -> None:
    # Several actions run first; then stage 1 wants B1 before it sends F2, while stage 2
    # wants F2 before it sends B1, and stage 0 is stuck behind stage 1.
    sched = PerStage(
        acts("F0 F1 F2 B2 B1 B0"),
        acts("F0 F1 B1 F2 B0 B2"),
        acts("F0 B0 F1 F2 B1 B2"),
    )
    with pytest.raises(ScheduleError) as info:
        validate_schedule(sched, 3, 3)
    assert str(info.value) == (
        "deadlock: rank 0 waits at B2 of stage 0 for B2 of stage 1 (rank 1); "
        "rank 1 waits at B1 of stage 1 for B1 of stage 2 (rank 2); "
        "rank 2 waits at F2 of stage 2 for F2 of stage 1 (rank 1)"
    )


@pytest.mark.parametrize(
    ("k", "m", "match"),
    [
        (0, 4, "num_ranks must be >= 1, got 0"),
        (2, 0, "num_microbatches must be >= 1, got 0"),
        (-1, 4, "num_ranks must be >= 1, got -1"),
        (2.0, 4, "num_ranks must be an int, got 2.0"),
        (2, True, "num_microbatches must be an int, got True"),
    ],
)
def test_bad_sizes(k: object, m: object, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        validate_schedule(FillDrain(), k, m)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=match):
        simulate(FillDrain(), k, m)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("stage_list", "match"),
    [
        (["F0", "B0"], r"^rank 0: item 0 is 'F0' \(str\), expected an Action$"),
        ([F(0), ("backward", 0)], r"^rank 0: item 1 is \('backward', 0\) \(tuple\), expected an"),
        (None, r"^rank 0: the schedule returned NoneType, expected a sequence of Action$"),
        ("F0B0", r"^rank 0: the schedule returned str"),
    ],
)
def test_wrong_action_types(stage_list: object, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        validate_schedule(PerStage(stage_list), 1, 1)


# --- Lookup -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cls"),
    [("fill_drain", FillDrain), ("gpipe", FillDrain), ("GPipe", FillDrain),
     ("fill-drain", FillDrain), ("1f1b", OneFOneB), ("1F1B", OneFOneB)],
)
def test_get_schedule_by_name(name: str, cls: type) -> None:
    assert get_schedule(name) == cls()


def test_get_schedule_passes_objects_through() -> None:
    sched = ForwardsThenBackwardsInOrder()
    assert get_schedule(sched) is sched
    validate_schedule("1f1b", 3, 5)  # names work wherever a schedule is taken


@pytest.mark.parametrize("obj", [42, None, object(), ["F0"]])
def test_get_schedule_rejects_non_schedules(obj: object) -> None:
    with pytest.raises(TypeError, match=r"actions\(stage, num_stages, num_microbatches\)"):
        get_schedule(obj)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        validate_schedule(obj, 2, 2)  # type: ignore[arg-type]


def test_get_schedule_rejects_a_class() -> None:
    with pytest.raises(TypeError, match=r"use OneFOneB\(\)"):
        get_schedule(OneFOneB)  # type: ignore[arg-type]
