"""``torch.jit.trace(pipe, x)`` and ``torch.export.export(pipe, (x,))``: refused, by name.

Both record the operations a call runs on the calling thread, under a tracing state or
mode of that thread; a ``Pipe`` runs its stages on worker threads and joins them to the
caller's graph through autograd Functions, so neither can record it. Unrefused, the
tracer failed on a private tensor of the engine ("Cannot insert a Tensor that requires
grad as a constant") and export on a data-dependent guard deep in the engine. The mend is
to trace or export the unwrapped model (the same layers: ``nn.Sequential(*pipe)``).
``torch.compile(pipe)`` is not refused: it runs the pipe uncompiled, with a warning
(``Pipe.forward``).

``torch.func``'s transforms (``vmap``, ``grad``, ``jacrev``, ... over the pipe, or over
``functional_call(pipe, ...)``) are refused the same way: they too wrap the calling
thread's tensors, and the engine's autograd Functions (which define no ``setup_context``)
failed with torch's "In order to use an autograd.Function with functorch transforms ...
it must override the setup_context staticmethod", which names neither seqpipe nor a mend.
"""
from __future__ import annotations

import torch

__all__ = ["UNTRACEABLE", "refuse_tracing"]

UNTRACEABLE = ("{tool} cannot record a Pipe: its stages run on worker threads, outside the "
               "tracer. {mend}")


def refuse_tracing(compiling: bool) -> None:
    """Raise ``RuntimeError`` inside ``torch.jit.trace``, ``torch.export`` or a ``torch.func``
    transform; ``compiling``: ``torch.compiler.is_compiling()`` (export is looked for only
    then)."""
    if torch._C._get_tracing_state() is not None:
        raise RuntimeError(UNTRACEABLE.format(
            tool="torch.jit.trace", mend="Trace the unwrapped model instead "
            "(nn.Sequential(*pipe), the same layers)"))
    if _functorch_level() is not None:
        raise RuntimeError(UNTRACEABLE.format(
            tool="torch.func's transforms (vmap, grad, jacrev, ...)", mend="Apply them to the "
            "unwrapped model instead (torch.func.functional_call(nn.Sequential(*pipe), "
            "params, x), the same layers)"))
    if compiling and torch.compiler.is_exporting():
        raise RuntimeError(UNTRACEABLE.format(
            tool="torch.export", mend="Export the unwrapped model instead "
            "(nn.Sequential(*pipe), the same layers)"))


# the innermost torch.func transform's level on this thread, None outside any
_functorch_level = torch._C._functorch.maybe_current_level
