"""The Dockerfile builds caravan from the source tree into a non-root image (read, not built)."""

from __future__ import annotations

import fnmatch
import json
import tomllib
from typing import Any

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


def setuptools_config() -> dict[str, Any]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    config: dict[str, Any] = pyproject["tool"]["setuptools"]
    return config


def installed_packages() -> list[str]:
    """The source folders of the packages pyproject.toml lists, top-level ones and mapped ones."""
    config = setuptools_config()
    mapped = config.get("package-dir", {})
    return sorted({mapped.get(name, name.split(".")[0]) for name in config["packages"]})


def test_package_list_is_every_package_on_disk():
    """pyproject lists exactly the Python packages of the tree, so none is left out of the wheel."""
    config = setuptools_config()
    listed = {name for name in config["packages"] if name not in config.get("package-dir", {})}
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "caravan_llm").rglob("__init__.py")
    }
    assert on_disk == listed


def stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's build stages, each a list of its instructions (FROM first)."""
    found: list[list[tuple[str, str]]] = []
    for keyword, arguments in instructions():
        if keyword == "FROM":
            found.append([])
        found[-1].append((keyword, arguments))
    return found


def test_production_image_holds_no_demo():
    """The image is a last stage that copies only the build stage's install, demo removed."""
    *builds, image = stages()
    assert [("FROM", "python:3.11-slim AS build")] == [build[0] for build in builds]
    copies = [arguments for keyword, arguments in image if keyword in {"COPY", "ADD"}]
    assert ["--from=build /install /usr/local"] == copies
    install = next(args for keyword, args in builds[0] if keyword == "RUN" and "pip" in args)
    assert "pip install --prefix=/install /wheels/caravan_llm-" in install
    assert "caravan_llm-*.whl[" not in install
    assert '"$site/caravan_llm/devcluster"' in install
    assert '"$site/caravan_llm/cli/example_profiles_data"' in install
    assert install.index("rm -rf") < install.index("python -c")


def ignored_patterns() -> list[str]:
    lines = DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_base_image_and_entrypoint():
    """The image starts from python:3.11-slim and runs the `caravan` command."""
    found = stages()[-1]
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
    """Every package pyproject installs is copied into the build stage before its wheel is built."""
    found = stages()[0]
    copied = {
        source.rstrip("/")
        for keyword, arguments in found
        if keyword == "COPY"
        for source in arguments.split()[:-1]
    }
    for needed in ["pyproject.toml", "README.md", *installed_packages()]:
        assert needed in copied, needed
    assert any(
        keyword == "RUN" and "pip wheel --no-deps --wheel-dir /wheels ." in arguments
        for keyword, arguments in found
    )


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches decides, and `!` re-includes."""
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        if fnmatch.fnmatch(path, pattern.removeprefix("!")):
            ignored = not negated
    return ignored


def test_dockerignore_keeps_what_the_build_needs():
    """.dockerignore leaves out the virtualenv and tests but none of what the image copies."""
    patterns = ignored_patterns()
    assert ".venv" in patterns
    assert dockerignored("tests", patterns)
    assert dockerignored("examples/terraform-like", patterns)
    for needed in ["pyproject.toml", "README.md", *installed_packages()]:
        assert not dockerignored(needed, patterns), needed
