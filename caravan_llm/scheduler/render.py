"""Render one replica of a model profile into the Nomad job that runs it.

`render(profile, replica, hints, config)` is pure and deterministic: the same
inputs give byte-identical JSON. The result is the body of `PUT /v1/jobs`
(`{"Job": {...}}`) and satisfies what a real Nomad accepts (see
`docs/nomad-consul-facts.md`, facts N5, N8, N18): durations are integer
nanoseconds, every constraint has an explicit `Operand`, the service name is
valid per RFC 1123, check intervals and timeouts are at least one second, and
host-mode raw_exec ports carry no `To`.

The job's `Meta` carries a spec hash: a hash of everything rendered except the
placement hints. The scheduler compares hashes, never Nomad's canonicalised
JSON, so an unchanged profile never causes a re-registration, and fresh hints
alone never do either.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from caravan_llm.common.contract import (
    ENGINE_KEY_ITEM,
    GROUP_NAME,
    HTTP_PORT_LABEL,
    KV_PORT_LABEL,
    MANAGED_BY_VALUE,
    SERVICE_TAG,
    TASK_NAME,
    JobMetaKey,
    ServiceMetaKey,
    encode_engine_routes,
    encode_metric_names,
    encode_prefill_rate,
    encode_stream_traits,
    model_service_name,
    replica_job_id,
    replica_key_path,
)
from caravan_llm.scheduler import weights
from caravan_llm.scheduler.cluster_config import RESTART_INTERVAL_S, ClusterConfig
from caravan_llm.scheduler.engines.base import resolve_metrics
from caravan_llm.scheduler.engines.kv_events import (
    EVENTS_ENDPOINT,
    RELAY_ARGS,
    RELAY_TASK_NAME,
    REPLAY_ENDPOINT,
    TOPIC,
    KvEventsSettings,
)
from caravan_llm.scheduler.engines.registry import adapter_for
from caravan_llm.scheduler.gpu_classes import GpuClass, UnknownGpuClassError, lookup_gpu_class
from caravan_llm.scheduler.nomad_time import NS_PER_S
from caravan_llm.scheduler.profiles import Driver

if TYPE_CHECKING:
    from caravan_llm.scheduler.engines.base import EngineAdapter
    from caravan_llm.scheduler.profiles import ModelProfile

SPEC_HASH_LEN = 16
# Nomad's restart policy for one replica: a crashed engine is restarted in
# place (cheap: weights are in the page cache) `restart_attempts` times (2),
# `restart_delay_s` (15 s) apart, within RESTART_INTERVAL_S (cluster config);
# then the allocation fails and the reschedule policy moves it to another node.
RESCHEDULE_MAX_DELAY_S = 60 * 60
# Time after which a passing replica counts as healthy for deployments.
MIN_HEALTHY_TIME_S = 5
# Extra time a deployment may take beyond one replica's startup.
PROGRESS_MARGIN_S = 5 * 60
# Consecutive critical checks (after the grace) before Nomad restarts the task.
CHECK_RESTART_LIMIT = 3
# An engine gets this long to finish in-flight work after SIGTERM before
# SIGKILL; llama-server can hang on SIGTERM mid-request, so this is also the
# bound on how long a stuck engine holds its node's resources.
KILL_TIMEOUT_S = 30
# The KV relay stops at once: it holds nothing a router cannot rebuild.
RELAY_KILL_TIMEOUT_S = 5
# The relay's own restart policy: it never fails the replica, whose engine
# serves on without it (routers keep the approximate index meanwhile), so it
# is retried on and on, at most RELAY_RESTART_ATTEMPTS times per interval.
RELAY_RESTART_ATTEMPTS = 10
RELAY_RESTART_DELAY_S = 10
# The relay's variable: the engine key, from the replica job's own Variable.
RELAY_KEY_ENV = "CARAVAN_KV_RELAY_ENGINE_API_KEY"
# Weight of the anti-affinity that keeps CPU replicas of one model apart. The
# most negative weight Nomad allows: a node hosting a sibling then scores
# below every node that doesn't, while staying feasible when it is the only one.
SIBLING_ANTI_AFFINITY_WEIGHT = -100


@dataclass(frozen=True, slots=True)
class PlacementHints:
    """Where the model's other replicas run now (Nomad node IDs).

    Nomad's `spread` and `distinct_hosts` only see allocations of the same job
    (facts N14), and caravan runs one job per replica, so the scheduler
    passes the nodes of sibling replicas here and rendering turns them into an
    anti-affinity. It is soft on purpose: a replica is never pinned, so Nomad
    can still reschedule it on its own when its node dies.
    """

    sibling_nodes: frozenset[str] = frozenset()


NO_HINTS = PlacementHints()


class RenderError(ValueError):
    """The profile is valid but cannot be rendered into a job (yet)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def _ns(seconds: float) -> int:
    return int(seconds * NS_PER_S)


