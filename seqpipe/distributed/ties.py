"""Tied weights across the stages of a ``DistributedPipe``: one parameter, a copy per rank.

A language model ties its input embedding to its output projection
(``head.weight = embedding.weight``), with the embedding on the first stage and the head
on the last. In one process the two layers share one ``nn.Parameter``, whose gradient
is the sum of both uses. Across processes each stage that uses it holds a copy, so:

* **finding**: at construction, every tensor object reachable from layers of two or more
  stages is a tie (by assignment, or one submodule reused inside two layers); the ranks
  agree on the list, since each computes it from the same model;
* **keeping**: a rank frees the layers it does not own by giving their tensors ``meta``
  stand-ins, but leaves alone the tensors and submodules its own layers share with them;
* **training**: after the step's backward, each tie's gradient (what this step added) is
  summed over the ranks that hold a copy (one all-reduce per tie, see
  ``seqpipe.distributed.tie_grads``), so every copy's ``.grad`` is the unpipelined
  model's and identical optimizer steps keep the copies identical. A copy may be sharded
  with FSDP2 or split with tensor parallelism after construction: it is read from its layer
  when needed (``TiedCopies.copies``), FSDP2's copies are summed in their unsharded
  gradients before FSDP2 reduces them, and ``DTensor`` copies by local shards or whole
  (``seqpipe.distributed.tie_layout``);
* **checking**: the copies must be equal at construction (one small all-gather of
  checksums, else ``ValueError`` on every rank naming the tensor), and ``check`` compares
  them again on demand. Copies built on ``meta`` are freshly initialised per rank, so
  they are set to the first holder's values instead.

A tie's all-reduce runs on a process group of the ranks that hold it. Creating a group
takes every rank of the world, in the same order; that is possible when the pipeline
spans the world, or when the pipelines and their data-parallel groups tile the world
(``mesh_groups``), since then every rank is constructing its stage now and can learn
every pipeline's ranks. Otherwise (a pipeline on a hand-made group of part of the world)
the sum runs over the whole pipeline group, the ranks without a copy adding zeros:
correct, at the cost of moving the tensor through the stages that do not use it.

Buffers shared across stages are refused: they are state that layers update in place
(running statistics), and keeping copies on several ranks in step would take a
collective at every update.
"""
from __future__ import annotations

import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpipe.distributed.agreement import gather_ints
from seqpipe.distributed.mesh import _new_group
from seqpipe.distributed.tensor_parallel import local
from seqpipe.distributed.tie_layout import full, sum_dtype, write_full

__all__ = ["Tie", "SharedBufferError", "find_ties", "drop_layer", "ties_kept", "TiedCopies",
           "canonical_names"]


class SharedBufferError(ValueError):
    """A buffer is used by layers of two or more stages, which ``DistributedPipe`` refuses."""


@dataclass(frozen=True)
class Tie:
    """A tensor that layers of two or more stages share.

    ``names`` are its keys in the unpipelined model's ``state_dict()``, in that order (the
    first is the one checkpoints keep); ``stages`` are the stages that hold a copy.
    Whether it is trained is not part of it: that is the copies' ``requires_grad``, read
    at every step.
    """

    names: Tuple[str, ...]
    stages: Tuple[int, ...]
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return self.names[0]

    def describe(self) -> str:
        also = f" (also {', '.join(repr(n) for n in self.names[1:])})" if self.names[1:] else ""
        return f"{self.names[0]!r}{also}"


def _tensors(layer: nn.Module, buffers: bool) -> Iterator[Tuple[str, Tensor]]:
    if buffers:
        return layer.named_buffers(remove_duplicate=False)
    return layer.named_parameters(remove_duplicate=False)


