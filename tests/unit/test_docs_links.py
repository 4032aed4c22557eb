"""Every relative link in README.md and docs/ points at a file of this checkout (and, with an
anchor, at a heading of it): the front door and the developer map move text between pages, and a
link left behind is a dead end for the reader."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def _links():
    for page in PAGES:
        in_code = False
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                yield page, target


@pytest.mark.parametrize("page,target", list(_links()), ids=lambda v: str(v).replace(str(ROOT) + "/", ""))
def test_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    assert file.exists(), f"{page.relative_to(ROOT)}: link to {target} (no such file)"
    if anchor and file.suffix == ".md":
        assert anchor in _anchors(file), f"{page.relative_to(ROOT)}: link to {target} (no such heading)"
