"""Where every skip of a partitioned ``nn.Sequential`` starts and ends.

The pipeline engines route a skip tensor *directly* from the partition whose layer stashes it
to the partition whose layer pops it, never through the partitions in between. To do so each
engine needs, per partition, the skips that leave it and the skips that arrive in it.
:func:`inspect_skip_layout` computes that once from the model's declarations and a
``balance`` (layers per partition) into a :class:`SkipLayout`.

A layout is plain, immutable data: namespaces, names and integers, no tensors or modules.
Every list it returns is ordered by ``(stash layer, name)``, never by namespace: namespace ids
are random per process, while the order must be the same in every process of a distributed
run so that sends and receives pair up. Namespaces still identify skips within a process
(``find(ns, name)``); note that ``DEFAULT_NAMESPACE`` differs between processes, so build
the layout in the process that queries it, and compare layouts across processes with
:meth:`SkipLayout.structure`.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from types import MappingProxyType
from typing import Any

from torch import nn

from seqpipe.core.arguments import layer_counts
from seqpipe.skip.namespace import Namespace
from seqpipe.skip.skippable import iter_pops, iter_stashes
from seqpipe.skip.verify import verify_skippables

__all__ = ["Skip", "SkipLayout", "inspect_skip_layout"]

SkipKey = tuple[Namespace, str]


@dataclass(frozen=True)
class Skip:
    """One skip connection: who stashes it, who pops it, and in which partitions."""

    ns: Namespace
    name: str
    stash_layer: int
    pop_layer: int
    stash_partition: int
    pop_partition: int

    @property
    def key(self) -> SkipKey:
        """``(ns, name)``, the key skip trackers use."""
        return (self.ns, self.name)

    @property
    def crosses(self) -> bool:
        """Whether the tensor must travel to another partition."""
        return self.stash_partition != self.pop_partition

    def structure(self) -> tuple[str, int, int, int, int]:
        """Everything but the namespace: comparable across processes."""
        return (self.name, self.stash_layer, self.pop_layer,
                self.stash_partition, self.pop_partition)


def _order(skip: Skip) -> tuple[int, str, int]:
    return (skip.stash_layer, skip.name, skip.pop_layer)


@dataclass(frozen=True)
class SkipLayout:
    """The skips of a model split by ``balance``, with the queries the engines route with."""

    balance: tuple[int, ...]
    skips: tuple[Skip, ...]
    _index: Mapping[SkipKey, Skip] = field(init=False, repr=False, compare=False)
    # Per partition, the skips that leave it and those that arrive in it: asked for at
    # every micro-batch's send and receive, so made once.
    _leaving: tuple[tuple[Skip, ...], ...] = field(init=False, repr=False, compare=False)
    _arriving: tuple[tuple[Skip, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        skips = tuple(sorted(self.skips, key=_order))
        index = {skip.key: skip for skip in skips}
        if len(index) != len(skips):
            raise ValueError("a SkipLayout cannot hold the same (namespace, name) twice")
        object.__setattr__(self, "balance", tuple(self.balance))
        object.__setattr__(self, "skips", skips)
        object.__setattr__(self, "_index", MappingProxyType(index))
        parts = range(len(self.balance))
        crossing = [s for s in skips if s.crosses]
        object.__setattr__(self, "_leaving", tuple(
            tuple(s for s in crossing if s.stash_partition == p) for p in parts))
        object.__setattr__(self, "_arriving", tuple(
            tuple(s for s in crossing if s.pop_partition == p) for p in parts))

    def __reduce__(self) -> tuple[Any, ...]:
        """Copied and pickled as its two fields (``copy.deepcopy(pipe)``, ``torch.save``): the
        derived indexes (a read-only mapping proxy, which cannot be pickled) are made anew."""
        return (SkipLayout, (self.balance, self.skips))

    @property
    def num_partitions(self) -> int:
        """How many partitions ``balance`` describes."""
        return len(self.balance)

    def __iter__(self) -> Iterator[Skip]:
        return iter(self.skips)

    def __len__(self) -> int:
        return len(self.skips)

    def find(self, ns: Namespace, name: str) -> Skip:
        """The skip stored under ``(ns, name)``; ``KeyError`` if the model has none."""
        try:
            return self._index[(ns, name)]
        except KeyError:
            raise KeyError(f"no skip named '{name}' in namespace {ns!r}") from None

    def is_local(self, ns: Namespace, name: str) -> bool:
        """Whether the skip is stashed and popped in the same partition."""
        return not self.find(ns, name).crosses

    def crosses(self, ns: Namespace, name: str) -> bool:
        """Whether ``(ns, name)`` leaves its partition; ``False`` for keys the layout lacks.

        Unknown keys come from skippable modules nested inside a layer; those skips never
        leave the layer, so a stage's tracker can keep them local.
        """
        skip = self._index.get((ns, name))
        return skip is not None and skip.crosses

    def stash_partition(self, ns: Namespace, name: str) -> int:
        """The partition whose layer stashes the skip."""
        return self.find(ns, name).stash_partition

    def pop_partition(self, ns: Namespace, name: str) -> int:
        """The partition whose layer pops the skip."""
        return self.find(ns, name).pop_partition

    def skips_stashed_by(self, partition: int) -> list[Skip]:
        """Skips stashed in ``partition`` and popped in another one (they leave it)."""
        self._check_partition(partition)
        return list(self._leaving[partition])

    def skips_popped_by(self, partition: int) -> list[Skip]:
        """Skips popped in ``partition`` and stashed in another one (they arrive in it)."""
        self._check_partition(partition)
        return list(self._arriving[partition])

    def local_skips(self, partition: int) -> list[Skip]:
        """Skips stashed and popped inside ``partition``."""
        self._check_partition(partition)
        return [s for s in self.skips if not s.crosses and s.stash_partition == partition]

    def structure(self) -> tuple[tuple[str, int, int, int, int], ...]:
        """The layout without namespaces, equal for identical models in any process."""
        return tuple(skip.structure() for skip in self.skips)

    def _check_partition(self, partition: int) -> None:
        if not 0 <= partition < len(self.balance):
            raise ValueError(f"partition {partition} out of range: the layout has "
                             f"{self.num_partitions} partitions")


def inspect_skip_layout(module: nn.Sequential, balance: Sequence[int]) -> SkipLayout:
    """Verify ``module``'s skips and place them in the partitions ``balance`` describes."""
    verify_skippables(module)
    counts = tuple(layer_counts(balance, len(module)))
    bounds = list(accumulate(counts))  # layer i lies in partition bisect_right(bounds, i)
    pops = {(site.ns, site.name): site.index for site in iter_pops(module)}
    skips = [_skip(site.ns, site.name, site.index, pops[(site.ns, site.name)], bounds)
             for site in iter_stashes(module)]
    return SkipLayout(counts, tuple(skips))


def _skip(ns: Namespace, name: str, stash_layer: int, pop_layer: int,
          bounds: list[int]) -> Skip:
    return Skip(ns, name, stash_layer, pop_layer,
                bisect_right(bounds, stash_layer), bisect_right(bounds, pop_layer))
