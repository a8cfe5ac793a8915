"""The caller's thread-local state, carried into the worker threads that run the stages.

PyTorch keeps many settings per thread: the saved-tensor hooks
(``torch.autograd.graph.saved_tensors_hooks``, ``save_on_cpu``), autograd's multithreading
and view-replay flags, the Python mode stacks
(``TorchDispatchMode`` such as ``FlopCounterMode``, ``TorchFunctionMode`` such as
``with torch.device(...)`` and ``torch.set_default_device``), autocast, inference mode,
the intra-op thread count and the current stream of each accelerator. Autograd carries
them into its own threads (a C++ ``ThreadLocalStateGuard``), but that mechanism has no
Python binding (PyTorch 2.13). So a ``ThreadState`` captures each Python-visible piece
on the caller's thread when a call starts (forward or backward) and re-enters it,
through PyTorch's own stack APIs, on every worker thread before the stage runs: the
mode objects are the caller's own, not copies. Python's ``contextvars`` are per thread
too (a library's setting held in a ``ContextVar``): each worker runs in a copy of the
caller's context.

seqpipe's own modes (private RNG, parameter aliases) are entered later, inside each stage
call, so they sit above the caller's, as they do on the caller's thread.

Not carried: the profiler's thread-local callbacks (no Python API; profile worker threads
with ``torch.profiler.profile(experimental_config=torch._C._profiler._ExperimentalConfig(
profile_all_threads=True))``) and functorch transforms (``vmap``/``grad`` over a Pipe).

Threads. Stages that run at the same time share the caller's intra-op thread count
``T``: each gets ``max(1, T // K)`` for ``K`` concurrent CPU stages, so the process does not
run ``K × T`` compute threads on ``T`` cores. The split applies while ``T`` is torch's
default (the count the process had when seqpipe was imported, which follows
``OMP_NUM_THREADS``); a count the user set with ``torch.set_num_threads`` to another
value is the user's choice and every stage gets it as it is. While the split applies, an
action during which no other stage can compute, whatever the timing (the pipeline's fill
and drain), takes all ``T`` (``IntraOp``); which actions those are follows from the
schedule alone (``seqpipe.local.lone``), so every run uses the same thread counts.
"""
from __future__ import annotations

import contextvars
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from seqpipe.core.stream import on_stream

__all__ = ["IntraOp", "ThreadState", "stage_threads"]

_DEFAULT_THREADS = torch.get_num_threads()  # torch's default, before any user change
_AUTOCAST_KINDS = ("cpu", "cuda", "xpu", "mps", "hpu")


