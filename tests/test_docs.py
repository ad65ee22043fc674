"""The documentation lives in the repository: every relative link in it resolves inside it, and
every repository path it names in prose (`src/...`, `kernels/...`, ...) exists."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)[^)]*\)|`((?:\.\./|docs/)[^`\s]+)`")
# A path in backquotes that starts at a top-level folder of the repository.
NAMED = re.compile(r"`((?:src|kernels|tests|bench|docs|\.ci)/[^`\s:]*)")


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


def test_paths_named_in_prose_exist():
    missing = [
        f"{doc.name}: {target}"
        for doc in _documents()
        for target in NAMED.findall(doc.read_text())
        if not any(REPO.glob(target.rstrip("/")))
    ]
    assert not missing, missing
