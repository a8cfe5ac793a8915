"""Reading a recorded timeline: Chrome trace JSON, the SVG chart, and the summary against
the simulator. Built on hand-made recordings and on recordings of simulated schedules,
whose numbers the simulator gives independently."""
from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from typing import List

import pytest

from seqpipe.schedule import simulate
from seqpipe.trace import (
    Event,
    EventKind,
    Recording,
    StepRecord,
    chrome_events,
    describe_wait,
    from_simulation,
    render_svg,
    summarize,
    write_chrome,
    write_svg,
)

SVG = "{http://www.w3.org/2000/svg}"
MS = 1e-3
F, B, I, W = EventKind.FORWARD, EventKind.BACKWARD, EventKind.INPUT_GRAD, EventKind.WEIGHT_GRAD  # noqa: E741
WAIT, SEND, LOSS = EventKind.WAIT, EventKind.SEND, EventKind.LOSS


def _simulated(schedule: str = "1f1b", ranks: int = 3, m: int = 4, start: float = 1000.0,
               step: int = 0, **costs: object) -> Recording:
    costs = costs or {"forward_cost": [1 * MS, 2 * MS, 1.5 * MS][:ranks],
                      "backward_cost": [2 * MS, 4 * MS, 3 * MS][:ranks]}
    sim = simulate(schedule, ranks, m, **costs)  # type: ignore[arg-type]
    return from_simulation(sim, schedule, start=start, step=step)


def _step(index: int, start: float, end: float, stages: int, m: int,
          schedule: str = "fill_drain") -> StepRecord:
    return StepRecord(index, start, end, schedule, stages, stages, m)


def _hand_made() -> Recording:
    """Three stages, one micro-batch, fill-drain; stage 1 waits 38 ms for stage 2's
    gradient and 2 ms for stage 0's activation; sends as small boxes."""
    ev = [Event(F, 0, 0 * MS, 10 * MS, 0),
          Event(SEND, 0, 10 * MS, 11 * MS, 0, peer=1, what="activation"),
          Event(WAIT, 1, 0 * MS, 12 * MS, 0, peer=0, what="activation"),
          Event(F, 1, 12 * MS, 22 * MS, 0),
          Event(WAIT, 2, 0 * MS, 24 * MS, 0, peer=1, what="activation"),
          Event(F, 2, 24 * MS, 34 * MS, 0),
          Event(LOSS, 2, 34 * MS, 36 * MS, 0),
          Event(B, 2, 36 * MS, 56 * MS, 0),
          Event(WAIT, 1, 22 * MS, 60 * MS, 0, peer=2, what="gradient"),
          Event(B, 1, 60 * MS, 80 * MS, 0),
          Event(WAIT, 0, 11 * MS, 82 * MS, 0, peer=1, what="gradient"),
          Event(B, 0, 82 * MS, 102 * MS, 0)]
    rec = Recording(ev, [_step(0, 0.0, 102 * MS, 3, 1)])
    rec.finish()
    return rec


# ---------------------------------------------------------------- Chrome trace JSON


def test_chrome_json_has_the_trace_fields_one_track_per_rank_and_stage(tmp_path) -> None:
    rec = _simulated("zbv", ranks=2, m=4, start=1000.0,
                     forward_cost=1 * MS, input_cost=1 * MS, weight_cost=0.5 * MS)
    path = tmp_path / "trace.json"
    write_chrome(rec, path)
    data = json.loads(path.read_text(encoding="utf-8"))
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(rec.events)
    for e in complete:
        assert {"ph", "ts", "dur", "pid", "tid", "name", "args", "cat"} <= e.keys()
    # zbv: rank r holds stages r and 3 - r; one track each, named by metadata.
    assert {(e["pid"], e["tid"]) for e in complete} == {(0, 0), (0, 3), (1, 1), (1, 2)}
    meta = [e for e in data["traceEvents"] if e["ph"] == "M"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta
               if e["name"] == "thread_name"}
    assert threads == {(0, 0): "stage 0", (0, 3): "stage 3", (1, 1): "stage 1",
                       (1, 2): "stage 2"}
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1"}
    # Microseconds from the first instant, one JSON event per recorded event.
    origin = min(e.start for e in rec.events)
    by_key = {(e["name"], e["pid"], e["tid"]): e for e in complete}
    for ev in rec.events:
        out = by_key[(ev.name, ev.rank, ev.stage)]
        assert out["ts"] == pytest.approx((ev.start - origin) * 1e6)
        assert out["dur"] == pytest.approx(ev.duration * 1e6)
    assert min(e["ts"] for e in complete) == 0
    # The chart has the same tracks, labelled with their rank where it is not the stage.
    rows = _rows(_sections(render_svg(rec))["measured"])
    labels = [next(r.iter(f"{SVG}text")).text for r in rows]
    assert labels == ["rank 0 · stage 0", "rank 0 · stage 3", "rank 1 · stage 1",
                      "rank 1 · stage 2"]


