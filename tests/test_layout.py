"""The package layout as a checked rule (docs/index.md, "Where things live").

Every ``seqpipe`` module's imports are read from its source (module-level, inside
functions and under ``TYPE_CHECKING`` alike) and must respect the layering:

* ``seqpipe.core`` (what both engines share) imports no engine and not the face;
* the engines, ``seqpipe.local`` and ``seqpipe.distributed``, do not import each other
  (nor the face);
* ``seqpipe.schedule`` imports nothing else of seqpipe (schedules are plain data);
  ``seqpipe.skip`` and ``seqpipe.balance`` import no engine and of the core only its data
  modules (``CORE_DATA``), never its runtime; ``seqpipe.trace`` imports only schedules;
* no import cycle among seqpipe modules, lazy imports included;
* no module over 400 lines;
* docs/index.md's package map has exactly one row per module, and no row for a module
  that does not exist (so the map stays complete as modules come and go).
"""
from __future__ import annotations

import ast
import pathlib
import re
from typing import Dict, List, Optional, Set, Tuple

import pytest

import seqpipe

ROOT = pathlib.Path(seqpipe.__file__).parent
INDEX = pathlib.Path(__file__).resolve().parent.parent / "docs" / "index.md"
MAX_LINES = 400
FACE = {"seqpipe", "seqpipe.pipe", "seqpipe.demo", "seqpipe.__main__", "seqpipe.launch",
        "seqpipe._moved"}
CORE_DATA = {"seqpipe.core", "seqpipe.core.arguments", "seqpipe.core.flags",
             "seqpipe.core.microbatch", "seqpipe.core.nochunk", "seqpipe.core.partition"}
"""The core's modules of plain data and argument checks, which skip and balance may use."""

Import = Tuple[str, str, int]  # (importing module, imported module, line)


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> Dict[str, Tuple[str, bool]]:
    """Every seqpipe module: name -> (source, is a package ``__init__``)."""
    return {_name(p): (p.read_text(), p.name == "__init__.py") for p in ROOT.rglob("*.py")}


def imports(modules: Dict[str, Tuple[str, bool]]) -> List[Import]:
    """Every import of a seqpipe module by a seqpipe module, wherever it is written. ``from
    package import name`` counts as importing the submodule ``package.name`` if there is
    one, else the package."""
    found: List[Import] = []
    for module, (source, is_package) in modules.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                found += [(module, a.name, node.lineno) for a in node.names
                          if a.name.split(".")[0] == "seqpipe"]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = module.split(".") if is_package else module.split(".")[:-1]
                    here = here[:len(here) - node.level + 1]
                    base = ".".join(here + ([node.module] if node.module else []))
                if base.split(".")[0] != "seqpipe":
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.append((module, sub if sub in modules else base, node.lineno))
    return found


def _part(module: str) -> str:
    """Which part of the layout a module belongs to."""
    if module in FACE:
        return "face"
    return module.split(".")[1]


def _within(module: str, *parts: str) -> bool:
    return _part(module) in parts


def broken_rule(importer: str, imported: str) -> Optional[str]:
    """Why ``importer`` may not import ``imported``; ``None`` if it may."""
    engines = ("local", "distributed")
    if _within(importer, "core") and _within(imported, *engines, "face", "compat"):
        return ("the core (seqpipe.core) must not import an engine, the face or compat: "
                "move the shared piece into seqpipe.core")
    for engine in engines:
        other = "distributed" if engine == "local" else "local"
        if _within(importer, engine) and _within(imported, other, "face", "compat"):
            return (f"an engine (seqpipe.{engine}) must not import the other engine, the "
                    f"face or compat: move the shared piece into seqpipe.core")
    if _within(importer, "schedule") and not _within(imported, "schedule"):
        return ("schedules are plain data: seqpipe.schedule may import only itself; move "
                "the piece into seqpipe.schedule or have the caller pass it in")
    if _within(importer, "skip", "balance") and (
            _within(imported, *engines, "face", "compat")
            or (_within(imported, "core") and imported not in CORE_DATA)):
        return ("seqpipe.skip and seqpipe.balance may not import an engine, the face or the "
                f"core's runtime (of the core only {sorted(CORE_DATA)}): move the piece "
                f"they need into one of those")
    if _within(importer, "trace") and not _within(imported, "trace", "schedule"):
        return ("seqpipe.trace sits below the core and the engines: it may import only "
                "itself and seqpipe.schedule; have the engines call trace.hooks instead")
    return None


