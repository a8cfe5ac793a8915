"""Measured timelines of real pipeline steps (``seqpipe.trace.record()``), their summary
against the simulator, and writers for Chrome trace JSON and SVG."""
from seqpipe.trace.events import Event, EventKind, Recording, StepRecord
from seqpipe.trace.record import Recorder, record

__all__ = ["Event", "EventKind", "Recorder", "Recording", "StepRecord", "record"]
