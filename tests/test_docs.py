"""Every relative link in the README and the docs resolves, anchors included: the README is a
doorway, and a doorway to a page that moved is a wall."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "helm").glob("*.md"),
        *(ROOT / "k8s").rglob("*.md"),
    ]
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", page.read_text())
    headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http(s), mailto: not ours to check here
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {path or page.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_a_broken_link_and_a_missing_anchor_are_found(tmp_path):
    (tmp_path / "there.md").write_text("# A page\n\n## Its part: one\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#its-part-one) [gone](missing.md) [no anchor](there.md#elsewhere) "
        "[web](https://example.com)\n```\n[in code](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "there.md#elsewhere: no heading #elsewhere in there.md",
    ]


def test_the_readme_stays_a_doorway():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
