"""Constraint and affinity matching, as Nomad's scheduler does it (facts N5, N13).

Node targets resolve to strings (`${node.unique.id}`, `${attr.*}`, `${meta.*}`);
device targets resolve to typed attributes with units, so `"40 GiB"` compares
with a GPU's `{"Int": 81559, "Unit": "MiB"}`. Everything here is pure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

DISTINCT_HOSTS = "distinct_hosts"
DISTINCT_PROPERTY = "distinct_property"
ORDER_OPERANDS = frozenset({"<", "<=", ">", ">="})
EQUAL_OPERANDS = frozenset({"=", "==", "is"})
NOT_EQUAL_OPERANDS = frozenset({"!=", "not"})
NODE_EXACT_TARGETS = (
    "${node.unique.id}",
    "${node.datacenter}",
    "${node.unique.name}",
    "${node.class}",
    "${node.pool}",
)
TARGET_PREFIXES = ("${attr.", "${device.", "${meta.")


@dataclass(frozen=True, slots=True)
class Unit:
    name: str
    base: str
    multiplier: Fraction


def _units() -> dict[str, Unit]:
    table: list[Unit] = []
    for power, name in enumerate(("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"), start=1):
        table.append(Unit(name, "byte", Fraction(1024**power)))
        table.append(Unit(f"{name}/s", "byterate", Fraction(1024**power)))
    for power, names in enumerate((("kB", "KB"), ("MB",), ("GB",), ("TB",), ("PB",), ("EB",)), 1):
        for name in names:
            table.append(Unit(name, "byte", Fraction(1000**power)))
            table.append(Unit(f"{name}/s", "byterate", Fraction(1000**power)))
    table += [
        Unit("MHz", "hertz", Fraction(1000**2)),
        Unit("GHz", "hertz", Fraction(1000**3)),
        Unit("mW", "watt", Fraction(1, 1000)),
        Unit("W", "watt", Fraction(1)),
        Unit("kW", "watt", Fraction(1000)),
        Unit("MW", "watt", Fraction(1000**2)),
        Unit("GW", "watt", Fraction(1000**3)),
    ]
    return {unit.name: unit for unit in table}


UNITS = _units()
_UNITS_LONGEST_FIRST = sorted(UNITS, key=len, reverse=True)


@dataclass(frozen=True, slots=True)
class Attribute:
    """A typed attribute value (`plugins/shared/structs.Attribute`)."""

    value: int | float | str | bool
    unit: str = ""

    def to_api(self) -> dict[str, Any]:
        match self.value:
            case bool():
                out: dict[str, Any] = {"Bool": self.value}
            case int():
                out = {"Int": self.value}
            case float():
                out = {"Float": self.value}
            case _:
                out = {"String": self.value}
        if self.unit:
            out["Unit"] = self.unit
        return out

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> Attribute:
        unit = str(data.get("Unit") or "")
        for key in ("Int", "Float", "Bool", "String"):
            if key in data and data[key] is not None:
                return cls(data[key], unit)
        return cls("", unit)

    def text(self) -> str:
        """The attribute as `${device.attr.x}` interpolation writes it."""
        if isinstance(self.value, bool):
            return "true" if self.value else "false"
        return f"{self.value}{self.unit}"


def parse_attribute(text: str) -> Attribute:
    """`ParseAttribute`: a number with an optional unit suffix, a bool, or a string."""
    if not text:
        return Attribute("")
    unit = ""
    numeric = text
    if text[-1].isalpha():
        for candidate in _UNITS_LONGEST_FIRST:
            if text.endswith(candidate):
                unit = candidate
                numeric = text[: -len(candidate)].strip()
                break
    if re.fullmatch(r"[+-]?\d+", numeric):
        return Attribute(int(numeric), unit)
    try:
        return Attribute(float(numeric), unit)
    except ValueError:
        pass
    lowered = text.lower()
    if text in {"1", "t", "T", "TRUE", "true", "True"} or lowered == "true":
        return Attribute(value=True)
    if text in {"0", "f", "F", "FALSE", "false", "False"} or lowered == "false":
        return Attribute(value=False)
    return Attribute(text)


def _as_number(attribute: Attribute) -> Fraction:
    # Callers rule out strings and bools first.
    number = Fraction(attribute.value)
    unit = UNITS.get(attribute.unit)
    return number * unit.multiplier if unit is not None else number


def compare_attributes(left: Attribute, right: Attribute) -> int | None:
    """-1/0/1, or None when the two are not comparable (kinds or units differ)."""
    left_unit, right_unit = UNITS.get(left.unit), UNITS.get(right.unit)
    if (left_unit is None) != (right_unit is None):
        return None
    if left_unit is not None and right_unit is not None and left_unit.base != right_unit.base:
        return None
    if isinstance(left.value, bool) or isinstance(right.value, bool):
        if not (isinstance(left.value, bool) and isinstance(right.value, bool)):
            return None
        return 0 if left.value == right.value else 1
    if isinstance(left.value, str) or isinstance(right.value, str):
        if not (isinstance(left.value, str) and isinstance(right.value, str)):
            return None
        return (left.value > right.value) - (left.value < right.value)
    a, b = _as_number(left), _as_number(right)
    return (a > b) - (a < b)


# Versions: hashicorp/go-version for `version`, strict semver for `semver`.

_VERSION = re.compile(
    r"^v?(?P<segments>\d+(?:\.\d+)*)(?:-(?P<pre>[0-9A-Za-z\-~]+(?:\.[0-9A-Za-z\-~]+)*))?"
    r"(?:\+(?P<meta>[0-9A-Za-z\-~]+(?:\.[0-9A-Za-z\-~]+)*))?$"
)
_CONSTRAINT_PART = re.compile(r"^\s*(?P<op>=|!=|>=|<=|>|<|~>)?\s*(?P<version>\S+)\s*$")


@dataclass(frozen=True, slots=True)
class Version:
    segments: tuple[int, ...]
    prerelease: str

    def compare(self, other: Version) -> int:
        width = max(len(self.segments), len(other.segments), 3)
        mine = self.segments + (0,) * (width - len(self.segments))
        theirs = other.segments + (0,) * (width - len(other.segments))
        if mine != theirs:
            return -1 if mine < theirs else 1
        if self.prerelease == other.prerelease:
            return 0
        if not self.prerelease:
            return 1
        if not other.prerelease:
            return -1
        return _compare_prerelease(self.prerelease, other.prerelease)


def _compare_prerelease(left: str, right: str) -> int:
    for a, b in zip(left.split("."), right.split("."), strict=False):
        if a == b:
            continue
        if a.isdigit() and b.isdigit():
            return -1 if int(a) < int(b) else 1
        if a.isdigit() != b.isdigit():
            return -1 if a.isdigit() else 1
        return -1 if a < b else 1
    return (len(left.split(".")) > len(right.split("."))) - (
        len(left.split(".")) < len(right.split("."))
    )


def parse_version(text: str, *, strict_semver: bool = False) -> Version | None:
    match = _VERSION.match(text.strip())
    if match is None:
        return None
    segments = tuple(int(part) for part in match.group("segments").split("."))
    if strict_semver and (len(segments) > 3 or text.strip().startswith("v")):
        return None
    return Version(segments, match.group("pre") or "")


@dataclass(frozen=True, slots=True)
class VersionConstraint:
    parts: tuple[tuple[str, Version, int], ...]  # operator, version, segments given

    def check(self, version: Version) -> bool:
        return all(_check_part(op, bound, given, version) for op, bound, given in self.parts)


def _check_part(operator: str, bound: Version, given: int, version: Version) -> bool:
    order = version.compare(bound)
    match operator:
        case "" | "=":
            return order == 0
        case "!=":
            return order != 0
        case ">":
            return order > 0
        case "<":
            return order < 0
        case ">=":
            return order >= 0
        case "<=":
            return order <= 0
        case _:  # "~>": at least `bound`, below the next release of its second-to-last segment
            if order < 0:
                return False
            prefix = max(given - 1, 1)
            return version.segments[:prefix] == bound.segments[:prefix]


def parse_version_constraint(text: str, *, strict_semver: bool = False) -> VersionConstraint | None:
    """A comma-separated list like `>= 1.8.0, < 2`; None when malformed."""
    parts: list[tuple[str, Version, int]] = []
    for piece in text.split(","):
        match = _CONSTRAINT_PART.match(piece)
        if match is None:
            return None
        version = parse_version(match.group("version"), strict_semver=False)
        if version is None:
            return None
        given = len(match.group("version").lstrip("v").split("-")[0].split("."))
        parts.append((match.group("op") or "", version, given))
    if strict_semver and not parts:
        return None
    return VersionConstraint(tuple(parts)) if parts else None


def validate_regexp(pattern: str) -> str | None:
    """None when `pattern` compiles, else the error text."""
    try:
        re.compile(pattern)
    except re.error as exc:
        return f"error parsing regexp: {exc}"
    return None


def _set_contains_all(left: str, right: str) -> bool:
    have = {item.strip() for item in left.split(",")}
    return all(item.strip() in have for item in right.split(","))


def _set_contains_any(left: str, right: str) -> bool:
    have = {item.strip() for item in left.split(",")}
    return any(item.strip() in have for item in right.split(","))


def _check_order(operand: str, left: str, right: str) -> bool:
    pairs: list[tuple[Any, Any]] = []
    if re.fullmatch(r"[+-]?\d+", left) and re.fullmatch(r"[+-]?\d+", right):
        pairs.append((int(left), int(right)))
    else:
        try:
            pairs.append((float(left), float(right)))
        except ValueError:
            pairs.append((left, right))
    a, b = pairs[0]
    return _ORDER[operand](a, b)


_ORDER: dict[str, Callable[[Any, Any], bool]] = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}


def _regexp_match(left: str, pattern: str) -> bool:
    try:
        return re.search(pattern, left) is not None
    except re.error:
        return False


def _version_match(left: str, right: str, *, strict: bool) -> bool:
    version = parse_version(left, strict_semver=strict)
    constraint = parse_version_constraint(right, strict_semver=strict)
    return version is not None and constraint is not None and constraint.check(version)


def check_constraint(
    operand: str, left: str, right: str, left_found: bool, right_found: bool
) -> bool:
    """`checkConstraint` over resolved node values (strings)."""
    both = left_found and right_found
    if operand in {DISTINCT_HOSTS, DISTINCT_PROPERTY}:
        return True
    if operand in EQUAL_OPERANDS:
        return both and left == right
    if operand in NOT_EQUAL_OPERANDS:
        # Go compares the resolved values, and a missing target resolves to "".
        return left != right
    if operand in ORDER_OPERANDS:
        return both and _check_order(operand, left, right)
    match operand:
        case "is_set":
            return left_found
        case "is_not_set":
            return not left_found
        case "version":
            return both and _version_match(left, right, strict=False)
        case "semver":
            return both and _version_match(left, right, strict=True)
        case "regexp":
            return both and _regexp_match(left, right)
        case "set_contains" | "set_contains_all":
            return both and _set_contains_all(left, right)
        case "set_contains_any":
            return both and _set_contains_any(left, right)
        case _:
            return False


def check_attribute_constraint(
    operand: str,
    left: Attribute | None,
    right: Attribute | None,
) -> bool:
    """`checkAttributeConstraint` over typed device attributes."""
    if operand in {DISTINCT_HOSTS, DISTINCT_PROPERTY}:
        return True
    if operand in NOT_EQUAL_OPERANDS:
        if left is None and right is None:
            return False
        if left is None or right is None:
            return True
        order = compare_attributes(left, right)
        return order is not None and order != 0
    if operand in {"is_set", "is_not_set"}:
        return (left is not None) == (operand == "is_set")
    if left is None or right is None:
        return False
    if operand in EQUAL_OPERANDS | ORDER_OPERANDS:
        order = compare_attributes(left, right)
        if order is None:
            return False
        return {
            "=": order == 0,
            "==": order == 0,
            "is": order == 0,
            "<": order == -1,
            "<=": order != 1,
            ">": order == 1,
            ">=": order != -1,
        }[operand]
    left_text = left.value if isinstance(left.value, str) else None
    right_text = right.value if isinstance(right.value, str) else None
    if operand in {"version", "semver"}:
        version_text = left_text if left_text is not None else None
        if (
            version_text is None
            and isinstance(left.value, int)
            and not isinstance(left.value, bool)
        ):
            version_text = str(left.value)
        if version_text is None or right_text is None:
            return False
        return _version_match(version_text, right_text, strict=operand == "semver")
    if left_text is None or right_text is None:
        return False
    match operand:
        case "regexp":
            return _regexp_match(left_text, right_text)
        case "set_contains" | "set_contains_all":
            return _set_contains_all(left_text, right_text)
        case "set_contains_any":
            return _set_contains_any(left_text, right_text)
        case _:
            return False


def constraint_text(constraint: Mapping[str, Any]) -> str:
    """`Constraint.String()`: the reason key in `ConstraintFiltered`."""
    parts = (constraint.get(key, "") for key in ("LTarget", "Operand", "RTarget"))
    return " ".join(str(part) for part in parts)