def find_ties(module: nn.Sequential, balance: Sequence[int]) -> List[Tie]:
    """The parameters that layers of two or more stages share, in state-dict order.

    Raises:
        SharedBufferError: a buffer is shared across stages.
    """
    stage_of = [s for s, n in enumerate(balance) for _ in range(n)]
    for buffers in (True, False):
        found: Dict[int, Tuple[Tensor, List[str], List[int]]] = {}
        for n, (layer_name, layer) in enumerate(module._modules.items()):
            assert layer is not None
            for name, tensor in _tensors(layer, buffers):
                _, names, stages = found.setdefault(id(tensor), (tensor, [], []))
                names.append(f"{layer_name}.{name}")
                if stage_of[n] not in stages:
                    stages.append(stage_of[n])
        ties = [Tie(tuple(names), tuple(stages), tuple(t.shape), t.dtype)
                for t, names, stages in found.values() if len(stages) > 1]
        if buffers and ties:
            tie = ties[0]
            raise SharedBufferError(
                f"the buffer {tie.describe()} is shared by layers of stages "
                f"{list(tie.stages)}; DistributedPipe cannot keep a buffer's copies in step "
                f"across ranks. Give those layers one stage (balance=...), or give each "
                f"layer its own buffer")
    return ties


def drop_layer(layer: nn.Module, keep: nn.Module) -> None:
    """Free a layer this rank does not run: give its parameters and buffers ``meta``
    stand-ins, except the modules and tensors that ``keep`` (this rank's own layers)
    shares with it, which are left exactly as they are.

    ``layer.to("meta")`` does for a layer that shares nothing with ``keep`` (it also lets
    a module that caches its tensors, like an RNN's flat weights, update the cache). For
    one that shares, it would not do: a submodule reused in ``keep`` would go to ``meta``
    for both, and where torch converts tensors in place
    (``torch.__future__.set_swap_module_params_on_conversion``) so would a tied tensor.
    """
    modules = {id(m) for m in keep.modules()}
    tensors = {id(t) for t in chain(keep.parameters(), keep.buffers())}
    if not any(id(m) in modules for m in layer.modules()) and not any(
            id(t) in tensors for t in chain(layer.parameters(), layer.buffers())):
        layer.to("meta")
        return
    pending = [layer]
    while pending:
        module = pending.pop()
        if id(module) in modules:
            continue
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and id(tensor) not in tensors and not tensor.is_meta:
                    table[name] = _on_meta(tensor)
        pending.extend(m for m in module._modules.values() if m is not None)


def _on_meta(tensor: Tensor) -> Tensor:
    stand_in = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(stand_in, tensor.requires_grad)
    return stand_in


def _slots(module: nn.Module) -> List[Tuple[Dict[str, Optional[Tensor]], str, int]]:
    return [(table, name, id(t)) for m in module.modules()
            for table in (m._parameters, m._buffers) for name, t in table.items()
            if t is not None]


@contextmanager
def ties_kept(module: nn.Module) -> Iterator[None]:
    """Restore, after the block, the sharing between ``module``'s parameter and buffer
    entries.

    ``Module.to_empty`` (materialising a ``meta`` model) gives every entry a new tensor,
    so two layers of one stage that shared a parameter would each get their own.
    """
    before = _slots(module)
    yield
    first: Dict[int, Tensor] = {}
    for table, name, old in before:
        tensor = table[name]
        assert tensor is not None
        if first.setdefault(old, tensor) is not tensor:
            table[name] = first[old]


def canonical_names(module: nn.Module, ties: Sequence[Tie] = ()) -> Dict[str, str]:
    """Each state-dict key of ``module`` that is a second name of a shared tensor, mapped to
    the tensor's first name in the unpipelined model (the key a checkpoint keeps).

    Covers tensors shared inside ``module`` and ``ties`` across stages (a
    ``DistributedPipe``'s ``ties``).
    """
    first: Dict[int, str] = {}
    out: Dict[str, str] = {}
    for name, tensor in chain(module.named_parameters(remove_duplicate=False),
                              module.named_buffers(remove_duplicate=False)):
        out[name] = first.setdefault(id(tensor), name)
    for tie in ties:
        for name in tie.names:
            if name in out:
                out[name] = tie.name
    return {k: v for k, v in out.items() if k != v}


