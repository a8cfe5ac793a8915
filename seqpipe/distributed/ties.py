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
  (``seqpipe.distributed.tie_layout``). Wrapped apart on one rank (a tied embedding and
  head that ``zbv`` puts on one rank, each wrapped with ``fully_shard``), a tie has several
  copies there: they are summed on the rank first, in the same sum (``TiedCopies.copies``,
  ``start_sum``; ``seqpipe.distributed.tie_local`` finds the ties within one rank);
* **checking**: the copies must be equal at construction (one small all-gather of
  checksums, else ``ValueError`` on every rank naming the tensor), and ``check`` compares
  them again on demand. Copies built on ``meta`` are freshly initialised per rank, so
  they are set to the first holder's values instead.

A tie's all-reduce runs on a process group of the ranks that hold it
(``seqpipe.distributed.tie_groups``), or, for a pipeline on a hand-made group of part of
the world, on the whole pipeline group, the ranks without a copy adding zeros: correct, at
the cost of moving the tensor through the stages that do not use it.

Buffers shared across stages are refused: they are state that layers update in place
(running statistics), and keeping copies on several ranks in step would take a
collective at every update.
"""
from __future__ import annotations

import zlib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import chain
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpipe.distributed.agreement import gather_ints
from seqpipe.distributed.tensor_parallel import local
from seqpipe.distributed.tie_groups import tie_groups
from seqpipe.distributed.tie_layout import full, sum_dtype, write_full
from seqpipe.schedule import Placement

__all__ = ["Tie", "SharedBufferError", "across_ranks", "find_ties", "shared_tensors",
           "drop_layer", "ties_kept", "TiedCopies", "canonical_names"]


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


def shared_tensors(module: nn.Sequential, owners: Sequence[int], buffers: bool = False
                   ) -> List[Tuple[Tensor, List[str], List[int]]]:
    """Every parameter (or buffer) of ``module``'s layers, in state-dict order: the tensor,
    its names in the model, and the owners that use it (``owners[n]``: layer ``n``'s stage,
    or rank), each once."""
    found: Dict[int, Tuple[Tensor, List[str], List[int]]] = {}
    for n, (layer_name, layer) in enumerate(module._modules.items()):
        assert layer is not None
        for name, tensor in _tensors(layer, buffers):
            _, names, users = found.setdefault(id(tensor), (tensor, [], []))
            names.append(f"{layer_name}.{name}")
            if owners[n] not in users:
                users.append(owners[n])
    return list(found.values())


def find_ties(module: nn.Sequential, balance: Sequence[int]) -> List[Tie]:
    """The parameters that layers of two or more stages share, in state-dict order.

    Raises:
        SharedBufferError: a buffer is shared across stages.
    """
    stage_of = [s for s, n in enumerate(balance) for _ in range(n)]
    for buffers in (True, False):
        ties = [Tie(tuple(names), tuple(stages), tuple(t.shape), t.dtype)
                for t, names, stages in shared_tensors(module, stage_of, buffers)
                if len(stages) > 1]
        if buffers and ties:
            tie = ties[0]
            raise SharedBufferError(
                f"the buffer {tie.describe()} is shared by layers of stages "
                f"{list(tie.stages)}; DistributedPipe cannot keep a buffer's copies in step "
                f"across ranks. Give those layers one stage (balance=...), or give each "
                f"layer its own buffer")
    return ties


def across_ranks(ties: Sequence[Tie], placement: Placement) -> List[Tie]:
    """The ties whose stages lie on two or more ranks of ``placement``, each naming those
    ranks in ``stages`` (the copies live per rank: stages on one rank share one tensor)."""
    out = []
    for tie in ties:
        ranks = tuple(sorted({placement.rank_of(s) for s in tie.stages}))
        if len(ranks) > 1:
            out.append(replace(tie, stages=ranks))
    return out


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

    ``ties`` are tied across ranks (the same list on every rank); ``local`` lists the
    parameters that two or more layers of one rank share (``tie_local.one_rank_ties``, every
    rank's, ``stages`` naming the one rank), which need no collective: they are one tensor
    until a wrapper (``fully_shard``, ``replicate``, ``parallelize_module``) wraps their
    layers apart and gives each its own copy, which are then summed on the rank. ``ties``
    here holds both, the ties across ranks first (``across`` of them).

    ``module`` holds this rank's layers under their names in the unpipelined model (the
    pipe). A tie's copies are read from its layers when asked for (``copies``): every
    distinct tensor that the names of the tie held here hold now, so copies that FSDP2's
    ``fully_shard`` or ``parallelize_module`` made after construction are the ones seen.
    Collective at construction (it may create process groups) and in every method: every
    rank of the pipeline calls them together (and, for ``DTensor`` copies, the ranks of
    their meshes, which run the same step).
    """

    def __init__(self, ties: Sequence[Tie], module: nn.Module, stage: int,
                 group: Optional[dist.ProcessGroup],
                 data_parallel_group: Optional[dist.ProcessGroup],
                 device: torch.device, local: Sequence[Tie] = ()) -> None:
        self.across = len(ties)
        self.ties = [*ties, *local]
        self.stage = stage
        self.group = group
        self.averaged = data_parallel_group  # where seqpipe's reducer averages (or None)
        self.device = device
        params = dict(module.named_parameters(remove_duplicate=False))
        # Per tie, its names this rank holds, and the (owner, attribute) of each.
        self.names = [[name for name in tie.names if name in params] for tie in self.ties]
        self.slots: List[List[Tuple[nn.Module, str]]] = [
            [(module.get_submodule(owner), attribute)
             for owner, _, attribute in (name.rpartition(".") for name in names)]
            for names in self.names]
        groups = (tie_groups([t.stages for t in ties], group, data_parallel_group, device)
                  if ties else {})
        # Per tie across ranks, the group its sums run on where this rank takes part, else
        # None: the holders' own group, or (where none could be made) the whole pipeline
        # group. A tie on one rank sums without one (None).
        self.pipeline_sums = groups is None
        self.sum_groups: List[Optional[dist.ProcessGroup]] = [
            group if groups is None else groups.get(t.stages) for t in ties]
        self.sum_groups += [None] * len(local)

    @property
    def copies(self) -> List[List[nn.Parameter]]:
        """Per tie, this rank's copies as its layers hold them now: each distinct tensor
        once, in the order of the tie's names (none: no copy here; one unless a wrapper
        wrapped the layers that share it apart)."""
        out = []
        for slots in self.slots:
            held: Dict[int, nn.Parameter] = {}
            for owner, attribute in slots:
                param = owner._parameters[attribute]
                assert param is not None
                held.setdefault(id(param), param)  # type: ignore[arg-type]
            out.append(list(held.values()))
        return out

    def uncounted(self) -> Set[int]:
        """The ids of this rank's copies that a sum over the whole model skips, so that it
        counts each tie once: all but the first copy on the tie's first rank."""
        return {id(copy) for tie, copies in zip(self.ties, self.copies)
                for copy in (copies[1:] if tie.stages[0] == self.stage else copies)}

    def whole(self, t: int, layouts: Sequence[int]) -> bool:
        """Whether tie ``t`` (across ranks)'s sum goes by whole tensors
        (``seqpipe.distributed.tie_layout``): unless every rank of its sum group holds
        copies and all are laid out alike. ``layouts``: per rank of the pipeline, its
        copies' ``tie_layout.layout`` code (``TieGrads`` gives one of its own to a rank
        whose copies differ), -1 without a copy."""
        members = range(len(layouts)) if self.pipeline_sums else self.ties[t].stages
        return len({layouts[r] for r in members}) > 1

    def start_sum(self, t: int, tensors: Sequence[Tensor],
                  whole: bool = False) -> Callable[[], None]:
        """Start summing ``tensors`` (this rank's copies' gradients or values; none on a
        rank without a copy, which adds zeros) over tie ``t``'s group (``sum_groups[t]``,
        which must not be ``None`` for a tie across ranks) and write the sum into each, in
        place: by local shards, or with ``whole`` by whole tensors (see ``tie_layout``); a
        tie on one rank sums its copies here, without a collective. The returned function
        waits for the sum."""
        tie = self.ties[t]
        mine = [] if whole else [local(tensor) for tensor in tensors]
        if whole or not tensors:
            dtype = sum_dtype(tie.dtype)
            parts = [full(tensor, dtype) for tensor in tensors]
        else:
            parts = [m if m.is_contiguous() else m.contiguous() for m in mine]
        flat = (torch.zeros(tie.shape, dtype=sum_dtype(tie.dtype), device=self.device)
                if not parts else parts[0] if len(parts) == 1 else torch.stack(parts).sum(0))
        work = (dist.all_reduce(flat, group=self.sum_groups[t], async_op=True)
                if t < self.across else None)

        def wait() -> None:
            if work is not None:
                work.wait()
            for tensor, part in zip(tensors, mine or tensors):
                if whole:
                    write_full(tensor, flat)
                elif part is not flat:
                    part.copy_(flat)
        return wait

    # -- checking ------------------------------------------------------------------------
    def _table(self, meta: Sequence[bool], ties: int) -> List[List[int]]:
        """Per stage, per tie (the first ``ties``): its copies' checksum; -1 without a copy,
        -2 if built on meta, -3 if this rank's copies differ."""
        mine = []
        for copies, on_meta in zip(self.copies[:ties], meta):
            sums = {-2} if on_meta and copies else {_checksum(c) for c in copies} or {-1}
            mine.append(sums.pop() if len(sums) == 1 else -3)
        return gather_ints(mine, self.group, self.device)

    def verify(self, meta: Optional[Sequence[bool]] = None, *,
               at_construction: bool = False) -> None:
        """Raise on every rank if some tie's copies differ. Copies built on ``meta``
        (``meta[t]`` on some holder, for the ties across ranks) take the first holder's
        values instead: fresh initialisations differ from rank to rank. At construction
        the ties on one rank are one tensor each, and are not checked."""
        ties = self.across if at_construction else len(self.ties)
        if not ties:
            return
        meta = [*(meta if meta is not None else []), *[False] * len(self.ties)]
        table = self._table(meta, ties)
        odd = []
        for t, tie in enumerate(self.ties[:ties]):
            sums = {table[s][t] for s in tie.stages}
            if -2 in sums:
                self._copy_from_first(t)
            elif -3 in sums:
                ranks = [s for s in tie.stages if table[s][t] == -3]
                odd.append(f"{tie.describe()} differs between its copies on rank(s) {ranks}")
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
            f"parameter only through train_step and the optimizer (or on every copy alike; "
            f"parameter groups chosen by name: map each name to its tie's first one, "
            f"first = {{n: tie.name for tie in pipe.ties for n in tie.names}})")

    @torch.no_grad()
    def _copy_from_first(self, t: int) -> None:
        """Give every copy of tie ``t`` (across ranks) its first holder's values (a sum
        where the others add zeros)."""
        copies = [copy.detach() for copy in self.copies[t]]
        if self.sum_groups[t] is None:
            return
        for n, copy in enumerate(copies):
            if n or self.stage != self.ties[t].stages[0]:
                copy.zero_()
        self.start_sum(t, copies, whole=True)()
