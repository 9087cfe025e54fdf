"""The service contract: the names, tags, Meta keys and KV paths both sides rely on.

The scheduler writes these (into rendered Nomad jobs and Consul KV); the router
and the autoscaler read them back (from Consul health entries and KV). Neither
side imports the other, so this module is the only place where the shape of
what crosses Consul is written down. Change it in one place, and both sides
follow.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Generic, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from caravan_llm.common.engine_metrics import MetricNames, metric_names_as_published

# Every model service carries this tag; the router discovers models by it.
SERVICE_TAG = "caravan"
# Routers register themselves under this service name (clients find them by DNS).
ROUTER_SERVICE = "caravan-router"
# The scheduler's own HTTP API registers under this name.
SCHEDULER_SERVICE = "caravan-scheduler"

# Prefix of every Nomad job id caravan owns; only the scheduler writes these.
JOB_PREFIX = "caravan-"
# Prefix of the Consul service of each model.
MODEL_SERVICE_PREFIX = "caravan-"
# Profile names that would collide with caravan's own service names.
RESERVED_MODEL_NAMES = frozenset({"router", "scheduler"})

# A profile name: DNS-safe, and short enough that every derived name stays within
# the 63 characters RFC 1123 and Nomad's service-name rule allow.
MODEL_NAME_MAX_LEN = 40
MODEL_NAME_PATTERN = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")

# The port label of the engine's HTTP listener in every rendered job.
HTTP_PORT_LABEL = "http"
# Router metrics the scheduler's autoscaler reads, one series per model; the
# `model` label holds the served model name (the OpenAI `model` clients send).
ROUTER_QUEUE_DEPTH_METRIC = "caravan_router_queue_depth"
ROUTER_QUEUE_WAIT_METRIC = "caravan_router_queue_wait_seconds"
ROUTER_MODEL_LABEL = "model"

# Task group and task names inside a replica job.
GROUP_NAME = "engine"
TASK_NAME = "engine"


class JobMetaKey:
    """Keys of the Nomad job `Meta` of a replica job."""

    MODEL = "caravan_model"
    REPLICA = "caravan_replica"
    ENGINE = "caravan_engine"
    SPEC_HASH = "caravan_spec_hash"
    MANAGED_BY = "managed_by"


MANAGED_BY_VALUE = "caravan"


class RouterMetaKey:
    """Keys of the Consul service `Meta` of a router."""

    # "host:port" of the listener serving the router's /metrics when that is
    # not its public port: the admin listener (`admin_port`), where a
    # `--workers N` supervisor also merges every worker's metrics.
    METRICS_ADDR = "metrics_addr"


def router_metrics_addr(host: str, port: int) -> str:
    """The `metrics_addr` Meta value of a router whose /metrics is at host:port."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def router_metrics_base_url(address: str, port: int, meta: Mapping[str, str]) -> str | None:
    """Where a registered router's /metrics is: its `metrics_addr`, else its public port.

    None when the Meta value is not a host and port (the router cannot be scraped).
    """
    published = meta.get(RouterMetaKey.METRICS_ADDR)
    if published is None:
        host = f"[{address}]" if ":" in address else address
        return f"http://{host}:{port}"
    host_part, sep, port_part = published.rpartition(":")
    if not sep or not host_part or not port_part.isdigit() or not 0 < int(port_part) < 65536:
        return None
    bare = host_part.removeprefix("[").removesuffix("]")
    if not bare or any(c in bare for c in "/?#@ ") or ("[" in host_part) != (":" in bare):
        return None
    return f"http://{host_part}:{int(port_part)}"


class ServiceMetaKey:
    """Keys of the Consul service `Meta` of a replica (contract 4).

    Consul Meta keys allow letters, digits, `-` and `_` only, and values are
    strings, so lists are comma-separated and numbers are decimal text.
    """

    MODEL = "caravan_model"
    SERVED_MODELS = "served_models"
    ENGINE = "engine"
    REPLICA = "replica"
    GPU_CLASS = "gpu_class"
    CAPACITY = "capacity"
    METRICS_PATH = "metrics_path"
    METRIC_RUNNING = "metric_running"
    METRIC_WAITING = "metric_waiting"
    METRIC_KV_CACHE = "metric_kv_cache"
    SPEC_HASH = "spec_hash"
    ALLOC_ID = "alloc_id"
    # Stream traits (`StreamTraits`): how the router continues a broken stream on
    # this replica. Published by the engine's adapter so the router never keys
    # on engine names.
    COMPLETION_DEFAULT_MAX_TOKENS = "completion_default_max_tokens"
    PREFILL_ECHO = "prefill_echo"
    STREAM_KEEPALIVE = "stream_keepalive"
    # The profile's prefill throughput (tokens/s, `prefill_tokens_per_s`): the
    # router's cost model starts from it until it has measured the replica.
    PREFILL_TOKENS_PER_S = "prefill_tokens_per_s"
    # The OpenAI routes the replica's engine serves (`EngineRoute` names,
    # comma-separated): the router sends a route only to replicas that serve it.
    ROUTES = "routes"


def model_service_name(model_name: str) -> str:
    """The Consul service of a model: `caravan-<name>`."""
    return f"{MODEL_SERVICE_PREFIX}{model_name}"


