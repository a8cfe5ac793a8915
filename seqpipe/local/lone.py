"""Which actions of a call run alone whatever the timing: decided from the programs, not
from the clock, so that a stage's intra-op thread count (and with it the order of every
reduction its kernels make) is the same in every run.

While ``K`` CPU stages share the caller's ``T`` intra-op threads, each runs its actions
with its share (``T // K``), and an action during which no other stage can compute takes
all ``T`` (``seqpipe.local.thread_state.IntraOp``). A kernel's result depends on its
thread count: a reduction split over two threads adds its partial sums in another order
than one thread does (a convolution's weight gradient, a BatchNorm's statistics, a
loss's mean). The engine used to decide "alone" when an action started, from what the
other threads were doing at that moment, so the same action ran with 1 thread in one run
and 2 in the next and the pipelined training's losses changed in the fourth digit from
run to run (``python -m seqpipe``: final loss 1.5547-1.5585). Now ``lone_actions`` decides
it once per set of programs, from their dependencies alone: an action is lone when every
action of every other thread is either one it must wait for or one that must wait for it,
so no timing can make another stage compute beside it (the pipeline's fill and drain:
stage 0's first forward, the last stage's last forward, the ends of the backward).

The dependencies are those the local engine's mailbox enforces (``seqpipe.local.step``):
a forward waits for the previous stage's forward of its micro-batch, a backward (``B`` or
``I``) for the next stage's ``B``/``I`` of its micro-batch and, on the last stage of a
training step, for its own forward; a ``W`` follows its ``I``; and each thread runs its
actions in order. Skips go forward and their gradients backward along the same chain, so
they add nothing.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Tuple

from seqpipe.schedule import Action, Phase

__all__ = ["lone_actions"]

Key = Tuple[Phase, int, int]  # (phase, micro-batch, stage)
_SENDS_GRAD = (Phase.BACKWARD, Phase.BACKWARD_INPUT)


def _waits_for(action: Key, present: Dict[Key, int], last_stage: int) -> List[int]:
    """The indices (into ``present``'s nodes) of the actions of another stage, or of the
    same stage's earlier pass, whose results ``action`` needs."""
    phase, i, s = action
    if phase is Phase.FORWARD:
        wanted = [(Phase.FORWARD, i, s - 1)] if s > 0 else []
    elif phase is Phase.BACKWARD_WEIGHT:
        wanted = [(Phase.BACKWARD_INPUT, i, s)]
    elif s < last_stage:
        wanted = [(p, i, s + 1) for p in _SENDS_GRAD]
    else:  # the last stage's backward starts from its loss (a training step) or autograd
        wanted = [(Phase.FORWARD, i, s)]
    return [present[key] for key in wanted if key in present]


@functools.lru_cache(maxsize=64)
def _lone(programs: Tuple[Tuple[Key, ...], ...]) -> Tuple[Tuple[bool, ...], ...]:
    nodes = [key for program in programs for key in program]
    index = {key: n for n, key in enumerate(nodes)}
    thread = [t for t, program in enumerate(programs) for _ in program]
    last_stage = max((key[2] for key in nodes), default=0)
    waits = [_waits_for(key, index, last_stage) for key in nodes]
    start = [0]
    for program in programs:
        start.append(start[-1] + len(program))
    for t, program in enumerate(programs):  # a thread runs its actions in order
        for k in range(1, len(program)):
            waits[start[t] + k].append(start[t] + k - 1)
    # Ancestors in an order the threads could run them in (Kahn's, over the programs).
    ancestors: List[int] = [0] * len(nodes)
    done: List[bool] = [False] * len(nodes)
    positions = [0] * len(programs)
    order: List[int] = []
    progress = True
    while progress:
        progress = False
        for t, program in enumerate(programs):
            while positions[t] < len(program):
                n = start[t] + positions[t]
                if not all(done[w] for w in waits[n]):
                    break
                mask = 0
                for w in waits[n]:
                    mask |= ancestors[w] | (1 << w)
                ancestors[n], done[n] = mask, True
                order.append(n)
                positions[t] += 1
                progress = True
    if len(order) < len(nodes):  # the programs cannot all run: no action is lone
        return tuple(tuple(False for _ in program) for program in programs)
    descendants: List[int] = [0] * len(nodes)
    for n in reversed(order):
        for w in waits[n]:
            descendants[w] |= descendants[n] | (1 << n)
    everything = (1 << len(nodes)) - 1
    own = [((1 << (start[t + 1] - start[t])) - 1) << start[t] for t in range(len(programs))]
    lone = [(ancestors[n] | descendants[n] | own[thread[n]]) == everything
            for n in range(len(nodes))]
    return tuple(tuple(lone[start[t]:start[t + 1]]) for t in range(len(programs)))


def lone_actions(programs: Sequence[Sequence[Action]]) -> Tuple[Tuple[bool, ...], ...]:
    """For each program (one thread's actions, each naming its stage), per action: whether
    it is lone, i.e. every action of every other program must finish before it starts or
    cannot start before it ends (see the module docstring). Programs that could not all
    run to the end (a schedule that deadlocks) have no lone action."""
    keys = tuple(tuple((a.phase, a.microbatch, _stage(a)) for a in program)
                 for program in programs)
    return _lone(keys)


def _stage(action: Action) -> int:
    stage: Optional[int] = action.stage
    assert stage is not None, "the local engine's actions name their stage"
    return stage
