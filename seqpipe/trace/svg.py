"""A recording as a Gantt chart in plain SVG: no plotting library needed, opens in any
browser, fits in docs.

One row per stage (per rank and stage when several ranks run), time left to right on a
shared axis. Actions are coloured by phase (``F``, ``B``, ``I``, ``W``, recomputation,
loss); sends and reductions are the thinner boxes at a row's foot; waits for a message are
hatched. Below the measured rows, the simulator's plan for the same schedule with the
measured per-stage median costs (see :mod:`seqpipe.trace.summary`), each step aligned with
the measured one's first action, on the same scale: where the measured step is longer, the
difference is time the plan did not foresee (messages, waits, the engine).
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence, Tuple, Union
from xml.sax.saxutils import escape, quoteattr

from seqpipe.trace.chrome import CATEGORIES
from seqpipe.trace.empty import require_events
from seqpipe.trace.events import Event, EventKind, Recording
from seqpipe.trace.simulated import from_simulation
from seqpipe.trace.summary import (
    Summary,
    format_count,
    format_share,
    format_time,
    summarize,
)

__all__ = ["COLOURS", "render_svg", "write_svg"]

COLOURS = {EventKind.FORWARD: "#4e79a7", EventKind.BACKWARD: "#e15759",
           EventKind.INPUT_GRAD: "#f28e2b", EventKind.WEIGHT_GRAD: "#59a14f",
           EventKind.RECOMPUTE: "#b07aa1", EventKind.LOSS: "#edc948",
           EventKind.SEND: "#76b7b2", EventKind.REDUCE: "#9c755f",
           EventKind.WAIT: "url(#wait)"}
"""The fill of each event kind (waits: the hatch pattern)."""

_DARK_TEXT = {EventKind.LOSS, EventKind.SEND}
_LEFT, _WIDTH, _RIGHT = 130.0, 1000.0, 20.0
_ROW, _GAP, _HEAD, _CHAR = 22.0, 4.0, 26.0, 6.2
_DEFS = ('<defs><pattern id="wait" patternUnits="userSpaceOnUse" width="6" height="6" '
         'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f2f2f2"/>'
         '<line x1="0" y1="0" x2="0" y2="6" stroke="#8c8c8c" stroke-width="2"/></pattern>'
         '</defs>')


class _Scale:
    """Seconds to x pixels over ``[t0, t1]``."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0 = t0
        self.per_second = _WIDTH / (t1 - t0) if t1 > t0 else 0.0

    def x(self, t: float) -> float:
        return _LEFT + (t - self.t0) * self.per_second

    def width(self, seconds: float) -> float:
        return seconds * self.per_second


def render_svg(recording: Recording, *, simulated: bool = True,
               step: Optional[int] = None) -> str:
    """The chart as SVG text: the measured steps (or only ``step``), then, with
    ``simulated``, the simulator's plan for each. Raises ``ValueError`` without events."""
    require_events(recording, "draw")
    measured = _only_step(recording, step)
    summary = summarize(measured)
    plan, notes = _plan(measured, summary) if simulated else (None, [])
    everything = measured.events + (plan.events if plan else [])
    scale = _Scale(min(e.start for e in everything), max(e.end for e in everything))
    body: List[str] = []
    top = 34.0
    y = _section(body, "measured", _measured_title(summary), measured, scale, top)
    if simulated:
        y = _section(body, "simulated", _plan_title(summary, notes), plan, scale, y)
    body.insert(0, _grid(scale, top, y))
    y = _axis(body, scale, y)
    kinds = {e.kind for e in everything}
    y = _legend(body, [k for k in COLOURS if k in kinds], y)
    width = _LEFT + _WIDTH + _RIGHT
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y:.0f}" '
            f'viewBox="0 0 {width:.0f} {y:.0f}" font-family="sans-serif" font-size="11">')
    title = _text(_LEFT, 20, _title(summary), size=14, weight="bold")
    return "\n".join(['<?xml version="1.0" encoding="UTF-8"?>', head, _DEFS,
                      f'<rect width="{width:.0f}" height="{y:.0f}" fill="white"/>', title]
                     + body + ["</svg>", ""])