def _checksum(tensor: Tensor) -> int:
    """A checksum of ``tensor``'s whole value (gathered over its mesh if a ``DTensor``)."""
    data = full(tensor, tensor.dtype).view(-1).view(torch.uint8).cpu().numpy()
    return zlib.crc32(data.tobytes()) & 0x7FFFFFFF


class TiedCopies:
    """This rank's copies of the pipeline's ties, and the groups their sums run on; checks
    their values (``tie_grads.TieGrads`` sums their gradients).

    ``module`` holds this rank's layers under their names in the unpipelined model (the
    pipe). A copy is read from its layer when asked for (``copies``), so a copy that
    FSDP2's ``fully_shard`` or ``parallelize_module`` replaced with a ``DTensor`` parameter
    after construction is the one seen. Collective at construction (it may create process
    groups) and in every method: every rank of the pipeline calls them together (and, for
    ``DTensor`` copies, the ranks of their meshes, which run the same step).
    """

    def __init__(self, ties: Sequence[Tie], module: nn.Module, stage: int,
                 group: Optional[dist.ProcessGroup],
                 data_parallel_group: Optional[dist.ProcessGroup],
                 device: torch.device) -> None:
        self.ties = list(ties)
        self.stage = stage
        self.group = group
        self.device = device
        params = dict(module.named_parameters(remove_duplicate=False))
        self.slots: List[Optional[Tuple[nn.Module, str]]] = []
        for tie in self.ties:
            name = next((n for n in tie.names if n in params), None)
            owner, _, attribute = (name or "").rpartition(".")
            self.slots.append(None if name is None
                              else (module.get_submodule(owner), attribute))
        groups = _tie_groups([t.stages for t in self.ties], group, data_parallel_group, device)
        # Per tie, the group its sums run on where this rank takes part, else None: the
        # holders' own group, or (where none could be made) the whole pipeline group.
        self.pipeline_sums = groups is None
        self.sum_groups: List[Optional[dist.ProcessGroup]] = [
            group if groups is None else groups.get(t.stages) for t in self.ties]

    @property
    def copies(self) -> List[Optional[nn.Parameter]]:
        """Per tie, this rank's copy as its layer holds it now (``None``: no copy here)."""
        return [None if slot is None else slot[0]._parameters[slot[1]]  # type: ignore[misc]
                for slot in self.slots]

    def whole(self, t: int, layouts: Sequence[int]) -> bool:
        """Whether tie ``t``'s sum goes by whole tensors (``seqpipe.distributed.tie_layout``):
        unless every rank of its sum group holds a copy and all are laid out alike.
        ``layouts``: per rank of the pipeline, its copy's ``tie_layout.layout`` code, -1
        without a copy."""
        members = range(len(layouts)) if self.pipeline_sums else self.ties[t].stages
        return len({layouts[r] for r in members}) > 1

    def start_sum(self, t: int, tensor: Optional[Tensor],
                  whole: bool = False) -> Callable[[], None]:
        """Start summing ``tensor`` (a copy's gradient or value; ``None`` on a rank without a
        copy, which adds zeros) in place over tie ``t``'s group (``sum_groups[t]``, which
        must not be ``None``): its local shard, or with ``whole`` the whole tensor (see
        ``tie_layout``); the returned function waits for it."""
        if whole or tensor is None:
            tie = self.ties[t]
            dtype = sum_dtype(tie.dtype)
            flat = (torch.zeros(tie.shape, dtype=dtype, device=self.device) if tensor is None
                    else full(tensor, dtype))
        else:
            mine = local(tensor)
            flat = mine if mine.is_contiguous() else mine.contiguous()
        work = dist.all_reduce(flat, group=self.sum_groups[t], async_op=True)

        def wait() -> None:
            work.wait()
            if tensor is None:
                return
            if whole:
                write_full(tensor, flat)
            elif flat is not mine:
                mine.copy_(flat)
        return wait

    # -- checking ------------------------------------------------------------------------
    def _table(self, meta: Sequence[bool]) -> List[List[int]]:
        """Per stage, per tie: its copy's checksum; -1 without a copy, -2 if built on meta."""
        mine = [(-2 if m else _checksum(c)) if c is not None else -1
                for c, m in zip(self.copies, meta)]
        return gather_ints(mine, self.group, self.device)

    def verify(self, meta: Optional[Sequence[bool]] = None, *,
               at_construction: bool = False) -> None:
        """Raise on every rank if some tie's copies differ. Copies built on ``meta``
        (``meta[t]`` on some holder) take the first holder's values instead: fresh
        initialisations differ from rank to rank."""
        table = self._table(meta if meta is not None else [False] * len(self.ties))
        odd = []
        for t, tie in enumerate(self.ties):
            sums = {table[s][t] for s in tie.stages}
            if -2 in sums:
                self._copy_from_first(t)
            elif len(sums) > 1:
                odd.append(f"{tie.describe()} differs between stages {list(tie.stages)}")
        if not odd:
            return
        more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
        if at_construction:
            raise ValueError(
                f"the tied parameter {odd[0]}, which share it{more}; every rank must build "
                f"the model with the same values "
                f"(seed the RNG the same way before building it, or load the same "
                f"checkpoint on every rank)")
        raise RuntimeError(
            f"the tied parameter {odd[0]}: its copies drifted apart{more}; step "
            f"the optimizer on every rank with the same settings, and change a tied "
            f"parameter only through train_step and the optimizer (or on every copy alike)")

    @torch.no_grad()
    def _copy_from_first(self, t: int) -> None:
        """Give every copy of tie ``t`` its first holder's values (a sum where the others
        add zeros)."""
        copy = self.copies[t]
        if self.sum_groups[t] is None:
            return
        if copy is not None and self.stage != self.ties[t].stages[0]:
            copy.zero_()
        self.start_sum(t, copy.detach() if copy is not None else None, whole=True)()


