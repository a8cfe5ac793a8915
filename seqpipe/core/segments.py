"""Checkpointing a partition N layers at a time (``checkpoint_every=N``).

A checkpointed micro-batch normally recomputes its whole partition at once in backward, so
the backward holds all the partition's activations together. With ``checkpoint_every=N``
each run of ``N`` consecutive layers (a *segment*) is its own
``torch.utils.checkpoint`` (non-reentrant): the forward keeps each segment's inputs, and
the backward recomputes one segment at a time, just before backpropagating through it,
and frees it after. The checkpoint mode still chooses which micro-batches are
checkpointed; ``N`` only sets the grain inside the partition.

What stays as for a whole-partition checkpoint:

* **Random draws.** With private streams (``seqpipe.core.rng``), the forward of all segments
  draws from the task's one stream, as the whole partition does; each segment's
  recomputation restarts from where the stream stood when the segment began. Without
  them, each segment's checkpoint saves and restores the global generators itself. Either
  way every mask is the one a whole-partition checkpoint (and ``checkpoint="never"``) draws.
* **Inputs written in place.** Each segment copies its inputs inside its checkpoint, as a
  checkpointed partition does, so a first layer with ``inplace=True`` cannot change what
  the recomputation starts from.
* **Skips.** A skip stashed in one segment and popped in a later one of the same
  partition is kept by the stage's tracker for the popping segment's recomputation
  (``StageSkipTracker.between``); skips to and from other partitions work as before.
* **Flags.** Each segment's forward runs under ``is_checkpointing()``, its recomputation
  under ``is_recomputing()`` (deferred BatchNorm counts its statistics once).
* **The partition's own hooks.** The segments run as the partition's forward, through its
  ``__call__`` (``_as_forward``), so the hooks registered on the partition module run
  around them once, as around ``partition(x)``: FSDP2's on a stage sharded as a whole
  (``fully_shard(stage)``: all-gather the parameters no inner unit owns, cast the input
  under a mixed-precision policy, register the reduction), or a user's forward hooks.
  Calling the segments alone skipped them, and a sharded stage then ran its layers on
  the sharded ``DTensor`` parameters.

Split backwards (``I`` then ``W``) recompute a checkpointed micro-batch once, at ``I``,
for both halves (``Stage.backward_input``); everything recomputed must then live until
``W``, so segmenting would save nothing there, and that path is unchanged.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, FrozenSet, List, Optional, Sequence, Tuple

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from seqpipe.core.checkpoint import checkpointed
from seqpipe.core.rng import PrivateStreams
from seqpipe.skip.layout import SkipLayout
from seqpipe.skip.tracker import SkipKey

__all__ = ["run_segments", "segments_of", "skips_between"]

Call = Callable[[nn.Module, Any], Any]  # runs one segment on a value (the stage's tracker on)


def segments_of(partition: nn.Sequential, every: Optional[int]) -> List[nn.Sequential]:
    """The runs of ``every`` consecutive layers of ``partition``; empty when that is the
    whole partition (``every`` is None or at least its length): it is checkpointed whole."""
    if every is None or every >= len(partition):
        return []
    return [partition[i:i + every] for i in range(0, len(partition), every)]  # type: ignore[misc]


def skips_between(layout: SkipLayout, stage: int, every: Optional[int]) -> FrozenSet[SkipKey]:
    """The skips stashed and popped in partition ``stage``, but in two different segments."""
    if every is None:
        return frozenset()
    first = sum(layout.balance[:stage])
    return frozenset(s.key for s in layout.local_skips(stage)
                     if (s.stash_layer - first) // every != (s.pop_layer - first) // every)


def run_segments(partition: nn.Module, segments: Sequence[nn.Module], call: Call,
                 value: Any, *, seed: Optional[int]) -> Any:
    """Run ``segments`` (of ``partition``) in turn from ``value``, each checkpointed on its
    own, as ``partition``'s forward (its hooks around them, see ``_as_forward``).

    ``seed`` selects the task's private random streams, as in ``run_task``; ``None`` keeps
    the global generators, which each segment's checkpoint saves and restores.
    """
    streams = None if seed is None else PrivateStreams(seed)

    def forward(value: Any) -> Any:
        with nullcontext() if streams is None else streams.live():
            for segment in segments:
                value = _checkpointed(segment, call, value, streams)
        return value
    return _as_forward(partition, forward, value)


def _as_forward(module: nn.Module, forward: Callable[[Any], Any], value: Any) -> Any:
    """``forward(value)`` run in ``module``'s place: through ``module(value)``, so that the
    forward pre- and post-hooks registered on ``module`` run around it exactly as they run
    around ``module``'s own forward (an instance attribute shadows the class's ``forward``
    for this one call; the partition runs one task at a time, on one thread)."""
    own = module.__dict__.get("forward")  # a forward the instance already had (rare)
    module.forward = forward  # type: ignore[method-assign]
    try:
        return module(value)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own  # type: ignore[method-assign]


def _checkpointed(segment: nn.Module, call: Call, value: Any,
                  streams: Optional[PrivateStreams]) -> Any:
    """One segment under its checkpoint; the tensors of ``value`` are its inputs (whatever
    structure holds them: a tensor, a tuple, a dict), the rest is passed as it is."""
    leaves, spec = tree_flatten(value)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
    tensors = tuple(leaves[i] for i in where)
    for i in where:
        leaves[i] = None  # the checkpoint keeps the tensors (for the recomputation), not us

    def run(*inputs: Tensor) -> Any:
        filled = list(leaves)
        for i, tensor in zip(where, inputs):
            filled[i] = tensor.clone()  # a layer may write its input in place
        return call(segment, tree_unflatten(filled, spec))

    def rng() -> Tuple[ContextManager[Any], Callable[[], ContextManager[Any]]]:
        if streams is None:
            return nullcontext(), nullcontext
        mark = streams.mark()  # where the forward starts (its stream: live() above)
        return nullcontext(), lambda: streams.replay(mark)

    return checkpointed(run, tensors, rng, preserve_rng_state=streams is None)