def write_svg(recording: Recording, path: Union[str, os.PathLike], *,
              simulated: bool = True, step: Optional[int] = None) -> None:
    """Write :func:`render_svg` to ``path`` (UTF-8)."""
    text = render_svg(recording, simulated=simulated, step=step)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _only_step(recording: Recording, step: Optional[int]) -> Recording:
    if step is None:
        return recording
    events = [e for e in recording.events if e.step == step]
    if not events:
        recorded = sorted({e.step for e in recording.events})
        raise ValueError(f"step {step} has no events; the recording has steps {recorded}")
    return Recording(events, [s for s in recording.steps if s.index == step])


def _plan(measured: Recording, summary: Summary) -> Tuple[Recording, List[str]]:
    """Each step's simulation as a recording, starting where the measured step's first
    action did; and why a step has none."""
    plan = Recording()
    notes: List[str] = []
    records = {r.index: r for r in measured.steps}
    for step in summary.steps:
        if step.predicted is None:
            notes.append(f"step {step.index}: {step.note}")
            continue
        first = min((e.start for e in measured.events
                     if e.step == step.index and e.kind.is_compute),
                    default=records[step.index].start)
        part = from_simulation(step.predicted, records[step.index].schedule, start=first,
                               step=step.index)
        plan.events += part.events
        plan.steps += part.steps
    plan.finish()
    return plan, notes


def _title(summary: Summary) -> str:
    shapes = sorted({f"{s.schedule}, {format_count(s.num_microbatches, 'micro-batch')}"
                     for s in summary.steps})
    stages = len({t.stage for t in summary.stages})
    return f"seqpipe pipeline trace: {'; '.join(shapes)}, {format_count(stages, 'stage')}"


def _measured_title(summary: Summary) -> str:
    n = len(summary.steps)
    return (f"measured ({format_count(n, 'step')}): {format_time(summary.span / n)} "
            f"per step, bubble {format_share(summary.bubble)}")


def _plan_title(summary: Summary, notes: Sequence[str]) -> str:
    span, bubble = summary.predicted_span, summary.predicted_bubble
    text = "simulated: same schedule, measured median costs"
    if span is not None and bubble is not None:
        text += (f": {format_time(span / len(summary.steps))} per step, "
                 f"bubble {format_share(bubble)}")
    return text + "".join(f"; no simulation for {note}" for note in notes)


def _section(out: List[str], name: str, title: str, recording: Optional[Recording],
             scale: _Scale, y: float) -> float:
    """One titled block of rows; returns the y below it."""
    out.append(f'<g class="section" id="{name}">')
    out.append(_text(_LEFT, y + 16, title, weight="bold"))
    y += _HEAD
    tracks = recording.stages() if recording is not None else []
    multi = len({r for r, _ in tracks}) > 1 and any(r != s for r, s in tracks)
    by_track: Dict[Tuple[int, int], List[Event]] = {t: [] for t in tracks}
    for e in recording.events if recording is not None else []:
        by_track[(e.rank, e.stage)].append(e)
    for rank, stage in tracks:
        label = f"rank {rank} · stage {stage}" if multi else f"stage {stage}"
        out.append(_row(rank, stage, label, by_track[(rank, stage)], scale, y))
        y += _ROW + _GAP
    out.append("</g>")
    return y + _GAP


def _row(rank: int, stage: int, label: str, events: Sequence[Event], scale: _Scale,
         y: float) -> str:
    """A row: its label and band; waits, actions, recomputations and sends, each layer on
    top of the one before; then the actions' names on top of every box."""
    parts = [f'<g class="row" data-rank="{rank}" data-stage="{stage}">',
             _text(_LEFT - 8, y + _ROW / 2 + 4, label, anchor="end"),
             f'<rect x="{_LEFT}" y="{y:.1f}" width="{_WIDTH}" height="{_ROW}" '
             'fill="#fafafa" stroke="#e0e0e0"/>']
    order = sorted(events, key=lambda e: _LAYER.get(e.kind, 1))
    parts += [_box(e, scale, y) for e in order]
    parts += [_label(e, scale, y) for e in order if _LAYER.get(e.kind, 1) == 1]
    parts.append("</g>")
    return "\n".join(p for p in parts if p)


_LAYER = {EventKind.WAIT: 0, EventKind.RECOMPUTE: 2, EventKind.SEND: 3, EventKind.REDUCE: 3}
"""Drawing order in a row (default 1: the actions). A recomputation lies inside the
backward it serves: it is a band across the top of that box, below the box's name."""