def layering_errors(found: List[Import]) -> List[str]:
    """One line per import that breaks the layering, naming it and the rule."""
    return [f"{importer} (line {line}) imports {imported}: {why}"
            for importer, imported, line in found
            if (why := broken_rule(importer, imported)) is not None]


def cycles(found: List[Import]) -> List[List[str]]:
    """The import cycles among the modules (Tarjan's strongly connected components, and
    modules importing themselves), each as its modules, sorted."""
    edges: Dict[str, Set[str]] = {}
    for importer, imported, _ in found:
        edges.setdefault(importer, set()).add(imported)
        edges.setdefault(imported, set())
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def cycle_errors(found: List[Import]) -> List[str]:
    """One line per cycle, with the imports (and their lines) that close it."""
    errors = []
    for component in cycles(found):
        members = set(component)
        links = sorted(f"{a} (line {line}) -> {b}" for a, b, line in found
                       if a in members and b in members)
        errors.append(f"import cycle among {component}: {'; '.join(links)}; move the piece "
                      f"they share into a module below both")
    return errors


def test_layering() -> None:
    errors = layering_errors(imports(sources()))
    assert not errors, "\n".join(errors)


def test_no_import_cycles() -> None:
    errors = cycle_errors(imports(sources()))
    assert not errors, "\n".join(errors)


def test_no_module_over_400_lines() -> None:
    long = {name: source.count("\n") for name, (source, _) in sources().items()
            if source.count("\n") > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split a concept out): {long}"


def test_the_walk_sees_the_layout() -> None:
    """The checks above read the real tree: the packages, the engines' imports of the core
    and the schedule's of itself are all there."""
    found = imports(sources())
    parts = {_part(m) for m, _, _ in found}
    assert {"face", "core", "local", "distributed", "schedule", "skip", "balance",
            "trace", "compat"} <= parts
    assert ("seqpipe.local.pipeline", "seqpipe.core.stage") in {(a, b) for a, b, _ in found}
    assert ("seqpipe.distributed.step", "seqpipe.core.tasks") in {(a, b) for a, b, _ in found}


FAKE = {
    "seqpipe.core.a": ("def f():\n    from seqpipe.local import b\n", False),
    "seqpipe.local": ("", True),
    "seqpipe.local.b": ("from seqpipe.distributed.c import x\n", False),
    "seqpipe.distributed.c": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from seqpipe.distributed import d\n", False),
    "seqpipe.distributed": ("", True),
    "seqpipe.distributed.d": ("from . import c\n", False),
    "seqpipe.schedule.e": ("import seqpipe.core.stage\n", False),
    "seqpipe.skip.f": ("from seqpipe.core.flags import is_recomputing\n"
                       "from seqpipe.core.checkpoint import run_task\n", False),
    "seqpipe.core.flags": ("", False),
    "seqpipe.core.checkpoint": ("", False),
    "seqpipe.core.stage": ("", False),
}


def test_the_rules_name_each_offending_import() -> None:
    """Lazy, ``TYPE_CHECKING`` and relative imports count; each error names the import."""
    errors = layering_errors(imports(FAKE))
    assert errors == [
        "seqpipe.core.a (line 2) imports seqpipe.local.b: the core (seqpipe.core) must not "
        "import an engine, the face or compat: move the shared piece into seqpipe.core",
        "seqpipe.local.b (line 1) imports seqpipe.distributed.c: an engine (seqpipe.local) "
        "must not import the other engine, the face or compat: move the shared piece into "
        "seqpipe.core",
        "seqpipe.schedule.e (line 1) imports seqpipe.core.stage: schedules are plain data: "
        "seqpipe.schedule may import only itself; move the piece into seqpipe.schedule or "
        "have the caller pass it in",
        "seqpipe.skip.f (line 2) imports seqpipe.core.checkpoint: seqpipe.skip and "
        "seqpipe.balance may not import an engine, the face or the core's runtime (of the "
        f"core only {sorted(CORE_DATA)}): move the piece they need into one of those",
    ]