def test_chrome_events_carry_names_categories_and_args() -> None:
    events = chrome_events(_hand_made())["traceEvents"]
    wait = next(e for e in events if e["ph"] == "X" and e["cat"] == "wait"
                and e["args"]["what"] == "gradient" and e["tid"] == 1)
    assert wait["name"] == "recv gradient 0 ← stage 2"
    assert wait["args"] == {"stage": 1, "step": 0, "microbatch": 0, "peer": 2,
                            "what": "gradient"}
    assert wait["dur"] == pytest.approx(38_000)
    names = {e["name"]: e["cat"] for e in events if e["ph"] == "X"}
    assert names["F0"] == "forward" and names["B0"] == "backward"
    assert names["loss 0"] == "loss" and names["send activation 0 → stage 1"] == "send"


# ---------------------------------------------------------------- SVG


def _sections(svg: str) -> dict:
    root = ET.fromstring(svg.encode("utf-8"))
    return {g.get("id"): g for g in root.iter(f"{SVG}g") if g.get("class") == "section"}


def _rows(section: ET.Element) -> List[ET.Element]:
    return [g for g in section.iter(f"{SVG}g") if g.get("class") == "row"]


def test_svg_is_well_formed_with_a_row_per_stage_and_both_sections(tmp_path) -> None:
    rec = _simulated("1f1b", ranks=3, m=4)
    path = tmp_path / "trace.svg"
    write_svg(rec, path)
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    sections = _sections(path.read_text(encoding="utf-8"))
    assert set(sections) == {"measured", "simulated"}
    for section in sections.values():
        assert [r.get("data-stage") for r in _rows(section)] == ["0", "1", "2"]
    # Waits are hatched: the pattern is defined and every wait box uses it.
    assert root.find(f".//{SVG}defs/{SVG}pattern[@id='wait']") is not None
    waits = [r for r in sections["measured"].iter(f"{SVG}rect") if r.get("class") == "wait"]
    assert len(waits) == sum(e.kind is WAIT for e in rec.events) > 0
    assert all(r.get("fill") == "url(#wait)" for r in waits)
    # An axis with ticks and a legend naming the phases drawn.
    axis = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "axis")
    assert len(axis.findall(f"{SVG}text")) >= 3
    legend = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "legend")
    assert {t.text for t in legend.iter(f"{SVG}text")} == {"forward", "backward", "wait"}


def test_svg_simulated_rows_replay_the_measured_costs() -> None:
    # A recording of the plan itself: the simulated boxes coincide with the measured.
    rec = _simulated("zb_h1", ranks=3, m=4, forward_cost=1 * MS, input_cost=1 * MS,
                     weight_cost=1 * MS)
    sections = _sections(render_svg(rec))

    def boxes(section: ET.Element) -> list:
        return sorted((r.get("x"), r.get("width"), r.get("class"))
                      for r in section.iter(f"{SVG}rect")
                      if r.get("class") in ("forward", "backward-input", "backward-weight"))

    assert boxes(sections["measured"]) == boxes(sections["simulated"])
    assert len(boxes(sections["measured"])) == 3 * 4 * 3


