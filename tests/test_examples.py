"""The examples the docs call the pattern to copy run as written and train."""
from __future__ import annotations

import os
import pathlib
import runpy
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_train_local_trains(capsys: pytest.CaptureFixture) -> None:
    main = runpy.run_path(str(ROOT / "examples" / "train_local.py"))["main"]
    first = main(steps=1)
    last = main(steps=20)
    assert last < first  # the synthetic data is learnable: 20 steps bring the loss down
    assert "step 20: loss " in capsys.readouterr().out


def test_train_distributed_trains_on_two_processes() -> None:
    script = ROOT / "examples" / "train_distributed.py"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script)], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(line.split("loss ")[1]) for line in run.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 4 and losses[-1] < losses[0], run.stdout
