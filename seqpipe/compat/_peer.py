"""What the peers' pipeline classes looked like from outside, shared by both stand-ins.

torchgpipe's ``GPipe`` and torch's ``Pipe`` registered their partitions as an
``nn.ModuleList`` of ``nn.Sequential``s, so ``named_children()`` shows ``partitions``,
``state_dict()`` keys read ``partitions.<j>.<k>.<name>``, and ``len``, indexing and
iteration go over the partitions' layers. They passed ``chunks`` and ``checkpoint`` through
``int()`` and ``str()``, accepted an empty ``nn.Sequential`` (its input comes back as it
is), and their argument errors had a fixed wording that ported tests match.

:class:`PeerPipe` gives a compat class that face; underneath, ``seqpipe.Pipe``'s engine runs
views of the same layer objects, so the registered structure only decides names.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterator, List, Sequence, Tuple, Type

from torch import nn

from seqpipe.compat._moving import DenyMoving
from seqpipe.core.checkpoint import MODES
from seqpipe.core.microbatch import check_input

__all__ = ["PeerPipe", "peer_arguments", "recommend_auto_balance", "verify_peer_module"]

Group = Sequence[Tuple[str, nn.Module]]


def peer_arguments(chunks: Any, checkpoint: Any) -> Tuple[int, str]:
    """``chunks`` and ``checkpoint`` read as the peers read them, with their errors."""
    chunks, checkpoint = int(chunks), str(checkpoint)
    if chunks <= 0:
        raise ValueError("number of chunks must be positive integer")
    if checkpoint not in MODES:
        raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")
    return chunks, checkpoint


def verify_peer_module(module: Any) -> None:
    """The peers' structural checks, with their messages."""
    if not isinstance(module, nn.Sequential):
        raise TypeError("module must be nn.Sequential to be partitioned")
    if len(list(module.named_children())) != len(module):
        raise ValueError("module with duplicate children is not supported")


def recommend_auto_balance(message: str, package: str, wrap: str) -> str:
    """``message``, then how to let ``<package>.balance`` choose a balance (as the peers did)."""
    return (f"{message}\n\nWhile a model is still changing, its best balance changes with it; "
            f"'{package}.balance' can choose one by profiling:\n\n"
            f"  from {package}.balance import balance_by_time\n\n"
            f"  balance = balance_by_time(partitions, model, sample)\n"
            f"  model = {wrap}\n")


class PeerPipe(DenyMoving):
    """Mixin for a compat class over ``seqpipe.Pipe``: the peers' module structure.

    Call :meth:`_register_partitions` at the end of ``__init__`` with the peer's grouping.
    """

    partitions: nn.ModuleList
    devices: List[Any]

    def _register_partitions(self, groups: Sequence[Group],
                             container: Type[nn.Sequential] = nn.Sequential) -> None:
        """Register ``groups`` (per partition: ``(name, layer)`` pairs) as ``partitions``.

        Replaces the layers registered under their own names, so each layer is registered
        once, under the peer's key.
        """
        for name in list(self._modules):
            del self._modules[name]
        self.__dict__.pop("partitions", None)
        self.partitions = nn.ModuleList(container(OrderedDict(group)) for group in groups)

    def _init_empty(self, chunks: int, checkpoint: str) -> None:
        """An empty ``nn.Sequential``: legal for the peers, whose forward returned the input."""
        nn.Module.__init__(self)
        self.chunks, self.checkpoint = chunks, checkpoint
        self.balance: List[int] = []
        self.devices = []
        self.partitions = nn.ModuleList()

    def _empty_forward(self, input: Any) -> Any:
        check_input(input)
        return input

    def __len__(self) -> int:
        return sum(len(partition) for partition in self.partitions)

    def __getitem__(self, index: int) -> nn.Module:
        return list(self)[index]

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition
