"""The code cites docs/design.md by section; every citation names a section that exists there."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_citations_name_existing_sections():
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", (REPO / "docs/design.md").read_text(), re.M)}
    cited = {}
    for path in (p for package in ("export", "runtime", "engines", "tools") for p in (REPO / package).rglob("*.py")):
        for n in re.findall(r"docs/design\.md section (\d+)", path.read_text(encoding="utf-8")):
            cited.setdefault(int(n), []).append(str(path.relative_to(REPO)))
        assert "DESIGN.md" not in path.read_text(encoding="utf-8"), f"{path}: cites a file outside the repository"
    assert cited and set(cited) <= sections, {n: p for n, p in cited.items() if n not in sections}


def test_every_module_is_named_where_it_lives():
    """docs/design.md names every module of the packages, itself or a folder of it (section 8)."""
    named = set(re.findall(r"`([a-z0-9_/]+(?:\.py)?/?)`", (REPO / "docs/design.md").read_text()))
    folders = tuple(n for n in named if n.endswith("/"))
    unnamed = [p.relative_to(REPO).as_posix() for package in ("export", "runtime", "engines", "tools")
               for p in sorted((REPO / package).rglob("*.py")) if p.name != "__init__.py"
               and p.relative_to(REPO).as_posix() not in named and not p.relative_to(REPO).as_posix().startswith(folders)]
    assert unnamed == [], f"docs/design.md section 8 should say where these live: {unnamed}"
