"""Threads that run stage programs, and the mailbox they exchange micro-batches through.

A *program* is one stage's ordered list of actions for one phase. A worker thread runs a
group of programs: usually one (a stage per thread, so CPU partitions overlap), or
several on the calling thread when their backward must run there (accelerator stages,
whose autograd work belongs to the engine's device threads). An action runs once its
inputs are in the mailbox. If any action raises, the mailbox is marked failed, every
other worker stops at its next wait, all are waited for, and the original exception
is raised on the caller with its own traceback, plus a note naming the stage and action.
A Ctrl-C on the caller stops the workers the same way and waits for them. No worker is
left running a stage after a call returns or raises (one still inside PyTorch when the
interpreter shuts down would abort the process); the threads themselves come from
``seqpipe.local.pool`` and wait, idle, for the next call.
"""
from __future__ import annotations

import functools
import threading
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from seqpipe.local import pool
from seqpipe.local.lone import lone_actions
from seqpipe.local.thread_state import IntraOp, ThreadState
from seqpipe.schedule import Action
from seqpipe.trace import hooks
from seqpipe.trace.events import EventKind

__all__ = ["Mailbox", "Program", "current_group", "device_context", "run_groups"]

_NOTHING = nullcontext()  # reusable and reentrant: one for every CPU action
_running = threading.local()  # .group: the index of the group this thread runs, in a call


def current_group() -> Optional[int]:
    """Which group of programs of the running ``run_groups`` call this thread runs (its
    index in ``groups``); ``None`` on any other thread (an autograd device thread)."""
    return getattr(_running, "group", None)


class _Aborted(Exception):
    """Raised in a worker waiting for data when another worker has failed."""


class Mailbox:
    """Values in flight between the stages of one phase, keyed by whatever the engine likes."""

    def __init__(self) -> None:
        self._items: Dict[Hashable, Any] = {}
        self._cond = threading.Condition()
        self._failed = False

    def put(self, key: Hashable, value: Any) -> None:
        with self._cond:
            self._items[key] = value
            self._cond.notify_all()

    def has(self, key: Hashable) -> bool:
        return key in self._items

    def take(self, key: Hashable) -> Any:
        """Remove and return a value the caller knows is present."""
        with self._cond:
            return self._items.pop(key)

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Block until ``predicate()`` holds; raise ``_Aborted`` if a worker failed."""
        with self._cond:
            while not self._failed and not predicate():
                self._cond.wait()
            if self._failed:
                raise _Aborted()

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()


@dataclass
class Program:
    """One stage's actions for one phase and how to run them."""

    stage: int
    actions: Sequence[Action]
    # what an action still waits for, as (stage, message); ``None`` once it can run
    awaits: Callable[[Action], Optional[Tuple[int, str]]]
    execute: Callable[[Action], None]
    device: torch.device

    def ready(self, action: Action) -> bool:
        """Whether ``action``'s inputs are all there."""
        return self.awaits(action) is None


def device_context(device: torch.device) -> Any:
    """``device`` current inside the block (nothing to do for the CPU)."""
    if device.type == "cpu" or device.index is None:
        return _NOTHING
    return torch.accelerator.device_index(device.index)


def _drive(programs: List[Program], mailbox: Mailbox, threads: Optional[IntraOp],
           lone: Sequence[bool] = ()) -> None:
    """Run ``programs`` (one thread's) to the end, each action once its inputs are there;
    with ``threads``, each at its share of the intra-op threads, or at all of them where
    ``lone`` (one flag per action of the thread's one program) says it runs alone."""
    positions = [0] * len(programs)
    chosen: List[int] = []

    def any_ready() -> bool:
        for k, program in enumerate(programs):
            if positions[k] < len(program.actions) and program.ready(
                    program.actions[positions[k]]):
                chosen[:] = [k]
                return True
        return False

    while any(p < len(prog.actions) for p, prog in zip(positions, programs)):
        if hooks.enabled() and not any_ready():
            with _waiting(programs, positions):
                mailbox.wait_for(any_ready)
        else:
            mailbox.wait_for(any_ready)
        k = chosen[0]
        action = programs[k].actions[positions[k]]
        if threads is not None:
            threads.take(bool(lone) and lone[positions[k]])
        try:
            with device_context(programs[k].device):
                programs[k].execute(action)
        except Exception as exc:
            stage = programs[k].stage if action.stage is None else action.stage
            exc.add_note(f"seqpipe: raised by stage {stage} in the "
                         f"{action.phase.value} of micro-batch {action.microbatch}")
            raise
        finally:
            positions[k] += 1


def _waiting(programs: List[Program], positions: List[int]) -> Any:
    """A wait of the first unfinished program (on a worker thread, the only one), as a
    traced span naming the message it waits for."""
    k = next(k for k, p in enumerate(programs) if positions[k] < len(p.actions))
    program, action = programs[k], programs[k].actions[positions[k]]
    peer, what = program.awaits(action) or (None, None)
    stage = program.stage if action.stage is None else action.stage
    return hooks.span(EventKind.WAIT, stage, action.microbatch, peer=peer, what=what)


def _join(workers: List[Tuple[str, threading.Event]], mailbox: Mailbox) -> None:
    """Wait for the workers; on Ctrl-C, stop them (at their next wait), wait, re-raise."""
    try:
        for _, done in workers:
            done.wait()
    except BaseException:
        mailbox.fail()
        for _, done in workers:
            done.wait()
        raise


def run_groups(groups: Sequence[List[Program]], mailbox: Mailbox,
               state: Optional[ThreadState] = None) -> None:
    """Run each group of programs on its own thread (the first on the caller's, the others
    on pooled workers: ``seqpipe.local.pool``).

    Worker threads first enter the caller's thread-local ``state``; the caller's thread
    already has it, and only takes its share of the intra-op threads until all are joined.
    """
    errors: List[BaseException] = []
    threads = None if state is None else state.intra_op(
        all(p.device.type == "cpu" for group in groups for p in group))
    lone: Sequence[Sequence[bool]] = [()] * len(groups)  # no action takes all the threads
    if threads is not None and all(len(group) == 1 for group in groups):
        lone = lone_actions([group[0].actions for group in groups])

    def work(g: int, replay: bool) -> None:
        outer, _running.group = current_group(), g  # a pipe's call inside a stage: restored
        try:
            with ExitStack() as stack:
                if state is not None and replay:
                    state.enter(stack)
                _drive(groups[g], mailbox, threads, lone[g])
        except _Aborted:
            pass
        except BaseException as exc:  # noqa: B902 - re-raised on the caller below
            errors.append(exc)
            mailbox.fail()
        finally:
            _running.group = outer

    others = [g for g in range(1, len(groups)) if groups[g]]
    workers = [(f"seqpipe-stage-{groups[g][0].stage}", threading.Event()) for g in others]
    with ExitStack() as caller:
        if state is not None:
            state.share_threads(caller)
        for g, (name, done) in zip(others, workers):  # ``work`` keeps what it raises
            job = functools.partial(work, g, True)
            pool.start(name, job if state is None else state.in_context(job), done)
        if groups and groups[0]:
            work(0, False)
        _join(workers, mailbox)
    if errors:
        # Raise the first error with no list or local of ours left holding it: its traceback
        # holds the frames of ``work``, whose closure holds ``errors``, and a cycle through
        # it would keep the failed call's tensors and autograd graph until a garbage
        # collection (or the interpreter's teardown).
        error = errors[0]
        errors.clear()
        try:
            raise error
        finally:
            del error
