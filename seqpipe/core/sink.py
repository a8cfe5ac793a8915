"""Where a stage adds up its parameters' gradients over the micro-batches of one step.

A pipeline step must look to autograd like one backward of the unpipelined model: each
parameter's hooks (a user's ``register_hook`` or ``register_post_accumulate_grad_hook``,
an "optimizer step in backward" recipe, ``DistributedDataParallel``'s reducer) fire once,
with the whole gradient, not once per micro-batch with a share of it. Two ways to get
there, both a ``GradSink`` (what the engines and stages hold), chosen per call by
``open_sink``:

* ``DirectSink`` (no hooks to keep, the usual case): the layers run exactly as in the
  unpipelined model, recording the parameters themselves, and every micro-batch's
  backward accumulates into ``.grad`` in place, as plain autograd does. Nothing runs per
  torch operation. For the local engine's autograd Function (``Pipe.forward``), ``hold``
  first puts each ``.grad`` aside, so that ``take`` can hand the call's sums to autograd
  (which accumulates them once, or returns them from ``torch.autograd.grad`` without
  touching ``.grad``) and put the old values back.
* ``AliasSink`` (a parameter has a hook, or a ``DistributedDataParallel`` forward is
  running): every micro-batch's backward must miss the real parameters. For one call the
  trainable parameters get leaf aliases (same storage and version counter, no copy);
  autograd records the aliases instead of the parameters, so the backward accumulates into
  the aliases' ``.grad`` in place, layer by layer, and no hook of the real parameters
  fires. ``take`` then hands the sums over, once. A parameter used by two partitions (tied
  weights, a shared module) has one alias, into which both stages accumulate (the local
  engine in a fixed order: ``shared_leaves``, ``seqpipe.local.tie_order``).

Both keep one set of gradients, as the unpipelined model does (asking
``torch.autograd.grad`` for each micro-batch's gradients and adding them up would hold a
second set at every micro-batch). A hook registered on a parameter's gradient accumulator
node instead of on the parameter is not visible from Python: under a ``DirectSink`` it
would fire once per micro-batch. ``DistributedDataParallel``'s reducer hooks there; its
running forward is what ``needs_aliases`` looks for.

``AliasSink``'s layers never see the aliases: while a partition runs, a thread-local
``TorchFunctionMode`` hands autograd the alias wherever a layer passes one of the
pipeline's parameters (``seqpipe.core.alias_mode``, which says what stays with the real
parameter and what the substitution costs).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from torch import Tensor, nn

from seqpipe.core.alias_mode import Substitute, make_alias
from seqpipe.core.late_hooks import Hidden, hide
from seqpipe.core.trainable import (
    Trainable,
    ddp_forward_running,
    needs_aliases,
    shared,
    step_aware,
    trainable,
)

__all__ = ["GradSink", "AliasSink", "DirectSink", "ddp_forward_running", "open_sink",
           "needs_aliases", "step_aware", "trainable"]


class GradSink:
    """Where the parameter gradients of one pipeline call add up (``open_sink`` picks one)."""

    params: List[nn.Parameter]  # the trainable parameters, each once, in model order
    # Whether every backward into this sink is one over the whole graph, as the plain
    # model's ``loss.backward()``: its owner runs each one (a ``train_step``), or the
    # caller's autograd call is one (``hold``). A stage then backpropagates as the plain
    # model does, with ``autograd.backward(roots, grads)`` and no ``inputs=``, and a split
    # backward's ``W`` reaches every leaf behind the weight path: each leaf reached gets
    # its gradient, a tensor outside the pipe that a layer or ``loss_fn`` holds included.
    plain = False

    def call(self, stage: int, partition: nn.Module, *args: Any) -> Any:
        """Run ``partition`` (number ``stage``) on ``args``."""
        raise NotImplementedError

    def weights(self, stage: int) -> List[Tensor]:
        """What partition ``stage``'s backward accumulates the parameters' gradients into
        (its ``inputs=``)."""
        raise NotImplementedError

    _shared: List[Tensor] = []
    own: Trainable = []  # per partition, its trainable parameters
    _aliases: Dict[int, Tensor] = {}  # id(parameter) -> its alias (``AliasSink``)

    def shared_leaves(self, held: Sequence[Tensor] = ()) -> List[Tensor]:
        """Where tensors several partitions use accumulate: ties, then ``held`` (``core.held``)."""
        return [*self._shared, *(self._aliases.get(id(t), t) for t in held)]

    def hold(self, whole: bool = False) -> None:
        """Before the call's first backward, where the sums are to be handed to autograd
        (the local engine's autograd Function). ``whole``: that autograd call is a backward
        over the whole graph (``loss.backward()``, no ``inputs=``), which accumulates
        into every leaf it reaches; a sink may then backpropagate as the plain model does
        (``plain``) and leave its sums in ``.grad`` (``DirectSink.hold``)."""
        raise NotImplementedError

    def take(self) -> List[Tuple[nn.Parameter, Tensor]]:
        """Each parameter with its summed gradient still to be handed over, once."""
        raise NotImplementedError

    def drop(self) -> None:
        """After a failed backward, instead of ``take``: the partial sums are let go and
        ``.grad`` is as it was before ``hold``."""
        self.take()


class AliasSink(GradSink):
    """Leaf aliases of the trainable parameters of ``partitions``, for one pipeline call."""

    def __init__(self, partitions: Sequence[nn.Module], own: Optional[Trainable] = None) -> None:
        self.params = []
        self._aliases: Dict[int, Tensor] = {}  # id(parameter) -> its alias
        self._modes: List[Substitute] = []
        self.own = trainable(partitions) if own is None else own
        self._leaves: List[List[Tensor]] = []
        by_alias: Dict[int, nn.Parameter] = {}  # id(alias) -> parameter
        for mine in self.own:
            leaves = [self._alias_of(p) for p in mine]
            by_alias.update((id(a), p) for p, a in zip(mine, leaves))
            self._modes.append(Substitute(self._aliases, by_alias, mine, leaves))
            self._leaves.append(leaves)
        self._shared = [self._aliases[id(p)] for p in shared(self.own)]

    def _alias_of(self, param: nn.Parameter) -> Tensor:
        if id(param) not in self._aliases:
            self._aliases[id(param)] = make_alias(param)
            self.params.append(param)
        return self._aliases[id(param)]

    @contextmanager
    def installed(self, stage: int) -> Iterator[None]:
        """Partition ``stage``'s parameters stand for their aliases in autograd, inside the
        block, on this thread."""
        with self._modes[stage]:
            yield

    def call(self, stage: int, partition: nn.Module, *args: Any) -> Any:
        """Run ``partition`` (number ``stage``) on ``args`` recording its parameters' aliases."""
        if not self._aliases:  # nothing trainable: nothing to substitute
            return partition(*args)
        with self._modes[stage]:
            return partition(*args)

    def leaves(self, stage: int) -> List[Tensor]:
        """Partition ``stage``'s aliases, to backpropagate into (``inputs=``); with those of
        other partitions' parameters that its layers used (once its forward ran)."""
        return self._leaves[stage]

    def weights(self, stage: int) -> List[Tensor]:
        """``leaves``, and the real parameters too, since one may reach autograd without
        passing through a torch function (a custom ``autograd.Function.apply``), where no
        alias stands in for it."""
        return [*self._leaves[stage], *self.own[stage]]

    def hold(self, whole: bool = False) -> None:
        """The sums never reach ``.grad``: nothing to put aside. With ``whole``, the
        stages backpropagate as the plain model does (``plain``): into the aliases, as
        ``inputs=`` would, and into whatever else the caller's call reaches."""
        self.plain = whole

    def take(self) -> List[Tuple[nn.Parameter, Tensor]]:
        """Each parameter with its summed gradient, letting go of it here (so autograd can
        adopt the tensor as ``.grad`` instead of copying it)."""
        pairs = []
        for param in self.params:
            alias = self._aliases[id(param)]
            if alias.grad is not None:
                pairs.append((param, alias.grad))
                alias.grad = None
        return pairs


class DirectSink(GradSink):
    """The trainable parameters of ``partitions`` recorded as themselves, for one call: their
    gradients accumulate in ``.grad`` (see the module docstring)."""

    def __init__(self, partitions: Sequence[nn.Module], own: Optional[Trainable] = None) -> None:
        self.own = own = trainable(partitions) if own is None else own
        if len(own) == 1:  # one partition (a one-stage call, a distributed stage's step)
            self.params = list(own[0])
            self._weights = [self.params]
        else:
            self.params = list({id(p): p for mine in own for p in mine}.values())
            # A layer may use another partition's parameter (a plain attribute): each
            # stage's backward reaches every parameter of the pipeline it used.
            ids = [{id(p) for p in mine} for mine in own]
            self._weights = [[*mine, *(p for p in self.params if id(p) not in seen)]
                             for mine, seen in zip(own, ids)]
        self._shared: List[Tensor] = list(shared(own))
        self._before: Optional[List[Tuple[nn.Parameter, Tensor]]] = None  # see ``hold``
        self._in_place = False  # the sums stay in ``.grad`` (``hold``)
        self._hidden: Optional[Hidden] = None  # hooks registered since the forward

    def call(self, stage: int, partition: nn.Module, *args: Any) -> Any:
        """Run ``partition`` on ``args``, as the unpipelined model would."""
        return partition(*args)

    def weights(self, stage: int) -> List[Tensor]:
        """Partition ``stage``'s parameters, then the other partitions' (a layer may use
        one through a plain attribute)."""
        return self._weights[stage]

    def hold(self, whole: bool = False) -> None:
        """From now until ``take``, ``.grad`` holds this call's sums only: the values before
        are put aside (the local engine's autograd Function hands the sums to autograd).

        With ``whole`` (the caller's autograd call is a backward over the whole graph), the
        stages backpropagate as the plain model does, without ``inputs=`` (``plain``): that
        call would accumulate into every leaf the stages' graphs reach, and so does their
        backward. If, besides, every ``.grad`` is ``None``, nothing is put aside and the
        sums stay in ``.grad``, where that call would have put them: ``take`` hands nothing
        over. A hook registered on a parameter since the forward is kept out of the
        micro-batches' backward and fires once, with the sum (``seqpipe.core.late_hooks``)."""
        self._hidden = hide(self.params)
        before: List[Tuple[nn.Parameter, Tensor]] = []
        for param in self.params:
            grad = param.grad
            if grad is not None:
                before.append((param, grad))
                param.grad = None
        self._before = before
        self.plain = whole
        self._in_place = whole and not before and not self._hidden

    def take(self) -> List[Tuple[nn.Parameter, Tensor]]:
        """After ``hold``: each parameter with its summed gradient, and ``.grad`` as it was
        before ``hold``. Without it, or with the sums left in ``.grad`` (``hold``): nothing
        (they are in ``.grad`` already)."""
        before, self._before = self._before, None
        self._restore_hooks()
        if before is None or self._in_place:
            return []
        pairs = []
        for param in self.params:
            summed = param.grad
            if summed is not None:
                pairs.append((param, summed))
                param.grad = None
        for param, grad in before:
            param.grad = grad
        return pairs

    def drop(self) -> None:
        """After a failed backward: ``.grad`` as before ``hold`` (``None``, where the sums
        were left in it)."""
        if self._in_place and self._before is not None:
            self._before = None
            self._restore_hooks()
            for param in self.params:
                param.grad = None
            return
        self.take()

    def _restore_hooks(self) -> None:
        hidden, self._hidden = self._hidden, None
        if hidden:
            hidden.restore()


def open_sink(partitions: Sequence[nn.Module]) -> GradSink:
    """The sink for one call over ``partitions``: an ``AliasSink`` where ``needs_aliases``
    says so, else a ``DirectSink`` (no cost per torch operation)."""
    own = trainable(partitions)
    if needs_aliases(own[0] if len(own) == 1 else [p for mine in own for p in mine]):
        return AliasSink(partitions, own)
    return DirectSink(partitions, own)
