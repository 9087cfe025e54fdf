"""The stand-in's reconciler: what one evaluation stops, places and reschedules."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Sequence
from typing import Any

from nomad_builders import NS, cpu_job, make_alloc, make_node

from caravan_llm.devcluster.nomad.model import (
    Allocation,
    Evaluation,
    Node,
    RescheduleEvent,
    TaskState,
)
from caravan_llm.devcluster.nomad.reconcile import (
    ALLOC_LOST,
    ALLOC_MIGRATING,
    ALLOC_NOT_NEEDED,
    ALLOC_RESCHEDULED,
    ALLOC_UPDATING,
    Plan,
    PlanInputs,
    next_reschedule,
    plan_evaluation,
)

NOW = 1_000_000 * NS


def evaluation(job_id: str = "web") -> Evaluation:
    return Evaluation(
        id="eval-1",
        namespace="default",
        priority=50,
        type="service",
        triggered_by="job-register",
        job_id=job_id,
        create_time_ns=NOW,
        modify_time_ns=NOW,
    )


def plan(
    job: dict[str, Any] | None,
    allocs: Sequence[Allocation] = (),
    nodes: Sequence[Node] | None = None,
    *,
    versions: dict[int, dict[str, Any]] | None = None,
) -> Plan:
    counter = itertools.count()
    inputs = PlanInputs(
        evaluation=evaluation(),
        job=job,
        job_versions=versions or ({int(job.get("Version", 0)): job} if job else {}),
        job_allocs=list(allocs),
        nodes=list(nodes if nodes is not None else [make_node(1), make_node(2), make_node(3)]),
        cluster_allocs=list(allocs),
        deployments=[],
        now_ns=NOW,
    )
    return plan_evaluation(inputs, random.Random(0), lambda: f"id-{next(counter)}")


def stops(result: Plan) -> dict[str, str]:
    return {stop.alloc_id: stop.description for stop in result.stops}


def failed_alloc(
    job: dict[str, Any], node: Node, *, finished_ns: int, **changes: Any
) -> Allocation:
    state = TaskState(state="dead", failed=True, finished_at_ns=finished_ns)
    return make_alloc(job, node, client_status="failed", task_states={"t": state}, **changes)


def test_new_job_places_every_index_under_one_deployment() -> None:
    """Count 2: names web.g[0] and web.g[1], both in the deployment created for version 0."""
    result = plan(cpu_job(count=2))
    assert ["web.g[0]", "web.g[1]"] == sorted(alloc.name for alloc in result.placements)
    assert result.new_deployment is not None
    assert {result.new_deployment.id} == {alloc.deployment_id for alloc in result.placements}
    assert 2 == result.new_deployment.task_groups["g"].placed_allocs


def test_a_job_in_place_is_left_alone() -> None:
    """Nothing to do when every index runs at the current version."""
    job = cpu_job(count=1)
    result = plan(job, [make_alloc(job, make_node(1))])
    assert (False, None) == (result.changes, result.new_deployment)


def test_allocation_on_a_down_node_is_lost_and_replaced() -> None:
    """The lost allocation stops as `lost` and its index is placed elsewhere, linked back."""
    job = cpu_job()
    down = dataclasses.replace(make_node(1), status="down")
    alloc = make_alloc(job, down)
    result = plan(job, [alloc], [down, make_node(2)])
    assert [(alloc.id, ALLOC_LOST, "lost")] == [
        (s.alloc_id, s.description, s.client_status) for s in result.stops
    ]
    (replacement,) = result.placements
    assert ("web.g[0]", "node-2", alloc.id) == (
        replacement.name,
        replacement.node_name,
        replacement.previous_allocation,
    )
    assert () == replacement.reschedule_events


def test_failed_allocation_is_rescheduled_once_its_delay_passed() -> None:
    """Past the 30 s delay the failure is replaced away from its node, with a tracker event."""
    job = cpu_job()
    alloc = failed_alloc(job, make_node(1), finished_ns=NOW - 31 * NS)
    result = plan(job, [alloc], [make_node(1), make_node(2)])
    assert {alloc.id: ALLOC_RESCHEDULED} == stops(result)
    (replacement,) = result.placements
    assert "node-2" == replacement.node_name
    assert [(alloc.id, "node-id-1", 30 * NS)] == [
        (e.prev_alloc_id, e.prev_node_id, e.delay_ns) for e in replacement.reschedule_events
    ]


def test_failed_allocation_waits_for_a_follow_up_evaluation() -> None:
    """Within the delay nothing is placed; a follow-up evaluation is due at fail time + delay."""
    job = cpu_job()
    alloc = failed_alloc(job, make_node(1), finished_ns=NOW - 5 * NS)
    result = plan(job, [alloc])
    assert ((), ()) == (result.placements, result.stops)
    (follow_up,) = result.follow_ups
    assert ((alloc.id,), NOW + 25 * NS) == (follow_up.alloc_ids, follow_up.wait_until_ns)


def test_exponential_delay_doubles_per_reschedule() -> None:
    """After a 30 s reschedule the next delay is 60 s."""
    job = cpu_job()
    event = RescheduleEvent(NOW - 100 * NS, "old", "node-id-2", 30 * NS)
    alloc = failed_alloc(job, make_node(1), finished_ns=NOW, reschedule_events=(event,))
    when, eligible = next_reschedule(alloc, job["TaskGroups"][0]["ReschedulePolicy"])
    assert (NOW + 60 * NS, True) == (when, eligible)


def test_limited_attempts_stop_rescheduling() -> None:
    """With Attempts 1 used up in the interval, the failed allocation keeps its slot."""
    job = cpu_job()
    job["TaskGroups"][0]["ReschedulePolicy"] = {
        "Attempts": 1,
        "Interval": 3600 * NS,
        "Delay": 5 * NS,
        "DelayFunction": "constant",
        "MaxDelay": 0,
        "Unlimited": False,
    }
    event = RescheduleEvent(NOW - 60 * NS, "old", "node-id-2", 5 * NS)
    alloc = failed_alloc(job, make_node(1), finished_ns=NOW - 30 * NS, reschedule_events=(event,))
    result = plan(job, [alloc])
    assert ((), (), ()) == (result.placements, result.stops, result.follow_ups)


def test_lower_count_stops_the_highest_indexes() -> None:
    """From 3 to 1: indexes 2 and 1 stop, 0 stays."""
    job = cpu_job(count=1)
    allocs = [make_alloc(job, make_node(i + 1), i) for i in range(3)]
    result = plan(job, allocs)
    assert {allocs[1].id: ALLOC_NOT_NEEDED, allocs[2].id: ALLOC_NOT_NEEDED} == stops(result)


def test_stopped_job_stops_everything() -> None:
    """`Stop: true` (a deregister without purge) stops every live allocation."""
    job = cpu_job(count=2)
    allocs = [make_alloc(job, make_node(i + 1), i) for i in range(2)]
    result = plan({**job, "Stop": True}, allocs)
    assert {a.id: ALLOC_NOT_NEEDED for a in allocs} == stops(result)
    assert () == result.placements


def test_purged_job_stops_everything() -> None:
    """A purged job (no job at all) stops its allocations too."""
    job = cpu_job()
    alloc = make_alloc(job, make_node(1))
    assert {alloc.id: ALLOC_NOT_NEEDED} == stops(plan(None, [alloc]))


def test_destructive_change_replaces_the_allocation() -> None:
    """A changed job Meta (caravan's spec hash) stops and re-places the index."""
    old = cpu_job(Meta={"caravan_spec_hash": "a"})
    new = {**cpu_job(Meta={"caravan_spec_hash": "b"}), "Version": 1}
    alloc = make_alloc(old, make_node(1))
    result = plan(new, [alloc], versions={0: old, 1: new})
    assert {alloc.id: ALLOC_UPDATING} == stops(result)
    assert [("web.g[0]", 1)] == [(a.name, a.job_version) for a in result.placements]


def test_service_only_change_updates_in_place() -> None:
    """Changing only a service's tags keeps the allocation (an in-place update)."""
    base: dict[str, Any] = {
        "Services": [{"Name": "web", "PortLabel": "http", "Tags": ["a"]}],
    }
    old = cpu_job()
    old["TaskGroups"][0].update(base)
    new = cpu_job()
    new["TaskGroups"][0].update({"Services": [{"Name": "web", "PortLabel": "http", "Tags": ["b"]}]})
    new["Version"] = 1
    alloc = make_alloc(old, make_node(1))
    result = plan(new, [alloc], versions={0: old, 1: new})
    assert ((alloc.id,), (), ()) == (result.in_place, result.stops, result.placements)


def test_migrating_allocation_is_replaced() -> None:
    """An allocation marked for migration (drain, alloc stop) stops and is re-placed."""
    job = cpu_job()
    alloc = make_alloc(job, make_node(1), desired_transition={"Migrate": True})
    result = plan(job, [alloc])
    assert {alloc.id: ALLOC_MIGRATING} == stops(result)
    assert [alloc.id] == [a.previous_allocation for a in result.placements]


def test_unplaceable_allocations_are_reported_per_group() -> None:
    """Two indexes that fit nowhere: one AllocMetric with one coalesced failure, 2 queued."""
    result = plan(cpu_job(count=2, memory=10**7))
    assert ["g"] == list(result.failures)
    assert 1 == result.failures["g"].coalesced_failures
    assert {"g": 2} == dict(result.queued)
