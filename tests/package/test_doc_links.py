"""Every relative link and image in README.md, BENCHMARKS.md and docs/ resolves to a file or folder inside the
repository (a reader of the repository alone can follow it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: [text](target) and ![alt](target), the target up to whitespace or ")"; code spans removed first
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def _targets(doc: Path):
    for target in LINK.findall(CODE.sub("", doc.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor in the same page
        yield target.split("#", 1)[0]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(doc):
    bad = []
    for target in _targets(doc):
        path = (doc.parent / target).resolve()
        if not path.is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository")
        elif not path.exists():
            bad.append(f"{target}: no such file")
    assert not bad, bad


def test_readme_shows_its_pictures():
    images = [t for t in re.findall(r"!\[[^\]]*\]\(([^)\s]+)", (ROOT / "README.md").read_text())]
    assert len(images) >= 2 and all((ROOT / t).is_file() for t in images), images
