"""``DTensor`` activations and gradients across a stage boundary: the local shard, described.

A stage split with tensor (sequence) parallelism may end in a layer whose output is a
``DTensor`` (``use_local_output=False``, ``SequenceParallel``'s default): sharded over the
stage's tensor-parallel ranks, say on the sequence dimension. Only plain tensors travel,
so the sending rank sends its **local shard**, and with it, among the message's
non-tensor values (``seqpipe.distributed.values``, at negative positions, which no item of
a micro-batch has), a short text describing it: its mesh's dimension names and sizes, the
sender's coordinate on them, the placements, the global shape and stride. The receiving
rank rebuilds the ``DTensor`` with ``DTensor.from_local`` on **its own** mesh of those
dimension names (the next stage's tensor-parallel group is other ranks): the sub-mesh of
``DistributedPipe(mesh=...)``, else that of one of this rank's ``DTensor`` parameters;
its coordinate there must be the sender's, so each shard reaches the rank that holds the
same part of the next stage (``mesh_groups`` builds pipelines that way).

Gradients go back the same way. The receiver's backward may give its input's gradient
other placements than the input had (a layer's own autograd function may return it
replicated): it is redistributed to the activation's placements before its local shard
is sent, and the sender rebuilds it on the mesh of the ``DTensor`` it sent, exactly as
the root of its backward expects. Between two stages of one rank the same description
is handed over in memory.

What cannot be rebuilt is refused, naming the mend: a mesh without dimension names or a
placement other than ``Shard``, ``Replicate`` and ``Partial`` (on the sender, before it
sends), and a receiver with no mesh of the sender's dimension names, on another
coordinate of it, or given a ``DistributedPipe(mesh=...)`` whose sub-mesh of those names
holds other ranks than the one its layers' ``DTensor`` parameters are split on (on the
receiver; it fails the call, so every rank of the pipeline raises).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from torch import Size, Tensor

from seqpipe.core.lazy_classes import is_dtensor
from seqpipe.core.stage import Stage
from seqpipe.distributed.traced import WHAT
from seqpipe.distributed.values import Values
from seqpipe.distributed.wire import Kind, Message

__all__ = ["Crossing", "check_mesh"]

_Identity = Tuple[Kind, int, int, int]  # a gradient message's kind, micro-batch, key, origin
_Name = Callable[[Optional[int]], str]  # how errors name a rank (None: this one)
_FORWARD = (Kind.ACTIVATION, Kind.SKIP)
_BACKWARD = (Kind.GRAD, Kind.SKIP_GRAD)


@dataclass(frozen=True)
class _Layout:
    """Where a ``DTensor`` lives and how it is laid out: what rebuilds it from its shard."""

    mesh: Any  # DeviceMesh
    placements: Tuple[Any, ...]
    shape: Size
    stride: Tuple[int, ...]

    @staticmethod
    def of(tensor: Any) -> "_Layout":
        return _Layout(tensor.device_mesh, tuple(tensor.placements), tensor.shape,
                       tuple(tensor.stride()))

    def build(self, shard: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(shard, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)


@dataclass(frozen=True)
class _Description:
    """A ``DTensor`` as the wire describes it (``text``), without its mesh."""

    names: Tuple[str, ...]
    sizes: Tuple[int, ...]
    coordinate: Tuple[int, ...]
    placements: Tuple[Any, ...]
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]

    def text(self) -> str:
        return "|".join([",".join(self.names), _ints(self.sizes), _ints(self.coordinate),
                         ",".join(map(_placement_text, self.placements)), _ints(self.shape),
                         _ints(self.stride)])

    @staticmethod
    def parse(text: str) -> "_Description":
        names, sizes, coordinate, placements, shape, stride = text.split("|")
        return _Description(tuple(names.split(",")), _parse_ints(sizes),
                            _parse_ints(coordinate),
                            tuple(_parse_placement(p) for p in placements.split(",")),
                            _parse_ints(shape), _parse_ints(stride))

    def layout(self, mesh: Any) -> _Layout:
        return _Layout(mesh, self.placements, Size(self.shape), self.stride)

    def shown(self) -> str:
        return (f"placements {self.placements}, global shape {self.shape}, on a mesh of "
                f"dimensions {self.names} sized {self.sizes}")


def _ints(values: Iterable[int]) -> str:
    return ",".join(map(str, values))


def _parse_ints(text: str) -> Tuple[int, ...]:
    return tuple(int(v) for v in text.split(",")) if text else ()


def _placement_text(placement: Any) -> str:
    from torch.distributed.tensor import Partial, Replicate, Shard
    if type(placement) is Shard:
        return f"S{placement.dim}"
    if type(placement) is Replicate:
        return "R"
    if type(placement) is Partial:
        return f"P{placement.reduce_op}"
    raise TypeError(f"a DTensor placed {placement!r} cannot cross a stage boundary: only "
                    f"Shard, Replicate and Partial placements are sent; redistribute it "
                    f"(tensor.redistribute(placements=...)) in the stage's last layer")


def _parse_placement(text: str) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard
    if text == "R":
        return Replicate()
    if text[0] == "S":
        return Shard(int(text[1:]))
    return Partial(text[1:])


def _describe(tensor: Any, sender: str, what: str) -> _Description:
    """How ``tensor``, a ``DTensor`` that ``sender`` sends as ``what``, goes on the wire;
    ``TypeError`` (on the sender) for one that no receiver could rebuild."""
    mesh = tensor.device_mesh
    if not mesh.mesh_dim_names:
        raise TypeError(
            f"{sender} would send a DTensor as the {what} on a mesh without dimension "
            f"names; the receiving stage rebuilds it on its own mesh of the same names: "
            f"name them (init_device_mesh(..., mesh_dim_names=(\"pp\", \"tp\")))")
    placements = tuple(tensor.placements)
    for placement in placements:
        _placement_text(placement)  # refuses what is not sent
    return _Description(tuple(mesh.mesh_dim_names), tuple(mesh.shape),
                        tuple(mesh.get_coordinate() or ()), placements, tuple(tensor.shape),
                        tuple(tensor.stride()))


def check_mesh(mesh: Any) -> Any:
    """``mesh`` (``DistributedPipe(mesh=...)``), checked: ``None`` or a ``DeviceMesh`` whose
    dimensions have names (a received ``DTensor``'s are looked up by name)."""
    if mesh is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, not "
                        f"{type(mesh).__name__}")
    if not mesh.mesh_dim_names:
        raise ValueError("mesh has no dimension names; a DTensor received from another "
                         "stage is rebuilt on the dimensions of its mesh's names: build it "
                         "with init_device_mesh(..., mesh_dim_names=(\"pp\", \"tp\"))")
    return mesh


