"""The gradients of tied weights over one ``train_step``: what the step added, summed over
the copies (on the ranks that hold one, and on one rank, the copies that wrappers made).

Each rank that uses a tie holds a copy (``seqpipe.distributed.ties``); at the end of a step
each copy's gradient is summed over the holders, so every copy gets the plain model's
gradient, the sum over all uses. Two things make "each copy's gradient" more than
``.grad``:

* **Accumulation.** ``.grad`` may hold earlier steps' gradients (two ``train_step`` calls
  without ``zero_grad()`` between them), which every copy already holds summed; summing
  ``.grad`` again would count them once more per holder. So at the start of the step
  each trained copy's ``.grad`` is set aside (``None`` meanwhile), the step's backward
  fills a fresh one, that is summed, and the earlier gradient is added back, in place
  in the tensor ``.grad`` held (as autograd accumulates). Exact: nothing is subtracted.
  Meanwhile a hook on a tied copy (a post-accumulate hook, the data-parallel reducer's)
  sees this step's gradient, not the earlier steps' (the reducer's mean is unchanged by
  it). A failed step puts the earlier gradient back under what the step left, unsummed.
* **Freezing.** Which ties are summed follows ``requires_grad`` at the start of every
  step, as the data-parallel reducer does: a tie unfrozen later is summed from then on,
  and a frozen one is left alone (``.grad`` stays ``None`` after ``zero_grad()``, so
  AdamW leaves it alone too). The ranks agree in one small all-gather over the pipeline
  group at the end of the step: per tie and rank, no copy, frozen, trained, or trained
  and given a gradient by this step. That names a tie frozen on some of its holders only
  (each rank raises, instead of one rank waiting in a sum the others never start), tells
  a rank without a copy whether to take part (on a pipeline group made by hand, where
  it adds zeros), and skips a tie that no holder got a gradient for in this step (its
  ``.grad`` stays as it was, ``None`` included, as with DDP); a holder that got none while
  another did gets the sum.
* **Sharding.** A copy FSDP2 manages keeps its gradient, unreduced, in FSDP2's unsharded
  parameter until FSDP2's reduce-scatter, which adds it to the sharded ``.grad``: that
  gradient is the one summed (nothing set aside), and its stage's reduction waits for the
  sum (``ShardedStep.claim``). The all-gather also carries each copy's layout, from which
  every rank picks whether a ``DTensor`` tie is summed by local shards or whole
  (``TiedCopies.whole``).
* **Copies on one rank.** Where a wrapper wrapped apart the layers of one rank that share a
  tie (``seqpipe.distributed.tie_local``), the rank holds several copies: each is set aside,
  read and written as above, their sum is the rank's part of the tie's sum (a tie within
  one rank needs no collective and no agreement), and the rank's layout code is one of its
  own when its copies are laid out differently, so that the tie goes whole. Its copies must
  all be trained or all frozen (``check``, at the start of the step: ``ValueError`` naming
  the names to set ``requires_grad`` on).
* **Drift.** Copies stay equal only if every rank's optimizer steps its copy alike. The
  all-gather also carries four elements of each rank's copy (their bits, read on the
  device: no extra sync), so copies that an optimizer stepped differently (parameter groups
  chosen by name, where a copy goes by its own layer's name on each rank; clipping per
  rank) make every rank raise at the next step, naming the mend, instead of training
  another model silently. A sharded or tensor-parallel copy is not compared.
* **Two averages.** seqpipe's reducer averages its copies over the replicas before the sum,
  FSDP2 its copies after it (in the reduce-scatter of the unsharded gradient the sum went
  into). Where one tie has copies of both kinds (on one rank, or on different ranks: the
  all-gather carries who averages each rank's copies), FSDP2's copies' gradients are
  averaged over ``data_parallel_group`` (the same ranks as FSDP2's mesh,
  ``ShardedStep.check``) before the sum, so that every copy gets the mean of the sum.
"""
from __future__ import annotations

import functools
import operator
from typing import List, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist
from torch import Tensor

from seqpipe.core.lazy_classes import is_dtensor
from seqpipe.distributed.agreement import gather_ints
from seqpipe.distributed.fsdp import ShardedStep, unsharded_grad
from seqpipe.distributed.tensor_parallel import local
from seqpipe.distributed.tie_layout import layout
from seqpipe.distributed.ties import TiedCopies

