"""pytest setup for the benchmarks: collect ``bench_*.py`` here, and only when asked for.

The benchmarks live outside ``tests/`` so ``pytest tests/`` never sees them. pytest's
default file pattern (``test_*.py``) would not collect ``bench_*.py`` either, so this
conftest collects them, but only when ``benchmarks/`` (or a file in it) is named on the
command line (``pytest benchmarks/ --benchmark-only``): a bare ``pytest`` from the
repository root does not run them.

It also puts the repository root on ``sys.path`` (``seqpipe`` imports without
``PYTHONPATH``) and pins glibc's malloc thresholds for the session (see ``_common``).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import pin_malloc  # noqa: E402

pin_malloc()


def _asked_for(config: pytest.Config) -> bool:
    base = Path(config.invocation_params.dir)
    for arg in config.args:
        path = (base / arg.split("::")[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> Optional[pytest.Module]:
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and file_path.parent == HERE and not parent.session.isinitpath(file_path)
            and _asked_for(parent.config)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
