"""What a submission would change, job by job, without writing anything (pure).

`caravan plan FILE` (and `POST /v1/plan`) validate the profiles exactly as a
submission does, then compare, for every replica job each model would run
at its desired count, the spec the new profile renders (`render`,
`spec_hash`) with the job Nomad has now (its `caravan_spec_hash` Meta):

- `create`: no such job runs yet;
- `update`: the job runs another spec; the field diff is between the job
  the stored profile renders and the one the new profile renders (both
  through `render`, so Nomad's defaults do not show as changes);
- `stop`: the job's replica index is at or beyond the new desired count (a
  narrower `replicas.max`, say): the scheduler drains it;
- `none`: the job already runs the new spec.

The desired count is the stored one clamped to the new profile's bounds,
the rule the scheduler applies (`DesiredState.desired_count`). How the
scheduler gets there (one surge replica at a time, ready before the old one
drains) is `scheduler/plan.py`'s business; this says where it ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from caravan_llm.common.contract import replica_job_id
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.model_store import DesiredState
from caravan_llm.scheduler.profiles import ModelProfile
from caravan_llm.scheduler.render import render, spec_hash
from caravan_llm.scheduler.world import ObservedReplica


class Change(StrEnum):
    CREATE = "create"
    UPDATE = "update"
    STOP = "stop"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class FieldChange:
    """One field of a job body: `+` added, `-` removed, `+/-` changed."""

    path: str
    mark: str
    old: Any = None
    new: Any = None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "mark": self.mark, "old": self.old, "new": self.new}


@dataclass(frozen=True, slots=True)
class JobChange:
    job_id: str
    replica: int
    change: Change
    fields: tuple[FieldChange, ...] = ()
    old_spec: str | None = None
    new_spec: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "replica": self.replica,
            "change": self.change.value,
            "old_spec_hash": self.old_spec,
            "new_spec_hash": self.new_spec,
            "fields": [f.to_json() for f in self.fields],
        }


@dataclass(frozen=True, slots=True)
class ModelPlan:
    name: str
    # "create" (a new model), "update" (its profile changes) or "none".
    change: Change
    desired: int
    jobs: tuple[JobChange, ...]

    @property
    def changes_jobs(self) -> bool:
        return any(job.change is not Change.NONE for job in self.jobs)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "change": self.change.value,
            "desired": self.desired,
            "jobs": [job.to_json() for job in self.jobs],
        }


@dataclass(frozen=True, slots=True)
class SubmissionPlan:
    models: tuple[ModelPlan, ...]

    @property
    def changes(self) -> bool:
        """Whether applying the submission would register or stop any job."""
        return any(model.changes_jobs for model in self.models)

    def to_json(self) -> dict[str, Any]:
        return {"changes": self.changes, "models": [m.to_json() for m in self.models]}


def _named(items: list[Any]) -> dict[str, Any] | None:
    """A list of objects that each have a unique `Name`, keyed by it; else None."""
    names = [item.get("Name") for item in items if isinstance(item, dict)]
    if len(names) != len(items) or None in names or len(set(names)) != len(names):
        return None
    return {str(item["Name"]): item for item in items}


def diff_documents(old: Any, new: Any, path: str = "") -> list[FieldChange]:
    """Field-level differences between two JSON documents (pure).

    Lists of named objects (task groups, tasks, services) are matched by
    `Name`, other lists by position.
    """
    if isinstance(old, dict) and isinstance(new, dict):
        changes: list[FieldChange] = []
        for key in sorted(set(old) | set(new), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in old:
                changes.append(FieldChange(where, "+", new=new[key]))
            elif key not in new:
                changes.append(FieldChange(where, "-", old=old[key]))
            else:
                changes.extend(diff_documents(old[key], new[key], where))
        return changes
    if isinstance(old, list) and isinstance(new, list):
        old_named, new_named = _named(old), _named(new)
        if old_named is not None and new_named is not None:
            changes = []
            for name in sorted(set(old_named) | set(new_named)):
                where = f"{path}[{name}]"
                if name not in old_named:
                    changes.append(FieldChange(where, "+", new=new_named[name]))
                elif name not in new_named:
                    changes.append(FieldChange(where, "-", old=old_named[name]))
                else:
                    changes.extend(diff_documents(old_named[name], new_named[name], where))
            return changes
        changes = []
        for index in range(max(len(old), len(new))):
            where = f"{path}[{index}]"
            if index >= len(old):
                changes.append(FieldChange(where, "+", new=new[index]))
            elif index >= len(new):
                changes.append(FieldChange(where, "-", old=old[index]))
            else:
                changes.extend(diff_documents(old[index], new[index], where))
        return changes
    if old != new:
        return [FieldChange(path, "+/-", old=old, new=new)]
    return []


def _job_diff(
    old: ModelProfile | None, new: ModelProfile, replica: int, config: ClusterConfig
) -> tuple[FieldChange, ...]:
    if old is None:
        return ()
    before = render(old, replica, config=config)["Job"]
    after = render(new, replica, config=config)["Job"]
    return tuple(diff_documents(before, after))


def plan_model(
    profile: ModelProfile,
    state: DesiredState,
    running: Sequence[ObservedReplica],
    config: ClusterConfig,
) -> ModelPlan:
    """What submitting `profile` changes for its model's replica jobs (pure)."""
    old = state.profiles.get(profile.name)
    count = replace(state, profiles={**state.profiles, profile.name: profile}).desired_count(
        profile.name
    )
    by_index = {r.replica: r for r in running if not r.stopped}
    jobs: list[JobChange] = []
    for index in range(count):
        want = spec_hash(profile, index, config)
        seen = by_index.get(index)
        job_id = replica_job_id(profile.name, index)
        if seen is None:
            jobs.append(JobChange(job_id, index, Change.CREATE, new_spec=want))
        elif seen.spec_hash == want:
            jobs.append(JobChange(job_id, index, Change.NONE, old_spec=want, new_spec=want))
        else:
            fields = _job_diff(old, profile, index, config)
            jobs.append(JobChange(job_id, index, Change.UPDATE, fields, seen.spec_hash, want))
    jobs.extend(
        JobChange(seen.job_id, index, Change.STOP, old_spec=seen.spec_hash)
        for index, seen in sorted(by_index.items())
        if index >= count
    )
    if old is None:
        change = Change.CREATE
    elif old == profile:
        change = Change.NONE
    else:
        change = Change.UPDATE
    return ModelPlan(profile.name, change, count, tuple(jobs))


def plan_submission(
    profiles: Sequence[ModelProfile],
    state: DesiredState,
    running: Mapping[str, Sequence[ObservedReplica]],
    config: ClusterConfig,
) -> SubmissionPlan:
    """The plan of a validated submission: each model, job by job (pure)."""
    return SubmissionPlan(
        tuple(plan_model(p, state, running.get(p.name, ()), config) for p in profiles)
    )
