"""The planner and a model's prefetch job: registered once per weights version, replicas wait."""

from __future__ import annotations

from dataclasses import replace

from profile_builders import make_vllm
from world_builders import NOW, NS, alloc, desired, nodes, replica, run_plan, world

from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.plan import Deregister, Register, RegisterPrefetch, Replace
from caravan_llm.scheduler.render import secret_templates
from caravan_llm.scheduler.weights import (
    ObservedPrefetch,
    PrefetchState,
    prefetch_job_id,
    render_prefetch,
)

WEIGHTS = {"volume": {"type": "host", "source": "models"}, "path": "/models", "prefetch": {}}


def _profile():
    return make_vllm(weights=WEIGHTS)


def _hash(profile) -> str:
    body = render_prefetch(profile, ClusterConfig(), secret_templates(profile))
    assert body is not None
    return str(body["Job"]["Meta"]["caravan_spec_hash"])


def _seen(profile, state: PrefetchState, *replicas, spec_hash: str | None = None, **kw):
    observed = ObservedPrefetch(
        job_id=prefetch_job_id(profile.name),
        model=profile.name,
        spec_hash=spec_hash or _hash(profile),
        state=state,
        submit_time_ns=int((NOW - 30) * NS),
        **kw,
    )
    return replace(world(*replicas), prefetch={profile.name: observed})


def test_prefetch_is_registered_first_and_replicas_wait() -> None:
    profile = _profile()
    result = run_plan(desired((profile, 2)), world())
    (action,) = result.actions
    assert isinstance(action, RegisterPrefetch)
    assert prefetch_job_id(profile.name) == action.job_id
    assert "batch" == action.body["Job"]["Type"]
    assert 0 == action.enforce_index  # the job must not exist yet
    (report,) = result.reports
    assert ("registering (not run yet)", False) == (report.prefetch, report.prefetch_failed)
    assert result.requeue_after_s is not None


def test_running_prefetch_holds_replicas_without_registering_again() -> None:
    profile = _profile()
    result = run_plan(desired((profile, 2)), _seen(profile, PrefetchState.RUNNING))
    assert () == result.actions
    assert "running for 30 s" == result.reports[0].prefetch
    assert result.requeue_after_s is not None


def test_completed_prefetch_lets_replicas_register_and_is_not_run_again() -> None:
    profile = _profile()
    result = run_plan(desired((profile, 2)), _seen(profile, PrefetchState.COMPLETE))
    assert all(isinstance(a, Register) for a in result.actions)
    assert 2 == len(result.actions)
    assert "complete" == result.reports[0].prefetch


def test_replacing_a_lost_replica_does_not_rerun_the_prefetch() -> None:
    profile = _profile()
    lost = replica(profile, 0, alloc("n1", "lost", at=NOW - 500))
    seen = _seen(profile, PrefetchState.COMPLETE, lost)
    seen = replace(seen, nodes=nodes("n1", "n2", down=("n1",)))
    result = run_plan(desired((profile, 1)), seen)
    assert [type(a) for a in result.actions] == [Replace]


def test_failed_prefetch_is_reported_and_holds_replicas() -> None:
    profile = _profile()
    seen = _seen(profile, PrefetchState.FAILED, failure="Terminated: Exit Code: 1")
    result = run_plan(desired((profile, 2)), seen)
    assert () == result.actions
    (report,) = result.reports
    assert ("failed: Terminated: Exit Code: 1", True) == (report.prefetch, report.prefetch_failed)


def test_changed_weights_register_the_prefetch_again() -> None:
    profile = _profile()
    seen = _seen(profile, PrefetchState.COMPLETE, spec_hash="older-version", job_modify_index=41)
    result = run_plan(desired((profile, 1)), seen)
    assert [type(a) for a in result.actions] == [RegisterPrefetch]
    # Conditioned on the version the plan read (facts N3): a lost race re-plans.
    assert 41 == result.actions[0].enforce_index
    assert "registering (weights changed)" == result.reports[0].prefetch


def test_a_model_without_prefetch_is_not_gated() -> None:
    profile = make_vllm()
    result = run_plan(desired((profile, 1)), world())
    assert [type(a) for a in result.actions] == [Register]
    assert result.reports[0].prefetch is None


def test_a_deleted_models_prefetch_is_purged_after_confirmation() -> None:
    profile = _profile()
    seen = _seen(profile, PrefetchState.COMPLETE)
    first = run_plan({}, seen)
    assert () == first.actions
    assert first.requeue_after_s is not None
    later = run_plan({}, seen, memory=first.memory, now=NOW + 60)
    (action,) = later.actions
    assert isinstance(action, Deregister)
    assert prefetch_job_id(profile.name) == action.job_id
    # A profile that comes back in time keeps it.
    assert () == run_plan(desired((profile, 0)), seen, memory=first.memory, now=NOW + 60).actions
