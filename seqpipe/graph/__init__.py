"""``seqpipe.graph``: any model, as written, into the ``nn.Sequential`` seqpipe runs.

``to_sequential(model, example_args, example_kwargs)`` traces the model's forward with
``torch.export``, keeps its units (by default its top-level children and the members of
its ``ModuleList`` trunks) as calls of the user's own module objects, cuts the traced
glue between them, and returns one layer per unit, with seqpipe skips for values that
jump ahead. See ``docs/models.md``.

The names are imported lazily: ``seqpipe.graph.origin`` (what the engines read) must not
pull in ``torch.export``.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ConversionError", "ConvertedSequential", "Origin", "default_units", "to_sequential"]

_HOMES = {"ConversionError": "errors", "ConvertedSequential": "convert", "Origin": "origin",
          "default_units": "units", "to_sequential": "convert"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"seqpipe.graph.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'seqpipe.graph' has no attribute {name!r}")