def replica_job_id(model_name: str, replica: int) -> str:
    """The deterministic Nomad job id of one replica: `caravan-<name>-<replica>`."""
    return f"{JOB_PREFIX}{model_name}-{replica}"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Where caravan keeps its state in Consul KV, under one prefix (contract 2)."""

    prefix: str = "caravan/"

    def __post_init__(self) -> None:
        if not self.prefix.endswith("/") or self.prefix.startswith("/"):
            raise ValueError(f"KV prefix must end with '/' and not start with one: {self.prefix!r}")

    @property
    def models(self) -> str:
        return f"{self.prefix}models/"

    @property
    def state(self) -> str:
        return f"{self.prefix}state/"

    @property
    def demand(self) -> str:
        return f"{self.prefix}demand/"

    @property
    def desired(self) -> str:
        return f"{self.prefix}desired/"

    @property
    def draining(self) -> str:
        return f"{self.prefix}draining/"

    @property
    def leader(self) -> str:
        return f"{self.prefix}leader"

    @property
    def cluster_config(self) -> str:
        """The leading scheduler's cluster config (JSON), so every reader renders alike."""
        return f"{self.prefix}cluster-config"

    @property
    def models_revision(self) -> str:
        """A counter every caravan write of models/ bumps with check-and-set, so two
        submissions validated against the same models cannot both be written."""
        return f"{self.prefix}models-revision"

    def model_key(self, name: str) -> str:
        """The profile of a model (JSON)."""
        return f"{self.models}{name}"

    def state_key(self, name: str) -> str:
        """The autoscaler's memory for a model (JSON; survives restarts)."""
        return f"{self.state}{name}"

    def demand_key(self, name: str) -> str:
        """The router's cold-start demand signal for a model at zero replicas."""
        return f"{self.demand}{name}"

    def draining_key(self, job_id: str) -> str:
        """Marks a replica job as draining: routers stop sending it new requests.

        Consul maintenance mode is local to the agent that registered the
        service (the replica's node), which a central scheduler usually cannot
        reach; a KV marker is seen cluster-wide (ADR 0004).
        """
        return f"{self.draining}{job_id}"

    def desired_key(self, name: str) -> str:
        """The desired replica count of a model (`caravan scale`, the autoscaler)."""
        return f"{self.desired}{name}"

    @property
    def placements(self) -> str:
        return f"{self.prefix}placements/"

    def placements_key(self, name: str) -> str:
        """The live allocations the scheduler placed for a model (JSON `Placements`).

        Written only by the leading scheduler, from what Nomad reports; routers
        accept a Consul service instance only if it is Nomad's registration of
        one of these allocations (endpoint verification, docs/security.md).
        """
        return f"{self.placements}{name}"

    @property
    def adapters(self) -> str:
        return f"{self.prefix}adapters/"

    def adapters_key(self, name: str) -> str:
        """Which LoRA adapters each replica of a model holds (JSON `ModelAdapters`).

        Written only by the leading scheduler, on change, after it loaded and
        unloaded adapters in a pass; routers send `model=<adapter>` to a
        replica whose `loaded` names it.
        """
        return f"{self.adapters}{name}"

    @property
    def adapter_demand(self) -> str:
        return f"{self.prefix}adapter-demand/"

    def adapter_demand_key(self, name: str, router: str) -> str:
        """One router's requests per second for each LoRA adapter of a model.

        Written by each router (`AdapterDemandRecord`), one key per router; the
        scheduler sums the fresh ones into the adapter placement's weights.
        """
        return f"{self.adapter_demand}{name}/{router}"

    @property
    def overrides(self) -> str:
        return f"{self.prefix}override/"

    @property
    def failures(self) -> str:
        return f"{self.prefix}failed/"

    def override_key(self, name: str) -> str:
        """A manual count that the autoscaler holds until it expires (JSON `ScaleOverride`)."""
        return f"{self.overrides}{name}"

    def failure_key(self, name: str) -> str:
        """Why every replica of a model failed for good (JSON `ModelFailure`; scheduler-written)."""
        return f"{self.failures}{name}"

    @property
    def history(self) -> str:
        """Earlier versions of every model's profile: `<prefix>-history/<name>/<version>`.

        Beside the prefix, not under it: the scheduler watches the whole prefix
        with one blocking query, which would otherwise carry every model's
        kept versions on each wake-up. With the default prefix `caravan/`
        this is `caravan-history/`.
        """
        return f"{self.prefix[:-1]}-history/"

    def history_prefix(self, name: str) -> str:
        """The versions of one model's profile (JSON `ProfileVersion` each)."""
        return f"{self.history}{name}/"

    def history_key(self, name: str, version: int) -> str:
        return f"{self.history_prefix(name)}{version}"


# -- placements (contract 5): what the scheduler placed, so routers can verify endpoints ----

# Nomad builds a service ID from the allocation ID, the task name (`group-<group>`
# for a group-level service), the service name and its port label
# (`MakeAllocServiceID` in client/serviceregistration/id.go and
# `WorkloadServices.Name` in workload.go of Nomad's source).
NOMAD_SERVICE_ID_PREFIX = "_nomad-task-"
# Nomad allocation IDs are UUIDs.
ALLOC_ID_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"


# The port label of a replica's KV relay (caravan_llm/kvrelay): the digest
# stream routers read. Its host port is published in the placements.
KV_PORT_LABEL = "kv"


def nomad_service_id(alloc_id: str, model_name: str) -> str:
    """The Consul service ID Nomad registers for a replica allocation's engine service."""
    return (
        f"{NOMAD_SERVICE_ID_PREFIX}{alloc_id}-group-{GROUP_NAME}-"
        f"{model_service_name(model_name)}-{HTTP_PORT_LABEL}"
    )


_Frozen = ConfigDict(frozen=True, extra="forbid")


class PlacedAllocation(BaseModel):
    """One live allocation of a replica job, where Nomad put its engine's HTTP port."""

    model_config = _Frozen

    alloc_id: Annotated[str, StringConstraints(pattern=ALLOC_ID_PATTERN)]
    job_id: Annotated[str, StringConstraints(min_length=1)]
    # The host IP and port Nomad allocated for the `http` label (the address
    # Nomad registers the service with).
    address: Annotated[str, StringConstraints(min_length=1)]
    port: int = Field(ge=1, le=65535)
    # The Nomad node the allocation runs on ("" when Nomad did not say). When
    # several Consul instances carry the allocation's service ID, routers
    # prefer the one registered on the Consul node of this name.
    node: str = ""
    # The host port Nomad allocated for the `kv` label (KV_PORT_LABEL), at
    # `address`: the replica's KV relay, whose digest stream
    # (`GET /v1/kv/stream`, behind the engine key) routers read for exact
    # prefix routing (issue 24). None: the replica publishes no KV events
    # (llama.cpp, or KV events off), and routers keep the approximate index.
    kv_port: int | None = Field(default=None, ge=1, le=65535)


