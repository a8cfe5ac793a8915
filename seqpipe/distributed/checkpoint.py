"""Sharded checkpoints of pipelines that load into any layout, and full state dicts.

Every ``DistributedPipe`` rank registers its layers under their names in the original
``nn.Sequential`` (``"4.weight"``), so ``torch.distributed.checkpoint`` (DCP) needs no help
to write a sharded checkpoint: each rank writes the keys it holds, replicas of a stage
(data parallelism) write each key once, and a rank that loads asks for the keys *it* holds
now, whatever layout wrote them. The helpers here only fix the choices that make this
work for pipelines, so every caller makes them the same way:

* model and optimizer go into one checkpoint, ``{"model": ..., "optim": ...}``;
* the optimizer state is *flattened* per parameter
  (``StateDictOptions(flatten_optimizer_state_dict=True)``), so ``"optim.state.4.weight.
  momentum_buffer"`` and ``"optim.param_groups.4.weight.lr"`` belong to one parameter.
  Unflattened, every stage writes its own ``param_groups[0]["params"]`` list under the
  same key and a checkpoint cannot be re-partitioned;
* a stage without parameters or buffers (only activations) has an empty state dict,
  which ``get_state_dict`` refuses; here it simply contributes nothing;
* a fresh optimizer gets its state allocated before loading even when the parameters
  already hold gradients (``get_optimizer_state_dict`` would otherwise skip the
  allocation and the saved momentum would be silently dropped);
* ``strict`` loading also rejects a checkpoint with *more* model entries than the model
  (DCP alone only rejects missing ones, so a bigger model's checkpoint would load);
* ``load_into_plain`` loads into one unpipelined model in one process, with or without
  a process group;
* a tensor with several names (tied weights: ``head.weight = embedding.weight``) is kept
  once, under its first name in the unpipelined model (``"0.weight"``), model state and
  optimizer state alike; on loading, every name of it (every stage's copy of a tie
  across stages) gets that entry. The unpipelined model's optimizer already keys the
  tensor by its first name, so the checkpoint moves between plain models, ``Pipe`` and
  ``DistributedPipe`` of any layout, and a plain model loads it with the tie intact.

``gather_full_state_dict`` is the other way to keep a model: the whole state dict on one
rank, for ``torch.save``. Only tensors travel (names as UTF-8 bytes in a ``uint8``
tensor, shapes and dtypes as ``int64`` tensors), never pickled objects.

See ``docs/checkpointing.md``.
"""
from __future__ import annotations

import os
import warnings
from itertools import chain
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from seqpipe.core.lazy_classes import is_dtensor
from seqpipe.distributed.pipe import DistributedPipe
from seqpipe.distributed.ties import canonical_names

__all__ = ["OPTIONS", "CheckpointError", "save", "load", "load_into_plain",
           "gather_full_state_dict"]

PathLike = Union[str, "os.PathLike[str]"]

#: The state-dict options every helper here uses (flattened optimizer state: one
#: parameter's state and hyperparameters under keys that start with its name).
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

#: Full tensors on every rank, for ``gather_full_state_dict`` of sharded stages.
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=False)

_MODEL = "model"
_OPTIM = "optim"


class CheckpointError(RuntimeError):
    """Saving or loading failed; raised on every rank, naming each failing rank's error.

    It wraps DCP's ``CheckpointException`` (its ``__cause__``), which derives from
    ``BaseException`` and so slips through ``except Exception``.
    """


def _dcp(what: str, path: PathLike, call: Any, *args: Any, **kwargs: Any) -> None:
    try:
        call(*args, **kwargs)
    except CheckpointException as exc:
        reasons = "; ".join(f"rank {rank}: {type(err).__name__}: {err}"
                            for rank, (err, _) in sorted(exc.failures.items()))
        raise CheckpointError(f"{what} the checkpoint at {os.fspath(path)!r} failed: "
                              f"{reasons}") from exc


def _has_state(module: nn.Module) -> bool:
    return bool(module.state_dict())


def _state_dicts(module: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 *, for_load: bool) -> Dict[str, Dict[str, Any]]:
    """``{"model": ..., "optim": ...}`` for DCP; either may be empty on a stage."""
    model = get_model_state_dict(module, options=OPTIONS) if _has_state(module) else {}
    optim: Dict[str, Any] = {}
    if optimizer is not None:
        if for_load and not optimizer.state:
            # get_optimizer_state_dict allocates the state of a fresh optimizer (one step
            # with zero gradients and lr 0) only if no parameter holds a gradient; set
            # them aside so the state to load into always exists.
            params = [p for g in optimizer.param_groups for p in g["params"]]
            grads = [p.grad for p in params]
            for p in params:
                p.grad = None
            try:
                optim = get_optimizer_state_dict(module, optimizer, options=OPTIONS)
            finally:
                for p, g in zip(params, grads):
                    p.grad = g
        else:
            optim = get_optimizer_state_dict(module, optimizer, options=OPTIONS)
    return {_MODEL: model, _OPTIM: optim}


