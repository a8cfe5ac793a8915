"""The payload size a receiver posts for a peer's next message, from the previous call.

The transport receives ahead (``seqpipe.distributed.transport``): before a peer sends a
planned message, the receiver posts its header and a payload sized as the same message was
in the previous call, and the sender, keeping the same record, knows that size. A message
whose shape has just changed is no longer trusted to keep it: the next call posts only its
header, so while shapes keep changing (a sequence length that varies every step) each such
message costs one header and one round trip more than the payload, and a stale
payload-sized placeholder is sent only on the first change after a shape held. Once the
same shape comes twice in a row, the payload is received in place again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from seqpipe.distributed.plan import Planned
from seqpipe.distributed.wire import Kind, Spec

__all__ = ["SeenShapes"]

_Key = Tuple[int, Kind, int, int, int]  # peer, and the planned message's identity


@dataclass(frozen=True)
class _Seen:
    """A planned message's payload in the previous call, and whether it is trusted to keep
    it: a shape seen first, or the same twice in a row. Sender and receiver derive both
    from the same payloads, so they agree on what the receiver posts."""

    spec: Spec
    trusted: bool

    def then(self, spec: Spec) -> "_Seen":
        return _Seen(spec, spec == self.spec)


class SeenShapes:
    """The payloads of one direction's planned messages (received, or sent), per peer."""

    def __init__(self) -> None:
        self._seen: Dict[_Key, _Seen] = {}

    def posted(self, peer: int, planned: Optional[Planned]) -> Spec:
        """The payload posted for this planned message: its last one if trusted, else none
        (a header-only receive); none for an unplanned message."""
        record = self._seen.get((peer, *planned.identity)) if planned else None
        return record.spec if record is not None and record.trusted else ()

    def saw(self, peer: int, planned: Planned, spec: Spec) -> None:
        """This call's ``planned`` message to or from ``peer`` carried payload ``spec``."""
        key = (peer, *planned.identity)
        record = self._seen.get(key)
        if record is None or not record.trusted or record.spec != spec:  # (else: as it was)
            self._seen[key] = _Seen(spec, True) if record is None else record.then(spec)
