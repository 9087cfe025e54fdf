"""Properties of `assess` and `plan` together over generated (desired, observation) pairs,
and `caravan status` agreeing with the planner on each replica: no controller involved."""

from __future__ import annotations

from hypothesis import given, settings
from observation_strategies import NOW, worlds

from caravan_llm.common.contract import MANAGED_BY_VALUE, JobMetaKey
from caravan_llm.common.nomad_api import JobStub
from caravan_llm.scheduler.assess import Assessment, assess
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.model_store import DesiredState
from caravan_llm.scheduler.plan import (
    Plan,
    PlanSettings,
    Register,
    RegisterPrefetch,
    Replace,
    StartDrain,
    plan,
)
from caravan_llm.scheduler.status import model_status
from caravan_llm.scheduler.weights import NO_PREFETCH
from caravan_llm.scheduler.world import (
    DesiredModel,
    Observation,
    PlannerMemory,
    replica_from_job_stub,
)

CONFIG = ClusterConfig()
World = tuple[dict[str, DesiredModel], Observation]


def plan_of(desired: dict[str, DesiredModel], seen: Observation, judged: Assessment | None) -> Plan:
    return plan(
        desired,
        seen,
        PlannerMemory(),
        config=CONFIG,
        settings=PlanSettings(),
        now=NOW,
        assessment=judged,
    )


@settings(max_examples=60, deadline=None)
@given(worlds())
def test_every_replica_is_judged_once_and_consistently(world: World) -> None:
    """Ready means placed and neither waiting nor failed; a model that failed has none ready."""
    desired, seen = world
    judged = assess(desired, seen, CONFIG, NOW)

    assert set(seen.replicas) == set(judged.replicas)
    assert set(desired) == set(judged.models)
    for job_id, replica in judged.replicas.items():
        observed = seen.replicas[job_id]
        if replica.ready:
            assert replica.node is not None
            assert (None, None) == (replica.unplaceable, replica.failed)
        if replica.unplaceable is not None:
            assert () == observed.live_allocs()
        has_profile = replica.model in desired and not replica.stopped
        assert has_profile == (replica.outdated is not None)
        assert (job_id in seen.draining) == replica.draining
    for name, model in judged.models.items():
        assert [r.replica for r in seen.of_model(name) if not r.stopped] == [
            r.replica for r in model.replicas
        ]
        if model.failure is not None:
            assert 0 == model.ready
        weights = desired[name].profile.weights
        if weights is None or weights.prefetch is None:
            assert NO_PREFETCH == model.prefetch


@settings(max_examples=60, deadline=None)
@given(worlds())
def test_the_plan_follows_the_assessment(world: World) -> None:
    """The planner's counts are the assessment's, replicas wait for their prefetch, and no
    drain takes a model below its desired ready count."""
    desired, seen = world
    judged = assess(desired, seen, CONFIG, NOW)
    result = plan_of(desired, seen, judged)

    assert plan_of(desired, seen, None) == result
    assert judged == result.assessment
    for report in result.reports:
        model = judged.models[report.model]
        live = [r for r in model.replicas if r.live]
        assert model.ready == report.ready
        assert len(live) == report.live
        assert sum(1 for r in live if r.outdated) == report.outdated
        assert tuple(r.job_id for r in live if r.node is None) == report.unplaced
        assert (model.prefetch.status, model.prefetch.failed) == (
            report.prefetch,
            report.prefetch_failed,
        )
    for name in desired:
        model = judged.models[name]
        registers = [
            a
            for a in result.actions
            if isinstance(a, Register | Replace | RegisterPrefetch) and a.model == name
        ]
        if not model.prefetch.ready:
            assert all(isinstance(a, RegisterPrefetch) for a in registers)
        ready_drained = [
            a
            for a in result.actions
            if isinstance(a, StartDrain) and a.model == name and judged.replicas[a.job_id].ready
        ]
        assert len(ready_drained) <= max(0, model.ready - desired[name].count)
    for action in result.actions:
        if isinstance(action, Register):
            assert action.job_id not in seen.replicas


@settings(max_examples=60, deadline=None)
@given(worlds())
def test_caravan_status_and_the_planner_agree_on_every_replica(world: World) -> None:
    """Driven through `caravan status`'s code path and through the planner, one observation
    gives the same ready, unplaceable and failed per replica, and the same ready count."""
    wanted, seen = world
    state = DesiredState(
        profiles={name: d.profile for name, d in wanted.items()},
        invalid={},
        stored_counts={name: d.count for name, d in wanted.items()},
        draining=seen.draining,
        demand={},
    )
    desired = state.desired_models()
    planned = plan_of(desired, seen, None)
    reports = {report.model: report for report in planned.reports}

    for name in desired:
        shown = model_status(name, state, seen, assess(desired, seen, CONFIG, NOW), NOW)
        report = reports[name]
        assert report.ready == shown.ready
        for replica in shown.replicas:
            decided = planned.assessment.replicas[replica.job_id]
            assert (decided.ready and decided.live) == (replica.state == "ready")
            assert decided.unplaceable == replica.pending_reason
            assert decided.failed == replica.failed
            if replica.state == "pending placement" and not decided.draining:
                assert replica.job_id in report.unplaced


def test_a_job_stub_and_its_observed_replica_carry_the_version() -> None:
    """The failure rule compares allocations with the job's version: the observation keeps it."""
    stub = JobStub.from_api(
        {
            "ID": "caravan-m-0",
            "Version": 3,
            "Meta": {
                JobMetaKey.MANAGED_BY: MANAGED_BY_VALUE,
                JobMetaKey.MODEL: "m",
                JobMetaKey.REPLICA: "0",
            },
        }
    )
    replica = replica_from_job_stub(stub)
    assert replica is not None
    assert 3 == replica.version
