"""``@skippable``: give a layer of an ``nn.Sequential`` a skip connection to a later layer.

A skippable layer declares the skip names it stashes and pops, and its ``forward`` is a
generator that yields :func:`~seqpipe.skip.stash` / :func:`~seqpipe.skip.pop` requests::

    @skippable(stash=["skip"])
    class Down(nn.Module):
        def forward(self, x):
            yield stash("skip", x)
            return self.lin(x)

How the class keeps its identity
--------------------------------
The decorator **patches the class in place and returns the very same class object**. It
replaces ``forward`` with a driver that runs the user's generator (the original is kept as
``forward.__wrapped__``) and adds four attributes: ``stashable_names``, ``poppable_names``,
``isolate`` and ``namespaced``. Everything else is untouched, so ``type(layer)`` *is* the
user's class: ``isinstance``, ``repr``, ``__name__``/``__qualname__``/``__module__``/
``__doc__``, attribute access, ``state_dict`` keys (no wrapper submodule), pickling by
reference and ``copy.deepcopy`` all behave exactly as for the undecorated class.

We rejected the two alternatives:

* a wrapper module holding the layer as ``self.module`` (torchgpipe's design) changes the
  ``state_dict`` keys and ``repr`` and breaks attribute access;
* returning a *subclass* with the same name keeps the keys, but an explicit
  ``super(Down, self).__init__()`` inside the user's class then resolves ``Down`` to the
  subclass and recurses forever, ``__init_subclass__`` hooks of the user's bases run twice,
  and two different classes share one qualified name.

Namespaces are per instance: :meth:`isolate` stores them in the instance's ``__dict__``
(only non-default ones, so ``DEFAULT_NAMESPACE``, which differs per process, is never
pickled). A subclass of a skippable class inherits its declarations and its driver; a
subclass that overrides ``forward`` with a generator must be decorated itself, listing every
name its ``forward`` stashes or pops.
"""
from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, TypeVar, cast

from torch import nn

from seqpipe.skip.namespace import DEFAULT_NAMESPACE, Namespace
from seqpipe.skip.ops import Pop, Stash
from seqpipe.skip.tracker import current_skip_tracker

__all__ = ["SkipSite", "is_skippable", "iter_pops", "iter_stashes", "skippable"]

ModuleClass = TypeVar("ModuleClass", bound=type)

_MARKER = "_seqpipe_skippable"
"""Class attribute set on every decorated class (and so inherited by its subclasses)."""

_NAMESPACES = "_skip_namespaces"
"""Instance ``__dict__`` key of the ``{name: Namespace}`` table filled by ``isolate``."""

_ADDED_ATTRS = ("stashable_names", "poppable_names", "isolate", "namespaced")


# --------------------------------------------------------------------------- decorator


def skippable(
    stash: Iterable[str] = (), pop: Iterable[str] = ()
) -> Callable[[ModuleClass], ModuleClass]:
    """Class decorator declaring the skip names an ``nn.Module`` subclass stashes and pops.

    Returns the same class, patched in place (see the module docstring).
    """
    return decorator(stash, pop, require_forward=True)


def decorator(stash: Iterable[str], pop: Iterable[str], *,
              require_forward: bool) -> Callable[[ModuleClass], ModuleClass]:
    """``skippable(stash, pop)``; without ``require_forward``, a class with no ``forward``
    is accepted (calling it raises ``nn.Module``'s own error), as the peers allowed."""
    stashable = _name_set(stash, "stash")
    poppable = _name_set(pop, "pop")

    def decorate(cls: ModuleClass) -> ModuleClass:
        _check_decoratable(cls, require_forward)
        added = {"forward": _make_driver(_user_forward(cls)), "stashable_names": stashable,
                 "poppable_names": poppable, "isolate": isolate, "namespaced": namespaced,
                 _MARKER: True}
        for attr, value in added.items():
            setattr(cls, attr, value)
        return cls

    return decorate


def _name_set(names: Any, param: str) -> frozenset[str]:
    """Validate a ``stash=``/``pop=``/``only=`` argument and return it as a frozenset."""
    if isinstance(names, type):
        raise TypeError("use @skippable(stash=[...], pop=[...]) with parentheses")
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(f"{param}= takes a list of skip names such as {param}=['skip'], "
                        f"got {names!r}")
    result = frozenset(names)
    bad = sorted(repr(name) for name in result if not isinstance(name, str))
    if bad:
        raise TypeError(f"skip names must be str; {param}= got {', '.join(bad)}")
    return result


def _check_decoratable(cls: Any, require_forward: bool = True) -> None:
    """Refuse non-modules, modules without a forward, and attribute clashes."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"@skippable decorates nn.Module subclasses, not {cls!r}")
    if require_forward and cls.forward is nn.Module.forward:
        raise TypeError(f"@skippable class {cls.__qualname__} must define forward()")
    for attr in _ADDED_ATTRS:
        owner = next((base for base in cls.__mro__ if attr in base.__dict__), None)
        if owner is not None and not owner.__dict__.get(_MARKER, False):
            raise TypeError(f"@skippable needs the attribute '{attr}', but "
                            f"{owner.__qualname__} already defines it")


def _user_forward(cls: type) -> Callable[..., Any]:
    """The user's forward, unwrapping the driver a skippable base class installed."""
    forward = cast(Any, cls).forward
    return getattr(forward, "__skippable_generator__", forward)