def _pipelines(group: Optional[dist.ProcessGroup],
               data_parallel_group: Optional[dist.ProcessGroup],
               device: torch.device) -> Optional[List[List[int]]]:
    """Every pipeline's ranks (global, by stage) when every rank of the world is building
    a stage now, so that groups can be created; else ``None``."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    world = dist.get_world_size()
    if len(ranks) == world:
        return [ranks]
    if data_parallel_group is None:
        return None
    if len(ranks) * dist.get_world_size(data_parallel_group) != world:
        return None
    lines = sorted({tuple(r) for r in gather_ints(ranks, data_parallel_group, device)})
    covered = sorted(r for line in lines for r in line)
    if covered != list(range(world)):
        return None
    return [list(line) for line in lines]


def _tie_groups(stage_sets: Sequence[Tuple[int, ...]], group: Optional[dist.ProcessGroup],
                data_parallel_group: Optional[dist.ProcessGroup], device: torch.device
                ) -> Optional[Dict[Tuple[int, ...], dist.ProcessGroup]]:
    """For each set of stages, the group of this pipeline's ranks at those stages; every
    pipeline's are created, by every rank in the same order. ``None`` where groups cannot
    be created (then the pipeline group is used)."""
    lines = _pipelines(group, data_parallel_group, device)
    if lines is None:
        assert group is not None  # a pipeline on the world has its lines
        return None
    like = group if group is not None else dist.group.WORLD
    assert like is not None
    me = dist.get_rank()
    mine: Dict[Tuple[int, ...], dist.ProcessGroup] = {}
    for stages in sorted(set(stage_sets)):
        for line in lines:
            members = [line[s] for s in stages]
            made = _new_group(members, like)
            if me in members:
                mine[stages] = made
    return mine
