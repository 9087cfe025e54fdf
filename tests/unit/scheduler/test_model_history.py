"""The versions of a profile: one new version per change, written once, pruned to the kept ones."""

from __future__ import annotations

import json

from profile_builders import make_llamacpp

from caravan_llm.common.consul_api import KVEntry, TxnCas, TxnDelete
from caravan_llm.common.contract import KVLayout
from caravan_llm.scheduler.model_history import (
    ModelHistory,
    ProfileVersion,
    parse_history,
    prune_ops,
    stored_document,
    version_write,
)
from caravan_llm.scheduler.profiles import profile_to_json

LAYOUT = KVLayout()


def entry(key: str, value: bytes) -> KVEntry:
    return KVEntry(key, value, 0, None, 0, 1, 1)


def history_of(*drain_s: int) -> ModelHistory:
    entries = [
        entry(
            LAYOUT.history_key("tiny", number),
            ProfileVersion(
                number, 100.0 + number, stored_document(profile_to_json(make_llamacpp(drain_s=d)))
            ).encode(),
        )
        for number, d in enumerate(drain_s)
    ]
    return parse_history("tiny", entries, LAYOUT)


def test_history_lives_beside_the_prefix():
    """The history is out of the scheduler's watch of `caravan/`: `caravan-history/`."""
    assert "caravan-history/tiny/3" == LAYOUT.history_key("tiny", 3)


def test_a_changed_profile_becomes_the_next_version_created_with_cas_zero():
    """The write claims version N+1 with cas 0, so no two writers can claim it."""
    changed = profile_to_json(make_llamacpp(drain_s=30))
    write = version_write(changed, history_of(10, 20), LAYOUT, now=500.0)
    (op,) = write.ops
    assert isinstance(op, TxnCas)
    assert (2, "caravan-history/tiny/2", 0) == (write.version, op.key, op.index)
    assert {"version": 2, "submitted_at": 500.0, "reverted_from": None} == {
        k: v for k, v in json.loads(op.value).items() if k != "profile"
    }


def test_an_unchanged_profile_keeps_its_version_and_writes_nothing():
    """Submitting the latest version again is not a new version (as `nomad job run`)."""
    same = profile_to_json(make_llamacpp(drain_s=20))
    write = version_write(same, history_of(10, 20), LAYOUT, now=500.0)
    assert (1, ()) == (write.version, write.ops)


def test_a_revert_is_a_new_version_that_names_its_origin():
    """Reverting to version 0 writes version 2 marked as a revert to 0."""
    old = profile_to_json(make_llamacpp(drain_s=10))
    (op,) = version_write(old, history_of(10, 20), LAYOUT, now=1.0, reverted_from=0).ops
    assert 0 == json.loads(op.value)["reverted_from"]


def test_only_the_newest_versions_are_kept():
    """Adding one to a full history deletes the oldest beyond the kept number."""
    history = history_of(*range(1, 11))
    assert [TxnDelete("caravan-history/tiny/0"), TxnDelete("caravan-history/tiny/1")] == prune_ops(
        history, 1, LAYOUT, kept=9
    )


def test_the_current_version_is_the_newest_with_the_stored_profile():
    """A revert's profile equals an older version's: the newest one is current."""
    history = history_of(10, 20, 10)
    stored = stored_document(profile_to_json(make_llamacpp(drain_s=10)))
    other = stored_document(profile_to_json(make_llamacpp(drain_s=99)))
    assert (2, None) == (history.current_version(stored), history.current_version(other))


def test_an_unreadable_version_is_reported_and_its_number_never_reused():
    """A version that does not decode is listed; the next one still counts past it."""
    history = parse_history("tiny", [entry("caravan-history/tiny/4", b"{not json")], LAYOUT)
    assert (5, 1) == (history.next_version, len(history.unreadable))
