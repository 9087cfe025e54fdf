"""When a model has failed for good, in `caravan status` words, and the KV writes that say so."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from profile_builders import make_llamacpp

from caravan_llm.common.contract import JobMetaKey, ModelFailure
from caravan_llm.common.nomad_api import Allocation, JobStub
from caravan_llm.scheduler.assess import assess
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.model_failure import (
    FailureUpdate,
    failure_updates,
    impossible_placement,
    model_failure,
)
from caravan_llm.scheduler.placement_explain import ReplicaAsk
from caravan_llm.scheduler.world import DesiredModel, Observation, replica_from_job_stub

NOT_RESTARTING = 'Exceeded allowed attempts 2 in interval 30m0s and mode is "fail"'


def job(model: str, replica: int, *, version: int = 0, stop: bool = False) -> JobStub:
    return JobStub.from_api(
        {
            "ID": f"caravan-{model}-{replica}",
            "Version": version,
            "Stop": stop,
            "Meta": {
                JobMetaKey.MANAGED_BY: "caravan",
                JobMetaKey.MODEL: model,
                JobMetaKey.REPLICA: str(replica),
            },
        }
    )


def event(kind: str, at: int, message: str) -> dict[str, Any]:
    return {"Type": kind, "Time": at, "DisplayMessage": message}


def alloc(
    alloc_id: str, status: str, *, version: int = 0, gave_up: bool = True, at: int = 10
) -> Allocation:
    events = [event("Terminated", at, "Exit Code: 1")]
    if gave_up:
        events.append(event("Not Restarting", at + 1, NOT_RESTARTING))
    return Allocation.from_api(
        {
            "ID": alloc_id,
            "ClientStatus": status,
            "JobVersion": version,
            "ModifyTime": at,
            "TaskStates": {"engine": {"Events": events}},
        }
    )


def model_failures(
    stubs: Sequence[JobStub],
    allocs_by_job: Mapping[str, Sequence[Allocation]],
    passing_by_alloc: Mapping[str, bool],
    models: frozenset[str],
    unplaceable: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Each model's failure as `assess` judges it from these stubs and allocations.

    `unplaceable` stands in for the impossible-placement reason of jobs
    without allocations (`impossible_placement` is tested on its own below).
    """
    replicas = {}
    for stub in stubs:
        seen = replica_from_job_stub(stub)
        assert seen is not None
        replicas[seen.job_id] = replace(seen, allocs=tuple(allocs_by_job.get(seen.job_id, ())))
    health = {alloc: "passing" if ok else "critical" for alloc, ok in passing_by_alloc.items()}
    observation = Observation(
        replicas=replicas, nodes={}, draining={}, taken_at=1000.0, health=health
    )
    desired = {name: DesiredModel(make_llamacpp(name=name), 1) for name in models}
    judged = assess(desired, observation, ClusterConfig(), 1000.0)
    found: dict[str, str] = {}
    for name, model in judged.models.items():
        reason = model.failure
        if unplaceable is not None:
            reason = model_failure(
                [(r.replica, r.failed or unplaceable.get(r.job_id)) for r in model.replicas]
            )
        if reason is not None:
            found[name] = reason
    return found


def test_every_replica_given_up_is_a_failed_model_with_nomads_words():
    """One replica whose engine Nomad stopped restarting: the model failed, the reason quotes it."""
    found = model_failures(
        [job("bad", 0)], {"caravan-bad-0": [alloc("a1", "failed")]}, {}, frozenset({"bad"})
    )

    assert {
        "bad": (
            "replica 0: the engine failed and Nomad stopped restarting it "
            f"(Not Restarting: {NOT_RESTARTING}); last: Terminated: Exit Code: 1"
        )
    } == found


def test_a_rescheduled_attempt_still_starting_keeps_the_failure():
    """Nomad's next attempt, not passing yet, does not clear it: the same spec fails again."""
    allocs = [alloc("a1", "failed", at=10), alloc("a2", "running", gave_up=False, at=20)]

    found = model_failures([job("bad", 0)], {"caravan-bad-0": allocs}, {}, frozenset({"bad"}))

    assert {"bad"} == set(found)


def test_a_passing_replica_a_new_version_or_a_healthy_sibling_clears_it():
    """Recovery without a new failure: passing check, re-registered spec, or one good replica."""
    failed = [alloc("a1", "failed"), alloc("a2", "running", gave_up=False, at=20)]
    models = frozenset({"bad"})

    passing = model_failures([job("bad", 0)], {"caravan-bad-0": failed}, {"a2": True}, models)
    new_version = model_failures([job("bad", 0, version=1)], {"caravan-bad-0": failed}, {}, models)
    sibling = model_failures(
        [job("bad", 0), job("bad", 1)],
        {"caravan-bad-0": failed, "caravan-bad-1": [alloc("b1", "pending", gave_up=False)]},
        {},
        models,
    )

    assert ({}, {}, {}) == (passing, new_version, sibling)


def test_restarting_within_policy_is_not_a_failure_yet():
    """A crash Nomad will still restart in place is not final."""
    allocs = [alloc("a1", "failed", gave_up=False)]

    assert {} == model_failures([job("bad", 0)], {"caravan-bad-0": allocs}, {}, frozenset({"bad"}))


def test_updates_write_new_reasons_keep_since_and_delete_what_cleared():
    """An unchanged reason is not rewritten (its `since` stays); a cleared one is deleted."""
    stored = {
        "same": ModelFailure(reason="r", since=5.0),
        "gone": ModelFailure(reason="r", since=5.0),
        "changed": ModelFailure(reason="old", since=5.0),
    }

    updates = failure_updates({"same": "r", "changed": "new", "fresh": "x"}, stored, 99.0)

    assert [
        FailureUpdate("changed", ModelFailure(reason="new", since=99.0)),
        FailureUpdate("fresh", ModelFailure(reason="x", since=99.0)),
        FailureUpdate("gone", None),
    ] == updates


GPU_ASK = ReplicaAsk(gpu_count=1, gpu_class="l4")


def test_no_node_with_the_gpu_class_is_a_placement_that_needs_a_change():
    """Every node filtered by a constraint: no freed capacity helps; said as status says it."""
    failed = {"engine": {"NodesEvaluated": 5, "ConstraintFiltered": {"missing devices": 5}}}

    reason = impossible_placement(failed, GPU_ASK)

    assert (
        "cannot be placed: no node has 1 free L4 (5 nodes have no matching GPU; 5 nodes evaluated)"
        == reason
    )


def test_a_full_cluster_is_waited_for_not_failed():
    """Resources in use free up: Nomad places the replica then, so it is no failure."""
    failed = {
        "engine": {
            "NodesEvaluated": 5,
            "ConstraintFiltered": {"missing devices": 3},
            "DimensionExhausted": {"devices: nvidia/gpu": 2},
        }
    }

    assert impossible_placement(failed, GPU_ASK) is None
    assert impossible_placement(None, GPU_ASK) is None


def test_an_unplaceable_replica_without_allocations_fails_its_model():
    """A job with no allocation counts as failed when its placement is impossible."""
    stubs = [job("gpu", 0)]

    found = model_failures(
        stubs, {}, {}, frozenset({"gpu"}), {"caravan-gpu-0": "cannot be placed: x"}
    )
    waiting = model_failures(stubs, {}, {}, frozenset({"gpu"}), {})

    assert ({"gpu": "replica 0: cannot be placed: x"}, {}) == (found, waiting)
