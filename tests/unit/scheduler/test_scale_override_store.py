"""`caravan scale` on an autoscaled model: the hold it writes, in one transaction (pure parts)."""

from __future__ import annotations

import pytest
from profile_builders import make_llamacpp

from caravan_llm.common.consul_api import KVEntry, TxnCheckIndex, TxnDelete, TxnSet
from caravan_llm.common.contract import KVLayout, ModelFailure, ScaleOverride
from caravan_llm.scheduler.model_store import (
    DEFAULT_OVERRIDE_S,
    ScaleOutOfBoundsError,
    parse_desired_state,
    release_ops,
    scale_ops,
    scale_override_for,
)
from caravan_llm.scheduler.profiles import profile_to_json

LAYOUT = KVLayout()
NOW = 1_700_000_000.0
AUTOSCALED = make_llamacpp(
    name="m", replicas={"min": 1, "max": 4}, autoscaling={"target_inflight": 2}
)


def test_autoscaled_model_is_held_for_the_default_or_the_given_duration():
    """No duration: one hour; a duration: that long, from now."""
    default = scale_override_for(AUTOSCALED, 3, None, NOW)
    given = scale_override_for(AUTOSCALED, 3, 600, NOW)

    assert ScaleOverride(count=3, until=NOW + DEFAULT_OVERRIDE_S, set_at=NOW) == default
    assert ScaleOverride(count=3, until=NOW + 600, set_at=NOW) == given


@pytest.mark.parametrize("hold_s", [0, -5, 10**9, float("inf")])
def test_a_hold_outside_its_range_is_refused(hold_s: float):
    """Zero, negative, absurd or infinite durations name the field and write nothing."""
    with pytest.raises(ScaleOutOfBoundsError, match="m: hold duration"):
        scale_override_for(AUTOSCALED, 3, hold_s, NOW)


def test_manual_model_takes_no_hold():
    """Without autoscaling a count holds anyway; a duration there is refused, not ignored."""
    manual = make_llamacpp(name="k", replicas={"min": 1, "max": 4})

    assert scale_override_for(manual, 2, None, NOW) is None
    with pytest.raises(ScaleOutOfBoundsError, match="no autoscaling"):
        scale_override_for(manual, 2, 60, NOW)


def test_count_and_hold_are_one_transaction_and_auto_removes_the_hold():
    """The desired count and the override land together; --auto deletes only the override."""
    override = ScaleOverride(count=3, until=NOW + 60, set_at=NOW)

    assert [
        TxnCheckIndex("caravan/models/m", 9),
        TxnSet("caravan/desired/m", b"3"),
        TxnSet("caravan/override/m", override.encode()),
    ] == scale_ops("m", 3, 9, LAYOUT, override)
    assert [
        TxnCheckIndex("caravan/models/m", 9),
        TxnDelete("caravan/override/m"),
    ] == release_ops("m", 9, LAYOUT)


def entry(key: str, value: bytes) -> KVEntry:
    return KVEntry(
        key=key, value=value, flags=0, session=None, lock_index=0, create_index=1, modify_index=1
    )


def test_desired_state_reads_holds_and_failures_and_skips_unreadable_ones():
    """override/ and failed/ are decoded with the contract's codecs; garbage is left out."""
    override = ScaleOverride(count=3, until=NOW + 60, set_at=NOW)
    failure = ModelFailure(reason="replica 0: exit 1", since=NOW)
    state = parse_desired_state(
        (
            entry("caravan/models/m", profile_to_json(AUTOSCALED).encode()),
            entry("caravan/override/m", override.encode()),
            entry("caravan/override/x", b"{}"),
            entry("caravan/failed/m", failure.encode()),
            entry("caravan/failed/x", b"nope"),
        ),
        LAYOUT,
        7,
    )

    assert ({"m": override}, {"m": failure}) == (dict(state.overrides), dict(state.failures))