def stage_threads(caller: int, concurrent: int, default: Optional[int] = None) -> int:
    """Intra-op threads for each of ``concurrent`` stages that run at once.

    The caller's count ``caller`` is shared (``caller // concurrent``, at least one) while it
    is torch's ``default`` (by default, the count at import); a count the user chose is
    kept for every stage.
    """
    if default is None:
        default = _DEFAULT_THREADS
    if caller != default or concurrent <= 1:
        return caller
    return max(1, caller // concurrent)


@contextmanager
def _dispatch_modes(modes: List[Any]) -> Iterator[None]:
    pushed = []
    try:
        for mode in modes:
            _push_mode(mode)
            pushed.append(mode)
        yield
    finally:
        for mode in reversed(pushed):
            _pop_mode(getattr(mode, "_mode_key", None))


@contextmanager
def _function_modes(modes: List[Any]) -> Iterator[None]:
    pushed = 0
    try:
        for mode in modes:
            torch._C._push_on_torch_function_stack(mode)
            pushed += 1
        yield
    finally:
        for _ in range(pushed):
            torch._C._pop_torch_function_stack()


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """This thread's intra-op thread count set to ``count`` inside the block."""
    before = torch.get_num_threads()
    if count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


class IntraOp:
    """Per action, a CPU stage thread's intra-op threads while ``K`` share the caller's
    ``T``: ``share`` (``T // K``) while another stage may compute at the same time, all ``T``
    (``alone``) for an action during which none can, whatever the timing: every action of
    every other stage thread either comes before it or waits for its results (the first
    micro-batch's forward, the last one's on the last stage, the ends of the backward;
    ``seqpipe.local.lone``). So the pipeline's fill and drain run at the plain model's
    intra-op parallelism instead of leaving cores idle, the threads busy at once never
    exceed ``T``, and each action's thread count, hence its kernels' order of summation,
    is the same in every run."""

    def __init__(self, share: int, alone: int) -> None:
        self.share = share
        self.alone = alone

    def take(self, alone: bool) -> None:
        """On a stage thread, before an action: ``alone`` says whether it runs alone."""
        count = self.alone if alone else self.share
        if torch.get_num_threads() != count:
            torch.set_num_threads(count)


class ThreadState:
    """The caller's thread-local settings, captured now, to replay in worker threads.

    ``concurrent`` is how many CPU stages run at once (they share the intra-op threads);
    the current stream of each accelerator in ``devices`` is carried too, so that stages
    on one device, and the caller, work on one stream.
    """

    def __init__(self, *, concurrent: int = 1, devices: Sequence[torch.device] = ()) -> None:
        self.caller = torch.get_num_threads()
        self.threads = stage_threads(self.caller, concurrent)
        self.streams = [torch.accelerator.current_stream(d)
                        for d in dict.fromkeys(devices) if d.type != "cpu"]
        self.autocast: List[Tuple[str, torch.dtype]] = [
            (kind, torch.get_autocast_dtype(kind)) for kind in _AUTOCAST_KINDS
            if torch.is_autocast_enabled(kind)]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.inference = torch.is_inference_mode_enabled()
        # autograd's other per-thread flags (torch.autograd.set_multithreading_enabled, and
        # _force_original_view_tracking, which functionalization sets)
        self.multithreading = torch.autograd.is_multithreading_enabled()
        self.view_replay = torch.autograd.is_view_replay_enabled()
        self.dispatch_modes = _get_current_dispatch_mode_stack()
        self.function_modes = _get_current_function_mode_stack()
        self.saved_hooks: Optional[Tuple[Any, Any]] = (
            torch._C._autograd._top_saved_tensors_default_hooks(False))
        self.hooks_disabled: Optional[str] = (
            torch._C._autograd._saved_tensors_hooks_get_disabled_error_message())
        self.context = contextvars.copy_context()  # the caller's ContextVar values

    def intra_op(self, all_cpu: bool) -> Optional["IntraOp"]:
        """How the stage threads of one call (``all_cpu``: every one a ``cpu`` stage) set
        their intra-op threads per action; ``None``: each keeps its share throughout.
        Never decided by the machine's load or the timing: a count that changed with
        them would change the results from run to run (``seqpipe.local.lone``)."""
        if not all_cpu or self.threads >= self.caller:
            return None
        return IntraOp(self.threads, self.caller)

    def in_context(self, function: Callable[[], None]) -> Callable[[], None]:
        """``function`` to run on a worker thread in a copy of the caller's
        ``contextvars`` context (a library's setting held in a ``ContextVar``); a layer's own
        ``ContextVar.set`` stays on its thread, as in an ``asyncio`` task."""
        context = self.context.copy()  # one per thread: a context runs on one at a time
        return lambda: context.run(function)

    def share_threads(self, stack: ExitStack) -> None:
        """On the caller's own thread: only its share of the intra-op threads."""
        stack.enter_context(intra_op_threads(self.threads))

    def enter(self, stack: ExitStack) -> None:
        """On a worker thread: everything, innermost last as on the caller's thread."""
        self.share_threads(stack)
        for stream in self.streams:
            stack.enter_context(on_stream(stream))
        if self.inference:
            stack.enter_context(torch.inference_mode())
        if not self.multithreading:
            stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        if self.view_replay:
            stack.enter_context(torch.autograd._force_original_view_tracking(True))
        for kind, dtype in self.autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype,
                                               cache_enabled=self.autocast_cache))
        if self.hooks_disabled is not None:
            stack.enter_context(torch.autograd.graph.disable_saved_tensors_hooks(
                self.hooks_disabled))
        elif self.saved_hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.saved_hooks))
        stack.enter_context(_function_modes(self.function_modes))
        stack.enter_context(_dispatch_modes(self.dispatch_modes))
