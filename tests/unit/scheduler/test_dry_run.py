"""`caravan plan`: which replica jobs a submission creates, updates or stops, with the fields."""

from __future__ import annotations

from profile_builders import make_llamacpp

from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.dry_run import Change, FieldChange, diff_documents, plan_model
from caravan_llm.scheduler.model_store import DesiredState
from caravan_llm.scheduler.render import spec_hash
from caravan_llm.scheduler.world import ObservedReplica

CONFIG = ClusterConfig()


def state(*profiles, counts=None) -> DesiredState:
    return DesiredState(
        profiles={p.name: p for p in profiles},
        invalid={},
        stored_counts=counts or {},
        draining={},
        demand={},
    )


def running(profile, *indexes: int) -> list[ObservedReplica]:
    return [
        ObservedReplica(
            job_id=f"caravan-{profile.name}-{i}",
            model=profile.name,
            replica=i,
            spec_hash=spec_hash(profile, i, CONFIG),
            job_status="running",
            stopped=False,
            submit_time_ns=0,
        )
        for i in indexes
    ]


def test_a_new_model_creates_a_job_per_desired_replica():
    """No profile and no job yet: every replica at the start count is a create."""
    new = make_llamacpp(replicas={"min": 1, "max": 4, "initial": 2})
    planned = plan_model(new, state(), [], CONFIG)
    assert (Change.CREATE, [Change.CREATE, Change.CREATE]) == (
        planned.change,
        [job.change for job in planned.jobs],
    )


def test_an_unchanged_profile_changes_no_job():
    """Submitting what runs changes nothing."""
    profile = make_llamacpp()
    planned = plan_model(profile, state(profile), running(profile, 0), CONFIG)
    assert (Change.NONE, False) == (planned.change, planned.changes_jobs)


def test_an_update_lists_the_changed_fields_of_the_job():
    """A new engine argument is an update of the job's args, spec hash to spec hash."""
    old = make_llamacpp()
    new = make_llamacpp(engine_args=["--threads", "2"])
    (job,) = plan_model(new, state(old), running(old, 0), CONFIG).jobs
    args = [f for f in job.fields if f.path.startswith("TaskGroups[engine].Tasks[engine].Config")]
    assert (Change.UPDATE, spec_hash(old, 0, CONFIG)) == (job.change, job.old_spec)
    assert args


def test_a_narrower_max_stops_the_replicas_beyond_it():
    """Replicas at or past the new count are stopped (drained)."""
    old = make_llamacpp(replicas={"min": 1, "max": 3, "initial": 3})
    new = make_llamacpp(replicas={"min": 1, "max": 1})
    planned = plan_model(new, state(old, counts={"tiny": 3}), running(old, 0, 1, 2), CONFIG)
    assert [Change.NONE, Change.STOP, Change.STOP] == [job.change for job in planned.jobs]


def test_named_lists_are_diffed_by_name_and_values_by_path():
    """Task groups match by Name; a changed value shows old and new, an added key its value."""
    before = {"TaskGroups": [{"Name": "engine", "Count": 1}], "Meta": {"a": "1"}}
    after = {"TaskGroups": [{"Name": "engine", "Count": 2}], "Meta": {"a": "1", "b": "2"}}
    assert [
        FieldChange("Meta.b", "+", new="2"),
        FieldChange("TaskGroups[engine].Count", "+/-", old=1, new=2),
    ] == diff_documents(before, after)
