"""The peers' skip API: seqpipe's implementation with their visible details.

``seqpipe.skip`` leaves a decorated class exactly the user's. Code ported from torchgpipe or
torch's ``Pipe`` may rely on three things the peers did differently, which this module
restores for the compat packages only:

* a skippable layer's ``repr`` reads ``@skippable(<the layer's own repr>)``;
* ``@skippable`` accepts a class without ``forward()`` (calling it raises ``nn.Module``'s
  own error), so stub classes can be declared and checked with ``verify_skippables``;
* ``verify_skippables`` reports a layer that declares one name both as stashable and as
  poppable, and its ``TypeError`` starts as theirs did
  (``one or more pairs of stash and pop do not match``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, List, TypeVar

from torch import nn

from seqpipe.skip import is_skippable
from seqpipe.skip.skippable import decorator
from seqpipe.skip.verify import _problems

__all__ = ["skippable", "verify_skippables"]

ModuleClass = TypeVar("ModuleClass", bound=type)


def skippable(stash: Iterable[str] = (),
              pop: Iterable[str] = ()) -> Callable[[ModuleClass], ModuleClass]:
    """``@skippable(stash=[...], pop=[...])`` as the peers had it (see the module docstring)."""
    native = decorator(stash, pop, require_forward=False)

    def decorate(cls: ModuleClass) -> ModuleClass:
        cls = native(cls)
        own_repr = cls.__repr__

        def __repr__(self: nn.Module) -> str:
            return f"@skippable({own_repr(self)})"

        cls.__repr__ = __repr__  # type: ignore[method-assign,assignment]
        return cls

    return decorate


def verify_skippables(module: nn.Sequential) -> None:
    """Raise one ``TypeError`` listing every unmatched stash/pop of ``module``'s children."""
    problems: List[str] = [
        f"'{name}' declared '{skip}' both as stashable and as poppable"
        for name, layer in module.named_children() if is_skippable(layer)
        for skip in sorted(_declared(layer, "stashable_names")
                           & _declared(layer, "poppable_names"))]
    problems += _problems(module)
    if problems:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n"
                        + "\n".join(f"* {problem}" for problem in problems))


def _declared(layer: Any, attr: str) -> frozenset:
    return frozenset(getattr(layer, attr))
