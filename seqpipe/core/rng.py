"""Private, replayable random streams for stages that run side by side in threads.

PyTorch has one global generator per device (one for the CPU, one per GPU). When two
stages run at once in two threads, their random ops (dropout) draw from a shared
generator in whatever order the threads happen to reach it, so results change from run
to run; and ``torch.utils.checkpoint``'s RNG preservation (save the device generator's
state at the forward, restore it for the recomputation) replays another mask as soon as
a second thread advances that generator in between. That happens on the CPU with two
``cpu`` stages, and on an accelerator with two stages on one device, or with any stage
whose checkpoint forks the CPU generator while another thread draws from it.

Each (stage, micro-batch) task therefore draws from private generators, one per device
it draws on (``torch.Generator(device=...)``), all seeded with the task's seed; the
seeds are drawn from the global CPU generator in a fixed order, so a fixed global seed
fixes every mask. The recomputation runs with fresh generators from the same seed, and
so replays the forward's draws exactly. A ``TorchDispatchMode`` hands the generator to
every random op that was not given one: ops with a ``generator`` argument get it, ops
with a sibling overload that takes one (``randn``, ``rand_like``, ``randint``...) are
redirected to it, and ``native_dropout`` (the fused dropout of accelerators, which takes
no generator) is computed from a ``bernoulli_`` draw on the private generator.

A layer may checkpoint itself (``torch.utils.checkpoint(..., use_reentrant=False)`` inside
its forward). That checkpoint saves "the" random state with ``torch.get_rng_state()`` (and
``torch.cuda.get_rng_state()``) and restores it with the setters before recomputing, in
the stage's backward. So that it saves and restores the stream its dropout really draws
from, those four functions are made stream-aware once the first private stream is made
(``_install``): under a private stream, innermost first on the calling context's dispatch
mode stack (which autograd carries into its own threads), they read and write that
stream's generator; everywhere else they are torch's own. A forward that had its stream's
state read (``captures``) has its backward run under a private stream too
(``backward_stream``), where the checkpoint's recomputation restores the saved state and
draws what its forward drew.
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

__all__ = ["PrivateStreams", "backward_stream", "captures", "draw_seeds", "isolated_rng",
           "needs_private_rng"]

_aten = torch.ops.aten
_NO_GENERATOR = object()
_ROUTES: Dict[Any, Any] = {}  # op overload -> itself, its generator overload, or _NO_GENERATOR


def _arg_names(func: Any) -> List[str]:
    return [a.name for a in func._schema.arguments if a.name != "generator"]


def _takes_generator(func: Any) -> bool:
    return any(a.name == "generator" for a in func._schema.arguments)


def _route(func: Any) -> Any:
    """The overload to call with a ``generator``: ``func`` itself or its sibling taking one."""
    route = _ROUTES.get(func)
    if route is None:
        route = _NO_GENERATOR
        if _takes_generator(func):
            route = func
        else:
            packet, names = func.overloadpacket, _arg_names(func)
            for name in packet.overloads():
                sibling = getattr(packet, name)
                if _takes_generator(sibling) and _arg_names(sibling) == names:
                    route = sibling
                    break
        _ROUTES[func] = route
    return route


def _generator_position(func: Any) -> int:
    """Where ``generator`` sits among the positional arguments (a large number if it is
    keyword-only, as in most random ops)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "generator":
            return 1 << 30 if arg.kwarg_only else i
    return 1 << 30


def _device_of(args: Sequence[Any], kwargs: Dict[str, Any]) -> torch.device:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, Tensor):
            return leaf.device
    return torch.device("cpu")


class _PrivateGenerator(TorchDispatchMode):
    """Gives every random op that was not handed a generator the task's own, per device."""

    def __init__(self, seed: int,
                 states: Optional[Dict[torch.device, Tensor]] = None) -> None:
        super().__init__()
        _install()
        self.seed = seed
        self.generators: Dict[torch.device, torch.Generator] = {
            device: torch.Generator(device=device).set_state(state)
            for device, state in (states or {}).items()}

    def _generator(self, device: torch.device) -> Optional[torch.Generator]:
        if device.type == "meta":
            return None
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, torch.accelerator.current_device_index())
        generator = self.generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
            self.generators[device] = generator
        return generator

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten.native_dropout.default:
            return self._native_dropout(func, *args, **kwargs)
        route = _route(func)
        if route is _NO_GENERATOR or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        position = _generator_position(route)
        if position < len(args) and args[position] is not None:
            return func(*args, **kwargs)  # given a generator positionally
        generator = self._generator(_device_of(args, kwargs))
        if generator is None:
            return func(*args, **kwargs)
        if position < len(args):
            return route(*args[:position], generator, *args[position + 1:], **kwargs)
        return route(*args, **{**kwargs, "generator": generator})

    def _native_dropout(self, func: Any, input: Tensor, p: float,
                        train: Optional[bool]) -> Tuple[Tensor, Tensor]:
        generator = self._generator(input.device)
        if not train or p == 0 or p == 1 or generator is None:
            return func(input, p, train)
        keep = torch.empty_like(input).bernoulli_(1 - p, generator=generator).bool()
        return input * keep * (1.0 / (1 - p)), keep


