"""Measured timelines of real pipeline steps (``seqpipe.trace.record()``), their summary
against the simulator, and writers for Chrome trace JSON and SVG."""
from seqpipe.trace.chrome import chrome_events, write_chrome
from seqpipe.trace.events import Event, EventKind, Recording, StepRecord
from seqpipe.trace.record import Recorder, record
from seqpipe.trace.simulated import from_simulation
from seqpipe.trace.summary import StageTime, StepSummary, Summary, describe_wait, summarize
from seqpipe.trace.svg import render_svg, write_svg

__all__ = [
    "Event",
    "EventKind",
    "Recorder",
    "Recording",
    "StageTime",
    "StepRecord",
    "StepSummary",
    "Summary",
    "chrome_events",
    "describe_wait",
    "from_simulation",
    "record",
    "render_svg",
    "summarize",
    "write_chrome",
    "write_svg",
]
