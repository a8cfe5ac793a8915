"""Every package the tests import is installed by the README's test command
(``pip install -e ".[test]"``): listed in setup.py's ``install_requires`` or ``test``
extra. A package missing there passes on a development machine that happens to have it
and fails on a fresh one."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parent.parent


def _listed() -> Set[str]:
    """Distribution names in setup.py's install_requires and test extra, normalised."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "setup")
    values = {k.arg: ast.literal_eval(k.value) for k in call.keywords
              if k.arg in ("install_requires", "extras_require")}
    wanted = [*values["install_requires"], *values["extras_require"]["test"]]
    return {_normal(re.split(r"[<>=!~\[;\s]", w, maxsplit=1)[0]) for w in wanted}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports(folder: Path) -> Dict[str, List[str]]:
    """Top-level names imported anywhere in ``folder``'s Python files (inside functions
    too) that are neither the standard library nor the repository's own modules."""
    own = {p.stem for p in folder.glob("*.py")} | {"seqpipe", "tests", "benchmarks"}
    found: Dict[str, List[str]] = {}
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in own:
                    found.setdefault(top, []).append(path.name)
    return found


def _distributions(module: str) -> List[str]:
    """The distributions that install ``module``: its own name when one is called so
    (cheap), else the full map of installed packages (slow, so only then)."""
    try:
        return [importlib.metadata.distribution(module).metadata["Name"]]
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.packages_distributions().get(module, [module])


def test_every_package_the_tests_import_is_in_the_test_extra() -> None:
    listed = _listed()
    missing = {name: files for name, files in _imports(ROOT / "tests").items()
               if not any(_normal(d) in listed for d in _distributions(name))}
    assert not missing, (
        f"tests import {sorted(missing)} (in {missing}), which setup.py's install_requires "
        f"and extras_require['test'] do not list, so the README's test command would not "
        f"install them: add them to the test extra, pinned to the installed version")
