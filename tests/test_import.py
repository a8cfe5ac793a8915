"""``import seqpipe`` costs little beyond ``import torch`` (issue 26): ``torch._dynamo``
(about 1.5 s, with sympy) is imported only when something first needs it, such as the first
checkpointed micro-batch or ``torch.compile``, and ``torch.distributed.tensor`` and
``torch.distributed.fsdp`` (sympy again) only by a user who shards stages with FSDP2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp", "sympy")


def _loaded_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; which of ``HEAVY`` it left imported, and how
    ``torch.distributed.nn.functional`` stands."""
    probe = (f"{code}\nimport json, sys\n"
             f"f = sys.modules.get('torch.distributed.nn.functional')\n"
             f"print(json.dumps({{'heavy': [m for m in {HEAVY!r} if m in sys.modules], "
             f"'functional': f is not None}}))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_seqpipe_does_not_import_torch_dynamo() -> None:
    state = _loaded_after("import seqpipe, seqpipe.distributed, seqpipe.trace, seqpipe.balance")
    assert state["heavy"] == [], f"import seqpipe imported {state['heavy']}"
    # Imported, so that it is never imported after init_process_group (see test_exit.py).
    assert state["functional"]

