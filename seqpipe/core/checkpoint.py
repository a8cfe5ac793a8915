"""Per-micro-batch activation checkpointing; it sets the flags layers read (``flags.py``).

Built on ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the non-reentrant
form keeps the autograd graph whole (so it composes with DistributedDataParallel, which
the reentrant form breaks with "Expected to mark a variable ready only once"), restores
RNG state for the recomputation, and its ``context_fn`` is where the flags below are set.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import GradientEdge
from torch.utils.checkpoint import CheckpointFunction
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from seqpipe.core.draws import NO_DRAWS
from seqpipe.core.flags import flag, is_checkpointing, is_recomputing
from seqpipe.core.rng import isolated_rng
from seqpipe.core.split_backward import reachable
from seqpipe.trace import hooks
from seqpipe.trace.events import EventKind

__all__ = ["MODES", "NOTHING", "ReentrantCheckpointError", "Replay", "check_mode",
           "checkpoint_stop", "checkpointed", "first_pass", "is_checkpointing", "is_recomputing",
           "refusing_reentrant", "run_task"]

MODES = ("always", "except_last", "never")

class ReentrantCheckpointError(RuntimeError):
    """A layer checkpoints itself with ``torch.utils.checkpoint.checkpoint(...,
    use_reentrant=True)`` in a stage backward that seqpipe cannot run it in.

    A stage backward that asks autograd for part of the graph
    (``torch.autograd.backward(..., inputs=...)``: a split backward's ``I``, which wants the
    input's gradient only, or a ``Pipe``'s stages under ``torch.autograd.grad`` or
    ``backward(inputs=...)``) cannot run the reentrant form, which runs a backward of its
    own inside, which torch refuses under ``inputs``. Every other stage backward runs as
    the plain model's, and trains it. The non-reentrant form (``use_reentrant=False``)
    works under every schedule, checkpoint mode and autograd call.
    """

    def __init__(self, stage: int) -> None:
        super().__init__(
            f"a layer of stage {stage} checkpoints itself with torch.utils.checkpoint."
            f"checkpoint(..., use_reentrant=True), whose backward cannot run in this stage "
            f"backward (it asks autograd for part of the graph with inputs=..., a split "
            f"backward's I or an autograd.grad call, which the reentrant form refuses); "
            f"pass use_reentrant=False (for a Hugging Face model: "
            f"gradient_checkpointing_enable(gradient_checkpointing_kwargs={{'use_reentrant': "
            f"False}})), or leave recomputation to the pipe's own checkpoint= argument")


@contextmanager
def refusing_reentrant(stage: int, roots: Sequence[GradientEdge]) -> Iterator[None]:
    """Around a backward of stage ``stage`` from ``roots``: torch's refusal to run a reentrant
    ``torch.utils.checkpoint`` under ``inputs=`` becomes a ``ReentrantCheckpointError``
    naming the fix. The graph is searched only once a backward has failed."""
    try:
        yield
    except RuntimeError as error:
        check_reentrant(stage, roots, error)
        raise


def check_reentrant(stage: int, roots: Sequence[GradientEdge], error: RuntimeError) -> None:
    """After a backward of stage ``stage`` from ``roots`` raised ``error``: raise a
    ``ReentrantCheckpointError`` (from it) where the graph holds a reentrant checkpoint;
    else return (the caller re-raises ``error``). ``refusing_reentrant``, for a caller
    that saves a generator's cost per backward."""
    if any(getattr(node, "_forward_cls", None) is CheckpointFunction
           for node in reachable(roots)):
        raise ReentrantCheckpointError(stage) from error


