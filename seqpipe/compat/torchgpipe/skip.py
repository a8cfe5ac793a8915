"""``torchgpipe.skip``: skip connections, seqpipe's implementation under torchgpipe's names.

The API is the same (``@skippable(stash=..., pop=...)``, ``yield stash(name, tensor)``,
``yield pop(name)``, ``Namespace``, ``layer.isolate(ns, only=...)``, ``verify_skippables``).
One thing a user can see differs, for the better: ``@skippable`` returns the user's own class
rather than a wrapper around it, so a layer's attributes are its own (``down.lin``, where
torchgpipe needed ``down.module.lin``) and its ``state_dict`` keys have no ``module.`` level.

As in the original, a skippable layer's ``repr`` reads ``@skippable(...)``, a class
without ``forward()`` may be decorated, and ``verify_skippables`` also reports a layer that
stashes and pops one name (see ``seqpipe.compat._skip``).
"""
from __future__ import annotations

from seqpipe.compat._skip import skippable, verify_skippables
from seqpipe.skip import Namespace, pop, stash

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Namespace"]
