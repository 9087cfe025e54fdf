"""Where a model's weights live: a Nomad host or CSI volume, and an optional prefetch.

A profile's `weights` block names a volume (Nomad's group `volume` block),
the path replicas mount it at (`volume_mount`, read-only), and optionally a
`prefetch`: a Nomad batch job, `caravan-<model>-prefetch`, that fills the
volume once (mounted read-write) before any replica is registered.

Everything here is pure: the blocks `render` adds to a replica job, the
prefetch job itself, and `prefetch_gate`, which tells the planner from what
Nomad reports (and `now`) whether replicas may be placed. The profile's
`weights:` schema is `caravan_llm.scheduler.weights_cache`'s.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from caravan_llm.common.contract import JOB_PREFIX, MANAGED_BY_VALUE, JobMetaKey
from caravan_llm.scheduler.engines.registry import adapter_for
from caravan_llm.scheduler.nomad_time import NS_PER_S
from caravan_llm.scheduler.weights_cache import Prefetch, VolumeType, WeightsCache

if TYPE_CHECKING:
    # Types only: `caravan render` must not load the Nomad client (aiohttp).
    from caravan_llm.common.nomad_api import Allocation, JobStub
    from caravan_llm.scheduler.cluster_config import ClusterConfig
    from caravan_llm.scheduler.profiles import ModelProfile

VOLUME_NAME = "weights"
PREFETCH_GROUP = "prefetch"
PREFETCH_TASK = "prefetch"
# The tasks that download adapters named by a Hugging Face id: `adapter-<index>`.
PREFETCH_ADAPTER_TASK_PREFIX = "adapter-"
PREFETCH_SUFFIX = "-prefetch"
# Job Meta of the prefetch job: which model it fills (JobMetaKey.MODEL) and this kind.
PREFETCH_KIND_KEY = "caravan_kind"
PREFETCH_KIND = "prefetch"
HASH_LEN = 16
# Without a prefetch the first replica on a cold cache downloads the weights
# itself: its default startup timeout is the engine's times this factor.
COLD_CACHE_STARTUP_FACTOR = 2
# A prefetch retries twice in place (a flaky download), then fails for good.
PREFETCH_RESTART_ATTEMPTS = 2
PREFETCH_RESTART_DELAY_S = 5
PREFETCH_RESTART_INTERVAL_S = 30 * 60
DEFAULT_CSI_ACCESS_MODE = "multi-node-reader-only"
# Replicas that fill a CSI cache themselves (no prefetch) write it from many nodes.
CSI_SHARED_WRITER_MODE = "multi-node-multi-writer"
# The claim a prefetch takes on a CSI volume to write it.
PREFETCH_CSI_ACCESS_MODE = "multi-node-single-writer"


def prefetch_job_id(model: str) -> str:
    """`caravan-<model>-prefetch`: one per model (its spec hash is the weights version)."""
    return f"{JOB_PREFIX}{model}{PREFETCH_SUFFIX}"


# -- blocks of a replica job -------------------------------------------------------


def _volume_request(
    weights: WeightsCache, *, read_only: bool, prefetch: bool = False
) -> dict[str, Any]:
    volume = weights.volume
    request: dict[str, Any] = {
        "Name": VOLUME_NAME,
        "Type": volume.type.value,
        "Source": volume.source,
        "ReadOnly": read_only,
    }
    if volume.type is VolumeType.CSI:
        if prefetch:
            mode = PREFETCH_CSI_ACCESS_MODE
        elif volume.access_mode is not None:
            mode = volume.access_mode
        else:
            mode = DEFAULT_CSI_ACCESS_MODE if read_only else CSI_SHARED_WRITER_MODE
        request["AccessMode"] = mode
        request["AttachmentMode"] = volume.attachment_mode or "file-system"
    return request


def _mount(weights: WeightsCache, *, read_only: bool) -> dict[str, Any]:
    return {"Volume": VOLUME_NAME, "Destination": weights.path, "ReadOnly": read_only}


def replica_volumes(profile: ModelProfile) -> dict[str, Any] | None:
    """The group `Volumes` of a replica: the weights volume (read-only once filled)."""
    if profile.weights is None:
        return None
    weights = profile.weights
    return {VOLUME_NAME: _volume_request(weights, read_only=weights.replicas_read_only)}


def replica_mounts(profile: ModelProfile) -> list[dict[str, Any]] | None:
    """The task `VolumeMounts` of a replica: the volume at `weights.path`."""
    if profile.weights is None:
        return None
    return [_mount(profile.weights, read_only=profile.weights.replicas_read_only)]


def _hub_cache_env(profile: ModelProfile, weights: WeightsCache) -> dict[str, str]:
    """The variable that makes the volume the engine's hub cache; none for a file engine."""
    variable = adapter_for(profile.engine).facts.weights.hub_cache_env
    return {} if variable is None else {variable: weights.path}