def _box(event: Event, scale: _Scale, y: float) -> str:
    """One event's rectangle, with a tooltip: a band at the row's foot for a send or a
    reduction, at its top for a recomputation, else the row's height."""
    if event.kind in (EventKind.SEND, EventKind.REDUCE):
        top, height = y + _ROW * 0.6, _ROW * 0.4
    elif event.kind is EventKind.RECOMPUTE:
        top, height = y + 1, _ROW * 0.3
    else:
        top, height = y + 1, _ROW - 2
    x, w = scale.x(event.start), max(scale.width(event.duration), 0.5)
    tip = f"{event.name} (stage {event.stage}, step {event.step}): " \
          f"{format_time(event.duration)}"
    return (f'<rect class="{CATEGORIES[event.kind].replace(" ", "-")}" x="{x:.2f}" '
            f'y="{top:.1f}" width="{w:.2f}" height="{height:.1f}" '
            f'fill="{COLOURS[event.kind]}"><title>{escape(tip)}</title></rect>')


def _label(event: Event, scale: _Scale, y: float) -> str:
    """An action's name, centred on its box when the box is wide enough, else nothing."""
    x, w = scale.x(event.start), scale.width(event.duration)
    if w < _CHAR * len(event.name) + 4:
        return ""
    colour = "#222" if event.kind in _DARK_TEXT else "white"
    return _text(x + w / 2, y + _ROW / 2 + 5, event.name, anchor="middle", fill=colour,
                 size=10)


def _grid(scale: _Scale, top: float, bottom: float) -> str:
    lines = [f'<line x1="{scale.x(t):.2f}" y1="{top:.1f}" x2="{scale.x(t):.2f}" '
             f'y2="{bottom:.1f}" stroke="#ececec"/>' for t in _ticks(scale)]
    return '<g class="grid">' + "".join(lines) + "</g>"


def _axis(out: List[str], scale: _Scale, y: float) -> float:
    """The time axis: a line, ticks and their labels in ms from the first event."""
    out.append('<g class="axis">')
    out.append(f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{_LEFT + _WIDTH}" y2="{y:.1f}" '
               'stroke="#444"/>')
    for t in _ticks(scale):
        x = scale.x(t)
        out.append(f'<line x1="{x:.2f}" y1="{y:.1f}" x2="{x:.2f}" y2="{y + 5:.1f}" '
                   'stroke="#444"/>')
        out.append(_text(x, y + 17, format_time(t - scale.t0), anchor="middle", size=10))
    # Right-aligned left of the first tick's label, which is centred on the axis's start.
    first = format_time(0.0)
    out.append(_text(_LEFT - _label_width(first, 10) / 2 - 8, y + 17, "time", anchor="end",
                     size=10))
    out.append("</g>")
    return y + 30


def _ticks(scale: _Scale) -> List[float]:
    """Round instants (1, 2 or 5 times a power of ten) about 8 to the axis."""
    if scale.per_second <= 0:
        return [scale.t0]
    span = _WIDTH / scale.per_second
    raw = span / 8
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw * (1 - 1e-9))
    return [scale.t0 + i * step for i in range(int(span / step + 1e-9) + 1)]


def _legend(out: List[str], kinds: Sequence[EventKind], y: float) -> float:
    out.append('<g class="legend">')
    x = _LEFT
    for kind in kinds:
        word = CATEGORIES[kind]
        out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="14" height="12" '
                   f'fill="{COLOURS[kind]}" stroke="#888" stroke-width="0.5"/>')
        out.append(_text(x + 19, y + 10, word))
        x += 19 + _CHAR * len(word) + 16
    out.append("</g>")
    return y + 24


def _label_width(text: str, size: int) -> float:
    """About how wide ``text`` is drawn at font ``size`` (a sans-serif average)."""
    return _CHAR * size / 11 * len(text)


def _text(x: float, y: float, text: str, *, anchor: str = "start", fill: str = "#222",
          size: int = 11, weight: str = "normal") -> str:
    return (f'<text x="{x:.2f}" y="{y:.1f}" text-anchor="{anchor}" fill={quoteattr(fill)} '
            f'font-size="{size}" font-weight="{weight}">{escape(text)}</text>')
