"""Where skip tensors live between the layer that stashes them and the one that pops them.

A skippable layer never stores a skip tensor itself: it hands it to the *current skip
tracker*. Outside a pipeline that is a plain per-thread dictionary, so a skippable model
runs unchanged in an ordinary ``nn.Sequential``. Inside a pipeline the engine installs a
tracker of its own for every (stage, micro-batch) task, which routes a skip tensor to the
stage that pops it.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Dict, FrozenSet, Iterator, Optional, Set, Tuple

from torch import Tensor

from seqpipe.core.flags import is_checkpointing, is_recomputing
from seqpipe.skip.namespace import Namespace

__all__ = ["SkipKey", "SkipTracker", "StageSkipTracker", "current_skip_tracker",
           "swap_skip_tracker", "use_skip_tracker"]

SkipKey = Tuple[Namespace, str]


class SkipTracker:
    """Holds stashed skip tensors until they are popped.

    The base tracker is a dictionary keyed by ``(namespace, name)``; the pipeline engine
    subclasses it. ``stash`` may receive ``None`` (a skip that carries nothing).
    """

    def __init__(self) -> None:
        self.tensors: Dict[SkipKey, Optional[Tensor]] = {}
        self.restashed: Set[SkipKey] = set()  # stashed again before being popped

    def stash(self, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        """Keep ``tensor`` under ``(ns, name)`` until a later layer pops it."""
        if (ns, name) in self.tensors:
            self.restashed.add((ns, name))
        self.tensors[(ns, name)] = tensor

    def pop(self, ns: Namespace, name: str) -> Optional[Tensor]:
        """Return the tensor stashed under ``(ns, name)`` and forget it."""
        try:
            return self.tensors.pop((ns, name))
        except KeyError:
            if (ns, name) in self.restashed:
                raise RuntimeError(
                    f"skip '{name}' is stashed by more than one layer (a second stash "
                    f"replaced the first before it was popped), so this pop finds nothing "
                    f"left; give each repeated block its own namespace with "
                    f"layer.isolate(Namespace()), and run seqpipe.skip.verify_skippables("
                    f"model) to list the layers") from None
            raise RuntimeError(
                f"skip '{name}' was popped before it was stashed; a layer that stashes "
                f"'{name}' must run before the layer that pops it") from None


_local = threading.local()


def current_skip_tracker() -> SkipTracker:
    """The tracker skippable layers talk to in this thread."""
    tracker = getattr(_local, "tracker", None)
    if tracker is None:
        tracker = _local.tracker = SkipTracker()
    return tracker


@contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Iterator[None]:
    """Make ``tracker`` the current one in this thread for the duration of the block."""
    previous = swap_skip_tracker(tracker)
    try:
        yield
    finally:
        swap_skip_tracker(previous)


def swap_skip_tracker(tracker: Optional[SkipTracker]) -> Optional[SkipTracker]:
    """Make ``tracker`` the current one in this thread (``None``: the thread's own, made
    afresh when next asked for); return the one it replaces, to swap back in a
    ``finally``. ``use_skip_tracker`` without a generator's cost, for the engines' calls
    of every layer run."""
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    return previous


class StageSkipTracker(SkipTracker):
    """The tracker of one (stage, micro-batch) task inside a pipeline.

    A skip whose pop sits in the same partition stays in the local dictionary. A skip
    that leaves the partition is collected in ``outgoing`` for the engine to send
    straight to the popping partition; one that arrives from another partition is read
    from ``received``. During a checkpoint's recomputation, outgoing stashes are ignored
    (they were sent already) and received skips are handed out again — as copies while
    checkpointing, so an in-place change in the first run cannot leak into the second.
    """

    def __init__(self, crossing: Callable[[SkipKey], bool],
                 received: Dict[SkipKey, Optional[Tensor]]) -> None:
        super().__init__()
        self.crossing = crossing
        self.received = received
        self.outgoing: Dict[SkipKey, Optional[Tensor]] = {}
        # A split backward's recomputation (seqpipe.core.stage) replaces the first run's graph:
        # it keeps its outgoing stashes, whose gradients flow through the new graph.
        self.replaying = False
        # Local skips whose stash and pop lie in two checkpointed segments of the partition
        # (seqpipe.core.segments): ``kept`` holds each from its stash until the task is done, for
        # the popping segment's recomputation, which runs before (and without) the stash's.
        self.between: FrozenSet[SkipKey] = frozenset()
        self.kept: Dict[SkipKey, Optional[Tensor]] = {}

    def stash(self, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        if (ns, name) in self.between:
            if not is_recomputing():
                self.kept[(ns, name)] = tensor
        elif not self.crossing((ns, name)):
            super().stash(ns, name, tensor)
        elif not is_recomputing() or self.replaying:
            self.outgoing[(ns, name)] = tensor

    def pop(self, ns: Namespace, name: str) -> Optional[Tensor]:
        if (ns, name) in self.kept:
            tensor = self.kept[(ns, name)]  # popped again by the recomputation: a copy
            return None if tensor is None else tensor.clone()
        if not self.crossing((ns, name)):
            return super().pop(ns, name)
        tensor = self.received[(ns, name)]
        if tensor is not None and (is_checkpointing() or is_recomputing()):
            # The recomputation pops the same tensor again; a layer that changes it in
            # place must not change what the recomputation sees.
            return tensor.clone()
        return tensor
