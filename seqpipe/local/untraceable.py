"""``torch.jit.trace(pipe, x)`` and ``torch.export.export(pipe, (x,))``: refused, by name.

Both record the operations a call runs on the calling thread, under a tracing state or
mode of that thread; a ``Pipe`` runs its stages on worker threads and joins them to the
caller's graph through autograd Functions, so neither can record it. Unrefused, the
tracer failed on a private tensor of the engine ("Cannot insert a Tensor that requires
grad as a constant") and export on a data-dependent guard deep in the engine. The mend is
to trace or export the unwrapped model (the same layers: ``nn.Sequential(*pipe)``).
``torch.compile(pipe)`` is not refused: it runs the pipe uncompiled, with a warning
(``Pipe.forward``).
"""
from __future__ import annotations

import torch

__all__ = ["UNTRACEABLE", "refuse_tracing"]

UNTRACEABLE = ("{tool} cannot record a Pipe: its stages run on worker threads, outside the "
               "tracer. {mend}")


def refuse_tracing(compiling: bool) -> None:
    """Raise ``RuntimeError`` inside ``torch.jit.trace`` or ``torch.export``; ``compiling``:
    ``torch.compiler.is_compiling()`` (export is looked for only then)."""
    if torch._C._get_tracing_state() is not None:
        raise RuntimeError(UNTRACEABLE.format(
            tool="torch.jit.trace", mend="Trace the unwrapped model instead "
            "(nn.Sequential(*pipe), the same layers)"))
    if compiling and torch.compiler.is_exporting():
        raise RuntimeError(UNTRACEABLE.format(
            tool="torch.export", mend="Export the unwrapped model instead "
            "(nn.Sequential(*pipe), the same layers)"))
