"""The README is the front door: short, and every link in it lands (a file that exists, a
heading that exists). Longer text belongs in docs/ (issue 34)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 150
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but hyphens dropped,
    spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    heads = re.findall(r"^#+ (.+)$", doc.read_text(), re.M)
    return {slug(h) for h in heads}


def links(doc: Path) -> list[str]:
    return [t for t in LINK.findall(doc.read_text()) if not re.match(r"[a-z]+:", t)]


def test_the_readme_is_the_front_door_only() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): move the detail to docs/"


@pytest.mark.parametrize("target", links(README))
def test_every_link_of_the_readme_lands(target: str) -> None:
    path, _, anchor = target.partition("#")
    doc = (README.parent / path).resolve() if path else README
    assert doc.exists(), f"README.md links {target}: {doc} does not exist"
    if anchor and doc.suffix == ".md":
        assert anchor in anchors(doc), f"README.md links {target}: no such heading in {path or 'README.md'}"


def test_slugs_are_githubs() -> None:
    assert slug("Multi-node engines (LeaderWorkerSet)") == "multi-node-engines-leaderworkerset"
    assert slug("Gateway API and Ingress") == "gateway-api-and-ingress"
    assert slug("`make bench` figures, 2026") == "make-bench-figures-2026"