def test_svg_labels_only_boxes_wide_enough_and_escapes_text() -> None:
    ev = [Event(F, 0, 0.0, 90 * MS, 0), Event(F, 0, 90 * MS, 90.01 * MS, 1),
          Event(WAIT, 1, 0.0, 90 * MS, 0, peer=0, what="<odd & name>"),
          Event(F, 1, 90 * MS, 100 * MS, 0)]
    rec = Recording(ev, [_step(0, 0.0, 100 * MS, 2, 2)])
    svg = render_svg(rec, simulated=False)
    sections = _sections(svg)
    assert set(sections) == {"measured"}
    labels = [t.text for t in sections["measured"].iter(f"{SVG}text")]
    assert "F0" in labels and "F1" not in labels
    titles = [t.text for t in sections["measured"].iter(f"{SVG}title")]
    assert any("<odd & name>" in t for t in titles)


def test_svg_names_stay_visible_over_a_recomputation() -> None:
    """A recomputation lies inside its backward: it is drawn as a band across the top of
    the backward's box, and every name is drawn after (on top of) every box."""
    ev = [Event(F, 0, 0.0, 40 * MS, 0),
          Event(EventKind.RECOMPUTE, 0, 40 * MS, 80 * MS, 0), Event(B, 0, 40 * MS, 100 * MS, 0)]
    rec = Recording(ev, [_step(0, 0.0, 100 * MS, 1, 1)])
    row = _rows(_sections(render_svg(rec, simulated=False))["measured"])[0]
    children = list(row)
    name = next(c for c in children if c.tag == f"{SVG}text" and c.text == "B0")
    boxes = [c for c in children if c.tag == f"{SVG}rect" and c.get("class") is not None]
    assert all(children.index(box) < children.index(name) for box in boxes)
    band = next(b for b in boxes if b.get("class") == "recompute")
    backward = next(b for b in boxes if b.get("class") == "backward")
    cap_top = float(name.get("y")) - 0.75 * float(name.get("font-size"))
    assert float(band.get("y")) + float(band.get("height")) <= cap_top
    assert float(band.get("height")) < float(backward.get("height")) / 2


def test_svg_axis_word_time_clears_the_first_tick_label() -> None:
    root = ET.fromstring(render_svg(_hand_made()).encode("utf-8"))
    axis = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "axis")
    texts = {t.text: t for t in axis.iter(f"{SVG}text")}
    word, zero = texts["time"], texts["0.00 ms"]
    assert word.get("text-anchor") == "end" and zero.get("text-anchor") == "middle"
    # 0.6 em per character over-estimates a sans-serif label's width
    zero_left = float(zero.get("x")) - 0.6 * float(zero.get("font-size")) * len(zero.text) / 2
    assert float(word.get("x")) + 4 <= zero_left


def test_svg_of_one_step_and_a_step_without_a_plan() -> None:
    first = _simulated(start=0.0, step=0)
    second = _simulated(start=1.0, step=1)
    both = Recording(first.events + second.events, first.steps + second.steps)
    one = _sections(render_svg(both, step=1))["measured"]
    assert {r.get("data-stage") for r in _rows(one)} == {"0", "1", "2"}
    assert all("step 1" in t.text for t in one.iter(f"{SVG}title"))
    with pytest.raises(ValueError, match="step 7 has no events; the recording has steps"):
        render_svg(both, step=7)
    # Stage 2 never ran a backward: no plan to draw, and the chart says why.
    partial = Recording([e for e in first.events if not (e.stage == 2 and e.kind is B)],
                        first.steps)
    sections = _sections(render_svg(partial))
    assert _rows(sections["simulated"]) == []
    title = next(sections["simulated"].iter(f"{SVG}text")).text
    assert "stage 2 has no measured backward" in title


# ---------------------------------------------------------------- summary


