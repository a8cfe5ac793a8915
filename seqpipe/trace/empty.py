"""The one error every reader of a recording raises when there is nothing to read."""
from __future__ import annotations

from seqpipe.trace.events import Recording

__all__ = ["require_events"]


def require_events(recording: Recording, doing: str) -> None:
    """Raise ``ValueError`` if ``recording`` has no events; ``doing`` says what needed them."""
    if not recording.events:
        raise ValueError(f"the recording holds no events, so there is nothing to {doing}: "
                         "run at least one training step inside "
                         "`with seqpipe.trace.record() as rec:` first")