def _make_driver(generator_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A ``forward`` that runs ``generator_fn`` and serves its stash/pop requests."""

    @functools.wraps(generator_fn)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        result = generator_fn(self, *args, **kwargs)
        if not isinstance(result, types.GeneratorType):
            return result  # a plain (non-generator) forward
        return _drive(self, result)

    forward.__skippable_generator__ = generator_fn  # type: ignore[attr-defined]
    return forward


# --------------------------------------------------------------------------- driving


def _drive(layer: nn.Module, gen: types.GeneratorType) -> Any:
    """Run ``gen`` to completion; its ``return`` value is the layer's output.

    A failing request is thrown back into the generator, so the traceback points at the
    user's ``yield`` line.
    """
    try:
        request = gen.send(None)
        while True:
            try:
                response = _serve(layer, request)
            except Exception as exc:  # noqa: BLE001 - re-raised inside the generator
                request = gen.throw(exc)
                continue
            request = gen.send(response)
    except StopIteration as stop:
        return stop.value
    finally:
        gen.close()


def _serve(layer: nn.Module, request: object) -> Any:
    """Carry out one yielded request against the current skip tracker."""
    if isinstance(request, Stash):
        ns = _namespace_for(layer, request.name, "stash")
        current_skip_tracker().stash(ns, request.name, request.tensor)
        return None
    if isinstance(request, Pop):
        ns = _namespace_for(layer, request.name, "pop")
        return current_skip_tracker().pop(ns, request.name)
    raise TypeError(f"{type(layer).__qualname__}.forward yielded a {type(request).__name__}; "
                    "a skippable forward may only yield stash(name, tensor) or pop(name)")


def _namespace_for(layer: nn.Module, name: str, kind: str) -> Namespace:
    """The namespace of a declared name, or a TypeError saying how to declare it."""
    declared = getattr(type(layer), "stashable_names" if kind == "stash" else "poppable_names")
    if name not in declared:
        cls = type(layer).__qualname__
        raise TypeError(f"{cls}.forward yielded {kind}('{name}') but {cls} does not declare "
                        f"'{name}'; add it to @skippable({kind}=[...]) on {cls}")
    return _namespace_table(layer).get(name, DEFAULT_NAMESPACE)


def _namespace_table(layer: nn.Module) -> dict[str, Namespace]:
    return layer.__dict__.get(_NAMESPACES, {})


# --------------------------------------------------------------------------- instance methods


def isolate(self: Any, ns: Namespace, *, only: Iterable[str] | None = None) -> Any:
    """Put this instance's skip names (all, or ``only`` these) into ``ns``; returns self.

    Other instances of the class are unaffected. Returning ``self`` lets it chain inside
    ``nn.Sequential(Down().isolate(ns), ..., Up().isolate(ns))``.
    """
    if not isinstance(ns, Namespace):
        raise TypeError(f"isolate() takes a Namespace, got {type(ns).__name__}")
    declared = type(self).stashable_names | type(self).poppable_names
    names = declared if only is None else _name_set(only, "only")
    unknown = sorted(names - declared)
    if unknown:
        raise ValueError(f"{type(self).__qualname__} declares no skip named "
                         f"{', '.join(map(repr, unknown))}; it declares {sorted(declared)}")
    table = dict(_namespace_table(self))
    for name in names:
        if ns == DEFAULT_NAMESPACE:
            table.pop(name, None)  # never store the per-process default (pickling)
        else:
            table[name] = ns
    self.__dict__[_NAMESPACES] = table
    return self


def namespaced(self: Any, name: str) -> tuple[Namespace, str]:
    """The ``(namespace, name)`` key this instance stashes or pops ``name`` under."""
    if name not in type(self).stashable_names | type(self).poppable_names:
        raise ValueError(f"{type(self).__qualname__} declares no skip named '{name}'")
    return _namespace_table(self).get(name, DEFAULT_NAMESPACE), name


# --------------------------------------------------------------------------- inspection


class SkipSite(NamedTuple):
    """One declared stash or pop of a direct child of an ``nn.Sequential``."""

    index: int  # type: ignore[assignment]  # shadows tuple.index, on purpose: it is the layer
    layer: nn.Module
    ns: Namespace
    name: str


def is_skippable(module: nn.Module) -> bool:
    """Whether ``module``'s class (or a base of it) was decorated with ``@skippable``."""
    return bool(getattr(type(module), _MARKER, False))


def iter_stashes(module: nn.Sequential) -> Iterator[SkipSite]:
    """``(layer_index, layer, ns, name)`` for every stash, by layer index then name."""
    return _sites(_check_sequential(module), "stashable_names")


def iter_pops(module: nn.Sequential) -> Iterator[SkipSite]:
    """``(layer_index, layer, ns, name)`` for every pop, by layer index then name."""
    return _sites(_check_sequential(module), "poppable_names")


def _check_sequential(module: object) -> nn.Sequential:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"expected nn.Sequential, got {type(module).__name__}")
    return module


def _sites(module: nn.Sequential, attr: str) -> Iterator[SkipSite]:
    for index, layer in enumerate(module):
        if is_skippable(layer):
            for name in sorted(getattr(type(layer), attr)):
                yield SkipSite(index, layer, cast(Any, layer).namespaced(name)[0], name)
