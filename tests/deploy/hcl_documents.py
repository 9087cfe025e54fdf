"""Reading the deployment files (jobspecs, Terraform) with python-hcl2.

python-hcl2 returns labelled blocks as `{"kind": [{"label": body}]}` and plain
blocks as `{"kind": [body]}`; expressions come back as `"${...}"` strings.
These helpers hide that shape from the tests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import hcl2

ROOT = Path(__file__).resolve().parents[2]
JOBSPECS = ROOT / "jobspecs"
TERRAFORM = ROOT / "terraform"

_OPTIONS = hcl2.SerializationOptions(
    strip_string_quotes=True,
    with_comments=False,
    explicit_blocks=False,
    preserve_heredocs=True,
)
_VAR_REFERENCE = re.compile(r"\bvar\.([A-Za-z_][A-Za-z0-9_-]*)")
_SOLE_VAR = re.compile(r"^\$\{var\.([A-Za-z_][A-Za-z0-9_-]*)\}$")
_DURATION = re.compile(r"^(\d+)(ms|s|m|h)$")
_DURATION_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_hcl(path: Path) -> dict[str, Any]:
    return parse_hcl_text(path.read_text(encoding="utf-8"))


def parse_hcl_text(text: str) -> dict[str, Any]:
    document: dict[str, Any] = hcl2.loads(text, serialization_options=_OPTIONS)
    return document


def plain_blocks(body: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """The bodies of the unlabelled blocks `kind { ... }` directly in `body`."""
    found: list[dict[str, Any]] = body.get(kind, [])
    return found


def labelled_blocks(body: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    """The bodies of the one-label blocks `kind "label" { ... }`, by label."""
    result: dict[str, dict[str, Any]] = {}
    for entry in body.get(kind, []):
        result.update(entry)
    return result


def only(mapping: dict[str, Any]) -> tuple[str, Any]:
    """The single item of a mapping (the one job of a jobspec, for instance)."""
    assert len(mapping) == 1, f"expected exactly one entry, found {sorted(mapping)}"
    return next(iter(mapping.items()))


def variable_references(value: Any) -> set[str]:
    """Names of the input variables an expression (or a whole body) refers to."""
    return set(_VAR_REFERENCE.findall(json.dumps(value)))


def resolve_default(value: Any, variables: dict[str, dict[str, Any]]) -> Any:
    """The value of `value` with the defaults applied, when it is a bare `var.x`."""
    if isinstance(value, str) and (match := _SOLE_VAR.match(value)):
        return variables[match.group(1)]["default"]
    return value


def duration_s(text: str) -> float:
    """A Nomad duration such as `15s` or `2m`, in seconds."""
    match = _DURATION.match(text)
    assert match is not None, f"not a simple duration: {text!r}"
    return int(match.group(1)) * _DURATION_UNITS_S[match.group(2)]


def walk_keys(value: Any) -> list[str]:
    """Every mapping key anywhere in a parsed body."""
    keys: list[str] = []
    if isinstance(value, dict):
        for key, child in value.items():
            keys.append(key)
            keys.extend(walk_keys(child))
    elif isinstance(value, list):
        for child in value:
            keys.extend(walk_keys(child))
    return keys