def _constraint(ltarget: str, operand: str, rtarget: str) -> dict[str, str]:
    return {"LTarget": ltarget, "RTarget": rtarget, "Operand": operand}


def _device_request(profile: ModelProfile, gpu_class: GpuClass) -> dict[str, Any]:
    assert profile.gpu is not None  # noqa: S101 - callers check uses_gpu
    if len(gpu_class.models) == 1:
        model_constraint = _constraint("${device.model}", "=", gpu_class.models[0])
    else:
        # One model name per comma; NVML names contain no commas (checked in
        # the catalog), and a device's model is a one-element set.
        model_constraint = _constraint(
            "${device.model}", "set_contains_any", ",".join(gpu_class.models)
        )
    return {
        "Name": "nvidia/gpu",
        "Count": profile.gpu.count,
        "Constraints": [
            model_constraint,
            _constraint("${device.attr.memory}", ">=", f"{gpu_class.min_memory_mib} MiB"),
        ],
    }


def _resources(
    profile: ModelProfile, adapter: EngineAdapter, gpu_class: GpuClass | None
) -> dict[str, Any]:
    resources: dict[str, Any] = {
        "MemoryMB": profile.resources.memory_mb or adapter.default_memory_mb(profile)
    }
    if profile.resources.cores is not None:
        resources["Cores"] = profile.resources.cores
    else:
        resources["CPU"] = profile.resources.cpu_mhz or adapter.default_cpu_mhz(profile)
    if gpu_class is not None:
        resources["Devices"] = [_device_request(profile, gpu_class)]
    return resources


def _service_meta(
    profile: ModelProfile, replica: int, adapter: EngineAdapter, gpu_class_name: str
) -> dict[str, str]:
    facts = adapter.facts
    metrics = resolve_metrics(facts.metrics, profile.metrics)
    return {
        ServiceMetaKey.MODEL: profile.name,
        ServiceMetaKey.SERVED_MODELS: profile.served_name,
        ServiceMetaKey.ENGINE: profile.engine.value,
        ServiceMetaKey.REPLICA: str(replica),
        ServiceMetaKey.GPU_CLASS: gpu_class_name,
        ServiceMetaKey.CAPACITY: str(adapter.capacity(profile)),
        ServiceMetaKey.METRICS_PATH: metrics.path,
        **encode_metric_names(metrics.names),
        # Filled in by Nomad when it registers the service.
        ServiceMetaKey.ALLOC_ID: "${NOMAD_ALLOC_ID}",
        **encode_stream_traits(facts.stream_traits),
        # Always published, so the router needs no per-engine default of its own.
        **encode_prefill_rate(profile.prefill_tokens_per_s or facts.default_prefill_tokens_per_s),
        # The OpenAI routes the engine serves: the router names no engine.
        **encode_engine_routes(facts.routes),
    }


def _service(
    profile: ModelProfile,
    replica: int,
    adapter: EngineAdapter,
    config: ClusterConfig,
    gpu_class_name: str,
) -> dict[str, Any]:
    startup_s = weights.startup_timeout_s(profile, adapter.startup_timeout_s(profile))
    check: dict[str, Any] = {
        "Name": "engine-health",
        "Type": "http",
        "Path": adapter.facts.health_path,
        "Interval": _ns(config.check_interval_s),
        "Timeout": _ns(config.check_timeout_s),
        "CheckRestart": {
            "Limit": CHECK_RESTART_LIMIT,
            # Loading a model is not a failure: the check may stay
            # critical for the whole startup time.
            "Grace": _ns(startup_s),
            # Consul `warning` means saturated, not broken.
            "IgnoreWarnings": True,
        },
    }
    if adapter.publishes_kv_events:
        # A group service's check_restart restarts every task of the group
        # unless the check names one: an unhealthy engine restarts alone, and
        # the relay tells its routers the engine went away.
        check["TaskName"] = TASK_NAME
    return {
        "Name": model_service_name(profile.name),
        "PortLabel": HTTP_PORT_LABEL,
        "Provider": "consul",
        "Tags": [SERVICE_TAG, f"engine-{profile.engine.value}", f"replica-{replica}"],
        "Meta": _service_meta(profile, replica, adapter, gpu_class_name),
        "Checks": [check],
    }


