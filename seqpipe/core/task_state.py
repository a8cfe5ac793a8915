"""What a stage hands on and keeps for one micro-batch: its output and skips (``Sent``), and
what its forward keeps for the backward (``TaskState``: the graph's roots, how the received
tensors entered it, a checkpointed forward's pending recomputation, a split backward's
halves). ``seqpipe.core.stage`` makes and consumes them; both engines carry them between a
micro-batch's forward and backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ContextManager, Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge

from seqpipe.core.boundary import Received, wants_grad
from seqpipe.core.checkpoint import NOTHING, Replay
from seqpipe.core.entry import Entry
from seqpipe.core.microbatch import Batch
from seqpipe.core.saved import SavedTensors
from seqpipe.core.sink import GradSink
from seqpipe.core.split_backward import SplitBackward
from seqpipe.skip.tracker import SkipKey

__all__ = ["Pending", "Sent", "TaskState", "edge_of", "gradient_edge"]


@dataclass
class Sent:
    """What a stage produced for one micro-batch: its output and outgoing skips."""

    outputs: Batch
    skips: Dict[SkipKey, Optional[Tensor]]
    replayed: bool = False  # computed without a graph, to be recomputed with one at I

    def wants_grad(self, tensor: Optional[Tensor]) -> bool:
        """Whether the receiver of ``tensor`` should send its gradient back: as
        ``wants_grad``; for a forward that will be recomputed, whether it will have one."""
        if self.replayed:
            return tensor is not None and (tensor.is_floating_point() or tensor.is_complex())
        return wants_grad(tensor)


@dataclass
class TaskState:
    """What one (stage, micro-batch) forward keeps for its backward."""

    num_inputs: int
    skip_keys: Tuple[SkipKey, ...]
    entry: Entry = field(default_factory=Entry)  # how the received tensors entered the graph
    roots: List[Optional[GradientEdge]] = field(default_factory=list)
    skip_roots: Dict[SkipKey, Optional[GradientEdge]] = field(default_factory=dict)
    replay: Optional["Pending"] = None  # a checkpointed forward, recomputed at I
    split: Optional[SplitBackward] = None  # between I and W
    head: Optional["TaskState"] = None  # the loss's own graph, on a replayed last stage
    saved: Optional[SavedTensors] = None  # split: what the forward saved, freed after I
    stream: Optional[int] = None  # the seed of the backward's private stream, if it needs one
    start: Optional[Tensor] = None  # on the last stage: the loss's gradient (its weight)

    def edges(self) -> List[GradientEdge]:
        """The roots of this micro-batch's graph on the stage (outputs and skips)."""
        return [e for e in (*self.roots, *self.skip_roots.values()) if e is not None]

    def recording(self) -> ContextManager[None]:
        """Around more of this micro-batch's forward (the loss on the last stage): what it
        saves is held with the rest, so that a split backward frees it after ``I``."""
        return self.saved.recording() if self.saved is not None else NOTHING


@dataclass
class Pending:
    """What the recomputation of a checkpointed forward needs (split backward)."""

    received: Received
    replay: Replay
    sink: Optional[GradSink]


def edge_of(tensor: Optional[Tensor]) -> Optional[GradientEdge]:
    """The gradient edge of an output that carries a gradient back (``None`` for one that
    does not)."""
    return gradient_edge(tensor) if tensor is not None and wants_grad(tensor) else None


def gradient_edge(tensor: Tensor) -> GradientEdge:
    """``get_gradient_edge(tensor)``, made directly for a C++ node (per micro-batch)."""
    node = tensor.grad_fn
    if node is None or isinstance(node, torch._C._FunctionBase):  # a leaf, a Python node
        return get_gradient_edge(tensor)  # (which keeps a Python node's graph alive)
    return GradientEdge(node, tensor.output_nr)