def cache_env(profile: ModelProfile) -> dict[str, str]:
    """Environment that points the engine at the volume (its Hugging Face cache)."""
    weights = profile.weights
    if weights is None:
        return {}
    env = _hub_cache_env(profile, weights)
    if env and weights.prefetch is not None:
        # The prefetch filled the cache: never reach out (and never write the
        # read-only mount) from a replica.
        env.update(adapter_for(profile.engine).facts.weights.offline_env)
    return env


def startup_timeout_s(profile: ModelProfile, engine_default_s: int) -> int:
    """A replica's startup timeout: a cold cache it fills itself gets longer by default."""
    if profile.startup_timeout_s is not None:
        return profile.startup_timeout_s
    weights = profile.weights
    if weights is not None and not weights.replicas_read_only:
        return engine_default_s * COLD_CACHE_STARTUP_FACTOR
    return engine_default_s


# -- the prefetch job ----------------------------------------------------------------


def _prefetch_command(profile: ModelProfile, prefetch: Prefetch) -> tuple[str, ...]:
    if prefetch.command:
        return prefetch.command
    download = adapter_for(profile.engine).facts.weights.default_download
    if download is None:
        # Profile loading refuses this (weights_cache.check_weights).
        raise ValueError("weights.prefetch.command: this engine has no default download")
    return (*download, profile.model)


