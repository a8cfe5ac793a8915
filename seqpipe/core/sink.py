"""Where a local pipeline's stage adds up its parameters' gradients over micro-batches.

``Pipe`` must hand autograd each parameter's gradient once per backward, summed over the
micro-batches, so that hooks on the parameters (``DistributedDataParallel``'s reducer, a
user's ``register_hook``) fire once, as for the unpipelined model. A stage therefore
cannot backpropagate into ``.grad``; and asking autograd for each micro-batch's gradients
(``torch.autograd.grad``) before adding them up keeps a whole second set of the stage's
gradients alive at every micro-batch.

A ``GradSink`` avoids both. For one call it gives the pipeline's trainable parameters
leaf aliases (same storage and version counter, no copy); autograd records the aliases
instead of the parameters, so every micro-batch's backward accumulates into the aliases'
``.grad`` in place, layer by layer, as plain autograd accumulates into ``.grad``, and no
hook of the real parameters fires. ``take`` then hands the sums over, once. A parameter
used by two partitions (tied weights, a shared module) has one alias, into which both
stages accumulate.

The layers never see the aliases. Their modules keep their own parameters (same objects,
type, attributes); while a partition runs (its forward, and a checkpoint's recomputation)
a thread-local ``TorchFunctionMode`` substitutes the alias wherever one of the
pipeline's parameters is passed to a torch function or ``Tensor`` method, at the top
level of the arguments, as a keyword, or inside a list or tuple (``torch.cat``, an RNN's
flat weights). A parameter of another partition (reached through a plain attribute)
joins the partition's leaves when first used, so its backward reaches that alias too.
An operation that hands back its argument unchanged (``w.to(w.dtype)``,
``w.contiguous()``) hands back the real parameter again. Reading or writing ``.grad``,
setting ``.data`` or ``requires_grad``, hashing and registering hooks go to the real
parameter. Where a parameter reaches autograd without passing through a torch function
under the mode (a custom ``autograd.Function.apply``, which PyTorch does not route through
``__torch_function__``), autograd records the real parameter: the stage's backward lists
the real parameters too, so its gradient still lands, in ``.grad``, once per micro-batch.

Under ``torch.compile`` the substitution is traced into the compiled graph; there it
tells parameters apart by type rather than by looking up each tensor's ``id`` (which would
make the compiled code guard on every activation's identity and recompile for each
micro-batch). Outside compiled code, it costs one Python call per torch operation while a
partition runs (the backward is not affected): docs/pipe.md gives the measured figures.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["GradSink"]

# What stays with the real parameter: its autograd metadata and identity, not its values.
_KEEP = frozenset({
    Tensor.grad.__get__, Tensor.grad.__set__, Tensor.grad.__delete__,
    Tensor._grad.__get__, Tensor._grad.__set__,
    Tensor.data.__set__, Tensor.requires_grad.__set__, Tensor.requires_grad_,
    Tensor.register_hook, Tensor.register_post_accumulate_grad_hook, Tensor.retain_grad,
    Tensor.__hash__,
})
_SEQUENCES = (list, tuple)


def _none_in(values: Iterable[Any], aliases: Mapping[int, Tensor]) -> bool:
    """Whether no parameter (and no list or tuple that might hold one) is in ``values``."""
    for value in values:
        if id(value) in aliases or value.__class__ in _SEQUENCES:
            return False
    return True


class _Substitute(TorchFunctionMode):
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


def _alias(param: nn.Parameter) -> Tensor:
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


class GradSink:
    """Leaf aliases of the trainable parameters of ``partitions``, for one pipeline call."""

    def __init__(self, partitions: Sequence[nn.Module]) -> None:
        self.params: List[nn.Parameter] = []
        self._aliases: Dict[int, Tensor] = {}  # id(parameter) -> its alias
        self._modes: List[_Substitute] = []
        self._leaves: List[List[Tensor]] = []
        by_alias: Dict[int, nn.Parameter] = {}  # id(alias) -> parameter
        for partition in partitions:
            own = [p for p in partition.parameters() if p.requires_grad]  # tied ones once
            leaves = [self._alias_of(p) for p in own]
            by_alias.update((id(a), p) for p, a in zip(own, leaves))
            self._modes.append(_Substitute(self._aliases, by_alias, own, leaves))
            self._leaves.append(leaves)

    def _alias_of(self, param: nn.Parameter) -> Tensor:
        if id(param) not in self._aliases:
            self._aliases[id(param)] = _alias(param)
            self.params.append(param)
        return self._aliases[id(param)]

    @contextmanager
    def installed(self, stage: int) -> Iterator[None]:
        """Partition ``stage``'s parameters stand for their aliases in autograd, inside the
        block, on this thread."""
        with self._modes[stage]:
            yield

    def call(self, stage: int, partition: nn.Module, *args: Any) -> Any:
        """Run ``partition`` (number ``stage``) on ``args`` recording its parameters' aliases."""
        if not self._aliases:  # nothing trainable: nothing to substitute
            return partition(*args)
        with self._modes[stage]:
            return partition(*args)

    def leaves(self, stage: int) -> List[Tensor]:
        """Partition ``stage``'s aliases, to backpropagate into (``inputs=``); with those of
        other partitions' parameters that its layers used (once its forward ran)."""
        return self._leaves[stage]

    def take(self) -> List[Tuple[nn.Parameter, Tensor]]:
        """Each parameter with its summed gradient, letting go of it here (so autograd can
        adopt the tensor as ``.grad`` instead of copying it)."""
        pairs = []
        for param in self.params:
            alias = self._aliases[id(param)]
            if alias.grad is not None:
                pairs.append((param, alias.grad))
                alias.grad = None
        return pairs
