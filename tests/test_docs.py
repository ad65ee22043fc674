"""The documentation lives in the repository: every relative link in it resolves inside it."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)[^)]*\)|`((?:\.\./|docs/)[^`\s]+)`")


def _documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_links_resolve_inside_the_repository():
    assert (REPO / "docs" / "ARCHITECTURE.md").is_file() and (REPO / "LICENSE").is_file()
    for doc in _documents():
        for match in LINK.finditer(doc.read_text()):
            target = match.group(1) or match.group(2)
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(REPO), f"{doc.name} links outside the repository: {target}"
            assert path.exists(), f"{doc.name} links to a missing file: {target}"
