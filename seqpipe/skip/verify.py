"""Static checks that every skip of an ``nn.Sequential`` is stashed once and popped once.

A broken skip only fails at run time, and inside a pipeline that can mean a stage waiting
forever for a tensor nobody sends. :func:`verify_skippables` finds those mistakes from the
declarations alone (``@skippable(stash=..., pop=...)`` plus each instance's namespaces) and
reports all of them in one ``TypeError``.

Only the *direct* children of the Sequential are inspected: the pipeline splits a model
between direct children, so only their skips can cross partitions. A skippable module nested
deeper inside a child is that child's own business; its skips travel through the default
tracker of the thread that runs the child. A ``yield`` of a name the class does not declare
cannot be seen here; the skippable driver reports it when it happens.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from torch import nn

from seqpipe.skip.namespace import DEFAULT_NAMESPACE, Namespace
from seqpipe.skip.skippable import SkipSite, iter_pops, iter_stashes

__all__ = ["verify_skippables"]

SkipKey = tuple[Namespace, str]

HINT = ("hint: every stashed name must be popped exactly once, by the same or a later layer; "
        "declare names with @skippable(stash=[...], pop=[...]), and to reuse a block class for "
        "independent skips give each instance its own namespace: block.isolate(Namespace())")


def verify_skippables(module: nn.Sequential) -> None:
    """Raise one ``TypeError`` listing every skip problem of ``module``'s direct children."""
    problems = _problems(module)
    if problems:
        plural = "s" if len(problems) > 1 else ""
        lines = [f"nn.Sequential has {len(problems)} skip connection problem{plural}:"]
        lines += [f"  - {problem}" for problem in problems]
        lines.append(HINT)
        raise TypeError("\n".join(lines))


def _problems(module: nn.Sequential) -> list[str]:
    """One message per problem, ordered by the first layer involved, then by name."""
    stashes = _group(iter_stashes(module))
    pops = _group(iter_pops(module))
    keys = sorted(stashes.keys() | pops.keys(),
                  key=lambda key: (_first_index(stashes[key] + pops[key]), key[1]))
    return [problem for key in keys for problem in _key_problems(key, stashes[key], pops[key])]


def _group(sites: Iterable[SkipSite]) -> defaultdict[SkipKey, list[SkipSite]]:
    groups: defaultdict[SkipKey, list[SkipSite]] = defaultdict(list)
    for site in sites:
        groups[(site.ns, site.name)].append(site)
    return groups


def _key_problems(key: SkipKey, stashes: list[SkipSite], pops: list[SkipSite]) -> list[str]:
    label = _label(*key)
    problems = []
    if len(stashes) > 1:
        problems.append(f"{label} is stashed more than once, by {_layers(stashes)}")
    if len(pops) > 1:
        problems.append(f"{label} is popped more than once, by {_layers(pops)}")
    if not pops:
        problems.append(f"{label} is stashed by {_layers(stashes)} but never popped")
    elif not stashes:
        problems.append(f"{label} is popped by {_layers(pops)} but never stashed")
    elif _first_index(pops) < _first_index(stashes):
        problems.append(f"{label} is popped by {_layers(pops)} before it is stashed by "
                        f"{_layers(stashes)}")
    return problems


def _first_index(sites: list[SkipSite]) -> int:
    return min(site.index for site in sites)


def _layers(sites: list[SkipSite]) -> str:
    noun = "layer" if len(sites) == 1 else "layers"
    where = ", ".join(f"{site.index} ({type(site.layer).__name__})" for site in sites)
    return f"{noun} {where}"


def _label(ns: Namespace, name: str) -> str:
    """``'name'``, tagged with a short namespace id when it is not the default one."""
    if ns == DEFAULT_NAMESPACE:
        return f"'{name}'"
    return f"'{name}' (namespace {str(ns.id)[:8]})"