def _env_template(path: str, lines: list[tuple[str, str]], dest: str) -> dict[str, Any]:
    """A `template` that reads one Nomad Variable into env vars (`NAME={{ .item }}`).

    The job carries only the variable's path; Nomad renders the values into
    the task's secrets dir and environment before the task starts.
    """
    body = "".join(f"{name}={{{{ .{item} }}}}\n" for name, item in lines)
    return {
        "EmbeddedTmpl": f'{{{{ with nomadVar "{path}" }}}}\n{body}{{{{ end }}}}\n',
        "DestPath": f"secrets/{dest}",
        "Envvars": True,
        "ChangeMode": "restart",
        "Perms": "0600",
    }


def secret_templates(profile: ModelProfile) -> list[dict[str, Any]]:
    """The `template` blocks that read the profile's secrets (references only)."""
    templates: list[dict[str, Any]] = []
    by_path: dict[str, list[tuple[str, str]]] = {}
    for name, ref in profile.secret_refs().items():
        by_path.setdefault(ref.path, []).append((name, ref.item))
    for number, (path, lines) in enumerate(sorted(by_path.items())):
        templates.append(_env_template(path, lines, f"profile-secrets-{number}.env"))
    return templates


def _templates(
    profile: ModelProfile, adapter: EngineAdapter, config: ClusterConfig, job_id: str
) -> list[dict[str, Any]]:
    templates = secret_templates(profile)
    if config.engine_api_keys:
        # The scheduler writes the model's key into the replica job's own
        # variable path before registering the job.
        templates.append(
            _env_template(
                replica_key_path(job_id),
                [(adapter.facts.api_key_env, ENGINE_KEY_ITEM)],
                "engine-key.env",
            )
        )
    return templates


def _relay_task(kv_events: KvEventsSettings, job_id: str) -> dict[str, Any]:
    """The KV relay's task: reads the engine's events on the allocation's ipc sockets and
    serves their digests on the `kv` port (caravan_llm/kvrelay).

    It gets the engine key as the engine does: a template reading the replica
    job's own Variable (Nomad's implicit workload access to `nomad/jobs/<job>`
    covers every task of the job); the job carries only the path.
    """
    env = {
        "CARAVAN_KV_RELAY_EVENTS_ENDPOINT": EVENTS_ENDPOINT,
        "CARAVAN_KV_RELAY_REPLAY_ENDPOINT": REPLAY_ENDPOINT,
        "CARAVAN_KV_RELAY_TOPIC": TOPIC,
    }
    if kv_events.max_blocks is not None:
        env["CARAVAN_KV_RELAY_MAX_BLOCKS"] = str(kv_events.max_blocks)
    task: dict[str, Any] = {"Name": RELAY_TASK_NAME, "Driver": kv_events.driver.value}
    if kv_events.driver is Driver.DOCKER:
        # Its own network namespace: listen on every interface of the
        # container, on the port Docker maps the allocated host port to.
        task["Config"] = {
            "image": kv_events.relay_image,
            "args": [
                *RELAY_ARGS,
                "--host",
                "0.0.0.0",  # noqa: S104 - inside the container
                "--port",
                str(kv_events.container_port),
            ],
            "ports": [KV_PORT_LABEL],
        }
        if kv_events.user is not None:
            task["User"] = kv_events.user
    else:
        # On the host: the relay's defaults are NOMAD_IP_kv and NOMAD_PORT_kv.
        task["Config"] = {"command": kv_events.relay_binary, "args": list(RELAY_ARGS)}
    task.update(
        {
            "Env": dict(sorted(env.items())),
            "Resources": {"CPU": kv_events.cpu_mhz, "MemoryMB": kv_events.memory_mb},
            "RestartPolicy": {
                "Attempts": RELAY_RESTART_ATTEMPTS,
                "Interval": _ns(RESTART_INTERVAL_S),
                "Delay": _ns(RELAY_RESTART_DELAY_S),
                "Mode": "delay",
            },
            "KillTimeout": _ns(RELAY_KILL_TIMEOUT_S),
            "KillSignal": "SIGTERM",
            "Templates": [
                _env_template(
                    replica_key_path(job_id), [(RELAY_KEY_ENV, ENGINE_KEY_ITEM)], "engine-key.env"
                )
            ],
        }
    )
    return task


