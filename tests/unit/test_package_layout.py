"""caravan's code lives in one import package, `caravan_llm`; nothing imports the old top names.

`scheduler`, `router`, `devcluster` and `caravan` are other projects' names on
PyPI. The repository's `scheduler/`, `router/` and `devcluster/` are links into
`caravan_llm/`; importing through them would load a second copy of a module.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOREIGN = r"(?:caravan|caravan_cli|scheduler|router|devcluster)"
IMPORT = re.compile(rf"^\s*(?:from|import)\s+{FOREIGN}(?:\.|\s|$)", re.MULTILINE)
RUN_MODULE = re.compile(rf"""(?:-m\s+|"-m",\s*"){FOREIGN}\b(?![.\w-])""")


# It imports the PyPI projects of those names on purpose, inside their own venv.
NEIGHBOURS_TEST = ROOT / "tests" / "deploy" / "test_side_by_side_install.py"


def python_files() -> list[Path]:
    roots = [ROOT / "caravan_llm", ROOT / "tests", ROOT / "bench", ROOT / "scripts"]
    found = {path for root in roots for path in root.rglob("*.py")}
    return sorted(found - {NEIGHBOURS_TEST})


def test_every_import_of_ours_goes_through_caravan_llm() -> None:
    """No module imports or runs `scheduler`, `router`, `devcluster`, `caravan` at the top."""
    offenders = [
        f"{path.relative_to(ROOT)}: {match.group(0).strip()}"
        for path in python_files()
        for pattern in (IMPORT, RUN_MODULE)
        for match in pattern.finditer(path.read_text(encoding="utf-8"))
    ]
    assert [] == offenders


def test_the_top_level_folders_lead_into_the_package() -> None:
    """`scheduler/`, `router/` and `devcluster/` at the top are links to caravan_llm's packages."""
    for name in ["scheduler", "router", "devcluster"]:
        link = ROOT / name
        assert link.is_symlink(), name
        assert (ROOT / "caravan_llm" / name) == link.resolve()
        assert (link / "__init__.py").is_file()
