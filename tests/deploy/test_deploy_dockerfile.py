"""The Dockerfile builds caravan from the source tree into a non-root image (read, not built)."""

from __future__ import annotations

import fnmatch
import json
import tomllib

from hcl_documents import ROOT

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (KEYWORD, arguments), continuation lines joined."""
    joined = DOCKERFILE.read_text(encoding="utf-8").replace("\\\n", " ")
    found: list[tuple[str, str]] = []
    for line in joined.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            keyword, _, arguments = stripped.partition(" ")
            found.append((keyword.upper(), arguments.strip()))
    return found


def installed_packages() -> list[str]:
    """The top-level packages pyproject.toml installs that exist in the tree."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(
        path.name
        for path in ROOT.iterdir()
        if (path / "__init__.py").exists() and any(fnmatch.fnmatch(path.name, p) for p in patterns)
    )


def ignored_patterns() -> list[str]:
    lines = DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_base_image_and_entrypoint():
    """The image starts from python:3.11-slim and runs the `caravan` command."""
    found = instructions()
    assert ("FROM", "python:3.11-slim") == found[0]
    entrypoints = [json.loads(arguments) for keyword, arguments in found if keyword == "ENTRYPOINT"]
    assert [["caravan"]] == entrypoints


def test_image_runs_as_a_non_root_user():
    """The last USER instruction names an unprivileged user."""
    users = [arguments for keyword, arguments in instructions() if keyword == "USER"]
    assert users
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}


def test_caravan_is_installed_from_the_source_tree():
    """Every package pyproject installs is copied in before `pip install .` runs."""
    found = instructions()
    copied = {
        source.rstrip("/")
        for keyword, arguments in found
        if keyword == "COPY"
        for source in arguments.split()[:-1]
    }
    for needed in ["pyproject.toml", "README.md", *installed_packages()]:
        assert needed in copied, needed
    assert any(keyword == "RUN" and "pip install ." in arguments for keyword, arguments in found)


def test_dockerignore_keeps_what_the_build_needs():
    """.dockerignore leaves out the virtualenv and tests but none of what the image copies."""
    patterns = ignored_patterns()
    assert ".venv" in patterns
    for needed in ["pyproject.toml", "README.md", *installed_packages()]:
        assert not any(fnmatch.fnmatch(needed, pattern) for pattern in patterns), needed