class Placements(BaseModel):
    """The document at `<prefix>placements/<model>`: one model's live, placed allocations."""

    model_config = _Frozen

    model: Annotated[str, StringConstraints(pattern=MODEL_NAME_PATTERN.pattern)]
    allocations: tuple[PlacedAllocation, ...] = ()


class PlacementsError(ValueError):
    """A placements document that cannot be read; the message names the key and the field."""


def encode_placements(placements: Placements) -> str:
    """The JSON the scheduler writes; allocations sorted, so equal sets encode alike."""
    ordered = placements.model_copy(
        update={"allocations": tuple(sorted(placements.allocations, key=lambda a: a.alloc_id))}
    )
    return ordered.model_dump_json()


def decode_placements(raw: bytes | str, *, key: str, model: str) -> Placements:
    """The placements stored at `key`, which must be those of `model`.

    Raises PlacementsError naming the key and the first field in error.
    """
    try:
        placements = Placements.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "document"
        raise PlacementsError(f"{key}: {where}: {first['msg']}") from None
    if placements.model != model:
        raise PlacementsError(f"{key}: model {placements.model!r} does not match its key")
    return placements


# -- engine API keys in Nomad Variables (docs/security.md "Engine API keys") --

# The item that holds the key in each of the variables below.
ENGINE_KEY_ITEM = "api_key"
# The scheduler's one copy per model, read by routers. Under `nomad/jobs/caravan-*`, so the
# scheduler's and router's ACL policies (docs/security.md) cover it, and four levels below
# `nomad/jobs`, deeper than any path Nomad lets a workload read implicitly
# (`nomad/jobs/<job>/<group>/<task>`), so no job can read it by its name.
ENGINE_KEY_PREFIX = "nomad/jobs/caravan-engine-keys/models/"
ENGINE_KEY_LEAF = "/key"


def engine_key_path(model_name: str) -> str:
    """The Nomad Variables path of a model's engine key (scheduler writes, routers read)."""
    return f"{ENGINE_KEY_PREFIX}{model_name}{ENGINE_KEY_LEAF}"


def engine_key_model(path: str) -> str | None:
    """The model whose engine key lives at `path`, or None for any other path."""
    if not path.startswith(ENGINE_KEY_PREFIX) or not path.endswith(ENGINE_KEY_LEAF):
        return None
    model = path[len(ENGINE_KEY_PREFIX) : -len(ENGINE_KEY_LEAF)]
    return model if MODEL_NAME_PATTERN.fullmatch(model) else None


def replica_key_path(job_id: str) -> str:
    """The copy in a replica job's own path, which its task reads with no ACL policy
    (Nomad's implicit workload access to `nomad/jobs/<job_id>`)."""
    return f"nomad/jobs/{job_id}"


# -- one codec per document that crosses Consul (contract 6) ------------------------------
#
# Every document caravan keeps in Consul KV has its codec here, used by its writer
# and by every reader, so the shape and each default live in one place:
#
#   models/<name>        the profile; readers outside the scheduler decode only the
#                        `ModelView` (name, served name); the full profile is
#                        `caravan_llm.scheduler.profiles.ModelProfile`
#   desired/<name>       `encode_desired_count` / `decode_desired_count`
#   demand/<name>        `DemandRecord`, `encode_demand` / `decode_demand`
#   draining/<job-id>    `DrainRecord`, `encode_drain` / `decode_drain`
#   state/<name>         `encode_state` / `decode_state` over a `JsonCodec` of the
#                        autoscaler's memory type (scheduler/autoscale/memory.py)
#   cluster-config       a `JsonCodec` of `caravan_llm.scheduler.cluster_config.ClusterConfig`
#   placements/<name>    `encode_placements` / `decode_placements` (above)
#   adapters/<name>      `ModelAdapters`, `encode_model_adapters` / `decode_model_adapters`
#   adapter-demand/<name>/<router>  `AdapterDemandRecord`, `encode_adapter_demand` /
#                        `decode_adapter_demand`
#   models-revision      `encode_models_revision` / `decode_models_revision`
#
# and, in each replica's Consul service Meta, its metric names:
# `encode_metric_names` (render) / `decode_metric_names` (router, autoscaler).


class ContractError(ValueError):
    """A document read from Consul that does not decode; the message names the key and field.

    Not retryable: the document stays wrong until its writer (or a person) replaces it.
    """

    retryable = False


def _first_problem(key: str, exc: ValidationError) -> ContractError:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return ContractError(f"{key}: not JSON ({first['msg']})")
    where = ".".join(str(part) for part in first["loc"]) or "document"
    return ContractError(f"{key}: {where}: {first['msg']}")


Document = TypeVar("Document", bound=BaseModel)


class JsonCodec(Generic[Document]):
    """The JSON codec of one pydantic document type: `encode` (writer), `decode` (readers)."""

    def __init__(self, document_type: type[Document]) -> None:
        self.document_type = document_type

    def encode(self, document: Document) -> str:
        return document.model_dump_json()

    def decode(self, raw: bytes | str, *, key: str) -> Document:
        """Raises ContractError naming `key` and the first field in error."""
        try:
            return self.document_type.model_validate_json(raw)
        except ValidationError as exc:
            raise _first_problem(key, exc) from None


