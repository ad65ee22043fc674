"""The documentation lives in the repository: every relative link in it resolves inside it, and
every repository path it names in prose (`src/...`, `kernels/...`, ...) exists. The map of the
parts in docs/ARCHITECTURE.md names every module once, and nothing that is not there."""

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


ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
# A line of the map of the parts that names a file or folder: two spaces of indent per level, then
# the name (a description's next lines are indented further, past any level).
MAP_ENTRY = re.compile(r"( *)((?:[\w.]+/)+|[\w.]+\.\w+)(?=\s|$)")
# A module path in backquotes, relative to a package (`engine/parallel/tp.py`, `channel.py`,
# `protocol/`).
MODULE = re.compile(r"`(\w[\w.]*(?:/[\w.]+)*(?:\.(?:py|c|h)|/))`")


def _map_entries() -> list[str]:
    """The repository paths the map under "The parts" names (a folder's ends in a slash)."""
    block = ARCHITECTURE.read_text().split("## The parts", 1)[1].split("```")[1]
    paths: list[str] = []
    folders: list[str] = []  # the folder open at each level
    for line in block.splitlines():
        match = MAP_ENTRY.match(line)
        if not match or len(match.group(1)) % 2 or len(match.group(1)) // 2 > len(folders):
            continue
        level, name = len(match.group(1)) // 2, match.group(2)
        del folders[level:]
        paths.append("".join(folders) + name)
        if name.endswith("/"):
            folders.append(name)
    return paths


def test_the_map_names_each_part_once_and_each_exists():
    entries = _map_entries()
    assert "src/nanoserve/server/routes.py" in entries and "kernels/python/" in entries
    assert len(entries) == len(set(entries)), sorted(p for p in entries if entries.count(p) > 1)
    missing = [p for p in entries if not (REPO / p).exists()]
    assert not missing, f"docs/ARCHITECTURE.md's map names what is not there: {missing}"


def test_the_map_covers_every_module():
    """Every module of nanoserve (and of nanoserve.kernels) is on the map, or in a folder the map
    names without listing what is in it."""
    entries = set(_map_entries())
    leaves = {
        f for f in entries if f.endswith("/") and not any(p.startswith(f) for p in entries - {f})
    }
    modules = [
        path.relative_to(REPO).as_posix()
        for root in ("src/nanoserve", "kernels/python")
        for path in (REPO / root).rglob("*.py")
        if path.name != "__init__.py"
    ]
    assert modules
    missing = [m for m in modules if m not in entries and not any(m.startswith(f) for f in leaves)]
    assert not missing, f"docs/ARCHITECTURE.md's map misses {missing}"


def test_module_paths_in_the_architecture_exist():
    """`engine/parallel/tp.py`, `channel.py`, `protocol/`: a path inside a package names a real
    file."""
    missing = [t for t in MODULE.findall(ARCHITECTURE.read_text()) if not _module_exists(t)]
    assert not missing, missing


def _module_exists(target: str) -> bool:
    """A path from the repository root or from a package's folder; a bare name anywhere in one."""
    name = target.rstrip("/")
    packages = [REPO / "src" / "nanoserve", REPO / "kernels", REPO / "tests"]
    if any((root / name).exists() for root in [REPO, *packages]):
        return True
    return "/" not in name and any(next(root.rglob(name), None) for root in packages)
