"""Actions: one pass (forward, backward, or half a backward) of one micro-batch on one stage.

A backward is either one full pass ``B`` or two halves that a zero-bubble schedule runs apart:
``I`` computes the gradient with respect to the stage's input (the upstream stage waits for
it, so it is on the critical path) and ``W`` the gradients of the stage's parameters (nobody
waits for it, so it can fill a bubble later). ``B = I + W``.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "Action",
    "B",
    "F",
    "I",
    "Phase",
    "W",
    "backward",
    "backward_input",
    "backward_phase",
    "backward_weight",
    "forward",
    "forward_phase",
]


class Phase(str, enum.Enum):
    """Which pass an action runs. ``Phase("F")`` etc. also accept the one-letter names."""

    FORWARD = "forward"
    BACKWARD = "backward"
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"

    @property
    def letter(self) -> str:
        """``F``, ``B``, ``I`` or ``W``."""
        return _LETTERS[self]

    @classmethod
    def _missing_(cls, value: object) -> Optional[Phase]:
        if isinstance(value, str):
            return _BY_LETTER.get(value.upper())
        return None


_LETTERS = {Phase.FORWARD: "F", Phase.BACKWARD: "B",
            Phase.BACKWARD_INPUT: "I", Phase.BACKWARD_WEIGHT: "W"}
_BY_LETTER = {letter: phase for phase, letter in _LETTERS.items()}


def _check_index(label: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{label} must be >= 0, got {value}")


@dataclass(frozen=True)
class Action:
    """One pass of one micro-batch, e.g. ``F3``; with its stage, e.g. ``2F3`` (stage 2).

    ``stage`` is ``None`` in the one-stage-per-rank protocol
    (``Schedule.actions(stage, ...)``), where the stage is implied; a schedule that places
    several stages on a rank names the stage of every action.
    """

    phase: Phase
    microbatch: int
    stage: Optional[int] = None

    def __post_init__(self) -> None:
        # Plain-type fast paths first: the validator builds and checks ~10^5 actions.
        if self.phase.__class__ is not Phase:
            try:
                object.__setattr__(self, "phase", Phase(self.phase))
            except ValueError:
                raise TypeError(f"phase must be a Phase, got {self.phase!r}") from None
        if self.microbatch.__class__ is not int or self.microbatch < 0:
            _check_index("microbatch", self.microbatch)
        if self.stage is not None and (self.stage.__class__ is not int or self.stage < 0):
            _check_index("stage", self.stage)

    @classmethod
    def forward(cls, microbatch: int, stage: Optional[int] = None) -> Action:
        """The forward pass of ``microbatch``."""
        return cls(Phase.FORWARD, microbatch, stage)

    @classmethod
    def backward(cls, microbatch: int, stage: Optional[int] = None) -> Action:
        """The full backward pass of ``microbatch`` (input and weight gradients at once)."""
        return cls(Phase.BACKWARD, microbatch, stage)

    @classmethod
    def backward_input(cls, microbatch: int, stage: Optional[int] = None) -> Action:
        """The input-gradient half of the backward of ``microbatch`` (``I``)."""
        return cls(Phase.BACKWARD_INPUT, microbatch, stage)

    @classmethod
    def backward_weight(cls, microbatch: int, stage: Optional[int] = None) -> Action:
        """The weight-gradient half of the backward of ``microbatch`` (``W``)."""
        return cls(Phase.BACKWARD_WEIGHT, microbatch, stage)

    @property
    def is_forward(self) -> bool:
        """True for a forward pass."""
        return self.phase is Phase.FORWARD

    @property
    def sends_gradient(self) -> bool:
        """True for ``B`` and ``I``: the passes that produce the upstream stage's gradient."""
        return self.phase is Phase.BACKWARD or self.phase is Phase.BACKWARD_INPUT

    def __str__(self) -> str:
        text = f"{self.phase.letter}{self.microbatch}"
        return text if self.stage is None else f"{self.stage}{text}"

    def __repr__(self) -> str:
        where = "" if self.stage is None else f", stage={self.stage}"
        return f"{self.phase.letter}({self.microbatch}{where})"


def forward(microbatch: int, stage: Optional[int] = None) -> Action:
    """The forward pass of ``microbatch`` (short for ``Action.forward``)."""
    return Action.forward(microbatch, stage)


def backward(microbatch: int, stage: Optional[int] = None) -> Action:
    """The full backward pass of ``microbatch`` (short for ``Action.backward``)."""
    return Action.backward(microbatch, stage)


def backward_input(microbatch: int, stage: Optional[int] = None) -> Action:
    """The input-gradient backward of ``microbatch`` (short for ``Action.backward_input``)."""
    return Action.backward_input(microbatch, stage)


def backward_weight(microbatch: int, stage: Optional[int] = None) -> Action:
    """The weight-gradient backward of ``microbatch`` (short for ``Action.backward_weight``)."""
    return Action.backward_weight(microbatch, stage)


F = forward
B = backward
I = backward_input  # noqa: E741 - the phase's name in the zero-bubble paper
W = backward_weight


def forward_phase(actions: Iterable[Action]) -> list[Action]:
    """The forwards of an action list, in schedule order."""
    return [a for a in actions if a.phase is Phase.FORWARD]


def backward_phase(actions: Iterable[Action]) -> list[Action]:
    """The backward passes (``B``, ``I`` and ``W``) of an action list, in schedule order."""
    return [a for a in actions if a.phase is not Phase.FORWARD]