# -- models/<name>: the profile document, and the part of it every reader shares -----------
#
# The one codec of a profile document, whoever wrote it (`caravan submit`, the
# scheduler's API, `consul kv put @file.yaml`, Terraform's consul_keys): UTF-8
# text holding YAML or JSON (JSON is YAML), one mapping, no key given twice.
# The scheduler validates the mapping as its `ModelProfile`; every other
# reader takes the `ModelView` out of the same mapping, so what the scheduler
# deploys the routers serve.


class ProfileDocumentError(ContractError):
    """A profile document that is no mapping of fields; `problem` says why, in one line."""

    def __init__(self, source: str, problem: str, *, syntax: bool = False) -> None:
        self.source = source
        self.problem = problem
        # True when the text parses as neither JSON nor YAML.
        self.syntax = syntax
        super().__init__(f"{source}: {problem}")


class _ProfileLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping key given twice (PyYAML keeps the last)."""


def _unique_mapping(loader: _ProfileLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str | int | float | bool) and key is not None:
            continue  # an unhashable key: construct_mapping below says so
        line = key_node.start_mark.line + 1
        if key in seen:
            problem = f"line {line}: duplicate key {key!r} (first given on line {seen[key]})"
            raise yaml.constructor.ConstructorError(None, None, problem, key_node.start_mark)
        seen[key] = line
    return loader.construct_mapping(node, deep=True)


_ProfileLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def decode_profile_document(raw: bytes | str, *, source: str) -> dict[str, Any]:
    """The mapping of a profile document; ProfileDocumentError (naming `source`) otherwise."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = raw[exc.start]
            problem = f"not UTF-8 text (byte {bad:#04x} at offset {exc.start})"
            raise ProfileDocumentError(source, problem) from None
    else:
        text = raw
    # JSON by JSON's rules when it is JSON (PyYAML reads YAML 1.1, which differs
    # from JSON in corners such as surrogate-pair escapes), else YAML.
    try:
        document: Any = json.loads(text, object_pairs_hook=_unique_json_object)
    except _DuplicateJsonKey as exc:
        raise ProfileDocumentError(source, f"duplicate key {exc.key!r}") from None
    except RecursionError:
        raise ProfileDocumentError(source, "the document is nested too deeply") from None
    except ValueError:
        document = _yaml_document(text, source)
    if not isinstance(document, dict):
        raise ProfileDocumentError(source, "a profile must be a mapping of fields (got no mapping)")
    return document


class _DuplicateJsonKey(ValueError):
    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(key)


def _unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise _DuplicateJsonKey(key)
        document[key] = value
    return document


def _yaml_document(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_ProfileLoader)  # noqa: S506 - a SafeLoader
    except yaml.constructor.ConstructorError as exc:
        if exc.problem is not None and "duplicate key" in exc.problem:
            raise ProfileDocumentError(source, exc.problem) from None
        raise ProfileDocumentError(source, f"YAML error: {exc.problem}", syntax=True) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = f"YAML syntax error at {where}: {exc.problem}"
        raise ProfileDocumentError(source, problem, syntax=True) from None
    except yaml.YAMLError as exc:
        # One line: a reader error (a control character) says where on a line of its own.
        problem = f"YAML syntax error: {' '.join(str(exc).split())}"
        raise ProfileDocumentError(source, problem, syntax=True) from None
    except RecursionError:
        # A hostile document (thousands of nested lists) is a problem, not a crash.
        raise ProfileDocumentError(source, "the document is nested too deeply") from None
    except (ValueError, TypeError, OverflowError, LookupError, AttributeError) as exc:
        # A scalar PyYAML's own constructors refuse is a YAML error too: they raise
        # ValueError (`2024-02-30`, `!!float x`, 5000 digits), KeyError (`!!bool x`),
        # IndexError (`!!int ''`) and AttributeError (`!!timestamp x`).
        raise ProfileDocumentError(source, f"YAML error: {str(exc)[:200]}", syntax=True) from None


def served_name_of(name: str, served_model_name: str | None) -> str:
    """The OpenAI `model` value clients send for a profile: its `served_model_name`, else its name.

    The one place this default lives; the scheduler's profile and the router's
    view of it both call it.
    """
    return served_model_name or name


def served_name_owners(declared: Mapping[str, tuple[str, int]]) -> dict[str, str]:
    """Which model keeps each served name when several profiles in KV declare it.

    `declared` maps a model to (its served name, its key's CreateIndex). The
    model declared first keeps the name (then the lower name, on a tie); the
    scheduler leaves the others undeployed and the routers ignore them, so both
    agree on who serves it. Answers served name -> owning model.
    """
    owners: dict[str, str] = {}
    for name, (served, _) in sorted(declared.items(), key=lambda item: (item[1][1], item[0])):
        owners.setdefault(served, name)
    return owners


def declared_name_owners(declared: Mapping[str, tuple[tuple[str, ...], int]]) -> dict[str, str]:
    """Which model keeps each OpenAI `model` value when profiles in KV declare it twice.

    `declared` maps a model to (every name it serves: its served name, then its
    LoRA adapters' names; its key's CreateIndex). Models are taken in the order
    they were declared (then by name, on a tie); a model keeps its names only
    if none of them is kept already, so a model that loses one name loses all
    (the scheduler leaves it undeployed; routers ignore it). Answers name ->
    owning model; a model owns its names iff `owners[n] == model` for each.
    With one name per model this is `served_name_owners`.
    """
    owners: dict[str, str] = {}
    for name, (names, _) in sorted(declared.items(), key=lambda item: (item[1][1], item[0])):
        if any(served in owners for served in names):
            continue
        for served in names:
            owners[served] = name
    return owners


class ModelAdapterView(BaseModel):
    """One LoRA adapter of a profile, as readers outside the scheduler see it."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    # The OpenAI `model` value that selects the adapter.
    name: Annotated[str, StringConstraints(min_length=1)]
    # Where it is loaded from (a folder on the nodes, or a Hugging Face id): what a
    # router passes to the engine's load route when it loads it on demand.
    source: str | None = None


class LoraView(BaseModel):
    """A profile's `lora:` limits, as routers read them."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    # Adapters one replica holds at once: a router loading on demand never asks for more.
    max_loras: int = Field(default=4, ge=1)


