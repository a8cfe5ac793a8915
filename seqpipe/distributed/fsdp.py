"""Stages sharded with FSDP2 (``fully_shard``): the per-step protocol a pipeline owes them.

FSDP2 is written for one forward and one backward per step: its hooks all-gather a module's
parameters before it runs, register the unsharded copies on the module while it runs (so
autograd records those leaves, not the registered sharded ``DTensor`` parameters), and
reduce-scatter the unsharded gradients after each backward. A pipeline stage runs many
micro-batches' forwards and backwards, interleaved, in a schedule, so, as
``torch.distributed.pipelining`` does (its ``stage.py`` and ``perform_reduce_grad``), the
runtime drives FSDP2 itself over a ``train_step``:

* at the start of the step: no gradient sync, no reshard after backward, no backward is the
  last, on every FSDP module of the stage, so the micro-batches' gradients accumulate,
  unreduced, in the unsharded parameters' ``.grad``;
* every backward (``B``, and a split backward's ``I`` and ``W``) targets the parameters the
  forward used: FSDP2's unsharded leaves (``unsharded_leaves``, which
  ``Stage.used_parameters`` asks for);
  before a ``W``, the stage's modules are unsharded (a no-op when they are: a forward with
  ``reshard_after_forward=True`` between ``I`` and ``W`` may have freed them, and ``W``
  re-runs autograd nodes that read them);
* after the stage's last ``B`` or ``W`` of the step: sync, reshard and "last backward" on,
  then each parameter group's post-backward (one reduce-scatter per group, per step) and
  each root's final callback, which waits for them and resets FSDP for the next step.

So gradients are reduced once per step, averaged over the FSDP mesh, whatever the schedule
and whichever ``reshard_after_forward`` the user chose; no ``GradSink`` aliases the stage's
parameters (their hooks would never see the unsharded leaves). FSDP2 over tensor-parallel
``DTensor`` parameters needs nothing more (``seqpipe.distributed.tensor_parallel``). The same
protocol drives HSDP (``fully_shard`` on a 2-D (replicate, shard) mesh) and the FSDP2-style
``replicate`` (``torch.distributed._composable.replicate_with_fsdp``), whose modules are
``FSDPModule``s too; a failure reaches the replicas and shards in FSDP2's collectives through
``seqpipe.distributed.fsdp_verdict``.

A weight tied across ranks whose copy FSDP2 manages (``claim``) is summed over its holders
before FSDP2 reduces it: the stage's end-of-step reduction waits (``finish``) until the
copies' sum (``seqpipe.distributed.tie_grads``) has added the other holders' unsharded
gradients to this one's (``unsharded_grad``), so each shard receives the tie's summed,
then averaged, gradient. That stage's reduce-scatter then runs after the call instead of
during it.

``count_fn``'s count is summed over the groups FSDP2 averages the last stage's gradients over
(``ShardedStep.replicas``), or over ``data_parallel_group`` when it is given too, which must
then span the same ranks as the stages' FSDP2 meshes (``ShardedStep.check``): each
parameter's gradient is averaged over one of them, so they must be one set of replicas.
``ShardedStep.check`` also refuses the DDP-based ``torch.distributed._composable.replicate``.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import TYPE_CHECKING, Dict, Iterator, List, Mapping, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from seqpipe.core.lazy_classes import is_instance
from seqpipe.core.loss_weights import Replicas
from seqpipe.core.stage import Stage
from seqpipe.distributed.fsdp_verdict import ShardedVerdicts, group_ranks
from seqpipe.schedule import Action, Phase

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["ShardedStage", "ShardedStep"]


def check_parameters(stage: Stage) -> None:
    """Refuse, naming it, a module of ``stage`` wrapped with the DDP-based
    ``torch.distributed._composable.replicate`` (its reducer expects one forward, then one
    backward, per step). FSDP2 (1-D mesh), HSDP (2-D) and the FSDP2-style ``replicate`` are
    driven by ``ShardedStage``."""
    for name, module in stage.partition.named_modules():
        if is_instance(module, "torch.distributed._composable.replicate", "DDP"):
            raise NotImplementedError(
                f"stage {stage.index}: module {name or 'the stage'!r} is wrapped with the "
                f"DDP-based torch.distributed._composable.replicate, whose reducer expects "
                f"one forward then one backward per step; use the FSDP2-style "
                f"torch.distributed._composable.replicate_with_fsdp.replicate (as "
                f"torch.distributed.pipelining does), or DistributedPipe's "
                f"data_parallel_group")


def unsharded_grad(fsdp_param: object, create: bool = False) -> Optional[Tensor]:
    """The gradient FSDP2 accumulated for ``fsdp_param`` in this step and has not reduced
    yet: its unsharded parameter's ``.grad``, or the copy in the reduce dtype a
    mixed-precision policy keeps (the last backward's part added to it, as FSDP2's
    post-backward would); ``None`` if there is none, unless ``create``: then zeros are
    set, for FSDP2 to reduce with the rest."""
    leaf = getattr(fsdp_param, "_unsharded_param", None)
    accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
    if accumulated is not None:
        if leaf is not None and leaf.grad is not None:
            accumulated += leaf.grad
            leaf.grad = None
        return accumulated
    if leaf is None:
        return None
    if leaf.grad is None and create:
        leaf.grad = torch.zeros_like(leaf)
    return leaf.grad


def _groups(states: List[object]) -> Iterator[object]:
    for state in states:
        yield from state._fsdp_param_groups  # type: ignore[attr-defined]


def unsharded_leaves(states: List[object], stage: Stage) -> List[Tensor]:
    """The leaves autograd recorded for ``stage``'s parameters: FSDP2's unsharded
    parameters of ``states`` (once a forward has created them), and the trainable
    parameters FSDP2 does not manage (plain, or tensor-parallel ``DTensor``s)."""
    seen: Dict[int, Tensor] = {}
    managed: Set[int] = set()
    for group in _groups(states):
        for fsdp_param in group.fsdp_params:  # type: ignore[attr-defined]
            managed.add(id(fsdp_param.sharded_param))
            leaf = getattr(fsdp_param, "_unsharded_param", None)
            if leaf is not None and leaf.requires_grad:
                seen.setdefault(id(leaf), leaf)
    for param in stage.parameters():
        if id(param) not in managed:
            seen.setdefault(id(param), param)
    return list(seen.values())


class ShardedStage:
    """One stage whose partition holds FSDP2 modules, and the protocol run on them."""

    def __init__(self, stage: Stage, modules: List[FSDPModule]) -> None:
        self.stage = stage
        self.modules = modules
        states: Dict[int, object] = {}
        for module in modules:
            state = module._get_fsdp_state()
            states.setdefault(id(state), state)
        self.states = list(states.values())
        stage.leaves = functools.partial(unsharded_leaves, self.states)

    def _groups(self) -> Iterator[object]:
        return _groups(self.states)

    def managed(self) -> Set[int]:
        """The ids of the parameters FSDP2 manages (its sharded ones)."""
        return {id(fp.sharded_param) for group in self._groups()
                for fp in group.fsdp_params}  # type: ignore[attr-defined]

    def begin(self) -> None:
        """Start of a step: accumulate unreduced unsharded gradients over its backwards."""
        for module in self.modules:
            module.set_requires_gradient_sync(False, recurse=False)
            module.set_reshard_after_backward(False, recurse=False)
            module.set_is_last_backward(False)

    def unshard(self) -> None:
        """Before a ``W``: the unsharded parameters hold their values (no-op if they do)."""
        for module in self.modules:
            module.unshard()

    def reduce(self, verdicts: Optional[ShardedVerdicts]) -> None:
        """After the stage's last backward of the step (and ``verdicts``, when checked:
        every replica and shard went well so far): one reduce-scatter per parameter group,
        into the sharded parameters' ``.grad``; then reshard and reset FSDP."""
        if verdicts is not None:
            verdicts.end_reduce(self._groups())
        for module in self.modules:
            module.set_requires_gradient_sync(True, recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
            module.set_is_last_backward(True)
        for group in self._groups():
            group.post_backward()  # type: ignore[attr-defined]
        for state in self.states:
            if state._is_root:  # type: ignore[attr-defined]
                state._root_post_backward_final_callback()  # type: ignore[attr-defined]


class ShardedStep:
    """The FSDP2 protocol over one ``train_step`` of a rank's stages (none may be sharded)."""

    def __init__(self, stages: Mapping[int, Stage], *, failure_checks: bool = False) -> None:
        self.all = stages
        self.stages: Dict[int, ShardedStage] = {}
        self.last: Dict[Optional[int], int] = {}  # stage -> index of its last B or W
        self.deferred: Set[int] = set()  # stages reduced at ``finish``, not in the schedule
        for s, stage in stages.items():
            modules = [m for m in stage.partition.modules()
                       if is_instance(m, "torch.distributed.fsdp", "FSDPModule")]
            if modules:
                self.stages[s] = ShardedStage(stage, modules)
            else:  # no longer sharded
                stage.leaves = None
        # a failure here reaches the replicas and shards in FSDP2's collectives (opt-in:
        # DistributedPipe(sharded_failure_checks=True), for what it costs)
        self.verdicts: Optional[ShardedVerdicts] = None
        if self.stages and failure_checks:
            self.verdicts = ShardedVerdicts(
                [g for sharded in self.stages.values() for g in sharded._groups()],
                next(iter(self.stages.values())).stage.device)

    def __contains__(self, stage: int) -> bool:
        return stage in self.stages

    def managed(self) -> Dict[int, int]:
        """The parameters FSDP2 manages on this rank (it reduces them itself): by id, the
        number of dimensions of the mesh it shards each on (a parameter ``DTensor`` with
        more is also split with tensor parallelism: FSDP over TP)."""
        return {id(fp.sharded_param): fp.mesh_info.mesh.ndim
                for sharded in self.stages.values() for group in sharded._groups()
                for fp in group.fsdp_params}  # type: ignore[attr-defined]

    def _meshes(self, stage: int) -> List[Tuple[Tuple[dist.ProcessGroup, ...], List[int]]]:
        """Per FSDP2 mesh ``stage`` is sharded over here (each once): its groups of more than
        one rank (shard, replicate) and its ranks."""
        meshes: Dict[Tuple[int, ...], Tuple[Tuple[dist.ProcessGroup, ...], List[int]]] = {}
        for group in self.stages[stage]._groups():
            info = group.mesh_info  # type: ignore[attr-defined]
            groups = tuple(g for g in (getattr(info, "shard_process_group", None),
                                       getattr(info, "replicate_process_group", None))
                           if g is not None and g.size() > 1)
            key = tuple(map(group_ranks, groups))
            meshes.setdefault(key, (groups, sorted(info.mesh.mesh.flatten().tolist())))
        return list(meshes.values())

    def replicas(self, stage: int, device: torch.device) -> Optional[Replicas]:
        """The data-parallel copies of ``stage`` FSDP2 averages its gradients over (its
        shard and, under HSDP or ``replicate``, replicate groups), for summing a step's
        ``count_fn`` count over them (``seqpipe.core.loss_weights``); ``None`` if ``stage``
        is not sharded here. FSDP2's default mean is assumed (no gradient divide factor
        set). A collective over those groups, behind a verdict when failures are checked."""
        if stage not in self.stages:
            return None
        meshes = self._meshes(stage)
        if len(meshes) != 1:
            raise ValueError(f"stage {stage} is sharded over different FSDP2 meshes (ranks "
                             f"{sorted(ranks for _, ranks in meshes)}), so count_fn's count "
                             f"has no one sum; shard the stage on one mesh")
        groups = meshes[0][0]
        size = 1
        for group in groups:
            size *= group.size()

        def all_reduce(total: Tensor) -> None:
            if self.verdicts is not None:
                self.verdicts.check(list(groups), "the sum of count_fn's count")
            for group in groups:
                dist.all_reduce(total, group=group)
        return Replicas(size, all_reduce, device)

    def check(self, data_parallel_group: Optional[dist.ProcessGroup]) -> None:
        """Refuse, naming it, a stage wrapped with the DDP-based ``replicate``
        (``check_parameters``), and a ``data_parallel_group`` that does not span the ranks
        of a sharded stage's FSDP2 mesh: FSDP2 averages its parameters' gradients over the
        mesh and seqpipe's reducer the others' over the group, so the two must be one set
        of replicas (and ``count_fn``'s count is summed over them)."""
        for stage in self.all.values():
            check_parameters(stage)
        if data_parallel_group is None:
            return
        replicas = sorted(group_ranks(data_parallel_group))
        for s in sorted(self.stages):
            for _, ranks in self._meshes(s):
                if ranks != replicas:
                    raise ValueError(
                        f"stage {s} is sharded with FSDP2 over ranks {ranks}, which average "
                        f"its sharded parameters' gradients, but data_parallel_group (ranks "
                        f"{replicas}) averages its other parameters' and sums count_fn's "
                        f"count; give fully_shard a mesh of the data_parallel_group's ranks, "
                        f"or leave data_parallel_group out (FSDP2 reduces the stage itself)")

    def claim(self, param: Tensor) -> Optional[object]:
        """The ``FSDPParam`` that manages ``param`` (a sharded parameter of a stage here),
        or ``None``. Its stage's end-of-step reduction then waits for ``finish``, so that
        a tie's copies can first be summed into its unsharded gradient."""
        for s, sharded in self.stages.items():
            for group in sharded._groups():
                for fsdp_param in group.fsdp_params:  # type: ignore[attr-defined]
                    if fsdp_param.sharded_param is param:
                        self.deferred.add(s)
                        return fsdp_param
        return None

    def finish(self) -> None:
        """The end-of-step reductions ``claim`` held back, in stage order (after the call
        closed; before ``close``)."""
        for s in sorted(self.deferred):
            self.stages[s].reduce(self.verdicts)
        self.deferred.clear()

    def begin(self, last: Mapping[Optional[int], int]) -> None:
        """Start of a step; ``last`` maps each stage to the index of its last backward
        (``B`` or ``W``) among the step's actions."""
        self.last = dict(last)
        for sharded in self.stages.values():
            sharded.begin()

    @contextmanager
    def around(self, n: int, action: Action) -> Iterator[None]:
        """Around ``action``, the ``n``-th of the step: unshard before a ``W``; reduce
        after the stage's last backward of the step (unless ``claim`` deferred it)."""
        sharded: Optional[ShardedStage] = self.stages.get(action.stage)  # type: ignore[arg-type]
        if sharded is None:
            yield
            return
        if self.verdicts is not None:
            self.verdicts.action = (f"the {action.phase.value} of micro-batch "
                                    f"{action.microbatch} on stage {action.stage}")
        if action.phase is Phase.BACKWARD_WEIGHT:
            sharded.unshard()
        yield
        if self.last.get(action.stage) == n and action.stage not in self.deferred:
            sharded.reduce(self.verdicts)

    def close(self) -> None:
        """After the call closed on this rank: every replica and shard went well, or
        ``PeerError`` (see ``seqpipe.distributed.fsdp_verdict``)."""
        if self.verdicts is not None:
            self.verdicts.action = "the end of the step"
            self.verdicts.close()

    def concede(self, text: str) -> None:
        """This rank failed in the step (``text``): tell its replicas and shards."""
        if self.verdicts is not None:
            self.verdicts.concede(text)