@pytest.mark.parametrize("schedule, costs", [
    ("fill_drain", {"forward_cost": [1 * MS, 2 * MS, 1.5 * MS],
                    "backward_cost": [2 * MS, 4 * MS, 3 * MS]}),
    ("1f1b", {"forward_cost": [1 * MS, 2 * MS, 1.5 * MS],
              "backward_cost": [2 * MS, 4 * MS, 3 * MS]}),
    ("zb_h1", {"forward_cost": [1 * MS, 2 * MS, 1 * MS], "input_cost": [1 * MS, 1 * MS, 3 * MS],
               "weight_cost": [0.5 * MS, 2 * MS, 1 * MS]}),
    ("interleaved_1f1b", {"forward_cost": 1 * MS, "backward_cost": 3 * MS}),
    ("zbv", {"forward_cost": [1 * MS, 2 * MS, 2 * MS, 1 * MS, 1 * MS, 1 * MS],
             "input_cost": 1 * MS, "weight_cost": 1 * MS}),
])
def test_measured_bubble_equals_the_simulators_for_a_simulated_recording(schedule,
                                                                        costs) -> None:
    sim = simulate(schedule, 3, 6, **costs)
    step = summarize(from_simulation(sim, schedule, start=50.0)).steps[0]
    assert step.span == pytest.approx(sim.makespan)
    assert step.bubble == pytest.approx(sim.bubble_fraction)
    # The replay with the median measured costs is the same plan.
    assert step.predicted is not None
    assert step.predicted.makespan == pytest.approx(sim.makespan)
    assert step.predicted.bubble_fraction == pytest.approx(sim.bubble_fraction)
    # Busy per simulated rank: the sum over its stages' rows.
    busy = [0.0] * sim.num_ranks
    for t in step.stages:
        busy[sim.placement.rank_of(t.stage)] += t.busy
    assert busy == pytest.approx(sim.busy_time)


def test_busy_comm_waiting_idle_add_up_to_the_step_span() -> None:
    rec = _hand_made()
    step = summarize(rec).steps[0]
    assert step.span == pytest.approx(102 * MS)
    for t in step.stages:
        assert t.span == pytest.approx(step.span)
    s0, s1, s2 = step.stages
    assert (s0.busy, s0.comm, s0.waiting) == pytest.approx((30 * MS, 1 * MS, 71 * MS))
    assert (s1.busy, s1.waiting, s1.idle) == pytest.approx((30 * MS, 50 * MS, 22 * MS))
    assert (s2.busy, s2.waiting, s2.idle) == pytest.approx((32 * MS, 24 * MS, 46 * MS))
    # Three devices, 92 ms busy out of 3 * 102 ms.
    assert step.bubble == pytest.approx(1 - 92 / 306)


def test_overlapping_intervals_count_once_busy_first() -> None:
    # A wait recorded across a forward, and a recomputation inside the backward.
    ev = [Event(WAIT, 0, 0.0, 6 * MS, 0, peer=1, what="gradient"),
          Event(F, 0, 2 * MS, 4 * MS, 0),
          Event(B, 0, 6 * MS, 10 * MS, 0),
          Event(EventKind.RECOMPUTE, 0, 6 * MS, 8 * MS, 0)]
    step = summarize(Recording(ev, [_step(0, 0.0, 10 * MS, 1, 1)])).steps[0]
    t = step.stages[0]
    assert (t.busy, t.waiting, t.idle) == pytest.approx((6 * MS, 4 * MS, 0.0))
    # The recomputation ran inside B: B's cost is its own duration, not 6 ms.
    assert step.costs["B"] == pytest.approx([4 * MS])


def test_costs_are_per_stage_medians_with_loss_and_recompute_where_they_ran() -> None:
    ev = [Event(F, 0, 0 * MS, 1 * MS, 0), Event(F, 0, 1 * MS, 2 * MS, 1),
          Event(F, 0, 2 * MS, 9 * MS, 2),                              # one slow outlier
          Event(F, 1, 9 * MS, 11 * MS, 0), Event(LOSS, 1, 11 * MS, 12 * MS, 0),
          Event(F, 1, 12 * MS, 14 * MS, 1), Event(LOSS, 1, 14 * MS, 15 * MS, 1),
          Event(F, 1, 15 * MS, 17 * MS, 2), Event(LOSS, 1, 17 * MS, 18 * MS, 2),
          Event(EventKind.RECOMPUTE, 1, 18 * MS, 19 * MS, 0), Event(I, 1, 19 * MS, 21 * MS, 0),
          Event(W, 1, 21 * MS, 22 * MS, 0), Event(I, 0, 22 * MS, 24 * MS, 0),
          Event(W, 0, 24 * MS, 27 * MS, 0)]
    rec = Recording(ev, [_step(0, 0.0, 27 * MS, 2, 3)])
    costs = summarize(rec).steps[0].costs
    assert costs["F"] == pytest.approx([1 * MS, 3 * MS])    # median; loss joins F
    assert costs["I"] == pytest.approx([2 * MS, 3 * MS])    # recompute joins I
    assert costs["W"] == pytest.approx([3 * MS, 1 * MS])
    assert "B" not in costs


