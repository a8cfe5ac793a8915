"""A failure on one rank of an FSDP2 mesh reaches its replicas and shards: verdicts.

FSDP2 stages meet their replicas and shards (the ranks of the same stage in the other
pipelines of the mesh) in FSDP2's own collectives: an all-gather before a module runs
(``FSDPParamGroup.unshard``), a reduce-scatter and (HSDP, ``replicate``) an all-reduce at
the end of the step. A rank whose pipeline failed stops joining them, and the others would
wait in the next one for the process group's timeout: on gloo a waiting collective cannot
be interrupted (``ProcessGroup.abort()`` does not break the peers' waits; only the failed
process's exit does), and the failing rank cannot join the others' collective for them, not
knowing which one they wait in.

So, during a ``train_step`` with sharded stages, every collective FSDP2 issues on a group
is preceded by a verdict on that group (``seqpipe.distributed.verdict``: one 8-byte
all-reduce of the number of failed ranks, read on the host): before each all-gather that
will communicate, before the end-of-step reduction, and once more after the call has closed
on this rank (so a rank failing after the reduction is heard too, as with
``data_parallel_group``). A rank that fails joins, at once and without waiting, one verdict
with a 1 on each group it has not settled, with the text of its failure (``concede``): the
collective its replicas and shards wait in, or will wait in next, on that group, is that
verdict, since every rank issues the same sequence of collectives on it. They raise
``PeerError`` with the text, and concede in turn on their other groups (and, through their
own pipelines, their stages' peers hear it). A group on which a rank read a failure, or
conceded, is settled: it takes no other verdict in the step.

The price: one 8-byte all-reduce and a host read per communicating all-gather of a sharded
stage and per group at the end of a step (on a GPU the host waits there for the device).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple

import torch
import torch.distributed as dist

from seqpipe.distributed import verdict
from seqpipe.distributed.transport import PeerError

__all__ = ["ShardedVerdicts", "group_ranks", "param_group_groups"]


def group_ranks(group: dist.ProcessGroup) -> Tuple[int, ...]:
    """The global ranks of ``group``: what tells two handles of one group apart from two
    groups."""
    return tuple(dist.get_process_group_ranks(group))


def param_group_groups(param_group: Any) -> List[dist.ProcessGroup]:
    """The process groups an FSDP2 parameter group communicates on (of more than one rank):
    its shard group (all-gather, reduce-scatter), a post-forward shard group, a separate
    reduce-scatter group, its replicate group (HSDP, ``replicate``)."""
    found: List[dist.ProcessGroup] = []
    for info in (param_group.mesh_info, getattr(param_group, "post_forward_mesh_info", None)):
        for attribute in ("shard_process_group", "reduce_scatter_process_group",
                          "replicate_process_group"):
            group = getattr(info, attribute, None)
            if group is not None and group.size() > 1:
                found.append(group)
    return found


class ShardedVerdicts:
    """The verdicts of one ``train_step`` over the groups of ``param_groups`` (this rank's
    FSDP2 parameter groups), which it watches: their ``unshard`` checks first."""

    def __init__(self, param_groups: Iterable[Any], device: torch.device) -> None:
        self.device = device
        self.groups: Dict[Tuple[int, ...], dist.ProcessGroup] = {}
        self.settled: set = set()
        self.active = True  # until the step's last verdict, or a failure
        self.action = "the start of the step"  # what this rank was at (for messages)
        self.watched = list(param_groups)
        for param_group in self.watched:
            for group in param_group_groups(param_group):
                self.groups.setdefault(group_ranks(group), group)
            param_group.unshard = self._checked(param_group, type(param_group).unshard)

    def _release(self) -> None:
        """No verdict after this: FSDP2's ``unshard`` is its own again (and the parameter
        groups no longer refer to this object)."""
        self.active = False
        for param_group in self.watched:
            param_group.__dict__.pop("unshard", None)
        self.watched = []

    def _checked(self, param_group: Any, unshard: Callable[..., Any]) -> Callable[..., Any]:
        """``param_group.unshard``, after a verdict on its all-gather group when it will
        communicate (the same decision on every rank of the group: FSDP2's state is)."""
        def checked(async_op: bool = False) -> Any:
            if (self.active and param_group._all_gather_result is None
                    and not param_group.is_unsharded
                    and hasattr(param_group.mesh_info, "shard_process_group")):  # not DDP's
                group = param_group._all_gather_process_group
                if group.size() > 1:
                    self.check([group], "FSDP2's all-gather")
            return unshard(param_group, async_op)
        return checked

    def check(self, groups: Sequence[dist.ProcessGroup], before: str) -> None:
        """Every rank of each of ``groups`` went well so far, or ``PeerError`` naming who
        failed (this rank then concedes on its other groups, through ``Call.abort``)."""
        for group in groups:
            key = group_ranks(group)
            if not self.active or key in self.settled:
                continue
            try:
                failures = verdict.Verdict(group, self.device).failures()
            except RuntimeError as exc:  # a rank of the group is gone: no verdict on it
                self.settled.add(key)
                raise PeerError(f"rank {dist.get_rank()} lost a rank of the FSDP2 group "
                                f"{list(key)} while at {self.action}, before {before}: "
                                f"{type(exc).__name__}: {exc}") from exc
            if failures:
                self.settled.add(key)
                heard = ", ".join(str(key[r]) for r, _ in failures)
                raise PeerError("\n".join(text for _, text in failures) + (
                    f"\n  rank {dist.get_rank()} was at {self.action}, before {before} "
                    f"over ranks {list(key)}, and heard it from rank(s) {heard}"))

    def end_reduce(self, param_groups: Iterable[Any]) -> None:
        """Before the end-of-step reduction of ``param_groups``."""
        groups: Dict[Tuple[int, ...], dist.ProcessGroup] = {}
        for param_group in param_groups:
            for group in param_group_groups(param_group):
                groups.setdefault(group_ranks(group), group)
        self.check(list(groups.values()), "FSDP2's gradient reduction")

    def close(self) -> None:
        """After the call closed on this rank: the step's last verdict on every group."""
        self.check(list(self.groups.values()), "the end of the step")
        self._release()

    def concede(self, text: str) -> None:
        """This rank failed in the step: join one verdict with a 1 and ``text`` on each
        group not settled, without waiting; no verdict after."""
        if not self.active:
            return
        self._release()
        text = f"{text} [rank {dist.get_rank()}]"
        for key, group in self.groups.items():
            if key not in self.settled:
                self.settled.add(key)
                verdict.concede(text, [], group, self.device)