def _lora_env(profile: ModelProfile, adapter: EngineAdapter) -> dict[str, str]:
    """What the engine needs to take adapters at run time, when the profile turns LoRA on."""
    if profile.lora_limits is None:
        return {}
    return dict(adapter.facts.adapters.runtime_env)


def _task(
    profile: ModelProfile, adapter: EngineAdapter, config: ClusterConfig, job_id: str
) -> dict[str, Any]:
    gpu_class = _gpu_class(profile, config)
    task: dict[str, Any] = {
        "Name": TASK_NAME,
        "Driver": adapter.driver(profile).value,
        "Config": adapter.task_config(profile),
        "Env": dict(sorted({**profile.env, **_lora_env(profile, adapter)}.items())),
        "Resources": _resources(profile, adapter, gpu_class),
        "KillTimeout": _ns(KILL_TIMEOUT_S),
        "KillSignal": "SIGTERM",
    }
    templates = _templates(profile, adapter, config, job_id)
    if templates:
        task["Templates"] = templates
    mounts = weights.replica_mounts(profile)
    if mounts is not None:
        if task["Driver"] == Driver.RAW_EXEC.value:
            raise RenderError(
                "weights",
                "the raw_exec driver cannot mount volumes (Nomad has no mounts for it); "
                "set driver: docker",
            )
        task["Env"] = dict(sorted({**task["Env"], **weights.cache_env(profile)}.items()))
        task["VolumeMounts"] = mounts
    return task


def _gpu_class(profile: ModelProfile, config: ClusterConfig) -> GpuClass | None:
    if profile.gpu is None:
        return None
    try:
        return lookup_gpu_class(profile.gpu.gpu_class, config.gpu_catalog)
    except UnknownGpuClassError as exc:
        raise RenderError("gpu.class", str(exc)) from None


def _network(
    profile: ModelProfile, adapter: EngineAdapter, kv_events: KvEventsSettings | None
) -> dict[str, Any]:
    port: dict[str, Any] = {"Label": HTTP_PORT_LABEL}
    container_port = adapter.container_port(profile)
    if container_port is not None:
        port["To"] = container_port
    ports = [port]
    if kv_events is not None:
        kv_port: dict[str, Any] = {"Label": KV_PORT_LABEL}
        if kv_events.driver is Driver.DOCKER:
            kv_port["To"] = kv_events.container_port
        ports.append(kv_port)
    return {"Mode": "host", "DynamicPorts": ports}


def node_pool(profile: ModelProfile, config: ClusterConfig) -> str:
    """The Nomad node pool a replica runs in: the profile's, else the cluster's for its kind."""
    if profile.node_pool is not None:
        return profile.node_pool
    return config.node_pools.gpu if profile.uses_gpu else config.node_pools.cpu