__all__ = ["TieGrads"]

# A rank's word on a tie, per step (the all-gather's values).
NO_COPY, FROZEN, TRAINED, GIVEN = -1, 0, 1, 2
# A layout code no single layout has (``layout`` codes are below 2**32): this rank's copies
# are laid out differently, so the tie's sum goes by whole tensors.
_APART = 1 << 32
# Who averages a rank's copies over the data-parallel replicas (bits): FSDP2, after the sum
# (it reduces the unsharded gradient the sum went into), and seqpipe's reducer, before it.
_SHARDED, _REDUCED = 1, 2
_BOTH = _SHARDED | _REDUCED
# Elements of each tied copy compared over its holders at every step (their bits), and the
# value of a probe a rank cannot give (no plain copy here: none, or a sharded or
# tensor-parallel one, whose local values differ between holders by design).
_PROBES = 4
_UNPROBED = -(1 << 62)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TieGrads:
    """One step's gradients of this rank's tied copies: ``set_aside`` at the start,
    ``reduce`` at the end (collective over the pipeline group), or ``put_back`` after a
    failure."""

    def __init__(self, copies: TiedCopies) -> None:
        self.copies = copies
        # Per tie, from the start of the step: this rank's copies (as its layers held them
        # then; none for a tie on one rank whose layers hold one tensor), the FSDPParam that
        # manages each (if FSDP2 does), whether it is trained, and what each copy's .grad
        # held then (set aside).
        ties = len(copies.ties)
        self.now: List[List[Tensor]] = [[] for _ in range(ties)]
        self.fsdp: List[List[Optional[object]]] = [[] for _ in range(ties)]
        self.trained: List[bool] = [False] * ties
        self.earlier: List[List[Optional[Tensor]]] = [[] for _ in range(ties)]

    @property
    def active(self) -> bool:
        """Whether this step sums something: a tie across ranks, or copies on one rank."""
        return self.copies.across > 0 or any(self.now)

    def set_aside(self, sharded: Optional[ShardedStep] = None) -> None:
        """Start of a step: note which copies are trained (``requires_grad`` now) and set
        their ``.grad`` aside, so that the step's backward fills a fresh one. A copy that
        FSDP2 manages (``sharded.claim``) keeps its sharded ``.grad``: its sum goes into
        the step's unsharded gradient before FSDP2 reduces it (and adds it to ``.grad``)."""
        across = self.copies.across
        for t, copies in enumerate(self.copies.copies):
            if t >= across and len(copies) < 2:
                copies = []  # one tensor on one rank: autograd sums its uses
            self.now[t] = copies
            self.fsdp[t] = [sharded.claim(c) if sharded is not None else None for c in copies]
            self.trained[t] = any(c.requires_grad for c in copies)
            self.earlier[t] = [None] * len(copies)
            if self.trained[t]:
                for n, (copy, fsdp_param) in enumerate(zip(copies, self.fsdp[t])):
                    if fsdp_param is None:
                        self.earlier[t][n], copy.grad = copy.grad, None

    def check(self) -> None:
        """Raise ``ValueError`` if some of a tie's copies on this rank are trained and
        others frozen (``requires_grad`` set through one of the layers that a wrapper
        wrapped apart): the tie would be half trained."""
        for t, (tie, copies) in enumerate(zip(self.copies.ties, self.now)):
            if len({c.requires_grad for c in copies}) > 1:
                self.put_back()
                trained = [name for name, (owner, attribute) in
                           zip(self.copies.names[t], self.copies.slots[t])
                           if owner._parameters[attribute].requires_grad]  # type: ignore[union-attr]
                raise ValueError(
                    f"the tied parameter {tie.describe()} requires grad in its copies "
                    f"{trained} on this rank but not in the others: a wrapper (fully_shard, "
                    f"replicate, parallelize_module) wrapped the layers that share it apart, "
                    f"so setting requires_grad through one layer reaches one copy only. Set "
                    f"it on every name alike, between steps: for name in {list(tie.names)}: "
                    f"pipe.get_parameter(name).requires_grad_(flag), on the ranks that hold "
                    f"it")

    def put_back(self) -> None:
        """Add what was set aside back to each copy's ``.grad`` (the tensor it was)."""
        for copies, earlier in zip(self.now, self.earlier):
            for n, copy in enumerate(copies):
                held, earlier[n] = earlier[n], None
                if held is None:
                    continue
                if copy.grad is not None:
                    held.add_(copy.grad)
                copy.grad = held

    def _made(self, t: int) -> List[Tensor]:
        """This step's gradient of each of this rank's copies of tie ``t``, zeros where
        there is none (``_grads``)."""
        return cast(List[Tensor], self._grads(t, create=True))

    def _grads(self, t: int, create: bool = False) -> List[Optional[Tensor]]:
        """This step's gradient of each of this rank's copies of tie ``t`` (FSDP2's
        unsharded one for a copy it manages); zeros set where there is none if
        ``create``."""
        grads: List[Optional[Tensor]] = []
        for copy, fsdp_param in zip(self.now[t], self.fsdp[t]):
            if fsdp_param is not None:
                grads.append(unsharded_grad(fsdp_param, create))
                continue
            if copy.grad is None and create:
                copy.grad = torch.zeros_like(copy)
            grads.append(copy.grad)
        return grads

    def _layout(self, t: int, grads: Sequence[Optional[Tensor]]) -> int:
        """The layout code of this rank's copies of tie ``t`` (``-1``: none here;
        ``_APART`` plus the rank where they differ): each copy's gradient, else what it
        would be made like (FSDP2's unsharded parameter, or the copy)."""
        codes = set()
        for copy, fsdp_param, grad in zip(self.now[t], self.fsdp[t], grads):
            if grad is None:
                leaf = getattr(fsdp_param, "_unsharded_param", None)
                grad = leaf if leaf is not None else copy
            codes.add(layout(grad))
        return -1 if not codes else codes.pop() if len(codes) == 1 else _APART + self.copies.stage

    def reduce(self) -> None:
        """End of a step: agree on which ties across ranks to sum, sum this step's gradient
        of each over its copies and holders (every all-reduce started before any is waited
        for; by local shards, or whole where the copies are laid out differently, see
        ``seqpipe.distributed.tie_layout``), then add back what earlier steps left.

        Raises:
            RuntimeError: on every rank, a tie trained on some holders and frozen on
                others.
        """
        across = self.copies.across
        waits = []
        if across:
            words, layouts, kinds, probes = self._words()
            said = [[words[r][t] for r in tie.stages]
                    for t, tie in enumerate(self.copies.ties[:across])]
            for tie, theirs in zip(self.copies.ties, said):
                if FROZEN in theirs and any(w >= TRAINED for w in theirs):
                    self.put_back()
                    raise RuntimeError(_mixed(tie.describe(), tie.stages, theirs))
            for t, tie in enumerate(self.copies.ties[:across]):
                seen = {tuple(probes[r][t]) for r in tie.stages} - {(_UNPROBED,) * _PROBES}
                if len(seen) > 1:
                    self.put_back()
                    raise RuntimeError(drifted(tie.describe(), tie.name, tie.stages))
            for t in range(across):
                if GIVEN not in said[t] or self.copies.sum_groups[t] is None:
                    continue  # frozen, or no gradient anywhere, or not this rank's sum
                whole = self.copies.whole(t, [row[t] for row in layouts])
                grads = self._made(t)
                if functools.reduce(operator.or_, (row[t] for row in kinds)) == _BOTH:
                    self._average_sharded(t, grads)
                waits.append(self.copies.start_sum(t, grads, whole))
        for t in range(across, len(self.copies.ties)):  # copies on this rank only
            if self.trained[t] and any(g is not None for g in self._grads(t)):
                grads = self._made(t)
                if self._kind(t) == _BOTH:
                    self._average_sharded(t, grads)
                whole = self._layout(t, grads) >= _APART
                waits.append(self.copies.start_sum(t, grads, whole))
        for wait in waits:
            wait()
        self.put_back()

    def _kind(self, t: int) -> int:
        """Who averages this rank's copies of tie ``t`` over the replicas (``_SHARDED``,
        ``_REDUCED``, both or neither)."""
        kind = 0
        for fsdp_param in self.fsdp[t]:
            kind |= _SHARDED if fsdp_param is not None else (
                _REDUCED if self.copies.averaged is not None else 0)
        return kind

    def _average_sharded(self, t: int, grads: Sequence[Tensor]) -> None:
        """Average FSDP2's copies' gradients of tie ``t`` over the replicas now, where other
        copies of the tie are seqpipe's reducer's, which has averaged theirs already: every
        part of the sum is then a mean, so the reducer's copies get the tie's mean too
        (FSDP2's mean of what is already equal over the replicas changes nothing)."""
        group = self.copies.averaged
        assert group is not None
        for grad, fsdp_param in zip(grads, self.fsdp[t]):
            if fsdp_param is not None:
                mine = local(grad)
                dist.all_reduce(mine, group=group)
                mine.div_(dist.get_world_size(group))

    def _probe(self, t: int) -> Tensor:
        """A few elements of this rank's copy of tie ``t``, as integers (their bits), on
        the device, not read on the host: equal on every holder while the copies are
        (``_UNPROBED`` where this rank has no plain copy)."""
        unprobed = torch.full((_PROBES,), _UNPROBED, dtype=torch.int64, device=self.copies.device)
        copies = self.now[t]
        if not copies or self.fsdp[t][0] is not None or is_dtensor(copies[0]) or \
                copies[0].element_size() not in _BITS or copies[0].numel() == 0:
            return unprobed
        flat = copies[0].detach().reshape(-1)
        stride = max(1, (flat.numel() - 1) // (_PROBES - 1))
        picked = flat[::stride][:_PROBES].view(_BITS[flat.element_size()]).to(
            self.copies.device, torch.int64)
        return torch.cat([picked, unprobed[picked.numel():]])

    def _words(self) -> Tuple[List[List[int]], List[List[int]], List[List[int]],
                              List[List[List[int]]]]:
        """Per rank of the pipeline, per tie across ranks: its word (``NO_COPY`` ...
        ``GIVEN``), its copies' gradients' layout (``_layout``; -1 without a copy), who
        averages them (``_kind``), and its copy's probe (``_probe``), from the last
        optimizer step: copies that differ there drifted apart."""
        mine = []
        for t in range(self.copies.across):
            grads = self._grads(t) if self.trained[t] else [None] * len(self.now[t])
            if not self.now[t]:
                word = NO_COPY
            elif not self.trained[t]:
                word = FROZEN
            else:
                word = GIVEN if any(g is not None for g in grads) else TRAINED
            mine += [word, self._layout(t, grads), self._kind(t)]
        across = self.copies.across
        probes = torch.cat([self._probe(t) for t in range(across)])
        everyone = gather_ints(mine, self.copies.group, self.copies.device, tail=probes)
        words = [w[:3 * across] for w in everyone]
        return ([w[0::3] for w in words], [w[1::3] for w in words],
                [w[2::3] for w in words],
                [[w[3 * across + _PROBES * t:3 * across + _PROBES * (t + 1)]
                  for t in range(across)] for w in everyone])


def _mixed(tie: str, stages: Sequence[int], said: List[int]) -> str:
    """The error for a tie trained on some of its holders (``stages``) and frozen on others."""
    trained = [s for s, w in zip(stages, said) if w >= TRAINED]
    frozen = [s for s, w in zip(stages, said) if w == FROZEN]
    return (f"the tied parameter {tie} requires grad on stages {trained} but not on "
            f"{frozen}: its copies would no longer get the same gradient. Set requires_grad "
            f"of a tied parameter on every rank alike, between steps: through the model you "
            f"built the pipe from (e.g. model[0].weight.requires_grad_(False)), which "
            f"reaches each rank's copy")


# How to choose parameter groups by name, as in the plain model (both errors about drifted
# copies name it).
FIRST_NAMES = ("map each name to its tie's first one, the name the plain model gives (first = "
               "{n: tie.name for tie in pipe.ties for n in tie.names}; first.get(name, name))")


def drifted(tie: str, first: str, stages: Sequence[int]) -> str:
    """The error for a tie whose copies differ after an optimizer step: what makes the
    copies' steps differ, and the mend."""
    return (f"the tied parameter {tie} differs between its copies on ranks {list(stages)} "
            f"after the last optimizer step: the copies drifted apart, so the model is no "
            f"longer the tied one. Step every copy alike on every rank (the same learning "
            f"rate, weight decay and clipping). Parameter groups chosen by name see a "
            f"copy under its own layer's name on each rank, while the plain model's "
            f"named_parameters() gives the tensor once, as {first!r}: {FIRST_NAMES}; clip "
            f"with pipe.clip_grad_norm_, not per rank")
