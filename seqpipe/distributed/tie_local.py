"""Parameters that two or more layers on one rank share: one parameter, however wrapped.

Layers of one rank that share a parameter (a tied embedding and head on the first and last
stage, both on rank 0 under ``zbv`` or ``dualpipev``; or two layers of one stage) hold one
tensor, so autograd sums both uses into its one gradient and no tie sum is needed. FSDP2's
``fully_shard``, the FSDP2-style ``replicate`` and ``parallelize_module`` break that sharing
when they wrap the layers apart: each gives the layer it wraps its own ``DTensor``
parameter, each of which would get only its own use's gradient. That is the situation of a
weight tied across ranks (``seqpipe.distributed.ties``) with the copies on one rank, and it
is trained the same way: ``one_rank_ties`` lists these parameters at construction (every
rank's, from the whole model, so that the ranks agree on them), ``TiedCopies`` reads the
copies the layers hold at each step, and ``TieGrads`` sums their gradients on the rank after
the step's backward (FSDP2's unsharded ones before FSDP2 reduces them; ``DTensor``\\ s by
local shards when laid out alike, else whole, see ``seqpipe.distributed.tie_layout``) and
writes the sum into each, so identical optimizer steps keep the copies equal. While the
layers hold one tensor nothing is summed.
"""
from __future__ import annotations

from typing import List, Sequence

from torch import nn

from seqpipe.distributed.ties import Tie, shared_tensors
from seqpipe.schedule import Placement

__all__ = ["one_rank_ties"]


def one_rank_ties(module: nn.Sequential, balance: Sequence[int],
                  placement: Placement) -> List[Tie]:
    """The parameters that two or more names of ``module``'s layers share, all on one rank
    (by ``placement`` of the stages ``balance`` gives), in state-dict order; each
    ``Tie.stages`` names that rank."""
    rank_of = [placement.rank_of(s) for s, n in enumerate(balance) for _ in range(n)]
    return [Tie(tuple(names), tuple(ranks), tuple(t.shape), t.dtype)
            for t, names, ranks in shared_tensors(module, rank_of)
            if len(ranks) == 1 and len(names) > 1]