def _job_without_hash(profile: ModelProfile, replica: int, config: ClusterConfig) -> dict[str, Any]:
    if replica < 0:
        raise RenderError("replica", f"replica index must be >= 0, got {replica}")
    if profile.nodes > 1:
        raise RenderError(
            "nodes",
            f"multi-node replicas (nodes: {profile.nodes}) are accepted by the schema "
            "but not supported by rendering yet; use nodes: 1",
        )
    adapter = adapter_for(profile.engine, config)
    gpu_class_name = profile.gpu.gpu_class if profile.gpu is not None else ""
    startup_s = weights.startup_timeout_s(profile, adapter.startup_timeout_s(profile))
    job_id = replica_job_id(profile.name, replica)
    kv_events = config.kv_events if adapter.publishes_kv_events else None
    tasks = [_task(profile, adapter, config, job_id)]
    if kv_events is not None:
        # The engine leads: when it is dead for good, Nomad stops the relay too.
        tasks[0]["Leader"] = True
        tasks.append(_relay_task(kv_events, job_id))
    job: dict[str, Any] = {
        "ID": job_id,
        "Name": job_id,
        "Type": "service",
        "Namespace": config.namespace,
        "Priority": config.priority,
        "Datacenters": list(config.datacenters),
        # CPU replicas stay out of the GPU nodes' pool (cluster_config.NodePools).
        "NodePool": node_pool(profile, config),
        "Meta": {
            JobMetaKey.MODEL: profile.name,
            JobMetaKey.REPLICA: str(replica),
            JobMetaKey.ENGINE: profile.engine.value,
            JobMetaKey.MANAGED_BY: MANAGED_BY_VALUE,
        },
        "Constraints": [_constraint("${attr.kernel.name}", "=", "linux")],
        "Update": {
            "MaxParallel": 1,
            "HealthCheck": "checks",
            "MinHealthyTime": _ns(MIN_HEALTHY_TIME_S),
            "HealthyDeadline": _ns(startup_s),
            "ProgressDeadline": _ns(startup_s + PROGRESS_MARGIN_S),
            "AutoRevert": False,
            "Canary": 0,
        },
        "TaskGroups": [
            {
                "Name": GROUP_NAME,
                "Count": 1,
                "RestartPolicy": {
                    "Attempts": config.restart_attempts,
                    "Interval": _ns(RESTART_INTERVAL_S),
                    "Delay": _ns(config.restart_delay_s),
                    "Mode": "fail",
                },
                "ReschedulePolicy": {
                    "Attempts": 0,
                    "Interval": 0,
                    "Delay": _ns(config.reschedule_delay_s),
                    "DelayFunction": "exponential",
                    "MaxDelay": _ns(RESCHEDULE_MAX_DELAY_S),
                    "Unlimited": True,
                },
                "Migrate": {
                    "MaxParallel": 1,
                    "HealthCheck": "checks",
                    "MinHealthyTime": _ns(MIN_HEALTHY_TIME_S),
                    "HealthyDeadline": _ns(startup_s),
                },
                "EphemeralDisk": {"SizeMB": 300},
                "Networks": [_network(profile, adapter, kv_events)],
                # Nomad deregisters the service, waits this long, then signals
                # the task: routers stop sending and in-flight requests finish.
                "ShutdownDelay": _ns(profile.drain_s),
                "Services": [_service(profile, replica, adapter, config, gpu_class_name)],
                "Tasks": tasks,
            }
        ],
    }
    volumes = weights.replica_volumes(profile)
    if volumes is not None:
        job["TaskGroups"][0]["Volumes"] = volumes
    if config.region is not None:
        job["Region"] = config.region
    return job


def _canonical_json(document: Any) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def spec_hash(profile: ModelProfile, replica: int, config: ClusterConfig | None = None) -> str:
    """The hash of a replica's rendered spec, placement hints excluded."""
    job = _job_without_hash(profile, replica, config or ClusterConfig())
    return hashlib.sha256(_canonical_json(job)).hexdigest()[:SPEC_HASH_LEN]


def _sibling_anti_affinity(hints: PlacementHints) -> dict[str, Any]:
    return {
        "LTarget": "${node.unique.id}",
        "RTarget": ",".join(sorted(hints.sibling_nodes)),
        "Operand": "set_contains_any",
        "Weight": SIBLING_ANTI_AFFINITY_WEIGHT,
    }


def render(
    profile: ModelProfile,
    replica: int,
    hints: PlacementHints = NO_HINTS,
    config: ClusterConfig | None = None,
) -> dict[str, Any]:
    """The `PUT /v1/jobs` body that runs replica `replica` of `profile`."""
    config = config or ClusterConfig()
    job = _job_without_hash(profile, replica, config)
    digest = hashlib.sha256(_canonical_json(job)).hexdigest()[:SPEC_HASH_LEN]
    job["Meta"][JobMetaKey.SPEC_HASH] = digest
    group = job["TaskGroups"][0]
    group["Services"][0]["Meta"][ServiceMetaKey.SPEC_HASH] = digest
    # GPU replicas bin-pack through their device request (Nomad's default
    # scoring); only CPU replicas are kept apart from their siblings.
    if not profile.uses_gpu and hints.sibling_nodes:
        job["Affinities"] = [_sibling_anti_affinity(hints)]
    return {"Job": job}
