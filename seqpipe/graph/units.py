"""Units: the modules of a model that become the layers of the converted ``nn.Sequential``.

A unit runs as the user's own module object, eagerly: train/eval, BatchNorm, hooks and
parameters stay the user's. Only the code *between* units (the "glue" of the parents'
``forward``) is traced. By default the units are the model's top-level children, and the
children of any ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` found on the way
down (GPT-2: ``transformer.wte, transformer.wpe, transformer.drop, transformer.h.0 ...
transformer.h.N, transformer.ln_f, lm_head``); a child whose own ``forward`` holds further
children is a unit as a whole unless it is such a container, or the user lists finer
units with ``units=``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from torch import nn

from seqpipe.graph.errors import ConversionError

__all__ = ["default_units", "check_units", "CONTAINERS"]

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def default_units(model: nn.Module) -> List[str]:
    """The fully qualified names of the default units of ``model`` (see the module doc).

    A child that holds modules *and* is called as a whole (``transformer``, whose forward
    calls its blocks) is descended into when it has a container child: its containers'
    members and its other children become units, and its own forward is glue.
    """
    found: List[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, CONTAINERS) or _holds_container(child):
                visit(child, path + ".")
            else:
                found.append(path)

    visit(model, "")
    return found


def _holds_container(module: nn.Module) -> bool:
    """A wrapper like GPT-2's ``transformer``: it loops over a ``ModuleList`` (or
    ``ModuleDict``) child, or holds a wrapper that does (BERT's ``bert`` holds ``encoder``,
    which holds the ``ModuleList`` of layers; OPT's ``model`` holds ``decoder``). (A block
    holding a small ``nn.Sequential``, like a ResNet block's downsampling, stays one unit.)"""
    return any(isinstance(child, (nn.ModuleList, nn.ModuleDict)) and len(child) > 0
               or not isinstance(child, CONTAINERS) and _holds_container(child)
               for child in module.children())


def check_units(model: nn.Module, units: Optional[Sequence[str]]) -> Dict[str, nn.Module]:
    """``{name: module}`` for the requested (or default) units, checked: each name must be
    a submodule, none may contain another, and the model itself cannot be one."""
    if units is None:
        names = default_units(model)
    elif isinstance(units, str):
        raise TypeError(f"units= takes a list of module names, e.g. units=[{units!r}], "
                        f"not a string")
    else:
        names = list(units)
    if not names:
        raise ConversionError(
            f"{type(model).__name__} has no submodules to make units of; a pipeline splits a "
            f"model between units (modules), so give it submodules or write the "
            f"nn.Sequential by hand")
    modules = dict(model.named_modules(remove_duplicate=False))
    found: Dict[str, nn.Module] = {}
    for name in names:
        if not isinstance(name, str) or name == "":
            raise ConversionError(f"units= entries are the fully qualified names of "
                                  f"submodules (like 'encoder.layers.0'), got {name!r}")
        if name not in modules:
            close = [n for n in modules if n and n.endswith(name.split(".")[-1])][:3]
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ConversionError(f"units= names {name!r}, which is not a submodule of "
                                  f"{type(model).__name__}{hint}")
        if name in found:
            raise ConversionError(f"units= names {name!r} twice")
        found[name] = modules[name]
    for a in found:
        for b in found:
            if a != b and b.startswith(a + "."):
                raise ConversionError(
                    f"units {a!r} and {b!r} overlap ({b!r} is inside {a!r}); a unit runs "
                    f"as a whole, so list either the parent or its parts")
    return found