def _aliases(module: nn.Module) -> Dict[str, str]:
    """Second names of shared tensors (tied weights), mapped to the first ones; for a model
    converted by ``seqpipe.to_sequential`` (``module.origin``), every key mapped to the
    user's model's own key (``"3.transformer.h.0.ln_1.weight"`` ->
    ``"transformer.h.0.ln_1.weight"``), a tie to its first name there."""
    tied = module._tied if isinstance(module, DistributedPipe) else None
    aliases = canonical_names(module, tied.ties if tied is not None else ())  # (also copies
    # that a wrapper made of a tensor shared on one rank: one entry, under its first name)
    origin = getattr(module, "origin", None)
    if origin is None:
        return aliases
    names = (name for name, _ in chain(module.named_parameters(remove_duplicate=False),
                                       module.named_buffers(remove_duplicate=False)))
    return {name: origin.model_key(aliases.get(name, name)) for name in names}


def _optim_key(key: str, aliases: Dict[str, str]) -> str:
    """A flattened optimizer-state key (``"state.4.weight.momentum_buffer"``) under the
    parameter's first name (``"state.0.weight.momentum_buffer"``)."""
    for section in ("state.", "param_groups."):
        if key.startswith(section):
            rest = key[len(section):]
            for alias, first in aliases.items():
                if rest.startswith(alias + "."):
                    return section + first + rest[len(alias):]
    return key


def _kept(state: Dict[str, Dict[str, Any]],
          aliases: Dict[str, str]) -> Dict[str, Dict[str, Any]]:
    """``state`` as the checkpoint keeps it: each shared tensor once, by its first name."""
    model: Dict[str, Any] = {}
    optim: Dict[str, Any] = {}
    for key, value in state[_MODEL].items():
        model.setdefault(aliases.get(key, key), value)
    for key, value in state[_OPTIM].items():
        optim.setdefault(_optim_key(key, aliases), value)
    return {_MODEL: model, _OPTIM: optim}


def _restored(local: Dict[str, Dict[str, Any]], kept: Dict[str, Dict[str, Any]],
              aliases: Dict[str, str]) -> Dict[str, Dict[str, Any]]:
    """The loaded ``kept`` entries under every local name (each copy of a tie gets one)."""
    return {_MODEL: {k: kept[_MODEL][aliases.get(k, k)] for k in local[_MODEL]},
            _OPTIM: {k: kept[_OPTIM][_optim_key(k, aliases)] for k in local[_OPTIM]}}


