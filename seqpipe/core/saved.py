"""The tensors one micro-batch's forward saved for backward, held so a split backward can
drop, right after its ``I``, those that only the input path needed.

A split backward's ``I`` runs with ``retain_graph``, because its ``W`` runs part of the
same graph afterwards. Autograd then keeps every saved tensor of the graph, those of the
nodes ``W`` will never run again included (a ReLU's output, a loss's input), until the
graph dies: each micro-batch between its ``I`` and its ``W`` would hold its input path's
activations too, and a zero-bubble schedule would break its papers' memory bound (ZB-H1
no more than 1F1B). There is no public way to free one node's saved tensors, so the
forward records under a ``saved_tensors_hooks`` pair whose pack puts each saved tensor in a
holder that only autograd references; after ``I``, ``release`` empties the holders of the
nodes ``I`` ran that ``W`` does not run, and the tensors die with the last reference.
Every holder is noted as it is made, and after ``W`` all are emptied (``free_all``): what
the nodes ``W`` calls itself saved (the engine frees only what the nodes it runs saved),
and what no node owns directly (the inputs a layer's own ``torch.utils.checkpoint`` saves
for its recomputation, which ``I`` and ``W`` each read), which is never freed early.

The hooks delegate to those the caller installed (a saved-tensor meter, ``save_on_cpu``):
their pack runs on the tensor and their unpack on what it returned, as without seqpipe.
Which holders a node owns is read from its raw saved tensors (``node._raw_saved_mat1``),
whose ``data`` is what the pack hook returned, without unpacking anything. Unpacking would
run whichever unpack hook packed the tensor: a layer that checkpoints itself
(``torch.utils.checkpoint(..., use_reentrant=False)`` inside its forward, as Hugging Face
models do under ``gradient_checkpointing_enable()``) saves its inner tensors under
torch's own hooks, whose unpack recomputes the layer. (A torch whose ``SavedTensor`` has no
``data`` attribute is read by touching the saved attributes while *probing*: the unpack
then notes the holder and hands autograd an empty tensor instead of unpacking; a layer
that checkpoints itself then needs a newer torch under a split backward.)
With hooks a saved tensor is not version-checked by autograd, so the unpack checks it:
modifying a saved tensor in place still raises autograd's error.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["SavedTensors"]

Node = Any  # torch.autograd.graph.Node
_NAMES: Dict[type, Tuple[str, ...]] = {}  # node type -> its saved attributes
_RAW: Dict[type, Tuple[str, ...]] = {}  # node type -> its raw saved attributes
_READABLE = hasattr(torch._C._autograd.SavedTensor, "data")  # packed values readable as they are


class _Held:
    """One saved tensor (or what the caller's pack hook made of it)."""

    __slots__ = ("value", "unpack", "version", "meta")

    def __init__(self, value: Any, unpack: Optional[Callable[[Any], Tensor]],
                 tensor: Tensor) -> None:
        self.value: Optional[Any] = value
        self.unpack = unpack  # the caller's unpack hook, if its pack made ``value``
        self.version = tensor._version
        # Only a torch without ``SavedTensor.data`` probes (``_holders``) with an empty tensor
        # of the saved one's kind; reading ``device`` costs ~1 µs a saved tensor.
        self.meta = None if _READABLE else (tensor.dtype, tensor.device)


def _raw_names(node: Node) -> Tuple[str, ...]:
    """The attributes of ``node`` that hold its ``SavedTensor``s (``_raw_saved_mat1``; a
    custom Function's ``_raw_saved_tensors``, a tuple of them)."""
    kind = type(node)
    names = _RAW.get(kind)
    if names is None:
        names = _RAW[kind] = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
    return names


def _saved_names(node: Node) -> Tuple[str, ...]:
    """The attributes of ``node`` that unpack its saved tensors (``_saved_mat1``; a custom
    Function's ``saved_tensors``)."""
    kind = type(node)
    names = _NAMES.get(kind)
    if names is None:
        raw = [a[len("_raw_saved_"):] for a in dir(node) if a.startswith("_raw_saved_")]
        names = tuple(f"_saved_{r}" if hasattr(node, f"_saved_{r}") else f"saved_{r}"
                      for r in raw)
        _NAMES[kind] = names
    return names


class SavedTensors:
    """What one (stage, micro-batch) forward saved for backward, in releasable holders."""

    def __init__(self) -> None:
        self._outer: Optional[Tuple[Any, Any]] = None
        self._probe: Optional[List[_Held]] = None
        self._all: List[_Held] = []  # every holder the forward made, for ``free_all``

    def recording(self) -> ContextManager[None]:
        """Around the forward (and a loss computed on its output): hold what it saves.
        Where saved-tensor hooks are disabled, nothing is held (nor ever released)."""
        if torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None:
            return nullcontext()
        return self._recording()

    @contextmanager
    def _recording(self) -> Iterator[None]:
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: Tensor) -> _Held:
        if self._outer is not None:
            held = _Held(self._outer[0](tensor), self._outer[1], tensor)
        else:
            # Detached: an output saved with its grad_fn would be a cycle through the node
            # that saves it (autograd gives the unpacked tensor its grad_fn back).
            held = _Held(tensor.detach(), None, tensor)
        self._all.append(held)
        return held

    def _unpack(self, held: _Held) -> Tensor:
        if self._probe is not None:
            self._probe.append(held)
            dtype, device = held.meta  # type: ignore[misc]
            return torch.empty(0, dtype=dtype, device=device)
        if held.value is None:
            raise RuntimeError(
                "seqpipe freed this saved tensor after the input-gradient pass (I) of a "
                "split backward, as the weight-gradient pass (W) should not need it; a "
                "backward that reads it after I is not supported (report it with the model)")
        if held.unpack is not None:
            return held.unpack(held.value)
        value = held.value
        if value._version != held.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified "
                f"by an inplace operation: [{value.type()} {list(value.shape)}] is at "
                f"version {value._version}; expected version {held.version} instead")
        return value

    def _holders(self, nodes: Iterable[Node]) -> Dict[int, _Held]:
        """The holders that ``nodes`` own, by id, read without unpacking them."""
        if _READABLE:
            found: Dict[int, _Held] = {}
            for node in nodes:
                names = _RAW.get(type(node))
                for name in _raw_names(node) if names is None else names:
                    raw = getattr(node, name)
                    for saved in raw if isinstance(raw, (list, tuple)) else (raw,):
                        if saved is not None and isinstance(held := saved.data, _Held):
                            found[id(held)] = held
            return found
        probe: List[_Held] = []
        self._probe = probe
        try:
            for node in nodes:
                for name in _saved_names(node):
                    getattr(node, name)
        finally:
            self._probe = None
        return {id(h): h for h in probe}

    def release(self, ran: Iterable[Node], kept: Iterable[Node]) -> None:
        """Free what the nodes ``ran`` saved, except what the nodes ``kept`` still need."""
        needed = self._holders(kept)
        for key, held in self._holders(ran).items():
            if key not in needed:
                held.value = None

    def let_go(self) -> None:
        """Stop holding on to the holders: each dies with the node that saved it, as without
        seqpipe (a backward that runs every node again, ``W`` rerunning the whole graph)."""
        self._all = []

    def prune(self) -> None:
        """Stop noting the holders that only this list keeps: those of nodes already gone (a
        temporary the forward made and the graph never reached, which without the list
        would have died with it). A split backward calls it after ``I`` (after the send),
        so such a tensor lives until then at most (~20 us for 228 holders)."""
        # 3 references when only the list holds one: the list, the loop, getrefcount's own
        self._all = [held for held in self._all if sys.getrefcount(held) > 3]

    def free_all(self) -> None:
        """After ``W``: free every tensor the forward saved. Nothing runs this micro-batch's
        nodes again (the graph may outlive ``W``, in the roots a task state keeps); the
        engine has freed what the nodes it ran saved, but not what the nodes ``W`` called
        itself saved, nor what no node owns (a layer's own checkpoint's inputs)."""
        held, self._all = self._all, []
        self.free(held)

    @staticmethod
    def free(holders: Iterable[_Held]) -> None:
        """Drop the tensors in ``holders``; reading one again raises."""
        for held in holders:
            held.value = None