def check_mode(mode: object) -> str:
    """Validate a ``checkpoint`` argument."""
    if mode not in MODES:
        raise ValueError(
            f"checkpoint must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def checkpoint_stop(mode: str, num_microbatches: int) -> int:
    """How many leading micro-batches are checkpointed under ``mode``."""
    if mode == "never":  # (no dict made per call: a call's fixed cost)
        return 0
    return {"always": num_microbatches, "except_last": num_microbatches - 1}[mode]


def _recompute(label: Optional[hooks.Label]) -> ContextManager[Any]:
    """The traced span of a recomputation, named by the forward it replays (``label``,
    taken when that forward ran: the recomputation may run on another thread)."""
    return hooks.OFF if label is None else hooks.span(EventKind.RECOMPUTE, *label)


NOTHING: ContextManager[None] = nullcontext()  # reentrant and reusable: one for every task


def _rng(seed: Optional[int]) -> ContextManager[None]:
    return NOTHING if seed is None or seed == NO_DRAWS else isolated_rng(seed)


@contextmanager
def _entered(*contexts: ContextManager[Any]) -> Iterator[None]:
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def run_task(function: Callable[..., Any], args: Tuple[Any, ...], *, checkpoint: bool,
             seed: Optional[int]) -> Any:
    """Run one (stage, micro-batch) forward, checkpointed or not.

    ``seed`` selects private random streams (see ``seqpipe.core.rng``), which the
    recomputation replays from the same seed; ``None`` keeps the global generators, whose
    state the checkpoint saves and restores itself (right only while no other thread
    draws from them: a single-stage pipeline, or one stage per process); ``NO_DRAWS``
    (``seqpipe.core.draws``): the function draws nothing, so neither.
    """
    if not checkpoint:
        with _rng(seed):
            return function(*args)
    return checkpointed(function, args, lambda: (_rng(seed), lambda: _rng(seed)),
                        preserve_rng_state=seed is None)


# The random contexts of a checkpoint's forward, and a maker of its recomputation's (a
# fresh one at each recomputation: see ``checkpointed``).
RngContexts = Callable[[], Tuple[ContextManager[Any], Callable[[], ContextManager[Any]]]]


class _EachTime:
    """A context manager made anew by ``make`` each time it is entered.

    ``torch.utils.checkpoint`` enters the recomputation context of one checkpoint once per
    recomputation, and there can be several: a layer that calls ``torch.autograd.grad``
    inside its forward (a force from an energy, a gradient penalty in the model) makes the
    forward itself unpack what the checkpoint dropped, and the backward recomputes again.
    A generator-based context manager can be entered only once ("'_GeneratorContextManager'
    object has no attribute 'args'"), and a random stream must start from its seed again.
    """

    def __init__(self, make: Callable[[], ContextManager[Any]]) -> None:
        self._make = make
        self._open: List[ContextManager[Any]] = []

    def __enter__(self) -> None:
        context = self._make()
        context.__enter__()
        self._open.append(context)

    def __exit__(self, *exc: Any) -> Optional[bool]:
        return self._open.pop().__exit__(*exc)


def checkpointed(function: Callable[..., Any], args: Tuple[Any, ...], rng: RngContexts, *,
                 preserve_rng_state: bool) -> Any:
    """``function(*args)`` under ``torch.utils.checkpoint`` (non-reentrant), its forward
    flagged ``is_checkpointing()`` and its recomputation ``is_recomputing()`` (and traced as
    the forward's recomputation); ``rng()``, called as the checkpoint starts, gives the
    forward's random context and a maker of the recomputation's, called at each one."""
    label = hooks.current_label()

    def contexts() -> Tuple[ContextManager[None], ContextManager[None]]:
        forward, recompute = rng()
        return (_entered(flag("checkpointing"), forward),
                _EachTime(lambda: _entered(flag("recomputing"), recompute(),
                                           _recompute(label))))

    return torch_checkpoint(function, *args, use_reentrant=False, context_fn=contexts,
                            preserve_rng_state=preserve_rng_state)


@dataclass
class Replay:
    """How to recompute a checkpointed forward by hand: its private seed, or else the
    global generators' states when it ran (CPU, and ``device``'s if it is a GPU).

    A split backward (``I`` then ``W``) recomputes once for both halves, which
    ``torch.utils.checkpoint`` cannot do: it recomputes in every backward call.
    """

    seed: Optional[int]
    device: torch.device
    cpu_state: Optional[torch.Tensor] = None
    device_state: Optional[torch.Tensor] = None
    label: Optional[hooks.Label] = None  # the forward's (stage, micro-batch), if traced

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """Gradients on, ``is_recomputing()`` true and the random state of the first pass."""
        with _recompute(self.label), self._replayed():
            yield

    @contextmanager
    def _replayed(self) -> Iterator[None]:
        if self.seed is not None:
            with torch.enable_grad(), flag("recomputing"):
                yield  # run_task's private stream, reseeded by the caller with ``seed``
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), flag("recomputing"):
            assert self.cpu_state is not None
            torch.set_rng_state(self.cpu_state)
            if self.device_state is not None:
                torch.cuda.set_rng_state(self.device_state, self.device)
            yield


def first_pass(function: Callable[..., Any], args: Tuple[Any, ...], *, seed: Optional[int],
               device: torch.device) -> Tuple[Any, Replay]:
    """Run a checkpointed forward without keeping a graph; and how to replay it."""
    replay = Replay(seed, device, label=hooks.current_label())
    if seed is None:
        replay.cpu_state = torch.get_rng_state()
        if device.type == "cuda":
            replay.device_state = torch.cuda.get_rng_state(device)
    with torch.no_grad(), flag("checkpointing"):
        return run_task(function, args, checkpoint=False, seed=seed), replay
