"""Measured timelines of real pipeline steps (``seqpipe.trace.record()``), their summary
against the simulator, and writers for Chrome trace JSON and SVG."""
from seqpipe.trace.events import Event, EventKind, Recording, StepRecord

__all__ = ["Event", "EventKind", "Recording", "StepRecord"]
