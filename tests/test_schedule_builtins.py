"""The nine built-in schedules: they validate, keep their papers' promises, and refuse what
they cannot lay out.

Numbers asserted here are closed forms (bubble fractions, makespans) or the papers' bounds
(peak live activations), not values copied from a run.
"""
from __future__ import annotations

import pytest

from seqpipe.schedule import (
    SCHEDULES,
    DualPipeV,
    FillDrain,
    Interleaved1F1B,
    InterleavedZeroBubble,
    LoopedBFS,
    OneFOneB,
    Phase,
    Placement,
    ScheduleError,
    ZeroBubbleH1,
    ZeroBubbleH2,
    ZeroBubbleV,
    get_schedule,
    placement_of,
    simulate,
    validate_schedule,
)

ONE_STAGE = ["fill_drain", "gpipe", "1f1b", "zb_h1", "zb_h2"]
SEVERAL = ["interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]
ROUNDS = {"interleaved_1f1b", "interleaved_zb"}  # M must split into max(1, M // K) rounds
ZERO_BUBBLE = ["zb_h1", "zb_h2", "interleaved_zb", "zbv", "dualpipev"]
MS = [1, 2, 3, 4, 5, 6, 8, 9, 12]


def acts(schedule, rank: int, k: int, m: int) -> str:
    """A rank's order as text, e.g. '0F0 0F1 2F0'."""
    if hasattr(schedule, "rank_actions"):
        return " ".join(str(a) for a in schedule.rank_actions(rank, k, m))
    return " ".join(str(a) for a in schedule.actions(rank, k, m))


def lays_out(name: str, k: int, m: int) -> bool:
    """Whether ``name`` is defined for K ranks and M micro-batches (the documented rule)."""
    if name in ROUNDS:
        return m % max(1, m // k) == 0
    if name == "dualpipev":
        return m >= 2 * k
    return True


def costs(name: str, f: float = 1.0, i: float = 1.0, w: float = 1.0) -> dict:
    """Equal work per rank: a rank holding V stages costs 1/V of a whole rank per stage."""
    v = 1 if name in ONE_STAGE else 2
    return {"forward_cost": f / v, "input_cost": i / v, "weight_cost": w / v}


# --- Lookup and shapes ------------------------------------------------------------------


def test_every_name_resolves_to_its_class() -> None:
    expected = {"fill_drain": FillDrain, "gpipe": FillDrain, "1f1b": OneFOneB,
                "zb_h1": ZeroBubbleH1, "zb_h2": ZeroBubbleH2,
                "interleaved_1f1b": Interleaved1F1B, "looped_bfs": LoopedBFS,
                "interleaved_zb": InterleavedZeroBubble, "zbv": ZeroBubbleV,
                "dualpipev": DualPipeV}
    assert set(SCHEDULES) == set(expected)
    for name, cls in expected.items():
        assert type(get_schedule(name)) is cls
        assert type(get_schedule(name.upper().replace("_", "-"))) is cls


def test_unknown_name_lists_every_valid_name() -> None:
    with pytest.raises(ValueError) as info:
        get_schedule("zb_h3")
    assert str(info.value) == (
        "unknown schedule 'zb_h3'; valid names: 'fill_drain', 'gpipe', '1f1b', 'zb_h1', "
        "'zb_h2', 'interleaved_1f1b', 'looped_bfs', 'interleaved_zb', 'zbv', 'dualpipev', "
        "'auto'")


@pytest.mark.parametrize("name", ONE_STAGE)
def test_one_stage_builtins_speak_the_old_protocol(name: str) -> None:
    sched = get_schedule(name)
    for stage in range(3):
        assert all(a.stage is None for a in sched.actions(stage, 3, 4))
    assert placement_of(sched, 3) == Placement.one_per_rank(3)


@pytest.mark.parametrize(("name", "stages"), [
    ("interleaved_1f1b", [[0, 3], [1, 4], [2, 5]]),
    ("looped_bfs", [[0, 3], [1, 4], [2, 5]]),
    ("interleaved_zb", [[0, 3], [1, 4], [2, 5]]),
    ("zbv", [[0, 5], [1, 4], [2, 3]]),
    ("dualpipev", [[0, 5], [1, 4], [2, 3]]),
])
def test_placements(name: str, stages: list[list[int]]) -> None:
    placement = placement_of(get_schedule(name), 3)
    assert [list(placement.stages_of(r)) for r in range(3)] == stages
    sched = get_schedule(name)
    for rank in range(3):
        assert {a.stage for a in sched.rank_actions(rank, 3, 6)} == set(stages[rank])


def test_three_stages_per_rank() -> None:
    for cls in (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble):
        sched = cls(stages_per_rank=3)
        assert placement_of(sched, 2).stages_of(1) == (1, 3, 5)
        for m in (1, 2, 4, 6):
            validate_schedule(sched, 2, m)


@pytest.mark.parametrize("cls", [Interleaved1F1B, LoopedBFS, InterleavedZeroBubble])
@pytest.mark.parametrize("v", [1, 0, 2.0, True])
def test_stages_per_rank_must_be_at_least_two(cls: type, v: object) -> None:
    with pytest.raises(ValueError, match=r"needs stages_per_rank >= 2 .* use '1f1b'"):
        cls(stages_per_rank=v)


# --- Every built-in validates (or says why not) ------------------------------------------


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("name", ONE_STAGE + SEVERAL)
def test_every_builtin_validates(name: str, k: int) -> None:
    for m in MS:
        if lays_out(name, k, m):
            validate_schedule(name, k, m)
            sim = simulate(name, k, m)
            ran = [a for row in sim.timeline for _, _, a in row]
            pairs = m * sim.num_stages  # every (stage, micro-batch) once forward, once back
            assert sum(a.is_forward for a in ran) == pairs
            assert sum(a.sends_gradient for a in ran) == pairs
            assert sum(a.phase is Phase.BACKWARD_WEIGHT for a in ran) == \
                sum(a.phase is Phase.BACKWARD_INPUT for a in ran)
        else:
            with pytest.raises(ScheduleError):
                validate_schedule(name, k, m)


@pytest.mark.parametrize("name", sorted(ROUNDS))
def test_interleaved_refuses_uneven_rounds(name: str) -> None:
    expected = (f"{name} with 4 ranks walks the micro-batches in max(1, M // K) = 2 rounds "
                "of equal size, so M must be a multiple of 2; got M = 9. Use M = 8 or 10")
    with pytest.raises(ScheduleError) as info:
        validate_schedule(name, 4, 9)
    assert str(info.value) == expected
    validate_schedule(name, 4, 3)  # M < K: one short round


def test_dualpipev_needs_a_microbatch_per_stage() -> None:
    with pytest.raises(ScheduleError, match="dualpipev needs at least as many micro-batches "
                                            "as stages: 6 for 3 ranks, got 5"):
        validate_schedule("dualpipev", 3, 5)
    validate_schedule("dualpipev", 3, 6)


def test_zbv_works_below_its_pattern_size() -> None:
    for k in (2, 3, 4):
        for m in range(1, 2 * k):
            validate_schedule("zbv", k, m)


# --- Orders, derived by hand from the papers' rules --------------------------------------


def test_zb_h1_order() -> None:
    # Stage 0: no deferral, 1F1B with I, W; stage 1 defers its first W by one step.
    assert acts(ZeroBubbleH1(), 0, 2, 3) == "F0 F1 I0 W0 F2 I1 W1 I2 W2"
    assert acts(ZeroBubbleH1(), 1, 2, 3) == "F0 I0 F1 I1 W0 F2 I2 W1 W2"


def test_zb_h2_order() -> None:
    # Stage 0 warms up with 2(K-1)+1 = 3 forwards; stage 1 with 1, deferring W by one step.
    assert acts(ZeroBubbleH2(), 0, 2, 4) == "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3"
    assert acts(ZeroBubbleH2(), 1, 2, 4) == "F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3"


def test_interleaved_1f1b_order() -> None:
    # K = 2, V = 2, M = 2: one round of 2; rank 0 warms up with (V-1)*2 + 2 = 4 forwards.
    assert acts(Interleaved1F1B(), 0, 2, 2) == "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1"
    assert acts(Interleaved1F1B(), 1, 2, 2) == "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"


def test_looped_bfs_order() -> None:
    assert acts(LoopedBFS(), 1, 2, 2) == "1F0 1F1 3F0 3F1 3B1 3B0 1B1 1B0"


# --- Simulator closed forms --------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("m_per_k", [1, 2, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("cls", [Interleaved1F1B, LoopedBFS])
def test_interleaved_bubble_formula(cls: type, v: int, m_per_k: int, k: int) -> None:
    m, f, b = m_per_k * k, 1.0 / v, 2.0 / v
    sim = simulate(cls(stages_per_rank=v), k, m, forward_cost=f, backward_cost=b)
    assert sim.bubble_fraction == pytest.approx((k - 1) / (v * m + k - 1))
    assert sim.makespan == pytest.approx((v * m + k - 1) * (f + b))


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_one_f_one_b_with_split_costs(k: int, m: int) -> None:
    sim = simulate("1f1b", k, m, input_cost=1, weight_cost=1)  # B = 2
    assert sim.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("m_per_k", [1, 2, 4])
@pytest.mark.parametrize(("f", "i", "w"), [(1, 1, 1), (1, 1, 0.5), (2, 1, 1)])
def test_zb_h1_makespan_closed_form(f: float, i: float, w: float, k: int, m_per_k: int) -> None:
    # M(F+I+W) + (K-1)(F+I-W) for M >= K: with F = I = W, a third of 1F1B's idle time.
    m = m_per_k * k
    sim = simulate("zb_h1", k, m, forward_cost=f, input_cost=i, weight_cost=w)
    assert sim.makespan == pytest.approx(m * (f + i + w) + (k - 1) * (f + i - w))
    one = simulate("1f1b", k, m, forward_cost=f, input_cost=i, weight_cost=w)
    assert one.makespan == pytest.approx((m + k - 1) * (f + i + w))


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("m_per_k", [1, 2, 4])
def test_papers_memory_promises(k: int, m_per_k: int) -> None:
    m = m_per_k * k
    base = max(simulate("1f1b", k, m).peak_live_microbatches)
    assert base == k
    assert max(simulate("zb_h1", k, m).peak_live_microbatches) <= base
    assert max(simulate("zb_h2", k, m).peak_live_microbatches) <= 2 * base
    zbv = simulate("zbv", k, m)
    assert max(zbv.peak_activation_memory) <= base
    assert zbv.peak_activation_memory == [p / 2 for p in zbv.peak_live_microbatches]


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("m_per_k", [2, 4])
@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_zero_bubble_beats_one_f_one_b(name: str, k: int, m_per_k: int) -> None:
    m = m_per_k * k
    base = simulate("1f1b", k, m, **costs("1f1b"))
    sim = simulate(name, k, m, **costs(name))
    assert sum(sim.busy_time) == pytest.approx(sum(base.busy_time))  # same work
    assert sim.makespan < base.makespan
    assert sim.bubble_fraction < base.bubble_fraction


@pytest.mark.parametrize("k", [2, 3, 4])
def test_zbv_and_interleaved_zb_approach_zero_bubble(k: int) -> None:
    # The bubble per rank is bounded by a constant (the ramp), so it falls like 1/M.
    for name in ("zbv", "interleaved_zb"):
        small = simulate(name, k, 2 * k, **costs(name))
        large = simulate(name, k, 8 * k, **costs(name))
        idle_small = small.makespan - max(small.busy_time)
        idle_large = large.makespan - max(large.busy_time)
        assert idle_large == pytest.approx(idle_small)
        assert large.bubble_fraction < small.bubble_fraction / 3
