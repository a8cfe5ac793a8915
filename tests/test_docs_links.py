"""Every relative link of README.md and docs/*.md leads somewhere: its file exists and, for
a page, its ``#anchor`` is one of that page's headings (as GitHub makes anchors of them).

A reader following the docs page to page meets a dead link as the first rough edge; the
anchors drift when a heading is renamed.
"""
from __future__ import annotations

import pathlib
import re
from typing import Dict, List, Set

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^#+ (.*)$", re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``-`` and ``_``
    kept), each space a ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def dead_links(pages: List[pathlib.Path]) -> List[str]:
    """One line per relative link (outside code blocks) whose file or anchor is missing."""
    texts = {page.resolve(): FENCE.sub("", page.read_text()) for page in pages}
    anchors: Dict[pathlib.Path, Set[str]] = {
        page: {anchor(h) for h in HEADING.findall(text)} for page, text in texts.items()}
    dead = []
    for page, text in texts.items():
        for link in LINK.findall(text):
            if re.match(r"[a-z]+:", link):  # https:, mailto: ...
                continue
            path, _, fragment = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                dead.append(f"{page.name}: ({link}): no file {path}; fix the path")
            elif fragment and target.suffix == ".md" and fragment not in anchors.get(
                    target, {anchor(h) for h in HEADING.findall(target.read_text())}):
                dead.append(f"{page.name}: ({link}): {target.name} has no heading "
                            f"#{fragment}; link to one of its headings")
    return dead


def test_every_link_leads_somewhere() -> None:
    dead = dead_links(PAGES)
    assert not dead, "\n".join(dead)


def test_a_dead_link_is_named(tmp_path: pathlib.Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\n## Pipeline × data parallelism\n\n"
                                   "[ok](#pipeline--data-parallelism) [ok](b.md#b-title)\n"
                                   "[gone](b.md#nothing) [no page](c.md)\n"
                                   "```\n[in code](d.md)\n```\n")
    (tmp_path / "b.md").write_text("# B `title`\n")
    dead = dead_links([tmp_path / "a.md", tmp_path / "b.md"])
    assert dead == ["a.md: (b.md#nothing): b.md has no heading #nothing; link to one of its "
                    "headings", "a.md: (c.md): no file c.md; fix the path"]
