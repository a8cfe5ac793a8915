"""Namespaces let one skippable block class be reused without its skip names clashing."""
from __future__ import annotations

import uuid

__all__ = ["Namespace"]


class Namespace:
    """A unique scope for skip names; two namespaces never compare equal.

    ``block.isolate(ns)`` puts a block's skip names into ``ns``, so the same class can be
    used at several levels of a U-Net and each level's ``stash``/``pop`` pair matches up.
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and self.id == other.id

    def __lt__(self, other: "Namespace") -> bool:
        """An arbitrary but stable order, so layouts can be sorted deterministically."""
        return self.id < other.id


DEFAULT_NAMESPACE = Namespace()