def _returning(kind: Kind, microbatch: int, key: int, origin: int) -> _Identity:
    """The identity of the gradient message that answers a forward message (an
    activation from stage ``origin`` comes back from ``origin + 1``; a skip by its key)."""
    if kind == Kind.ACTIVATION:
        return (Kind.GRAD, microbatch, -1, origin + 1)
    return (Kind.SKIP_GRAD, microbatch, key, -1)


def _identity(kind: Kind, microbatch: int, key: int, origin: int) -> _Identity:
    """A gradient message's identity, as ``_returning`` names it."""
    if kind == Kind.GRAD:
        return (Kind.GRAD, microbatch, -1, origin)
    return (Kind.SKIP_GRAD, microbatch, key, -1)


class Crossing:
    """One call's ``DTensor``s across this rank's stage boundaries, both ways.

    ``stages``: this rank's stages (their ``DTensor`` parameters' meshes are where a
    received ``DTensor`` is rebuilt, without ``mesh``); ``mesh``: the
    ``DistributedPipe(mesh=...)``, or ``None``. It remembers the layout of every
    ``DTensor`` sent or received that wants a gradient, until the gradient passes. Each
    method takes ``name``, how errors name a rank (``Call.name``: by its stage; this one
    for ``None``), rather than holding it: a bound method would tie the call in a cycle.
    """

    def __init__(self, stages: Dict[int, Stage], mesh: Any) -> None:
        self._stages = stages
        self._mesh = mesh
        self._sent: Dict[_Identity, Dict[int, _Layout]] = {}  # their gradients come back
        self._received: Dict[_Identity, Dict[int, _Layout]] = {}  # theirs go back
        self._meshes: Dict[Tuple[str, ...], Any] = {}

    def outgoing(self, kind: Kind, microbatch: int, key: int, origin: int,
                 tensors: Sequence[Optional[Tensor]], flags: Optional[Sequence[bool]],
                 values: Values, name: _Name) -> Tuple[Sequence[Optional[Tensor]], Values]:
        """The tensors of a message as they go on the wire (each ``DTensor`` its local
        shard) and its values (with the descriptions, first); a gradient is first laid out
        as the ``DTensor`` it is the gradient of. Plain messages pass unchanged."""
        layouts = (self._received.pop(_identity(kind, microbatch, key, origin), None)
                   if self._received and kind in _BACKWARD else None)
        if layouts is None and (all(type(t) is Tensor or t is None for t in tensors)  # (plain:
                                or not any(map(is_dtensor, tensors))):  # at once) the usual case
            return tensors, values
        sender, what = name(None), WHAT[kind]
        if kind in _BACKWARD:
            tensors = _as_sent(tensors, layouts or {}, sender, what)
        out: List[Optional[Tensor]] = list(tensors)
        described: List[Tuple[int, Any]] = []
        kept: Dict[int, _Layout] = {}
        for j, tensor in enumerate(tensors):
            if not is_dtensor(tensor):
                continue
            described.append((-1 - j, _describe(tensor, sender, what).text()))
            out[j] = tensor.to_local().detach()  # type: ignore[union-attr]
            if kind in _FORWARD and flags is not None and flags[j]:
                kept[j] = _Layout.of(tensor)
        if kept:
            self._sent[_returning(kind, microbatch, key, origin)] = kept
        return out, (*described, *values)

    def incoming(self, message: Message, src: int, name: _Name) -> Message:
        """``message`` with its ``DTensor``s rebuilt from their shards: an activation or
        skip on this rank's mesh of the sender's dimension names, a gradient on the mesh of
        the ``DTensor`` it answers (``src``: the rank it came from). Plain messages pass
        unchanged."""
        values = message.values
        if not values or values[0][0] >= 0:  # the usual case: at once
            if self._sent and message.kind in _BACKWARD:
                self._sent.pop(_identity(message.kind, message.microbatch, message.key,
                                         message.origin), None)
            return message
        described = {-1 - position: _Description.parse(text) for position, text in values
                     if position < 0}
        tensors: List[Optional[Tensor]] = list(message.tensors)
        if message.kind in _BACKWARD:
            layouts = self._sent.pop(_identity(message.kind, message.microbatch, message.key,
                                               message.origin), {})
            for j in described:
                if tensors[j] is not None:
                    tensors[j] = layouts[j].build(tensors[j])  # type: ignore[arg-type]
        else:
            kept: Dict[int, _Layout] = {}
            for j, description in described.items():
                layout = description.layout(self._mesh_for(description, src, message.kind,
                                                            name))
                tensors[j] = layout.build(tensors[j])  # type: ignore[arg-type]
                if message.flags[j]:
                    kept[j] = layout
            if kept:
                self._received[_returning(message.kind, message.microbatch, message.key,
                                          message.origin)] = kept
        return dataclasses.replace(message, tensors=tuple(tensors),
                                   values=tuple(v for v in values if v[0] >= 0))

    def _mesh_for(self, description: _Description, src: int, kind: Kind, name: _Name) -> Any:
        """This rank's mesh of the described dimensions, checked against the sender's."""
        names = description.names
        mesh = self._meshes.get(names)
        if mesh is None:
            mesh = self._find(names, description, src, kind, name)
            self._check_parameters(mesh, names, description, src, kind, name)
            self._meshes[names] = mesh
        coordinate = tuple(mesh.get_coordinate() or ())
        if tuple(mesh.shape) != description.sizes or coordinate != description.coordinate:
            raise ValueError(
                f"{name(None)} received a DTensor {WHAT[kind]} from {name(src)} ("
                f"{description.shown()}, the sender at coordinate {description.coordinate}), "
                f"but this rank is at coordinate {coordinate} of a mesh of those dimensions "
                f"sized {tuple(mesh.shape)}: its shard would land on the wrong rank. Build "
                f"the pipeline groups from the same mesh (seqpipe.distributed.mesh_groups: "
                f"a pipeline's ranks share their tensor-parallel coordinate), and pass that "
                f"mesh as DistributedPipe(mesh=...)")
        return mesh

    def _check_parameters(self, mesh: Any, names: Tuple[str, ...], description: _Description,
                          src: int, kind: Kind, name: _Name) -> None:
        """``ValueError`` unless ``mesh`` (of ``DistributedPipe(mesh=...)``) holds the same
        ranks as this rank's ``DTensor`` parameters' meshes of ``names``: a received
        activation rebuilt on another mesh than the layers that take it were split on
        meets them on other ranks (torch then refuses on some ranks only, and the rank
        whose coordinate happens to differ would blame the pipeline groups)."""
        if self._mesh is None:
            return  # found among the parameters' meshes themselves
        ranks = mesh.mesh.tolist()
        seen: Dict[int, Any] = {}
        for stage in self._stages.values():
            for p in stage.partition.parameters():
                if is_dtensor(p) and set(names) <= set(p.device_mesh.mesh_dim_names or ()):
                    seen.setdefault(id(p.device_mesh), p.device_mesh)
        for theirs in seen.values():
            sub = theirs if tuple(theirs.mesh_dim_names) == names else theirs[
                names[0] if len(names) == 1 else names]
            if sub.mesh.tolist() != ranks:
                raise ValueError(
                    f"{name(None)} received a DTensor {WHAT[kind]} from {name(src)} "
                    f"({description.shown()}) to rebuild on DistributedPipe(mesh=...)'s "
                    f"{names} dimensions, ranks {ranks}, but its layers' DTensor parameters "
                    f"are split over ranks {sub.mesh.tolist()} on those dimensions: pass "
                    f"the mesh the tensor-parallel layers were split on (the one the "
                    f"pipeline groups come from) as DistributedPipe(mesh=...)")

    def _find(self, names: Tuple[str, ...], description: _Description, src: int,
              kind: Kind, name: _Name) -> Any:
        """The sub-mesh of ``names``: of ``DistributedPipe(mesh=...)``, else of a mesh of
        one of this rank's ``DTensor`` parameters that has them."""
        candidates = [self._mesh] if self._mesh is not None else [
            p.device_mesh for stage in self._stages.values()
            for p in stage.partition.parameters() if is_dtensor(p)]
        for mesh in candidates:
            if set(names) <= set(mesh.mesh_dim_names or ()):
                return mesh if tuple(mesh.mesh_dim_names) == names else mesh[
                    names[0] if len(names) == 1 else names]
        where = ("DistributedPipe(mesh=...) has dimensions "
                 f"{tuple(self._mesh.mesh_dim_names or ())}" if self._mesh is not None else
                 "none of its parameters is a DTensor on a mesh of those dimensions")
        raise ValueError(
            f"{name(None)} received a DTensor {WHAT[kind]} from {name(src)} "
            f"({description.shown()}) and cannot tell which of its meshes to rebuild it "
            f"on: {where}. Pass DistributedPipe(..., mesh=mesh), the DeviceMesh with "
            f"dimensions {names} (say the (\"pp\", \"tp\") mesh the pipeline groups come "
            f"from), or make the sender's output a plain tensor (use_local_output=True)")


def _as_sent(grads: Sequence[Optional[Tensor]], layouts: Dict[int, _Layout], sender: str,
             what: str) -> List[Optional[Tensor]]:
    """Each gradient laid out as the ``DTensor`` it is the gradient of (redistributed if
    the backward gave it other placements)."""
    out: List[Optional[Tensor]] = list(grads)
    for j, grad in enumerate(grads):
        layout = layouts.get(j)
        if grad is None or layout is None:
            if grad is not None and is_dtensor(grad):
                raise TypeError(f"{sender} would send a DTensor {what} for a plain tensor it "
                                f"received: its backward made the gradient a DTensor")
            continue
        if not is_dtensor(grad):
            raise TypeError(
                f"{sender} would send a plain {what} ({tuple(grad.shape)}) for a DTensor "
                f"it received (placements {layout.placements}, global shape "
                f"{tuple(layout.shape)}); its backward must give a DTensor gradient")
        if tuple(grad.placements) != layout.placements:  # type: ignore[attr-defined]
            grad = grad.redistribute(layout.mesh, layout.placements)  # type: ignore[attr-defined]
        out[j] = grad
    return out
