"""Glue whose behaviour depends on train/eval mode: dropout follows the layer's unit, and a
forward that branches on ``self.training`` outside its units runs in the mode it was traced.

``torch.export`` records ``F.dropout(x, p, self.training)`` in a parent's ``forward``
(BART's encoder and decoder, after the embeddings) as ``aten.dropout(x, p, True)``: the
mode at conversion, frozen. A converted layer instead reads the ``training`` flag of its
own unit (the user's module object, which ``model.train()``/``model.eval()`` and
``seq.train()``/``seq.eval()`` both reach) each time it runs, so dropout in the glue is
on in train mode and off in eval mode, as in the model. Other train/eval-dependent ops in
the glue (a functional batch norm, a bare ``bernoulli``) are refused by ``to_sequential``.

Python control flow on ``self.training`` in the glue (torchvision's GoogLeNet and
Inception v3 run and return their auxiliary heads only in training: ``if self.training
and self.aux_logits``) is followed one way by the trace: the converted model ran the
conversion's mode's code in the other mode too, silently (the auxiliary head in eval, or
never in training). ``mode_dependent`` finds such a forward at conversion (one more dry
run with the glue's modules in the other mode, comparing the torch calls made), and each
layer of such a conversion then refuses to run while its unit is in the other mode,
naming the mend (``check_mode``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from seqpipe.graph.calls import dry_run

__all__ = ["FOLLOWS_MODE", "REFUSED_MODE_OPS", "MODE_ARG", "TorchCalls", "check_mode",
           "mode_dependent"]

_aten = torch.ops.aten

# ops of the form (input, p, train) whose ``train`` argument a layer sets from its unit
FOLLOWS_MODE = frozenset({_aten.dropout.default, _aten.feature_dropout.default,
                          _aten.alpha_dropout.default, _aten.feature_alpha_dropout.default})
MODE_ARG = 2  # the position of ``train``

# words in the names of the other ops whose behaviour the trace would freeze
REFUSED_MODE_OPS = ("dropout", "batch_norm", "bernoulli")


class TorchCalls(TorchFunctionMode):
    """Records which torch functions that make tensors ``model``'s forward calls, in order
    (their arguments aside: dropout's ``training`` flag is one, and the glue's dropout
    follows the mode anyway). Reads of sizes and devices, and what runs around the forward
    (making the fake tensors), are left out: caches make them differ from run to run. So
    are in-place writes to tensors the forward did not compute: upkeep of the model's state
    (RWKV rescales its weights in place when the mode changes), not its output, and the
    trace refuses glue that writes state in the mode it follows."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.calls: List[Callable[..., Any]] = []
        self._model = model
        self._on = False
        self._handles: List[Any] = []
        self._made: Dict[int, torch.Tensor] = {}  # by id, held: no id is reused meanwhile

    def __enter__(self) -> "TorchCalls":
        def on(*_: Any) -> None:
            self._on = True

        def off(*_: Any) -> None:
            self._on = False

        self._handles = [self._model.register_forward_pre_hook(on),
                         self._model.register_forward_hook(off, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        super().__exit__(*exc)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self._on:
            return out
        made = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor)]
        if not made:
            return out
        if getattr(func, "__name__", "").endswith("_") and args and \
                isinstance(args[0], torch.Tensor) and id(args[0]) not in self._made:
            return out  # an in-place write to the model's state (or to an input)
        self.calls.append(func)
        self._made.update((id(t), t) for t in made)
        return out


def mode_dependent(model: nn.Module, units: Dict[str, nn.Module], args: Tuple[Any, ...],
                   kwargs: Dict[str, Any], calls: List[Any]) -> bool:
    """Whether ``model``'s forward, outside its ``units``, calls other torch functions (or
    fails) with its glue modules in the other train/eval mode: code the trace follows one
    way only. ``calls``: those of the conversion's dry run in the model's own mode
    (``TorchCalls``); one more dry run (``seqpipe.graph.calls.dry_run``, fake tensors)
    flips the glue. The units' own modes are left as they are, so only the glue's
    reading of ``training`` counts."""
    inside = {id(m) for unit in units.values() for m in unit.modules()}
    glue = [m for m in model.modules() if id(m) not in inside]
    # what the other mode's forward may set on the modules (RWKV: layers_are_rescaled)
    kept = [(m, dict(m.__dict__)) for m in model.modules()]
    for module in glue:
        module.training = not module.training
    log = TorchCalls(model)
    try:
        with log:
            dry_run(model, args, kwargs)
    except Exception:  # noqa: BLE001 - the other mode's code cannot even run on the example
        return True
    finally:
        for module, attributes in kept:
            module.__dict__.clear()
            module.__dict__.update(attributes)
    return log.calls != calls


def check_mode(unit: nn.Module, traced: Optional[Tuple[bool, str, str]]) -> None:
    """Before a layer runs: refuse, naming the mend, when the model's forward branches on
    ``training`` outside its units (``traced``: the mode of the layer's ``unit`` at
    conversion, the unit's name and the model's class) and the unit is in the other mode
    now; nothing otherwise."""
    if traced is None or unit.training == traced[0]:
        return
    then, now = ("train", "eval") if traced[0] else ("eval", "train")
    raise RuntimeError(
        f"{traced[2]}'s forward branches on self.training outside its units (code a trace "
        f"follows one way, such as an auxiliary head run only in training): it was converted "
        f"in {then} mode, and unit {traced[1]!r} is in {now} mode now, where the model "
        f"would run other code. Convert the model in the mode it runs in: "
        f"seqpipe.to_sequential(model.{now}(), ...) gives a second converted model over "
        f"the same parameters (one for training, one for evaluation); or make the module "
        f"whose forward branches a unit (units=[...]), which runs eagerly")
