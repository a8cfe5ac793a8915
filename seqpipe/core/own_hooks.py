"""The hooks a user registered on the ``nn.Sequential`` itself, kept by the pipe that wraps it.

A pipe wraps the Sequential in place: its layers (with their hooks) become the pipe's, but
the Sequential object itself is not called any more. Hooks registered on it before
wrapping (``model.register_forward_pre_hook(normalise)``, a logging forward hook, a
``register_full_backward_hook``, a ``state_dict`` or ``load_state_dict`` hook that renames
keys) were dropped silently. The pipe now starts with the Sequential's hooks, so each runs
where it ran on the model (one call of the pipe is one call of the model: the whole
mini-batch in, the whole output out; the pipe's ``state_dict`` keys are the Sequential's).
The hooks receive the pipe as their module, which reads like the Sequential (``len``,
indexing, iteration over the same layers). They are copied, not shared: a hook registered
on the pipe afterwards stays off the user's Sequential (which still runs the same layers if
called), and a handle returned before wrapping removes its hook from the Sequential only:
remove such hooks before wrapping, or register them on the pipe.

``train_step`` calls no forward of the whole model: the micro-batches' outputs go to the
loss one by one (under 1F1B the whole output never exists), so a forward or backward hook
of the pipe (its own, or the Sequential's) cannot run as on the model there; it was skipped
silently and is refused by name now. ``DistributedPipe`` likewise (``train_step`` runs the
stages; ``forward`` returns the output on the last rank only): a forward or backward hook
on the Sequential is refused when it is wrapped, and the state-dict hooks are kept.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, List

from torch import nn
from torch.nn.modules.module import _WrappedHook

__all__ = ["CALL_HOOKS", "STATE_HOOKS", "adopt_hooks", "call_hooks_of", "keep_hooks",
           "refuse_call_hooks"]

# the dictionaries of hooks that run around a call of the module
CALL_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
              "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
              "_backward_pre_hooks", "_backward_hooks")
# those that run around state_dict() and load_state_dict()
STATE_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")

_CALL_KINDS = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
               "_backward_pre_hooks": "backward pre-hook", "_backward_hooks": "backward hook"}


def call_hooks_of(module: nn.Module) -> List[str]:
    """What call hooks ``module`` holds, in words (``["forward hook log"]``): empty if none."""
    found = []
    for attr, kind in _CALL_KINDS.items():
        for hook in getattr(module, attr).values():
            found.append(f"{kind} {getattr(hook, '__qualname__', type(hook).__name__)}")
    return found


def adopt_hooks(pipe: nn.Module, module: nn.Module, *, calls: bool) -> None:
    """Make ``pipe`` run the hooks registered on ``module`` (the Sequential it wraps): the
    state-dict hooks always, the call hooks if ``calls``, in their order, before its own."""
    for attr in STATE_HOOKS + (CALL_HOOKS if calls else ()):
        hooks = OrderedDict((key, _rebound(hook, pipe))
                            for key, hook in getattr(module, attr).items())
        hooks.update(getattr(pipe, attr))
        object.__setattr__(pipe, attr, hooks)
    if calls:
        object.__setattr__(pipe, "_is_full_backward_hook", module._is_full_backward_hook)


def refuse_call_hooks(module: nn.Module, where: str, mend: str) -> None:
    """Raise ``RuntimeError`` naming ``module``'s call hooks, which ``where`` cannot run as a
    call of the model would, and ``mend``; nothing if it has none."""
    found = call_hooks_of(module)
    if found:
        raise RuntimeError(f"{where} cannot run the hooks registered on the whole model "
                           f"({', '.join(found)}): {mend}")


_DISTRIBUTED = ("DistributedPipe, whose train_step runs the stages one micro-batch at a time "
                "and whose forward returns the output on the last rank only,")
_DISTRIBUTED_MEND = ("register them on the layers instead (model[0] sees the input, model[-1] "
                     "the output, per micro-batch, on their stage's rank), and remove them "
                     "from the nn.Sequential (handle.remove()) before wrapping it")


def keep_hooks(pipe: nn.Module, module: nn.Module, *, calls: bool = True) -> None:
    """As a pipe is built: ``pipe`` runs the hooks of the ``module`` it wraps, all of them
    (``calls``: a call of ``pipe`` is a call of the model), or only its state-dict hooks,
    and then a call hook of ``module`` is refused by name (``DistributedPipe``)."""
    if not calls:
        refuse_call_hooks(module, _DISTRIBUTED, _DISTRIBUTED_MEND)
    adopt_hooks(pipe, module, calls=calls)


def _rebound(hook: Any, pipe: nn.Module) -> Any:
    """``hook`` as registered on ``pipe``: a load-state-dict pre-hook holds a weak
    reference to its module (``_WrappedHook``), which is now the pipe, not the Sequential
    (which the user may drop once it is wrapped)."""
    if isinstance(hook, _WrappedHook) and hook.with_module:
        return _WrappedHook(hook.hook, pipe)
    return hook
