"""Keep the default process group from outliving ``destroy_process_group()``.

``torch.distributed.nn.functional`` declares its functions with ``group=group.WORLD`` as a
default argument, evaluated once, when the module is first imported: before
``init_process_group()`` that is ``None`` ("the default group, whichever it is when
called"); after it, the default group object itself, which every one of those functions
then keeps for good. The module is rarely imported by name: ``torch._dynamo`` imports it,
and activation checkpointing (``torch.utils.checkpoint``), ``torch.compile`` and
``DistributedDataParallel`` import ``torch._dynamo`` on first use, so a script that
creates its group first and checkpoints afterwards binds it.

A group kept that way is not freed by ``destroy_process_group()``: a gloo group's worker
threads then live on into the interpreter's finalisation, where one still letting go of a
finished collective's tensors needs the interpreter lock, is ended by ``pthread_exit``
inside a ``noexcept`` C++ destructor, and the process aborts (``terminate called without an
active exception``, SIGABRT) after its work is done. See "Ending a script" in
docs/distributed.md, and ``benchmarks/exit_soak.py``.

seqpipe imports the module when it is itself imported (which costs a few milliseconds, not
``torch._dynamo``), and puts back the ``None`` defaults that an import before
``init_process_group()`` would have given. Every ``torch.distributed`` call reads ``None``
as the default group at call time, which is the group bound while that group lives, and
the right one after a new ``init_process_group()``; so the functions behave the same in
either import order. The module is imported once per process, so nothing binds the group
again afterwards.
"""
from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["unbind_default_group"]


def unbind_default_group() -> None:
    """Give ``torch.distributed.nn.functional``'s functions ``None`` for every default
    argument that holds a process group.

    Imports the module first (if it is not yet), so that it is never imported later, after
    a group exists. Safe to call any number of times, with or without a process group; a
    no-op where ``torch.distributed`` is not available.
    """
    if not torch.distributed.is_available():
        return
    import torch.distributed.nn.functional as functional

    for value in vars(functional).values():
        if isinstance(value, types.FunctionType) and value.__module__ == functional.__name__:
            if value.__defaults__:
                value.__defaults__ = tuple(_unbound(v) for v in value.__defaults__)
            if value.__kwdefaults__:
                value.__kwdefaults__ = {k: _unbound(v) for k, v in value.__kwdefaults__.items()}


def _unbound(value: Any) -> Any:
    """``None`` for a process group (the default group at call time), else ``value``."""
    return None if isinstance(value, torch.distributed.ProcessGroup) else value
