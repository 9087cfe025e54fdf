"""The transactions ModelStore writes, built purely from what it read."""

from __future__ import annotations

import pytest
from profile_builders import make_llamacpp

from caravan_llm.common.consul_api import (
    KVEntry,
    TxnCas,
    TxnCheckIndex,
    TxnDelete,
    TxnDeleteCas,
    TxnSet,
)
from caravan_llm.common.contract import KVLayout
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.model_service import SubmissionRejectedError, validate_submission
from caravan_llm.scheduler.model_store import (
    StoredModels,
    delete_ops,
    parse_desired_state,
    parse_stored_models,
    scale_ops,
    submit_ops,
)
from caravan_llm.scheduler.profiles import profile_to_json

LAYOUT = KVLayout()


def entry(key: str, value: bytes, modify_index: int) -> KVEntry:
    return KVEntry(key, value, 0, None, 0, modify_index, modify_index)


def test_submit_is_cas_on_every_profile_and_the_revision():
    """New models are cas 0, replaced ones cas their index, and the revision is bumped by cas."""
    new, replaced = make_llamacpp(name="new"), make_llamacpp(name="old")
    stored = StoredModels(profiles={}, indexes={"old": 41}, revision=6, revision_index=42)
    ops = submit_ops([new, replaced], stored, LAYOUT)
    assert [
        TxnCas("caravan/models/new", profile_to_json(new).encode(), 0),
        TxnCas("caravan/models/old", profile_to_json(replaced).encode(), 41),
        TxnCas("caravan/models-revision", b"7", 42),
    ] == ops


def test_delete_and_scale_are_conditioned_on_the_profile_read():
    """delete is delete-cas on the profile; scale checks the profile's index before setting."""
    assert [
        TxnDeleteCas("caravan/models/m", 9),
        TxnDelete("caravan/desired/m"),
        TxnDelete("caravan/demand/m"),
        TxnDelete("caravan/state/m"),
        TxnDelete("caravan/override/m"),
    ] == delete_ops("m", 9, LAYOUT)
    assert [
        TxnCheckIndex("caravan/models/m", 9),
        TxnSet("caravan/desired/m", b"3"),
        TxnDelete("caravan/override/m"),
    ] == scale_ops("m", 3, 9, LAYOUT)


def test_parse_stored_models_keeps_indexes_of_invalid_entries_too():
    """An unreadable profile has no profile but its index still conditions a write over it."""
    good = make_llamacpp(name="good")
    stored = parse_stored_models(
        (
            entry("caravan/models/good", profile_to_json(good).encode(), 5),
            entry("caravan/models/broken", b"{not a profile", 6),
        ),
        entry("caravan/models-revision", b"3", 7),
        LAYOUT,
    )
    assert ["good"] == list(stored.profiles)
    assert {"good": 5, "broken": 6} == dict(stored.indexes)
    assert (3, 7) == (stored.revision, stored.revision_index)


def test_validation_reports_every_problem_of_every_document():
    """Problems from several documents are all reported, each with its source."""
    documents = [
        ("a.yaml", "name: a\nmodel: m\nengine: llamacpp\nenv: {LD_PRELOAD: x}\n"),
        ("b.yaml", "name: b\nengine: llamacpp\n"),
        ("c.yaml", "name: c\nmodel: m\nengine: llamacpp\n"),
    ]
    with pytest.raises(SubmissionRejectedError) as refused:
        validate_submission(documents, ClusterConfig())
    assert ["a.yaml", "b.yaml"] == [p.source for p in refused.value.problems]


def test_validation_renders_every_replica():
    """A profile whose replicas.max is beyond what caravan renders is refused."""
    documents = [("a.yaml", "name: a\nmodel: m\nengine: llamacpp\nreplicas: {max: 5000}\n")]
    with pytest.raises(SubmissionRejectedError) as refused:
        validate_submission(documents, ClusterConfig())
    assert "replicas.max: 5000" in str(refused.value)


def test_a_profile_written_around_caravan_that_the_policy_refuses_is_not_deployed():
    """The scheduler treats a KV profile with LD_PRELOAD as invalid (left alone), saying why."""
    bad = make_llamacpp(name="bad", env={"LD_PRELOAD": "/x.so"})
    good = make_llamacpp(name="good")
    state = parse_desired_state(
        (
            entry("caravan/models/bad", profile_to_json(bad).encode(), 5),
            entry("caravan/models/good", profile_to_json(good).encode(), 6),
        ),
        LAYOUT,
        6,
    )
    assert ["good"] == list(state.profiles)
    assert state.invalid["bad"].startswith("env: LD_PRELOAD is refused")


def test_the_published_policy_decides_for_the_scheduler_too():
    """With the leader's published config allowing LD_PRELOAD, the same profile is deployed."""
    bad = make_llamacpp(name="bad", env={"LD_PRELOAD": "/x.so"})
    config = ClusterConfig.model_validate({"profile_policy": {"allow_env": ["LD_PRELOAD"]}})
    state = parse_desired_state(
        (
            entry("caravan/cluster-config", config.model_dump_json().encode(), 4),
            entry("caravan/models/bad", profile_to_json(bad).encode(), 5),
        ),
        LAYOUT,
        5,
    )
    assert ["bad"] == list(state.profiles)
    assert {} == dict(state.invalid)