class ModelView(BaseModel):
    """What a reader outside the scheduler needs from `<prefix>models/<name>`.

    The stored document is the whole profile (`caravan_llm.scheduler.profiles.profile_to_json`,
    or YAML written around caravan); every other field is the scheduler's and is
    ignored here.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: Annotated[str, StringConstraints(pattern=MODEL_NAME_PATTERN.pattern)]
    served_model_name: str | None = None
    # The weights the engine loads (a path on the node or a Hugging Face id).
    model: str | None = None
    # Where a router finds the model's tokenizer (`tokenizer.json`, and
    # `tokenizer_config.json` with its chat template): a local directory on
    # the router's machine. None: the profile's `model` when that is a local
    # directory there; else the router has no tokenizer for the model and
    # keeps the approximate prefix index (issue 24).
    tokenizer: str | None = None
    # The profile's LoRA adapters, each served under its own name with this
    # model as its parent (issue 25); where each is loaded is `adapters/<name>`.
    adapters: tuple[ModelAdapterView, ...] = ()
    # Its LoRA limits (None: the profile has no `lora:` block).
    lora: LoraView | None = None

    @property
    def served_name(self) -> str:
        return served_name_of(self.name, self.served_model_name)

    @property
    def declared_names(self) -> tuple[str, ...]:
        """Every `model` value the profile serves: its served name, then its adapters'."""
        return (self.served_name, *(adapter.name for adapter in self.adapters))


def decode_model_view(raw: bytes | str, *, key: str, model: str) -> ModelView:
    """The view of the profile stored at `key`, which must be that of `model`.

    The document is read by `decode_profile_document`, as the scheduler reads
    it. Raises ContractError naming the key and the first field in error.
    """
    try:
        document = decode_profile_document(raw, source=key)
    except ProfileDocumentError as exc:
        if exc.syntax:
            raise ContractError(f"{key}: not JSON or YAML ({exc.problem})") from None
        raise
    try:
        view = ModelView.model_validate(document)
    except ValidationError as exc:
        raise _first_problem(key, exc) from None
    if view.name != model:
        raise ContractError(f"{key}: name {view.name!r} does not match its key")
    return view


# -- desired/<name> and models-revision: decimal counters ----------------------------------


def _encode_count(value: int, what: str) -> bytes:
    if value < 0:
        raise ValueError(f"{what} must not be negative: {value}")
    return str(value).encode()


def _decode_count(raw: bytes | str, *, key: str, what: str) -> int:
    text = (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw).strip()
    return _decimal(text, f"{key}: {what} is not a non-negative decimal integer")


def _decimal(text: str, problem: str) -> int:
    """The non-negative decimal integer `text` is; ContractError saying `problem` otherwise."""
    if not (text.isascii() and text.isdigit()):
        raise ContractError(problem)
    try:
        return int(text)
    except ValueError:  # more digits than Python converts (4300)
        raise ContractError(problem) from None


def encode_desired_count(count: int) -> bytes:
    """The value of `<prefix>desired/<name>`: the replica count as decimal text."""
    return _encode_count(count, "a desired count")


def decode_desired_count(raw: bytes | str, *, key: str) -> int:
    """Raises ContractError naming the key when the value is not a count."""
    return _decode_count(raw, key=key, what="the desired count")


def encode_models_revision(revision: int) -> bytes:
    """The value of `<prefix>models-revision`: a counter as decimal text."""
    return _encode_count(revision, "the models revision")


def decode_models_revision(raw: bytes | str, *, key: str) -> int:
    """Raises ContractError naming the key when the value is not a counter."""
    return _decode_count(raw, key=key, what="the models revision")


# -- demand/<name>: a router's cold-start demand --------------------------------------------


class DemandRecord(BaseModel):
    """A router saw requests for a model with no ready replica (written by routers)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    # Wall-clock time of the write (Unix seconds).
    at: float = Field(allow_inf_nan=False)
    # Requests waiting at that router when it wrote.
    waiting: int = Field(default=1, ge=0)
    # Which router wrote it ("" when the writer did not say).
    router: str = ""


_DEMAND = JsonCodec(DemandRecord)


def encode_demand(record: DemandRecord) -> str:
    return _DEMAND.encode(record)


def decode_demand(raw: bytes | str, *, key: str) -> DemandRecord:
    """Raises ContractError naming the key and the first field in error."""
    return _DEMAND.decode(raw, key=key)


# -- draining/<job-id>: a replica being drained ----------------------------------------------


class DrainRecord(BaseModel):
    """A replica being drained before its job is stopped (written by the leading scheduler).

    Routers act on the key alone (no new requests to that job); the record says
    why and until when, for the scheduler and for people.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    model: Annotated[str, StringConstraints(min_length=1)]
    # Wall-clock time the drain began (Unix seconds).
    since: float = Field(allow_inf_nan=False)
    # How long in-flight requests may run on before the job is stopped.
    drain_s: float = Field(ge=0, allow_inf_nan=False)
    reason: str = ""


_DRAIN = JsonCodec(DrainRecord)


def encode_drain(record: DrainRecord) -> str:
    return _DRAIN.encode(record)


def decode_drain(raw: bytes | str, *, key: str) -> DrainRecord:
    """Raises ContractError naming the key and the first field in error."""
    return _DRAIN.decode(raw, key=key)


# -- service Meta: a replica's metric names ---------------------------------------------------


