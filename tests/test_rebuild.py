"""How the ranks of a new ``DistributedPipe`` agree on its tag and on a fresh group
(``seqpipe.distributed.rebuild``), from every rank's view in the construction's all-gather.

The multi-process case (a rebuild on the group of a failed call trains as the plain model)
runs in ``tests/test_distributed_failures.py``'s launch."""
from __future__ import annotations

from seqpipe.distributed.rebuild import _CLOCK_TAG, agreed


def test_the_tag_is_one_more_than_any_ranks_and_a_failure_anywhere_counts() -> None:
    # [highest tag a pipe on the group uses on that rank, a call on it failed there]
    assert agreed(None, [[0, 0], [0, 0]]) == (1, False)
    assert agreed(None, [[2, 0], [5, 0], [1, 0]]) == (6, False)
    assert agreed(None, [[2, 0], [2, 1]]) == (3, True)  # one rank saw it fail: all know


def test_the_tag_skips_the_ones_other_messages_use() -> None:
    assert agreed(None, [[_CLOCK_TAG - 1, 0]]) == (_CLOCK_TAG + 1, False)
