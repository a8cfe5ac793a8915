"""A stand-in for ``torchgpipe``: ``import seqpipe.compat.torchgpipe as torchgpipe``.

Code written for torchgpipe ports by changing its imports — ``torchgpipe`` becomes
``seqpipe.compat.torchgpipe``, submodules included::

    from seqpipe.compat.torchgpipe import GPipe
    from seqpipe.compat.torchgpipe.balance import balance_by_time
    from seqpipe.compat.torchgpipe.skip import Namespace, pop, skippable, stash

``GPipe`` keeps torchgpipe's signature (``balance`` second and positional) and runs on
``seqpipe.Pipe``; the rest is seqpipe's own, re-exported. See ``docs/migration.md`` for what
behaves differently and why.
"""
from __future__ import annotations

from seqpipe import __version__
from seqpipe.compat.torchgpipe import balance, batchnorm, skip
from seqpipe.compat.torchgpipe.gpipe import GPipe
from seqpipe.core.flags import is_checkpointing, is_recomputing

__all__ = ["GPipe", "is_checkpointing", "is_recomputing", "balance", "batchnorm", "skip",
           "__version__"]