def encode_metric_names(names: MetricNames) -> dict[str, str]:
    """The service Meta entries stating a replica's metric names ("" = not exposed).

    The scheduler renders them complete (engine defaults and the profile's
    override already applied), so a reader finds every name stated.
    """
    return {
        ServiceMetaKey.METRIC_RUNNING: names.running or "",
        ServiceMetaKey.METRIC_WAITING: names.waiting or "",
        ServiceMetaKey.METRIC_KV_CACHE: names.kv_cache_usage or "",
    }


def decode_metric_names(meta: Mapping[str, object]) -> MetricNames:
    """The metric names a replica's Meta states, read the same by the router and the autoscaler.

    Read as written: the scheduler resolves a profile's mapping against its
    engine's own names once, when it renders the job (`encode_metric_names`),
    so readers never fill blanks themselves. Absent, empty or non-string
    values are "not exposed".
    """

    def text(key: str) -> str | None:
        value = meta.get(key)
        return value if isinstance(value, str) and value else None

    return metric_names_as_published(
        running=text(ServiceMetaKey.METRIC_RUNNING),
        waiting=text(ServiceMetaKey.METRIC_WAITING),
        kv_cache_usage=text(ServiceMetaKey.METRIC_KV_CACHE),
    )


class ContractDecodeError(ContractError):
    """A KV document of the contract could not be read; says which field is wrong."""


def _json_object(raw: bytes | str, what: str) -> dict[str, Any]:
    try:
        document = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ContractDecodeError(f"{what}: not JSON ({str(exc)[:200]})") from None
    except RecursionError:
        raise ContractDecodeError(f"{what}: not JSON (nested too deeply)") from None
    if not isinstance(document, dict):
        raise ContractDecodeError(f"{what}: not a JSON object")
    return document


def _number(document: dict[str, Any], key: str, what: str) -> float:
    value = document.get(key)
    problem = f"{what}: {key} must be a finite number, got {repr(value)[:100]}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ContractDecodeError(problem)
    try:
        number = float(value)
    except OverflowError:  # an integer past the float range
        raise ContractDecodeError(problem) from None
    if not math.isfinite(number):
        raise ContractDecodeError(problem)
    return number