def test_a_cycle_through_a_type_checking_import_is_found() -> None:
    assert cycle_errors(imports(FAKE)) == [
        "import cycle among ['seqpipe.distributed.c', 'seqpipe.distributed.d']: "
        "seqpipe.distributed.c (line 3) -> seqpipe.distributed.d; "
        "seqpipe.distributed.d (line 1) -> seqpipe.distributed.c; "
        "move the piece they share into a module below both"]


@pytest.mark.parametrize("lines, over", [(MAX_LINES, False), (MAX_LINES + 1, True)])
def test_the_line_limit(lines: int, over: bool) -> None:
    assert (("x = 1\n" * lines).count("\n") > MAX_LINES) is over


MAP_ROW = re.compile(r"^\| `(seqpipe[\w.]*)` \|(.*)\|\s*$")


def map_rows(index: str) -> List[Tuple[str, str]]:
    """The rows of the "Package map" section of docs/index.md: (module, what it holds)."""
    section = index.split("\n## Package map\n", 1)[1].split("\n## ", 1)[0]
    return [(m.group(1), m.group(2).strip()) for line in section.splitlines()
            if (m := MAP_ROW.match(line))]


def map_errors(modules: Set[str], index: str) -> List[str]:
    """One line per module without a row, with several rows or with an empty one, and per
    row naming no module, each with the mend."""
    rows = map_rows(index)
    named = [module for module, _ in rows]
    errors = [f"{m} has no row in docs/index.md's package map: add one (what it holds and "
              f"why, one line) to its part's table" for m in sorted(modules - set(named))]
    errors += [f"{m} has {named.count(m)} rows in docs/index.md's package map: keep one"
               for m in sorted(set(named)) if named.count(m) > 1]
    errors += [f"docs/index.md's package map has a row for {m}, which is no module under "
               f"seqpipe/: remove the row or rename it to where the module moved"
               for m in sorted(set(named) - modules)]
    errors += [f"{m}'s row in docs/index.md's package map says nothing: say what it holds"
               for m, holds in rows if not holds]
    return errors


def test_the_package_map_has_one_row_per_module() -> None:
    errors = map_errors(set(sources()), INDEX.read_text())
    assert not errors, "\n".join(errors)


FAKE_INDEX = """# x

## Package map

| module | holds |
|---|---|
| `seqpipe.core` | the core |
| `seqpipe.core.gone` | a module since removed |
| `seqpipe.core.flags` | flags |
| `seqpipe.core.flags` | flags again |
| `seqpipe.core.stage` |  |

## Elsewhere

| `seqpipe.core.checkpoint` | a row outside the map does not count |
"""


def test_the_package_map_check_names_each_fault() -> None:
    """A missing, doubled, empty and stale row are each reported; rows outside the "Package
    map" section do not count."""
    modules = {"seqpipe.core", "seqpipe.core.flags", "seqpipe.core.stage",
               "seqpipe.core.checkpoint"}
    assert map_errors(modules, FAKE_INDEX) == [
        "seqpipe.core.checkpoint has no row in docs/index.md's package map: add one (what "
        "it holds and why, one line) to its part's table",
        "seqpipe.core.flags has 2 rows in docs/index.md's package map: keep one",
        "docs/index.md's package map has a row for seqpipe.core.gone, which is no module "
        "under seqpipe/: remove the row or rename it to where the module moved",
        "seqpipe.core.stage's row in docs/index.md's package map says nothing: say what it "
        "holds",
    ]