def test_the_biggest_wait_is_named() -> None:
    summary = summarize(_hand_made())
    wait = summary.biggest_wait
    assert wait is not None and (wait.stage, wait.peer) == (0, 1)   # 71 ms on stage 0
    assert describe_wait(wait) == \
        "stage 0 waited 71.0 ms for gradients of micro-batch 0 from stage 1"
    # Without stage 0's long wait, stage 1's 38 ms for stage 2's gradient is the biggest.
    rec = _hand_made()
    rec = Recording([e for e in rec.events if not (e.stage == 0 and e.kind is WAIT)],
                    rec.steps)
    summary = summarize(rec)
    assert describe_wait(summary.biggest_wait) == \
        "stage 1 waited 38.0 ms for gradients of micro-batch 0 from stage 2"
    assert "biggest wait: stage 1 waited 38.0 ms" in str(summary)
    assert "biggest wait: stage 1 waited 38.0 ms" in summary.oneline()


def test_a_wait_for_data_is_named_before_a_longer_wait_to_close_the_step() -> None:
    """Waiting for the end of the step only says another stage was still working; the
    longest data wait says which message held a stage up. Control waits count only when
    no data wait was recorded."""
    data = Event(WAIT, 1, 0.0, 2 * MS, 0, peer=0, what="activation")
    closing = Event(WAIT, 0, 3 * MS, 9 * MS, None, peer=1, what="end of the step")
    work = [Event(F, 0, 0.0, 3 * MS, 0), Event(F, 1, 2 * MS, 9 * MS, 0)]
    summary = summarize(Recording([data, closing, *work], [_step(0, 0.0, 9 * MS, 2, 1)]))
    assert summary.biggest_wait == data
    alone = summarize(Recording([closing, *work], [_step(0, 0.0, 9 * MS, 2, 1)]))
    assert alone.biggest_wait == closing
    assert describe_wait(closing) == "stage 0 waited 6.00 ms for the end of the step from stage 1"


def test_a_stage_on_two_ranks_names_the_rank() -> None:
    ev = [Event(WAIT, 1, 0.0, 5 * MS, 2, rank=3, peer=0, what="activation"),
          Event(F, 1, 5 * MS, 6 * MS, 2, rank=3), Event(F, 1, 0.0, 1 * MS, 2, rank=1)]
    summary = summarize(Recording(ev, [_step(0, 0.0, 6 * MS, 2, 3)]))
    assert summary.oneline().endswith(
        "stage 1 on rank 3 waited 5.00 ms for activations of micro-batch 2 from stage 0")


def test_several_steps_and_their_totals() -> None:
    first, second = _simulated(start=10.0, step=0), _simulated(start=11.0, step=1, m=8)
    rec = Recording(first.events + second.events, first.steps + second.steps)
    summary = summarize(rec)
    a, b = (summarize(first).steps[0], summarize(second).steps[0])
    assert [s.index for s in summary.steps] == [0, 1]
    assert summary.span == pytest.approx(a.span + b.span)
    for total, x, y in zip(summary.stages, a.stages, b.stages):
        assert total.busy == pytest.approx(x.busy + y.busy)
        assert total.span == pytest.approx(summary.span)
    busy = a.device_busy + b.device_busy
    assert summary.bubble == pytest.approx(1 - busy / (3 * (a.span + b.span)))
    assert summary.predicted_span == pytest.approx(a.span + b.span)
    assert summary.predicted_bubble == pytest.approx(summary.bubble)
    text = str(summary)
    assert text.startswith("2 steps recorded (1f1b)")
    assert "step 0 (1f1b, 4 micro-batches)" in text and "step 1 (1f1b, 8 micro-batches)" in text
    assert "\n" not in summary.oneline()
    assert summary.oneline().startswith(f"trace: 2 steps, {(a.span + b.span) / 2 * 1e3:.1f} ms")