@dataclass(frozen=True, slots=True)
class ScaleOverride:
    """`caravan scale NAME N` on an autoscaled model: hold `count` until `until`.

    Times are wall-clock Unix seconds: the override is written by the CLI or
    the API and read by whichever scheduler leads, possibly on another host.
    """

    count: int
    until: float
    set_at: float

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")
        if not self.until >= self.set_at:
            raise ValueError(f"until ({self.until}) must not be before set_at ({self.set_at})")

    def in_force(self, now: float) -> bool:
        return now < self.until

    def encode(self) -> bytes:
        document = {"count": self.count, "until": self.until, "set_at": self.set_at}
        return json.dumps(document, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> ScaleOverride:
        what = "scale override"
        document = _json_object(raw, what)
        count = document.get("count")
        if isinstance(count, bool) or not isinstance(count, int):
            raise ContractDecodeError(f"{what}: count must be an integer, got {count!r}")
        try:
            return cls(
                count=count,
                until=_number(document, "until", what),
                set_at=_number(document, "set_at", what),
            )
        except ValueError as exc:
            raise ContractDecodeError(f"{what}: {exc}") from None


# A failure reason is shown to API clients and in `caravan status`; a bound
# keeps one odd task event from making the document large.
MAX_FAILURE_REASON_CHARS = 500


@dataclass(frozen=True, slots=True)
class ModelFailure:
    """Every replica of a model failed in a way that needs a change to recover.

    The scheduler writes it (it observes Nomad) and deletes it when a change
    clears it; routers answer requests for the model with a 503 naming
    `reason` instead of holding them. `since` is wall-clock Unix seconds.
    """

    reason: str
    since: float

    def __post_init__(self) -> None:
        if not self.reason:
            raise ValueError("reason must not be empty")

    def encode(self) -> bytes:
        reason = self.reason[:MAX_FAILURE_REASON_CHARS]
        return json.dumps({"reason": reason, "since": self.since}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> ModelFailure:
        what = "model failure"
        document = _json_object(raw, what)
        reason = document.get("reason")
        if not isinstance(reason, str) or not reason:
            raise ContractDecodeError(f"{what}: reason must be a non-empty string")
        return cls(reason=reason[:MAX_FAILURE_REASON_CHARS], since=_number(document, "since", what))


# -- stream traits (contract 4): what the router must know to continue a stream --

# The OpenAI completions default for `max_tokens`, which engines that follow the
# API keep when a request leaves it out.
OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class StreamTraits:
    """How an engine takes a continuation of a stream another replica started.

    `completion_default_max_tokens`: the `max_tokens` a completions request
    without one gets (None: no limit), so a continuation states what is left of
    it. `echoes_prefill`: the engine may repeat a partial assistant message at
    the start of its first delta, which the router then cuts.
    `keeps_stream_connections`: the engine keeps a connection open for the next
    request after a streamed answer, as HTTP/1.1 keep-alive says; when it
    closes it instead (without saying so), the router closes its end after
    every stream rather than pool a connection the next request would fail on.
    """

    completion_default_max_tokens: int | None = OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS
    echoes_prefill: bool = False
    keeps_stream_connections: bool = True


# What a replica that publishes no traits is taken to do: follow the OpenAI API.
OPENAI_STREAM_TRAITS = StreamTraits()


class StreamTraitsError(ValueError):
    """Service Meta whose stream traits cannot be read; the message names the key."""


def encode_stream_traits(traits: StreamTraits) -> dict[str, str]:
    """The service Meta entries of `traits` (Meta values are strings; "" is no limit).

    `stream_keepalive` is written only when false (its default is true), so that
    the Meta, and with it the spec hash, of every engine that keeps its
    connections stays as it was before the key existed: no replica rolls for it.
    """
    limit = traits.completion_default_max_tokens
    meta = {
        ServiceMetaKey.COMPLETION_DEFAULT_MAX_TOKENS: "" if limit is None else str(limit),
        ServiceMetaKey.PREFILL_ECHO: "true" if traits.echoes_prefill else "false",
    }
    if not traits.keeps_stream_connections:
        meta[ServiceMetaKey.STREAM_KEEPALIVE] = "false"
    return meta


def decode_stream_traits(meta: Mapping[str, object]) -> StreamTraits:
    """The traits a replica's Meta publishes; a key left out takes the OpenAI default.

    Raises StreamTraitsError naming the key when a value is not one the
    scheduler writes.
    """
    limit_key, echo_key = ServiceMetaKey.COMPLETION_DEFAULT_MAX_TOKENS, ServiceMetaKey.PREFILL_ECHO
    limit: int | None = OPENAI_STREAM_TRAITS.completion_default_max_tokens
    if limit_key in meta:
        raw = meta[limit_key]
        if raw == "":
            limit = None
        else:
            problem = f"Meta.{limit_key} must be a positive integer or empty: {repr(raw)[:200]}"
            try:
                limit = _decimal(raw, problem) if isinstance(raw, str) else 0
            except ContractError:
                raise StreamTraitsError(problem) from None
            if limit <= 0:
                raise StreamTraitsError(problem)
    echo = _meta_flag(meta, echo_key, default=OPENAI_STREAM_TRAITS.echoes_prefill)
    keeps = _meta_flag(
        meta,
        ServiceMetaKey.STREAM_KEEPALIVE,
        default=OPENAI_STREAM_TRAITS.keeps_stream_connections,
    )
    return StreamTraits(
        completion_default_max_tokens=limit, echoes_prefill=echo, keeps_stream_connections=keeps
    )


def _meta_flag(meta: Mapping[str, object], key: str, *, default: bool) -> bool:
    """A "true"/"false" Meta value; `default` when left out; StreamTraitsError otherwise."""
    if key not in meta:
        return default
    raw = meta[key]
    if not isinstance(raw, str) or raw not in {"true", "false"}:
        raise StreamTraitsError(f"Meta.{key} must be true or false: {raw!r}")
    return raw == "true"


class PrefillRateError(ValueError):
    """Service Meta whose prefill rate cannot be read; the message names the key."""


def encode_prefill_rate(tokens_per_s: int | None) -> dict[str, str]:
    """The service Meta entry of a declared prefill rate (none when not declared)."""
    if tokens_per_s is None:
        return {}
    return {ServiceMetaKey.PREFILL_TOKENS_PER_S: str(tokens_per_s)}


def decode_prefill_rate(meta: Mapping[str, object]) -> int | None:
    """The prefill rate a replica's Meta declares, tokens/s; None when it declares none.

    Raises PrefillRateError naming the key when the value is not a positive integer.
    """
    raw = meta.get(ServiceMetaKey.PREFILL_TOKENS_PER_S)
    if raw is None:
        return None
    problem = (
        f"Meta.{ServiceMetaKey.PREFILL_TOKENS_PER_S} must be a positive integer: {repr(raw)[:200]}"
    )
    try:
        rate = _decimal(raw, problem) if isinstance(raw, str) else 0
    except ContractError:
        raise PrefillRateError(problem) from None
    if rate <= 0:
        raise PrefillRateError(problem)
    return rate


# -- service Meta: the routes a replica's engine serves ------------------------------------


class EngineRoute(StrEnum):
    """An OpenAI-compatible route an engine may serve; the value is its name in Meta.

    `engine_path` is where every engine that serves the route answers it (the
    three engines caravan runs agree on these paths).
    """

    CHAT_COMPLETIONS = "chat_completions"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"
    MESSAGES = "messages"
    RERANK = "rerank"
    SCORE = "score"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    # Anthropic's token counting: the prompt tokens of a /v1/messages body.
    MESSAGES_COUNT_TOKENS = "messages_count_tokens"
    # vLLM's pooling routes (mounted only for a pooling or classification model).
    POOLING = "pooling"
    CLASSIFY = "classify"

    @property
    def engine_path(self) -> str:
        return _ENGINE_PATHS[self]


_ENGINE_PATHS: Mapping[EngineRoute, str] = {
    EngineRoute.CHAT_COMPLETIONS: "/v1/chat/completions",
    EngineRoute.COMPLETIONS: "/v1/completions",
    EngineRoute.EMBEDDINGS: "/v1/embeddings",
    EngineRoute.RESPONSES: "/v1/responses",
    EngineRoute.MESSAGES: "/v1/messages",
    EngineRoute.RERANK: "/v1/rerank",
    EngineRoute.SCORE: "/v1/score",
    # vLLM and llama-server serve these without the /v1 prefix only; SGLang serves both.
    EngineRoute.TOKENIZE: "/tokenize",
    EngineRoute.DETOKENIZE: "/detokenize",
    EngineRoute.MESSAGES_COUNT_TOKENS: "/v1/messages/count_tokens",
    EngineRoute.POOLING: "/pooling",
    EngineRoute.CLASSIFY: "/classify",
}

# What a replica that publishes no routes is taken to serve: the routes every
# router forwarded before replicas published theirs.
DEFAULT_ENGINE_ROUTES = frozenset(
    {EngineRoute.CHAT_COMPLETIONS, EngineRoute.COMPLETIONS, EngineRoute.EMBEDDINGS}
)


class EngineRoutesError(ValueError):
    """Service Meta whose routes cannot be read; the message names the key and the value."""


def encode_engine_routes(routes: frozenset[EngineRoute]) -> dict[str, str]:
    """The service Meta entry of the routes an engine serves (sorted, comma-separated)."""
    return {ServiceMetaKey.ROUTES: ",".join(sorted(route.value for route in routes))}


def decode_engine_routes(meta: Mapping[str, object]) -> frozenset[EngineRoute]:
    """The routes a replica's Meta publishes; `DEFAULT_ENGINE_ROUTES` when it publishes none.

    A name this version does not know is skipped (a newer scheduler may publish
    more routes than this router forwards); raises EngineRoutesError naming the
    key when the value is not a comma-separated list.
    """
    raw = meta.get(ServiceMetaKey.ROUTES)
    if raw is None:
        return DEFAULT_ENGINE_ROUTES
    if not isinstance(raw, str):
        raise EngineRoutesError(f"Meta.{ServiceMetaKey.ROUTES} must be a string: {raw!r}")
    names = [name.strip() for name in raw.split(",")] if raw.strip() else []
    if any(not name for name in names):
        raise EngineRoutesError(
            f"Meta.{ServiceMetaKey.ROUTES} must be comma-separated route names: {raw[:200]!r}"
        )
    known = {route.value: route for route in EngineRoute}
    return frozenset(known[name] for name in names if name in known)


# -- adapters/<name>: the LoRA adapters each replica holds (issue 25) ------------------------
#
# KV, not the service's Meta: Nomad writes a service's Meta from the job spec, so
# a change there would re-register (restart) the replica, while adapters are
# loaded and unloaded at run time. One writer (the leading scheduler, on change);
# routers read it with the placements (blocking queries under the prefix).


class ReplicaAdapters(BaseModel):
    """What one replica allocation holds now, and what the plan wants it to hold."""

    model_config = _Frozen

    alloc_id: Annotated[str, StringConstraints(pattern=ALLOC_ID_PATTERN)]
    job_id: Annotated[str, StringConstraints(min_length=1)]
    # The adapters the engine lists as loaded (after this pass's loads and
    # unloads): where routers send `model=<adapter>`.
    loaded: tuple[str, ...] = ()
    # The adapters the scheduler's plan wants it to hold (scheduler/lora/plan.py).
    desired: tuple[str, ...] = ()


class AdapterFailure(BaseModel):
    """An adapter the engine refused to load, with its answer (a bad path: vLLM's 404)."""

    model_config = _Frozen

    adapter: Annotated[str, StringConstraints(min_length=1)]
    source: str
    # The replica job that refused it, and the engine's answer (status and message).
    job_id: str
    reason: str
    # Wall-clock time of the first refusal of this source (Unix seconds).
    since: float = Field(allow_inf_nan=False)


class ModelAdapters(BaseModel):
    """The document at `<prefix>adapters/<model>`: the adapters of one model's replicas."""

    model_config = _Frozen

    model: Annotated[str, StringConstraints(pattern=MODEL_NAME_PATTERN.pattern)]
    replicas: tuple[ReplicaAdapters, ...] = ()
    # Adapters that failed to load; the scheduler retries them later.
    failed: tuple[AdapterFailure, ...] = ()
    # Adapters the replicas' slots (lora.max_loras) left out of the plan.
    unplaced: tuple[str, ...] = ()
    # How a request names an adapter on this model's engine: `{adapter}` the
    # adapter's name (vLLM), `{served}:{adapter}` (SGLang), with `{served}` the
    # model's served name: what a router puts in `model` when it forwards.
    request_model: str = "{adapter}"
    # The engine's routes that load (`{"lora_name", "lora_path"}`) and unload
    # (`{"lora_name"}`) an adapter at run time, behind its API key: what a router
    # calls to load an adapter held nowhere on demand. None: the engine takes its
    # adapters at start only (routers never load).
    load_path: str | None = None
    unload_path: str | None = None

    def holders(self, adapter: str) -> tuple[str, ...]:
        """The allocations that hold `adapter` now (their `loaded` names it)."""
        return tuple(r.alloc_id for r in self.replicas if adapter in r.loaded)


_ADAPTERS = JsonCodec(ModelAdapters)


def encode_model_adapters(document: ModelAdapters) -> str:
    """The JSON the scheduler writes: everything sorted, so equal states encode alike."""
    ordered = document.model_copy(
        update={
            "replicas": tuple(
                r.model_copy(
                    update={"loaded": tuple(sorted(r.loaded)), "desired": tuple(sorted(r.desired))}
                )
                for r in sorted(document.replicas, key=lambda r: r.alloc_id)
            ),
            "failed": tuple(sorted(document.failed, key=lambda f: (f.adapter, f.job_id))),
            "unplaced": tuple(sorted(document.unplaced)),
        }
    )
    return _ADAPTERS.encode(ordered)


def decode_model_adapters(raw: bytes | str, *, key: str, model: str) -> ModelAdapters:
    """The adapters document at `key`, which must be that of `model`.

    Raises ContractError naming the key and the first field in error.
    """
    document = _ADAPTERS.decode(raw, key=key)
    if document.model != model:
        raise ContractError(f"{key}: model {document.model!r} does not match its key")
    return document


# -- adapter-demand/<name>/<router>: how much each adapter is asked for (issue 25) ----------
#
# One key per router and model (several routers never overwrite each other),
# rewritten every few seconds while the router serves the model's adapters. The
# scheduler sums the records written within its freshness window into the
# placement's demand (`caravan_llm.scheduler.lora.plan.AdapterDemand`).


class AdapterDemandRecord(BaseModel):
    """One router's requests per second for each adapter of one model."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    # Wall-clock time of the write (Unix seconds).
    at: float = Field(allow_inf_nan=False)
    # Which router wrote it.
    router: str = ""
    # Adapter name -> requests per second over the router's window (absent: none seen).
    requests_per_s: dict[str, Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(
        default_factory=dict
    )


_ADAPTER_DEMAND = JsonCodec(AdapterDemandRecord)


def encode_adapter_demand(record: AdapterDemandRecord) -> str:
    return _ADAPTER_DEMAND.encode(record)


def decode_adapter_demand(raw: bytes | str, *, key: str) -> AdapterDemandRecord:
    """Raises ContractError naming the key and the first field in error."""
    return _ADAPTER_DEMAND.decode(raw, key=key)
