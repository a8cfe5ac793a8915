"""Skip connections between non-adjacent layers of an ``nn.Sequential``.

A layer decorated with :func:`skippable` yields ``stash(name, tensor)`` to hand a tensor to a
later layer, which yields ``pop(name)`` to receive it. :func:`verify_skippables` checks the
declarations statically, and :func:`inspect_skip_layout` tells the pipeline engines which
partition stashes and which pops every skip. See ``docs/skip.md``.
"""
from __future__ import annotations

from seqpipe.skip.layout import Skip, SkipLayout, inspect_skip_layout
from seqpipe.skip.namespace import DEFAULT_NAMESPACE, Namespace
from seqpipe.skip.ops import Pop, Stash, pop, stash
from seqpipe.skip.skippable import SkipSite, is_skippable, iter_pops, iter_stashes, skippable
from seqpipe.skip.tracker import SkipTracker, current_skip_tracker, use_skip_tracker
from seqpipe.skip.verify import verify_skippables

__all__ = [
    "DEFAULT_NAMESPACE",
    "Namespace",
    "Pop",
    "Skip",
    "SkipLayout",
    "SkipSite",
    "SkipTracker",
    "Stash",
    "current_skip_tracker",
    "inspect_skip_layout",
    "is_skippable",
    "iter_pops",
    "iter_stashes",
    "pop",
    "skippable",
    "stash",
    "use_skip_tracker",
    "verify_skippables",
]
