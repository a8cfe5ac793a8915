"""Tensors a partition's layers hold outside registration, and which of them several
partitions use.

A layer may use a tensor it does not register: another layer's ``nn.Parameter`` kept in a
list or dict (``self.refs = [embedding.weight]``: ``nn.Module`` registers a parameter only
when it is assigned to an attribute by itself), one put in ``__dict__``, a module held that
way, or a leaf that is no parameter of the pipe at all (a learned prompt, an adapter beside
a frozen base). ``seqpipe.core.trainable`` lists what partitions *register*; a tensor that
two partitions use, one or both by holding it, is a tie all the same: in the local engine
two stage threads add into its gradient, in whatever order they reach it
(``seqpipe.local.tie_order`` fixes the order for the tensors listed here too).

The scan reads each module's ``__dict__`` (skipping ``nn.Module``'s own bookkeeping:
registered parameters, buffers, submodules, hooks), one level into lists, tuples and dicts
(of at most 256 items), and the parameters of modules found there; a tensor behind another
object or a closure is not seen. It runs at every call of a pipeline with several
partitions (a layer may take a tensor between calls), ~2 µs per module.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from torch import Tensor, nn

__all__ = ["held", "held_ties"]

_BOOKKEEPING = frozenset(vars(nn.Module()))  # _parameters, _buffers, _modules, hooks, ...
_CONTAINERS = (list, tuple)
_PLAIN = frozenset({int, float, bool, str, type(None)})  # hyperparameters: nothing held
_LONGEST = 256  # a longer list (token ids, a vocabulary) is not searched: a call's cost


def held(partition: nn.Module) -> List[Tensor]:
    """The leaf tensors that require grad and that ``partition``'s modules hold outside
    registration (module docstring), each once."""
    found: Dict[int, Tensor] = {}
    modules, seen = [partition], {id(partition)}
    while modules:  # a loop, not ``modules()``' generators: a call's fixed cost
        module = modules.pop()
        values = module.__dict__
        for name in values.keys() - _BOOKKEEPING:  # in C: most modules hold nothing else
            value = values[name]
            cls = value.__class__
            if cls in _PLAIN:
                continue
            if cls is dict:
                value = list(value.values())
            if isinstance(value, _CONTAINERS):
                if len(value) <= _LONGEST:
                    for item in value:
                        _take(item, found)
            else:
                _take(value, found)
        for child in module._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                modules.append(child)
    return list(found.values())


def _take(value: object, found: Dict[int, Tensor]) -> None:
    if isinstance(value, Tensor):
        if value.requires_grad and value.is_leaf:
            found.setdefault(id(value), value)
    elif isinstance(value, nn.Module):
        for param in value.parameters():
            if param.requires_grad:
                found.setdefault(id(param), param)


def held_ties(own: Sequence[Sequence[Tensor]], partitions: Sequence[nn.Module]) -> List[Tensor]:
    """The tensors that two or more of ``partitions`` use, one of them at least by holding
    it (``held``): a partition uses what it registers (``own[p]``, its trainable parameters)
    and what it holds. Ties of registered parameters only are ``trainable.shared``'s."""
    holders = [held(partition) for partition in partitions]
    if not any(holders):
        return []
    users: Dict[int, int] = {}
    for mine, theirs in zip(own, holders):
        for key in {id(t) for t in mine} | {id(t) for t in theirs}:
            users[key] = users.get(key, 0) + 1
    out: Dict[int, Tensor] = {}
    for theirs in holders:
        for tensor in theirs:
            if users[id(tensor)] > 1:
                out.setdefault(id(tensor), tensor)
    return list(out.values())
