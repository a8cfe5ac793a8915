"""Shared fixtures for the seqpipe test suite."""
from __future__ import annotations

import threading

import pytest
import torch

# The tests check results, not speed. With PyTorch's default intra-op pool (one OpenMP team
# per thread), every pipeline worker thread spins its own team, and on a small machine the
# teams fight for the cores: the same test then takes 10-50x longer from one run to the
# next. One intra-op thread keeps the suite fast and its runtime steady.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fixed_seed_and_no_leaked_workers():
    """Every test starts from the same global RNG state and leaves no worker thread behind."""
    torch.manual_seed(0)
    yield
    alive = [t.name for t in threading.enumerate() if t.name.startswith("seqpipe-stage-")]
    assert not alive, f"seqpipe worker threads still alive after the test: {alive}"
