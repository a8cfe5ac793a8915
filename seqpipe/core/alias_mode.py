"""The alias mode: a partition's layers record their parameters' aliases, not the parameters.

An ``AliasSink`` (``seqpipe.core.sink``) gives each trainable parameter, for one call, a
leaf alias (``make_alias``: same storage and version counter, no copy), so that every
micro-batch's backward accumulates into the aliases and no hook of the real parameters
fires before the sums are handed over once. ``Substitute`` is how autograd gets the
aliases without the layers seeing them.

A sink's layers never see the aliases. Their modules keep their own parameters
(same objects, type, attributes); while a partition runs (its forward, and a checkpoint's
recomputation) a thread-local ``TorchFunctionMode`` substitutes the alias wherever one of
the pipeline's parameters is passed to a torch function or ``Tensor`` method, at the top
level of the arguments, as a keyword, or inside a list or tuple (``torch.cat``, an RNN's
flat weights). A parameter of another partition (reached through a plain attribute)
joins the partition's leaves when first used, so its backward reaches that alias too.
An operation that hands back its argument unchanged (``w.to(w.dtype)``,
``w.contiguous()``) hands back the real parameter again. Reading or writing ``.grad``,
setting ``.data`` or ``requires_grad``, hashing, registering hooks and reading the hook
dictionaries (``_backward_hooks``) go to the real parameter. Where a parameter reaches
autograd without passing through a torch function under the mode (a custom
``autograd.Function.apply``, which PyTorch does not route through ``__torch_function__``),
autograd records the real parameter: the stage's backward lists the real parameters too,
so its gradient still lands, in ``.grad``, once per micro-batch.

Under ``torch.compile`` the substitution is traced, telling parameters apart by type (an
``id`` lookup would make compiled code guard on every activation and recompile per
micro-batch). Outside it, it costs one Python call per torch operation while a partition
runs, hence only for the calls that need it (figures: docs/pipe.md).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["Substitute", "make_alias"]

# What stays with the real parameter: its autograd metadata and identity, not its values.
_KEEP = frozenset({
    Tensor.grad.__get__, Tensor.grad.__set__, Tensor.grad.__delete__,
    Tensor._grad.__get__, Tensor._grad.__set__,
    Tensor.data.__set__, Tensor.requires_grad.__set__, Tensor.requires_grad_,
    Tensor.register_hook, Tensor.register_post_accumulate_grad_hook, Tensor.retain_grad,
    Tensor._backward_hooks.__get__, Tensor._backward_hooks.__set__,
    Tensor._post_accumulate_grad_hooks.__get__, Tensor._post_accumulate_grad_hooks.__set__,
    Tensor.__hash__,
})
_SEQUENCES = (list, tuple)


def _none_in(values: Iterable[Any], aliases: Mapping[int, Tensor]) -> bool:
    """Whether no parameter (and no list or tuple that might hold one) is in ``values``."""
    for value in values:
        if id(value) in aliases or value.__class__ in _SEQUENCES:
            return False
    return True


class Substitute(TorchFunctionMode):
    """Gives autograd the aliases wherever a partition's layers pass a real parameter.

    Runs for every torch operation of a training call, so the common case (no parameter
    among flat arguments, no keywords) takes one membership test per argument. Any of
    the pipeline's parameters is substituted; one of another partition (reached through a
    plain attribute) joins this partition's ``leaves``, so its backward reaches it too.
    """

    def __init__(self, aliases: Dict[int, Tensor], params: Dict[int, nn.Parameter],
                 own: Sequence[nn.Parameter], leaves: List[Tensor]) -> None:
        super().__init__()
        self.aliases = aliases  # id(parameter) -> alias, for the whole pipeline
        self.params = params  # id(alias) -> parameter
        self.own = {id(param) for param in own}  # this partition's parameters...
        self.leaves = leaves  # ... and their aliases

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        aliases = self.aliases
        if torch.compiler.is_compiling():
            return self._traced(func, args, kwargs or {})
        for value in args:
            if id(value) in aliases or value.__class__ in _SEQUENCES:
                break
        else:  # no parameter among the arguments (the common case): nothing to map back
            if not kwargs:
                return func(*args)
            if _none_in(kwargs.values(), aliases):
                return func(*args, **kwargs)
        kwargs = kwargs or {}
        if func in _KEEP:
            return func(*args, **kwargs)
        swap = self._swap
        out = func(*[swap(value) for value in args],
                   **{key: swap(value) for key, value in kwargs.items()})
        return self.params.get(id(out), out)

    def _swap(self, value: Any) -> Any:
        """``value``'s alias if it is a parameter (inside a list or tuple too)."""
        cls = value.__class__
        if cls in _SEQUENCES:
            return cls([self._swap(item) for item in value])
        alias = self.aliases.get(id(value))
        if alias is None:
            return value
        if id(value) not in self.own:
            self._adopt(value, alias)
        return alias

    @torch._disable_dynamo  # torch.compiler.disable, but imports torch._dynamo when called
    def _adopt(self, param: nn.Parameter, alias: Tensor) -> None:
        """Another partition's parameter used here: backpropagate into its alias here too.

        Never traced: a compiled layer runs it eagerly (a graph break, only where a layer
        uses another partition's parameter)."""
        if id(param) not in self.own:
            self.own.add(id(param))
            self.leaves.append(alias)

    def _traced(self, func: Callable[..., Any], args: Sequence[Any],
                kwargs: Dict[str, Any]) -> Any:
        """The substitution as ``torch.compile`` traces it: parameters told apart by
        type, not by looking up every tensor's ``id`` (which would make the compiled
        code guard on the identity of each activation and recompile per micro-batch)."""
        if func in _KEEP:
            return func(*args, **kwargs)
        args = [self._param_swapped(value) for value in args]
        kwargs = {key: self._param_swapped(value) for key, value in kwargs.items()}
        return func(*args, **kwargs)

    def _param_swapped(self, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(self._param_swapped(v) for v in value)
        if not isinstance(value, nn.Parameter) or id(value) not in self.aliases:
            return value
        if id(value) not in self.own:
            self._adopt(value, self.aliases[id(value)])
        return self.aliases[id(value)]


def make_alias(param: nn.Parameter) -> Tensor:
    """A leaf sharing ``param``'s storage and version counter.

    A plain tensor, unless ``param``'s class has its own ``__torch_function__``: then an
    instance of that class sharing ``param``'s attributes, so that its override still
    runs (with the alias) once the mode has substituted it.
    """
    with torch._C.DisableTorchFunctionSubclass():
        data = param.detach()
    if type(param).__torch_function__ is torch._C._disabled_torch_function_impl:
        return data.requires_grad_()
    alias = Tensor._make_subclass(type(param), data, True)
    alias.__dict__ = param.__dict__
    return alias