def save(module: nn.Module, optimizer: Optional[torch.optim.Optimizer], path: PathLike, *,
         process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Write ``module`` and ``optimizer`` to the sharded DCP checkpoint directory ``path``.

    Collective: every rank of ``process_group`` (default: the world; with no process
    group, this one process) calls it, each with its own stage and optimizer
    (``optimizer=None`` on a stage without parameters, or to save the model alone). Works
    the same for a ``DistributedPipe`` of any balance, with or without data-parallel
    replicas (they write each key once), for ``seqpipe.Pipe`` and for a plain model.
    Keys: ``"model.<original key>"``, ``"optim.state.<param>.<name>"`` and
    ``"optim.param_groups.<param>.<hyperparameter>"``.
    """
    state = _kept(_state_dicts(module, optimizer, for_load=False), _aliases(module))
    _dcp("saving", path, dcp.save, state, checkpoint_id=path, process_group=process_group)


def load(module: nn.Module, optimizer: Optional[torch.optim.Optimizer], path: PathLike, *,
         process_group: Optional[dist.ProcessGroup] = None, strict: bool = True) -> None:
    """Load the checkpoint at ``path`` into ``module`` (and ``optimizer``), in place.

    Collective over ``process_group`` like ``save``. The layout may differ from the one
    that saved: another ``balance``, another number of stages, a ``Pipe``, a plain model.
    Each rank reads only the keys it holds. The optimizer gets the saved state *and*
    hyperparameters (``lr``, momentum, ...), as ``Optimizer.load_state_dict`` does.

    Raises:
        CheckpointError: (on every rank) some rank needs a key the checkpoint lacks
            ("rank 1: RuntimeError: Missing key in checkpoint state_dict:
            model.5.weight."), or a shape does not match; DCP's own message.
        ValueError: with ``strict``, the checkpoint holds model entries that no stage of
            this model has (a bigger or different model saved it).
    """
    _load(module, optimizer, path, process_group=process_group, strict=strict, no_dist=False)


def load_into_plain(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                    path: PathLike, *, strict: bool = True) -> None:
    """Load a checkpoint into one unpipelined model (and optimizer) in this process alone.

    No process group is needed, and one that exists is not used, so one rank of a job
    (or a later single-process script) can load a checkpoint written by a pipeline.
    """
    with warnings.catch_warnings():  # DCP warns that it assumes one process: we mean it
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        _load(model, optimizer, path, process_group=None, strict=strict, no_dist=True)


def _load(module: nn.Module, optimizer: Optional[torch.optim.Optimizer], path: PathLike, *,
          process_group: Optional[dist.ProcessGroup], strict: bool, no_dist: bool) -> None:
    local = _state_dicts(module, optimizer, for_load=True)
    aliases = _aliases(module)
    kept = _kept(local, aliases)
    if strict:
        _check_no_unexpected(module, kept[_MODEL], aliases, path, no_dist)
    _dcp("loading", path, dcp.load, kept, checkpoint_id=path, process_group=process_group,
         no_dist=no_dist)
    state = _restored(local, kept, aliases)
    if state[_MODEL]:
        set_model_state_dict(module, state[_MODEL], options=OPTIONS)
    if optimizer is not None:
        set_optimizer_state_dict(module, optimizer, state[_OPTIM], options=OPTIONS)


def _check_no_unexpected(module: nn.Module, model_state: Dict[str, Any],
                         aliases: Dict[str, str], path: PathLike, no_dist: bool) -> None:
    """Raise if the checkpoint has more model entries than all stages hold together.

    Missing entries are DCP's to report. For a ``DistributedPipe`` the stages add up their
    counts over the pipeline group, so every rank reaches the same verdict and raises
    together (none is left waiting in a collective). A tie across stages counts once (on
    its first stage); a second name of a shared tensor that the checkpoint holds (one
    saved by ``dcp.save`` of a plain state dict) counts as expected.
    """
    metadata = dcp.FileSystemReader(path).read_metadata()
    prefix = _MODEL + "."
    saved = sorted(k[len(prefix):] for k in metadata.state_dict_metadata if k.startswith(prefix))
    count = len(model_state) + len(set(saved) & set(aliases))
    distributed = isinstance(module, DistributedPipe) and not no_dist
    if isinstance(module, DistributedPipe) and not no_dist:
        count -= sum(aliases.get(t.name, t.name) in model_state for t in module.ties
                     if t.stages[0] != module.rank)  # counted by its first rank
        total = torch.tensor([count], dtype=torch.int64, device=module.device)
        dist.all_reduce(total, group=module.group)
        count = int(total.item())
    if len(saved) <= count:
        return
    if distributed:
        assert isinstance(module, DistributedPipe)
        layers = {str(i) for i in range(sum(module.balance))}
        mine = set(module.layer_names)
        odd = [k for k in saved if k.split(".")[0] not in layers
               or (k.split(".")[0] in mine and k not in model_state and k not in aliases)]
        where = f"the {module.num_ranks} ranks of this pipeline hold {count} together"
    else:
        odd = [k for k in saved if k not in model_state and k not in aliases]
        where = f"this model has {count}"
    listed = f"; for example {', '.join(odd[:5])}" if odd else ""
    raise ValueError(
        f"the checkpoint at {os.fspath(path)!r} holds {len(saved)} model entries but "
        f"{where}: it was saved from a bigger or different model{listed}. Pass strict=False "
        f"to load the entries that match anyway")


# ------------------------------------------------------------------- full state dict

_WIRE_DTYPES: Tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def gather_full_state_dict(pipe: DistributedPipe, dst: int = 0) -> Optional[Dict[str, Tensor]]:
    """The whole model's state dict on stage ``dst``; ``None`` on the other stages.

    Collective over ``pipe.group``: every stage calls it (between training steps); with
    stages sharded by FSDP2 (``DTensor`` entries), over their meshes too: every shard
    calls it, and DCP's ``get_model_state_dict`` gathers each stage's full tensors. Keys
    and their order are those of the unpipelined ``nn.Sequential``'s ``state_dict()``;
    the values are CPU copies (they do not alias the live parameters), ready for
    ``torch.save`` and for ``nn.Sequential.load_state_dict``. With data-parallel
    replicas, each pipeline gathers over its own ``pipe.group``.

    On the wire, tensors only: one all-gather of a small ``int64`` header per stage, then
    from each stage to ``dst`` its keys (UTF-8 in a ``uint8`` tensor), their dtypes and
    shapes (an ``int64`` tensor), and the tensors themselves in state-dict order.

    Raises:
        ValueError: ``dst`` is not a stage, or some stage holds a state-dict entry that is
            not a tensor (``get_extra_state``) or has a dtype that cannot travel (raised
            on every stage).
    """
    if not isinstance(pipe, DistributedPipe):
        raise TypeError(f"gather_full_state_dict takes a DistributedPipe, not "
                        f"{type(pipe).__name__}; a local module's state_dict() is already full")
    k, me, group = pipe.num_ranks, pipe.rank, pipe.group
    if not 0 <= dst < k:
        raise ValueError(f"dst={dst} is not a stage of this {k}-stage pipeline "
                         f"(give a stage index, 0 to {k - 1})")
    local = pipe.state_dict()
    if any(is_dtensor(value) for value in local.values()):  # sharded stages: DCP's helper
        full = get_model_state_dict(pipe, options=_FULL)  # gathers over their meshes
        local = {name: full[name] for name in local}
    problem = ""
    for name, value in local.items():
        if not isinstance(value, Tensor):
            problem = f"stage {me}: {name!r} is a {type(value).__name__}, not a tensor"
        elif value.dtype not in _WIRE_DTYPES:
            problem = f"stage {me}: {name!r} has dtype {value.dtype}, which cannot be sent"
    names = "\0".join(local).encode("utf-8")
    spec: List[int] = []
    if not problem:
        for value in local.values():
            spec += [_WIRE_DTYPES.index(value.dtype), value.dim(), *value.shape]
    device = pipe.device
    header = torch.tensor([int(not problem), len(local), len(names), len(spec)],
                          dtype=torch.int64, device=device)
    headers = [torch.empty_like(header) for _ in range(k)]
    dist.all_gather(headers, header, group=group)
    table = [h.tolist() for h in headers]
    bad = [s for s, h in enumerate(table) if not h[0]]
    if bad:
        raise ValueError(f"cannot gather the state dict: stage(s) {bad} hold entries that "
                         f"are not tensors of a sendable dtype" + (f" ({problem})" if problem
                                                                  else ""))

    def peer(stage: int) -> int:
        return dist.get_global_rank(group, stage) if group is not None else stage

    if me != dst:
        if local:
            works = [dist.isend(t, dst=peer(dst), group=group) for t in (
                torch.tensor(spec, dtype=torch.int64, device=device),
                torch.frombuffer(bytearray(names), dtype=torch.uint8).to(device),
                *(v.detach().contiguous() for v in local.values()))]
            for work in works:
                if work is not None:
                    work.wait()
        return None

    full: Dict[str, Tensor] = {}
    for stage, (_, n, nbytes, nspec) in enumerate(table):
        if stage == me:
            entries = [(name, value.detach().to("cpu", copy=True))
                       for name, value in local.items()]
        elif n == 0:
            continue
        else:
            entries = _receive(peer(stage), group, device, n, nbytes, nspec)
        for name, value in entries:
            if name in full:
                raise ValueError(f"stage {stage} holds {name!r}, which an earlier stage "
                                 f"holds too; the stages do not split one model")
            full[name] = value
    if pipe.num_stages != k and all(name.split(".")[0].isdigit() for name in full):
        # a rank holds stages from several places in the model: back to the model's order
        full = dict(sorted(full.items(), key=lambda kv: int(kv[0].split(".")[0])))
    if pipe.origin is not None:  # a converted model: the user's model's own keys
        full = {pipe.origin.original_key(k): v for k, v in reversed(full.items())}
        full = dict(reversed(full.items()))  # a weight in two layers: kept under its first
    return full


def _receive(src: int, group: Optional[dist.ProcessGroup], device: torch.device, n: int,
             nbytes: int, nspec: int) -> List[Tuple[str, Tensor]]:
    spec = torch.empty(nspec, dtype=torch.int64, device=device)
    dist.recv(spec, src=src, group=group)
    raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dist.recv(raw, src=src, group=group)
    names = bytes(raw.cpu().tolist()).decode("utf-8").split("\0")
    words = spec.tolist()
    entries: List[Tuple[str, Tensor]] = []
    pos = 0
    for name in names[:n]:
        dtype, ndim = _WIRE_DTYPES[words[pos]], words[pos + 1]
        shape = words[pos + 2:pos + 2 + ndim]
        pos += 2 + ndim
        value = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(value, src=src, group=group)
        entries.append((name, value.cpu()))
    return entries