def _prefetch_task_config(
    profile: ModelProfile,
    prefetch: Prefetch,
    config: ClusterConfig,
    command: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    program, *args = command or _prefetch_command(profile, prefetch)
    if prefetch.driver == "exec":
        return {"command": program, "args": args}
    return {
        "image": prefetch.image or adapter_for(profile.engine, config).prefetch_image,
        # An engine image's entrypoint is its server: replace it.
        "entrypoint": [program],
        "args": args,
    }


def _adapter_download_tasks(
    profile: ModelProfile, prefetch: Prefetch, config: ClusterConfig, model_task: dict[str, Any]
) -> list[dict[str, Any]]:
    """With the engine's default download, one more task per adapter named by a Hugging Face
    id (`hf download <id>` into the same cache), run beside the model's: the allocation
    completes when all have. A prefetch with its own command brings the adapters itself."""
    download = adapter_for(profile.engine).facts.weights.default_download
    if prefetch.command or download is None:
        return []
    tasks: list[dict[str, Any]] = []
    for index, adapter in enumerate(profile.adapters):
        if adapter.is_path:
            continue
        tasks.append(
            {
                **model_task,
                "Name": f"{PREFETCH_ADAPTER_TASK_PREFIX}{index}",
                "Config": _prefetch_task_config(
                    profile, prefetch, config, (*download, adapter.source)
                ),
            }
        )
    return tasks


def _canonical_hash(document: Any) -> str:
    text = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(text).hexdigest()[:HASH_LEN]


def render_prefetch(
    profile: ModelProfile, config: ClusterConfig, templates: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The `PUT /v1/jobs` body of the model's prefetch job, or None when it has none.

    `templates` are the profile's secret templates (as `render` makes them), so
    the download can use HF_TOKEN without the job carrying its value.
    """
    weights = profile.weights
    if weights is None or weights.prefetch is None:
        return None
    prefetch = weights.prefetch
    job_id = prefetch_job_id(profile.name)
    env = _hub_cache_env(profile, weights)
    task: dict[str, Any] = {
        "Name": PREFETCH_TASK,
        "Driver": prefetch.driver,
        "Config": _prefetch_task_config(profile, prefetch, config),
        "Env": env,
        "Resources": {"CPU": prefetch.cpu_mhz, "MemoryMB": prefetch.memory_mb},
        "VolumeMounts": [_mount(weights, read_only=False)],
    }
    if templates:
        task["Templates"] = templates
    tasks = [task, *_adapter_download_tasks(profile, prefetch, config, task)]
    job: dict[str, Any] = {
        "ID": job_id,
        "Name": job_id,
        "Type": "batch",
        "Namespace": config.namespace,
        "Priority": config.priority,
        "Datacenters": list(config.datacenters),
        "Meta": {
            JobMetaKey.MODEL: profile.name,
            JobMetaKey.ENGINE: profile.engine.value,
            JobMetaKey.MANAGED_BY: MANAGED_BY_VALUE,
            PREFETCH_KIND_KEY: PREFETCH_KIND,
        },
        "Constraints": [{"LTarget": "${attr.kernel.name}", "RTarget": "linux", "Operand": "="}],
        "TaskGroups": [
            {
                "Name": PREFETCH_GROUP,
                "Count": 1,
                "RestartPolicy": {
                    "Attempts": PREFETCH_RESTART_ATTEMPTS,
                    "Interval": PREFETCH_RESTART_INTERVAL_S * NS_PER_S,
                    "Delay": PREFETCH_RESTART_DELAY_S * NS_PER_S,
                    "Mode": "fail",
                },
                # A failed prefetch is shown, not retried on other nodes forever.
                "ReschedulePolicy": {"Attempts": 0, "Interval": 0, "Unlimited": False},
                "Volumes": {VOLUME_NAME: _volume_request(weights, read_only=False, prefetch=True)},
                "Tasks": tasks,
            }
        ],
    }
    if config.region is not None:
        job["Region"] = config.region
    job["Meta"][JobMetaKey.SPEC_HASH] = _canonical_hash(job)
    return {"Job": job}


# -- what Nomad reports, and the planner's gate ---------------------------------------


class PrefetchState(StrEnum):
    ABSENT = "absent"
    PENDING = "pending"
    RUNNING = "running"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ObservedPrefetch:
    """A prefetch job as Nomad reports it, decoded once at the edge."""

    job_id: str
    model: str
    spec_hash: str
    state: PrefetchState
    submit_time_ns: int
    # Why it failed, in Nomad's words (the failing task event), when it did.
    failure: str | None = None
    # The job's JobModifyIndex as read: a re-registration is conditioned on it.
    job_modify_index: int = 0


def _failure_text(alloc: Allocation) -> str:
    events = alloc.task_events
    for event in reversed(events):
        if event.type in {"Terminated", "Driver Failure", "Task hook failed"}:
            return event.words
    for event in reversed(events):
        if event.fails_task and event.message:
            return event.message
    return "allocation failed"


def observe_prefetch(stub: JobStub, allocs: Sequence[Allocation]) -> ObservedPrefetch | None:
    """A prefetch job from its `?meta=true` stub and allocations; None if not one."""
    meta = stub.meta
    if (
        meta.get(PREFETCH_KIND_KEY) != PREFETCH_KIND
        or meta.get(JobMetaKey.MANAGED_BY) != MANAGED_BY_VALUE
        or not stub.id.startswith(JOB_PREFIX)
    ):
        return None
    # Only the current version's allocations say how this weights version did:
    # a completed run of an older version must not count as this one's.
    current = [a for a in allocs if a.job_version == stub.version]
    statuses = [a.client_status for a in current]
    failure: str | None = None
    if "complete" in statuses:
        state = PrefetchState.COMPLETE
    elif "running" in statuses:
        state = PrefetchState.RUNNING
    elif statuses and all(s in {"failed", "lost"} for s in statuses):
        state = PrefetchState.FAILED
        latest = max(current, key=lambda a: a.modify_time_ns)
        failure = _failure_text(latest)
    else:
        state = PrefetchState.PENDING
    return ObservedPrefetch(
        job_id=stub.id,
        model=str(meta.get(JobMetaKey.MODEL, "")),
        spec_hash=str(meta.get(JobMetaKey.SPEC_HASH, "")),
        state=state,
        submit_time_ns=stub.submit_time_ns,
        failure=failure,
        job_modify_index=stub.job_modify_index,
    )


@dataclass(frozen=True, slots=True)
class PrefetchGate:
    """The planner's view of a model's prefetch in this pass."""

    # Register this body (absent, or the weights version changed); None: nothing to do.
    register: dict[str, Any] | None
    # Replicas may be registered (no prefetch, or it completed for this version).
    ready: bool
    # For `caravan status` and fail-fast: e.g. "running 120 s", "failed: ...".
    status: str | None
    # The prefetch failed for this version: will not recover without a change.
    failed: bool = False


NO_PREFETCH = PrefetchGate(register=None, ready=True, status=None)


def prefetch_gate(
    body: dict[str, Any] | None, observed: ObservedPrefetch | None, now: float, timeout_s: int
) -> PrefetchGate:
    """Whether replicas may be placed, and whether to (re-)register the prefetch job.

    Pure: `body` is `render_prefetch`'s result, `observed` Nomad's view of the
    job, `now` wall-clock seconds (compared with the job's SubmitTime).
    """
    if body is None:
        return NO_PREFETCH
    want_hash = str(body["Job"]["Meta"][JobMetaKey.SPEC_HASH])
    if observed is None or observed.spec_hash != want_hash:
        why = "not run yet" if observed is None else "weights changed"
        return PrefetchGate(register=body, ready=False, status=f"registering ({why})")
    if observed.state is PrefetchState.COMPLETE:
        return PrefetchGate(register=None, ready=True, status="complete")
    if observed.state is PrefetchState.FAILED:
        return PrefetchGate(
            register=None,
            ready=False,
            status=f"failed: {observed.failure or 'allocation failed'}",
            failed=True,
        )
    age_s = max(0, int(now - observed.submit_time_ns / NS_PER_S))
    status = f"{observed.state.value} for {age_s} s"
    if age_s > timeout_s:
        status += f" (over its {timeout_s} s timeout: see `nomad alloc logs`)"
    return PrefetchGate(register=None, ready=False, status=status)