def test_no_prediction_when_a_stage_has_no_measurement() -> None:
    rec = _hand_made()
    rec = Recording([e for e in rec.events if e.name != "B0" or e.stage != 1], rec.steps)
    summary = summarize(rec)
    assert summary.steps[0].predicted is None
    assert summary.predicted_span is None and summary.predicted_bubble is None
    assert "no simulation: stage 1 has no measured backward" in str(summary)
    uncounted = Recording(_hand_made().events, [_step(0, 0.0, 102 * MS, 3, 0)])
    assert "no simulation: its step record counts 0 micro-batches" in str(summarize(uncounted))


def test_empty_or_inconsistent_recordings_are_refused() -> None:
    for reader in (summarize, chrome_events, render_svg):
        with pytest.raises(ValueError, match="the recording holds no events"):
            reader(Recording())
    orphan = Recording([Event(F, 0, 0.0, 1.0, 0, step=4)], [_step(0, 0.0, 1.0, 1, 1)])
    with pytest.raises(ValueError, match="belongs to step 4, but the recording has no step"):
        summarize(orphan)


# ---------------------------------------------------------------- from_simulation


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_simulated_recording_holds_every_action_once_and_waits_for_peers(schedule) -> None:
    sim = simulate(schedule, 2, 4)
    rec = from_simulation(sim, schedule, start=3.0)
    actions = [e for e in rec.events if e.kind is not WAIT]
    planned = sorted((str(a.phase.letter), a.microbatch,
                      r if a.stage is None else a.stage, start + 3.0)
                     for r, row in enumerate(sim.timeline) for start, _, a in row)
    got = sorted((e.kind.value, e.microbatch, e.stage, e.start) for e in actions)
    assert [g[:3] for g in got] == [p[:3] for p in planned]
    assert all(math.isclose(g[3], p[3]) for g, p in zip(got, planned))
    starts = {(e.stage, e.microbatch, e.start) for e in actions}
    for wait in (e for e in rec.events if e.kind is WAIT):
        # A wait ends when the action it waited for starts, on another rank's stage.
        assert (wait.stage, wait.microbatch, wait.end) in starts
        assert sim.placement.rank_of(wait.peer) != sim.placement.rank_of(wait.stage)
    assert rec.steps[0].end - rec.steps[0].start == pytest.approx(sim.makespan)


def test_one_step_prints_as_that_step_and_waits_read_as_sentences() -> None:
    summary = summarize(_hand_made())
    text = str(summary)
    assert text == str(summary.steps[0])
    assert text.startswith("step 0 (fill_drain, 1 micro-batch): 102 ms, bubble 69.9 %")
    assert "median cost per action, stage 0 / 1 / ...: F 10.0 ms / 10.0 ms / 12.0 ms" in text
    start = Event(WAIT, 1, 0.0, 5 * MS, None, peer=0, what="start of the step")
    assert describe_wait(start) == "stage 1 waited 5.00 ms for the start of the step from stage 0"
    skip = Event(WAIT, 2, 0.0, 0.25, 3, peer=0, what="skip tensor")
    assert describe_wait(skip) == "stage 2 waited 250 ms for skip tensors of micro-batch 3 " \
        "from stage 0"


def test_schedule_objects_are_named_by_their_built_in_name() -> None:
    from seqpipe.schedule import Interleaved1F1B, OneFOneB

    rec = from_simulation(simulate(OneFOneB(), 2, 4), OneFOneB())
    assert summarize(rec).steps[0].schedule == "1f1b"
    rec = from_simulation(simulate(Interleaved1F1B(3), 2, 4), Interleaved1F1B(3))
    step = summarize(rec).steps[0]
    assert step.schedule == "Interleaved1F1B(stages_per_rank=3)"
    assert step.predicted is not None and len(step.stages) == 6
