"""Run every example a user is shown, many times, and count the runs that do not exit 0.

A script that trains correctly and then dies in the interpreter's teardown (SIGABRT,
"terminate called without an active exception", see "Ending a script" in
docs/distributed.md) fails its job all the same, and does so only now and then: this
counts it. Not a timed test; it takes a while (``--runs 100``: tens of minutes).

What runs, each ``--runs`` times:

* every complete Python script among the code blocks of ``README.md`` and ``docs/*.md``:
  one that calls ``init_process_group`` under ``torchrun --nproc-per-node=2`` (as the docs
  launch it), the others with ``python``. Blocks that are fragments (they use names they
  do not define, or need a GPU) are found by one trial run and listed as skipped;
* ``examples/*.py`` (``train_distributed.py`` under ``torchrun``), with short settings;
* ``python -m seqpipe --processes 2``, with short settings;
* ``benchmarks/import_order.py`` under ``torchrun``, importing seqpipe before
  ``init_process_group`` (``import-order-first``) and after it (``import-order-late``).

    PYTHONPATH=$PWD python benchmarks/exit_soak.py --runs 20
    PYTHONPATH=$PWD python benchmarks/exit_soak.py --runs 100 --only seqpipe-processes-2
    PYTHONPATH=$PWD python benchmarks/exit_soak.py --runs 40 --only import-order-{first,late}
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
SHORT = ["--steps", "2", "--batch", "8", "--chunks", "2", "--balance-by", "params"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
REASON = re.compile(r"terminate called|outlived destroy_process_group|Signal \d+ \(SIG\w+\)")
"""The telling line of a failed run's stderr (torchrun's own report ends with a rule)."""
FRAGMENT = re.compile(r"NameError|ModuleNotFoundError|Found no NVIDIA driver|CUDA|cuda|"
                      r"No such file or directory|Torch not compiled")


@dataclass
class Target:
    """One command to run again and again."""

    name: str
    command: List[str]
    from_docs: bool = False


def doc_blocks() -> List[Target]:
    """Each ``python`` code block of the README and the docs as a script in a temp folder."""
    folder = Path(tempfile.mkdtemp(prefix="seqpipe-soak-"))
    targets = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
        for n, code in enumerate(blocks):
            path = folder / f"{doc.stem}_{n}.py"
            path.write_text(code)
            launcher = TORCHRUN if "init_process_group" in code else [sys.executable]
            targets.append(Target(f"{doc.name}#{n}", [*launcher, str(path)], from_docs=True))
    return targets


def all_targets() -> List[Target]:
    examples = ROOT / "examples"
    return [
        *doc_blocks(),
        Target("examples/train_local.py", [sys.executable, str(examples / "train_local.py"),
                                           *SHORT]),
        Target("examples/train_distributed.py",
               [*TORCHRUN, str(examples / "train_distributed.py"), *SHORT]),
        Target("seqpipe-processes-2", [sys.executable, "-m", "seqpipe", "--processes", "2",
                                       *SHORT]),
        *(Target(f"import-order-{order}", [*TORCHRUN, str(ROOT / "benchmarks" / "import_order.py"),
                                           f"--seqpipe-import={order}"])
          for order in ("first", "late")),
    ]


def run_once(target: Target, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    try:
        return subprocess.run(target.command, cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(target.command, -9, "", f"timeout: {exc}")


def soak(target: Target, runs: int, timeout: float) -> Dict[str, object]:
    """Runs and failures; ``skipped`` (the reason) for a doc fragment, whose first run
    fails for want of a name or a GPU."""
    failures: List[str] = []
    started = time.monotonic()
    for n in range(runs):
        done = run_once(target, timeout)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["(no output)"]
            last = lines[-1]
            if n == 0 and target.from_docs and FRAGMENT.search(done.stderr):
                return {"skipped": last[:100]}
            telling = next((line for line in lines if REASON.search(line)), last)
            failures.append(f"run {n + 1}: exit {done.returncode}: {telling.strip()[:160]}")
    return {"runs": runs, "failed": len(failures), "seconds": time.monotonic() - started,
            "failures": failures}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="runs of each target (default 100)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="names of the targets to run (default: all)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    targets = [t for t in all_targets() if args.only is None or t.name in args.only]
    total_failed = 0
    for target in targets:
        result = soak(target, args.runs, args.timeout)
        if "skipped" in result:
            print(f"{target.name:32s} skipped, a fragment: {result['skipped']}", flush=True)
            continue
        total_failed += int(result["failed"])  # type: ignore[call-overload]
        print(f"{target.name:32s} {result['failed']:3d} of {result['runs']} runs exited "
              f"non-zero ({result['seconds']:.0f} s)", flush=True)
        for line in result["failures"]:  # type: ignore[attr-defined]
            print(f"    {line}", flush=True)
    return 1 if total_failed else 0


if __name__ == "__main__":
    sys.exit(main())