# ------------------------------------------------- the accessors torch's checkpoint saves with

_local = threading.local()  # .captures: how often a private stream's state was read here
_lock = threading.Lock()
_installed: List[bool] = []
_BACKWARD_SALT = 0x5DEECE66D  # the backward's stream is not the forward's stream again


def _innermost() -> Optional[_PrivateGenerator]:
    """The private stream that random ops in this context draw from, if any."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, _PrivateGenerator):
            return mode
    return None


def _stream_aware(module: Any, device_of: Callable[..., torch.device]) -> None:
    """Make ``module.get_rng_state``/``set_rng_state`` read and write the innermost private
    stream's generator, when there is one (``device_of`` picks the device from their
    ``device`` argument); torch's own functions otherwise."""
    get, put = module.get_rng_state, module.set_rng_state

    @functools.wraps(get)
    def get_rng_state(*args: Any, **kwargs: Any) -> Tensor:
        mode = _innermost()
        generator = None if mode is None else mode._generator(device_of(*args, **kwargs))
        if generator is None:
            return get(*args, **kwargs)
        _local.captures = captures() + 1
        return generator.get_state()

    @functools.wraps(put)
    def set_rng_state(new_state: Tensor, *args: Any, **kwargs: Any) -> None:
        mode = _innermost()
        generator = None if mode is None else mode._generator(device_of(*args, **kwargs))
        if generator is None:
            return put(new_state, *args, **kwargs)
        generator.set_state(new_state)
        return None

    module.get_rng_state, module.set_rng_state = get_rng_state, set_rng_state


def _cuda(device: Any = "cuda") -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _install() -> None:
    """Once per process: the CPU's and CUDA's state accessors become stream-aware (what
    ``torch.utils.checkpoint`` and ``torch.random.fork_rng`` call, by attribute, when they
    run). Outside a private stream they behave exactly as before."""
    if _installed:
        return
    with _lock:
        if not _installed:
            for module in (torch, torch.random):  # one function, exported twice
                _stream_aware(module, lambda: torch.device("cpu"))
            _stream_aware(torch.cuda, _cuda)
            _installed.append(True)


def captures() -> int:
    """How many times this thread has read a private stream's state so far (a layer's own
    checkpoint saving it for its recomputation): a task whose forward raised the count
    needs its backward under ``backward_stream``."""
    return int(getattr(_local, "captures", 0))


def backward_stream(seed: Optional[int]) -> ContextManager[Any]:
    """Around a task's backward (``seed`` its stream's, ``None`` for none): a private
    stream, so that a layer's own checkpoint recomputes from the state of that stream it
    saved in the forward (restored through the accessors above), not the global one."""
    return nullcontext() if seed is None else _PrivateGenerator(seed ^ _BACKWARD_SALT)


def needs_private_rng(devices: Sequence[torch.device]) -> bool:
    """Whether stages on ``devices`` must draw from private generators.

    Whenever two or more stages can run at once, on any device types. One stage runs on
    one thread at a time, so ``torch.utils.checkpoint``'s own RNG preservation replays its
    draws, and its masks are those the unwrapped model would draw.
    """
    return len(devices) > 1


def draw_seeds(count: int) -> List[int]:
    """``count`` seeds from the global CPU generator, so a fixed global seed fixes them all."""
    return torch.randint(0, 2**62, (count,), dtype=torch.int64).tolist() if count else []


@contextmanager
def isolated_rng(seed: int) -> Iterator[None]:
    """Within the block, random ops in this thread draw from generators seeded ``seed``."""
    with _PrivateGenerator(seed):
        yield


class PrivateStreams:
    """One task's private generators, followed across the pieces of its forward.

    A partition checkpointed N layers at a time (``seqpipe.core.segments``) runs its forward
    under ``live()``, one stream from the task's seed as for the whole partition, so the
    pieces draw what the whole would. ``mark()`` notes where the generators stand when a
    piece starts; ``replay(mark)`` gives the piece's recomputation generators that start
    there, so it draws the piece's forward values again.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._mode = _PrivateGenerator(seed)

    def live(self) -> TorchDispatchMode:
        """The forward's generators, to enter once around all the pieces."""
        return self._mode

    def mark(self) -> Dict[torch.device, Tensor]:
        """The state of every generator drawn from so far (the others are still fresh)."""
        return {device: g.get_state() for device, g in self._mode.generators.items()}

    @contextmanager
    def replay(self, mark: Dict[torch.device, Tensor]) -> Iterator[None]:
        """Within the block, random ops draw from generators restored to ``mark``."""
        with _PrivateGenerator(self.seed, mark):
            yield
