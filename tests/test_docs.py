"""The READMEs' links (the front page's and each backend's): every relative link names a file of
the repository and every anchor a heading of its page. (The pages under docs/ are checked by
``mkdocs build --strict`` in CI; the READMEs lie outside the site, so they are checked here.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    """The ids GitHub and MkDocs give the headings of ``markdown`` (lower case, punctuation dropped,
    spaces to hyphens), code blocks left out."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


READMES = [ROOT / "README.md", *sorted((ROOT / "plugins").glob("*/README.md"))]


@pytest.mark.parametrize("readme", READMES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_of_a_readme_resolves(readme):
    broken = []
    for target in LINK.findall(readme.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        page = (readme.parent / path).resolve() if path else readme
        if not page.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and page.suffix == ".md" and anchor not in _anchors(page.read_text()):
            broken.append(f"{target}: {path or readme.name} has no heading #{anchor}")
    assert not broken, broken

