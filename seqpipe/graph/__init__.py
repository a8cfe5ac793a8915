"""``seqpipe.graph``: any model, as written, into the ``nn.Sequential`` seqpipe runs.

``to_sequential(model, example_args, example_kwargs)`` traces the model's forward with
``torch.export``, keeps its units (by default its top-level children and the members of
its ``ModuleList`` trunks) as calls of the user's own module objects, cuts the traced
glue between them, and returns one layer per unit, with seqpipe skips for values that
jump ahead. See ``docs/models.md``.
"""
from seqpipe.graph.convert import ConvertedSequential, to_sequential
from seqpipe.graph.errors import ConversionError
from seqpipe.graph.origin import Origin
from seqpipe.graph.units import default_units

__all__ = ["ConversionError", "ConvertedSequential", "Origin", "default_units", "to_sequential"]
