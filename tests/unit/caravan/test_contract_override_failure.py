"""The KV documents of the contract: one codec each, written and read the same way."""

from __future__ import annotations

import pytest

from caravan_llm.common.contract import (
    MAX_FAILURE_REASON_CHARS,
    ContractDecodeError,
    KVLayout,
    ModelFailure,
    ScaleOverride,
)


def test_scale_override_round_trips():
    """What the CLI writes is what the autoscaler reads."""
    override = ScaleOverride(count=3, until=1_700_003_600.5, set_at=1_700_000_000.0)

    assert override == ScaleOverride.decode(override.encode())
    assert override.in_force(1_700_003_600.4)
    assert not override.in_force(1_700_003_600.5)


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"not json", "scale override: not JSON"),
        (b"[1]", "scale override: not a JSON object"),
        (b'{"count": "3", "until": 2, "set_at": 1}', "count must be an integer, got '3'"),
        (b'{"count": true, "until": 2, "set_at": 1}', "count must be an integer, got True"),
        (b'{"count": 3, "until": "x", "set_at": 1}', "until must be a finite number"),
        (b'{"count": 3, "until": 1, "set_at": 2}', "until (1.0) must not be before set_at"),
        (b'{"count": -1, "until": 2, "set_at": 1}', "count must be >= 0"),
    ],
)
def test_bad_scale_override_names_the_field(raw: bytes, problem: str):
    """A document that is not an override says which field is wrong."""
    with pytest.raises(ContractDecodeError) as refused:
        ScaleOverride.decode(raw)
    assert problem in str(refused.value)


def test_model_failure_round_trips_and_bounds_its_reason():
    """The scheduler's record reads back equal; a huge reason is cut to the bound."""
    failure = ModelFailure(reason="replica 0: exit 1", since=1_700_000_000.0)
    long = ModelFailure(reason="x" * (MAX_FAILURE_REASON_CHARS + 50), since=1.0)

    assert failure == ModelFailure.decode(failure.encode())
    assert MAX_FAILURE_REASON_CHARS == len(ModelFailure.decode(long.encode()).reason)


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b'{"since": 1}', "reason must be a non-empty string"),
        (b'{"reason": "x", "since": NaN}', "since must be a finite number"),
        (b'{"reason": "x"}', "since must be a finite number, got None"),
    ],
)
def test_bad_model_failure_names_the_field(raw: bytes, problem: str):
    """A record the router cannot trust is refused with the field named."""
    with pytest.raises(ContractDecodeError) as refused:
        ModelFailure.decode(raw)
    assert problem in str(refused.value)


def test_keys_live_under_the_prefix():
    """override/<name> and failed/<name> sit beside the other per-model keys."""
    layout = KVLayout("x/")
    assert ("x/override/m", "x/failed/m") == (layout.override_key("m"), layout.failure_key("m"))
