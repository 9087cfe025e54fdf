"""Constraint operands, versions and unit-aware device attributes, as Nomad matches them."""

from __future__ import annotations

import pytest

from caravan_llm.devcluster.nomad.matching import (
    Attribute,
    check_attribute_constraint,
    check_constraint,
    compare_attributes,
    parse_attribute,
)


@pytest.mark.parametrize(
    ("operand", "left", "right", "expected"),
    [
        ("=", "linux", "linux", True),
        ("==", "linux", "darwin", False),
        ("is", "a", "a", True),
        ("!=", "a", "b", True),
        ("not", "a", "a", False),
        ("<", "9", "10", True),  # integers compare as numbers
        (">", "b", "a", True),  # and strings lexically
        ("<=", "1.5", "1.50", True),
        (">=", "2", "10", False),
        ("regexp", "NVIDIA H100 80GB HBM3", "H100", True),
        ("regexp", "NVIDIA A100", "^H", False),
        ("version", "1.10.5", ">= 1.8, < 2.0", True),
        ("version", "2.0.1", ">= 1.8, < 2.0", False),
        ("semver", "1.21.4", ">= 1.8.0", True),
        ("semver", "1.7.9", ">= 1.8.0", False),
        ("version", "1.2.9", "~> 1.2.3", True),
        ("version", "1.3.0", "~> 1.2.3", False),
        ("set_contains", "SIGINT,SIGKILL,SIGTERM", "SIGTERM", True),
        ("set_contains_all", "a,b,c", "a, c", True),
        ("set_contains_all", "a,b", "a,d", False),
        ("set_contains_any", "node-1", "node-2,node-1", True),
        ("set_contains_any", "node-3", "node-2,node-1", False),
        ("distinct_hosts", "", "", True),
        ("bogus", "a", "a", False),
    ],
)
def test_node_constraint_operands(operand: str, left: str, right: str, expected: bool) -> None:
    """Every operand of `checkConstraint` over found string values."""
    assert expected == check_constraint(operand, left, right, True, True)


def test_missing_targets() -> None:
    """A missing target fails `=`, passes `!=` against a value, and drives is_set."""
    assert not check_constraint("=", "", "linux", False, True)
    assert check_constraint("!=", "", "linux", False, True)
    assert check_constraint("is_not_set", "", "", False, True)
    assert not check_constraint("is_set", "", "", False, True)


@pytest.mark.parametrize(
    ("text", "attribute"),
    [
        ("40 GiB", Attribute(40, "GiB")),
        ("81559MiB", Attribute(81559, "MiB")),
        ("1.5GHz", Attribute(1.5, "GHz")),
        ("true", Attribute(value=True)),
        ("NVIDIA H100 80GB HBM3", Attribute("NVIDIA H100 80GB HBM3")),
        ("12", Attribute(12)),
    ],
)
def test_parse_attribute(text: str, attribute: Attribute) -> None:
    """`ParseAttribute` splits numbers from unit suffixes."""
    assert attribute == parse_attribute(text)


def test_units_convert_within_a_base_unit() -> None:
    """80 GB of MiB compares against GiB; bytes and hertz do not compare."""
    memory = Attribute(81559, "MiB")
    assert 1 == compare_attributes(memory, parse_attribute("40 GiB"))
    assert -1 == compare_attributes(memory, parse_attribute("80 GiB"))
    assert compare_attributes(memory, parse_attribute("1 GHz")) is None
    assert compare_attributes(memory, parse_attribute("81559")) is None


@pytest.mark.parametrize(
    ("operand", "right", "expected"),
    [
        (">=", "40 GiB", True),
        (">=", "80 GiB", False),
        ("<", "100 GB", True),
        ("=", "81559 MiB", True),
        ("!=", "81559 MiB", False),
    ],
)
def test_device_memory_constraints(operand: str, right: str, expected: bool) -> None:
    """`${device.attr.memory}` constraints in any byte unit, as in the vLLM example."""
    memory = Attribute(81559, "MiB")
    assert expected == check_attribute_constraint(operand, memory, parse_attribute(right))


def test_device_string_operands() -> None:
    """Model names match by equality, regexp and sets."""
    model = Attribute("NVIDIA H100 80GB HBM3")
    assert check_attribute_constraint("=", model, parse_attribute("NVIDIA H100 80GB HBM3"))
    assert check_attribute_constraint("regexp", model, parse_attribute("H100"))
    assert check_attribute_constraint(
        "set_contains_any", model, parse_attribute("NVIDIA A100-SXM4-80GB,NVIDIA H100 80GB HBM3")
    )
    assert not check_attribute_constraint("=", None, parse_attribute("x"))
    assert check_attribute_constraint("!=", None, parse_attribute("x"))
