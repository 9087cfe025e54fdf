"""The model profile: what a user writes to say "serve this model like this".

A profile is a YAML or JSON file validated here. It is frozen and rejects
unknown keys, so a typo is an error rather than a silently ignored setting.
Every rule that involves more than one field is checked here too, and each
error names the field it is about, so `caravan validate` can say exactly what
to fix. Loading never touches Nomad or Consul: a profile that fails
validation is never half-applied.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from caravan_llm.common.contract import (
    JOB_PREFIX,
    MODEL_NAME_MAX_LEN,
    MODEL_NAME_PATTERN,
    RESERVED_MODEL_NAMES,
    ProfileDocumentError,
    decode_profile_document,
    served_name_of,
)
from caravan_llm.scheduler.engines.base import Driver, EngineAdapter, resolve_metrics
from caravan_llm.scheduler.engines.registry import Engine, adapter_for, engine_key_env_names
from caravan_llm.scheduler.lora.profile import (
    LoraAdapter,
    LoraLimits,
    check_adapter_list,
    check_adapters,
)
from caravan_llm.scheduler.weights_cache import WeightsCache, check_weights

_FROZEN = ConfigDict(frozen=True, extra="forbid")

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A Nomad Variables path (`structs.ValidatePath`) and a template-safe item name.
_VARIABLE_PATH = re.compile(r"^[a-zA-Z0-9\-_~/]{1,128}$")
_ITEM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The variables that carry an engine's own API key (rendered by caravan), of every engine.
ENGINE_KEY_ENV_NAMES = engine_key_env_names()
# Re-exported: profiles name these, and callers have always imported them from here.
__all__ = ["Driver", "Engine"]


class SecretRef(BaseModel):
    """A secret by reference: the item `item` of the Nomad Variable at `path`."""

    model_config = _FROZEN

    path: str
    item: str

    @classmethod
    def parse(cls, env_name: str, reference: str) -> SecretRef:
        """`path[#item]`; the item defaults to the variable's name (`HF_TOKEN`)."""
        path, _, item = reference.partition("#")
        path, item = path.strip().strip("/"), item.strip() or env_name
        if not _VARIABLE_PATH.fullmatch(path) or path == "nomad":
            raise ValueError(
                f"secrets.{env_name}: {path!r} is not a Nomad Variables path "
                "(letters, digits, - _ ~ /, at most 128 characters)"
            )
        parts = path.split("/")
        if parts[0] == "nomad" and parts[1:2] != ["jobs"]:
            raise ValueError(f"secrets.{env_name}: under nomad/ only nomad/jobs... holds variables")
        # nomad/jobs/caravan*: the engine keys and the control plane's own variables.
        if parts[0] == "nomad" and parts[2:3] and parts[2].startswith(JOB_PREFIX.rstrip("-")):
            raise ValueError(
                f"secrets.{env_name}: {path!r} is caravan's own (engine keys, the control "
                "plane's tokens); a profile may not read it"
            )
        if not _ITEM_NAME.fullmatch(item):
            raise ValueError(
                f"secrets.{env_name}: item {item!r} must be letters, digits and _ "
                "(not starting with a digit)"
            )
        return cls(path=path, item=item)


# Nomad's rule for node pool names (nomad/structs/node_pool.go).
_NODE_POOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")


def check_node_pool_name(name: str) -> str:
    """A Nomad node pool name, as Nomad accepts it; ValueError naming the value otherwise."""
    if not _NODE_POOL_NAME.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a valid Nomad node pool name: use 1 to 128 letters, "
            "digits, '-' or '_' (for example 'gpu')"
        )
    return name


class GpuRequest(BaseModel):
    """GPUs per replica, by class from the GPU class catalog."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    gpu_class: str = Field(alias="class", min_length=1)
    count: int = Field(default=1, ge=1, le=64)
    # vLLM normally uses exactly `tensor_parallel` GPUs per node; set this to
    # say that a different count is deliberate (for example spare memory for
    # a draft model).
    allow_count_mismatch: bool = False


class Replicas(BaseModel):
    """How many replicas: bounds for scaling and the count to start with."""

    model_config = _FROZEN

    min: int = Field(default=1, ge=0)
    max: int = Field(default=1, ge=1)
    initial: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _bounds_are_ordered(self) -> Self:
        if self.min > self.max:
            raise ValueError(f"replicas.min ({self.min}) must be <= replicas.max ({self.max})")
        start = self.start
        if not self.min <= start <= self.max:
            raise ValueError(
                f"replicas.initial ({start}) must lie between replicas.min ({self.min}) "
                f"and replicas.max ({self.max})"
            )
        return self

    @property
    def start(self) -> int:
        """The count to start with: `initial`, else `min` but at least one."""
        if self.initial is not None:
            return self.initial
        return max(self.min, 1)


class Resources(BaseModel):
    """CPU and memory reserved for one replica's engine task on its node."""

    model_config = _FROZEN

    cpu_mhz: int | None = Field(default=None, ge=1)
    cores: int | None = Field(default=None, ge=1)
    memory_mb: int | None = Field(default=None, ge=10)

    @model_validator(mode="after")
    def _cpu_or_cores(self) -> Self:
        # Nomad refuses a task that asks for both ("Task can only ask for
        # 'cpu' or 'cores' resource, not both.").
        if self.cpu_mhz is not None and self.cores is not None:
            raise ValueError("resources: set either cpu_mhz or cores, not both")
        return self


class MetricsOverride(BaseModel):
    """Which Prometheus metrics of the engine say running, waiting and KV-cache use.

    The per-profile override of the engine's default mapping. An empty
    mapping means the engine's own names; a mapping that names its own `running`
    metric is a complete statement, so the fields it leaves out stay unset.
    """

    model_config = _FROZEN

    path: str = Field(default="/metrics", pattern=r"^/")
    running: str | None = None
    waiting: str | None = None
    kv_cache_usage: str | None = None


class Autoscaling(BaseModel):
    """The scaling policy of one model (used by the autoscaler in the scheduler).

    Targets are per replica. `target_inflight` is running + waiting requests
    per replica; `target_kv_cache` is the KV-cache use (0..1) per replica,
    for engines that report it.
    """

    model_config = _FROZEN

    enabled: bool = True
    target_inflight: float | None = Field(default=None, gt=0)
    target_kv_cache: float | None = Field(default=None, gt=0, le=1)
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    scale_up_window_s: float = Field(default=15, ge=0)
    scale_down_window_s: float = Field(default=300, ge=0)
    max_step_up: int | None = Field(default=None, ge=1)
    max_step_down: int | None = Field(default=None, ge=1)
    scale_to_zero_after_s: float | None = Field(default=None, gt=0)
    evaluation_interval_s: float = Field(default=5, gt=0)

    @model_validator(mode="after")
    def _has_a_target(self) -> Self:
        if self.enabled and self.target_inflight is None and self.target_kv_cache is None:
            raise ValueError(
                "autoscaling: set target_inflight and/or target_kv_cache "
                "(or enabled: false to keep the count manual)"
            )
        return self


class ModelProfile(BaseModel):
    """One model served by caravan: engine, model, GPUs, replicas and tuning."""

    model_config = _FROZEN

    name: str = Field(min_length=1, max_length=MODEL_NAME_MAX_LEN)
    model: str = Field(min_length=1)
    served_model_name: str | None = Field(default=None, min_length=1)
    engine: Engine
    gpu: GpuRequest | None = None
    tensor_parallel: int = Field(default=1, ge=1, le=64)
    nodes: int = Field(default=1, ge=1)
    replicas: Replicas = Field(default_factory=Replicas)
    resources: Resources = Field(default_factory=Resources)
    # Concurrent sequences per replica: vLLM --max-num-seqs, llama.cpp --parallel.
    max_concurrency: int | None = Field(default=None, ge=1)
    # Context window: vLLM --max-model-len, llama.cpp --ctx-size.
    context_length: int | None = Field(default=None, ge=16)
    # Prompt tokens per second one replica prefills (measured on its hardware):
    # routers start their cost model from it until they have measured the
    # replica themselves. None: the engine's built-in default.
    prefill_tokens_per_s: int | None = Field(default=None, ge=1, le=100_000_000)
    # A local directory with the model's `tokenizer.json` (and
    # `tokenizer_config.json`, its chat template) on the routers' machines:
    # routers tokenize prompts with it for exact prefix routing on the
    # engines' KV events. None: the `model` directory when routers can read it.
    tokenizer: str | None = Field(default=None, min_length=1)
    # How long a replica may take to load its model before Nomad gives up on it.
    startup_timeout_s: int | None = Field(default=None, ge=10)
    # How long routers get to drain a replica before its engine is stopped.
    drain_s: int = Field(default=10, ge=0, le=3600)
    driver: Driver | None = None
    image: str | None = Field(default=None, min_length=1)
    # Nomad node pool of the replicas (Nomad 1.6+); default from the cluster config.
    node_pool: str | None = None
    engine_args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    # Environment variables filled from Nomad Variables at task start:
    # NAME -> "path[#item]". The job spec carries only the reference.
    secrets: dict[str, str] = Field(default_factory=dict)
    autoscaling: Autoscaling | None = None
    metrics: MetricsOverride | None = None
    # Where the weights live (a Nomad host or CSI volume) and an optional prefetch.
    weights: WeightsCache | None = None
    # LoRA adapters served as models of their own, and the limits of a replica
    # (scheduler/lora/profile.py). LoRA is on when either is given.
    adapters: tuple[LoraAdapter, ...] = ()
    lora: LoraLimits | None = None

    @field_validator("name")
    @classmethod
    def _name_is_dns_safe(cls, name: str) -> str:
        if not MODEL_NAME_PATTERN.fullmatch(name):
            raise ValueError(
                f"{name!r} is not DNS-safe: use lowercase letters, digits and hyphens, "
                "starting and ending with a letter or digit (for example 'qwen2-5-7b')"
            )
        if name in RESERVED_MODEL_NAMES:
            raise ValueError(f"{name!r} is reserved for caravan's own services")
        return name

    @field_validator("node_pool")
    @classmethod
    def _node_pool_is_valid(cls, node_pool: str | None) -> str | None:
        return None if node_pool is None else check_node_pool_name(node_pool)

    @field_validator("env")
    @classmethod
    def _env_names_are_valid(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return env

    @field_validator("secrets")
    @classmethod
    def _secrets_are_references(cls, secrets: dict[str, str]) -> dict[str, str]:
        for name, reference in secrets.items():
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"secrets: {name!r} is not a valid environment variable name")
            if name in ENGINE_KEY_ENV_NAMES:
                raise ValueError(
                    f"secrets: {name} carries the engine's API key, which caravan manages"
                )
            SecretRef.parse(name, reference)
        return secrets

    def secret_refs(self) -> dict[str, SecretRef]:
        """The secrets, parsed (validated when the profile was built)."""
        return {
            name: SecretRef.parse(name, reference)
            for name, reference in sorted(self.secrets.items())
        }

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Self:
        clash = sorted(set(self.env) & set(self.secrets))
        if clash:
            raise ValueError(f"env and secrets both set {', '.join(clash)}; keep one")
        check_adapter_list(self.adapters, self.served_name)
        policy = self.autoscaling
        if (
            policy is not None
            and policy.scale_to_zero_after_s is not None
            and self.replicas.min != 0
        ):
            raise ValueError(
                "autoscaling.scale_to_zero_after_s requires replicas.min: 0 "
                f"(replicas.min is {self.replicas.min})"
            )
        return self

    @property
    def served_name(self) -> str:
        """The OpenAI `model` value clients send: `served_model_name`, else `name`."""
        return served_name_of(self.name, self.served_model_name)

    @property
    def uses_gpu(self) -> bool:
        return self.gpu is not None

    @property
    def lora_limits(self) -> LoraLimits | None:
        """The LoRA limits in force when LoRA is on (adapters or a `lora:` block), else None."""
        if self.lora is not None:
            return self.lora
        return LoraLimits() if self.adapters else None

    @property
    def declared_names(self) -> tuple[str, ...]:
        """Every OpenAI `model` value this profile serves: its served name, then its adapters."""
        return (self.served_name, *(adapter.name for adapter in self.adapters))


def check_engine_rules(profile: ModelProfile) -> None:
    """The rules a profile's engine adds (its adapter's); raises ValueError naming the field.

    Kept out of `ModelProfile`'s validators: the schema is the engine-agnostic
    shape, and every loader below applies these rules to what it validated.
    """
    adapter = adapter_for(profile.engine)
    facts = adapter.facts
    adapter.check_profile(profile)
    # Flags caravan renders itself: a profile may not set them through
    # `engine_args`, because two values for one flag would make the engine's
    # behaviour depend on argument order, and the router and autoscaler read
    # these values from the profile.
    for arg in profile.engine_args:
        flag = arg.split("=", 1)[0]
        if facts.kv_events is not None and _reads_as(adapter, flag, facts.kv_events.flag):
            raise ValueError(
                f"engine_args: {flag} is set by caravan (the cluster config's kv_events): "
                "the engine's KV events carry token ids and stay inside the allocation"
            )
        if flag in facts.managed_flags:
            raise ValueError(
                f"engine_args: {flag} is set by caravan from the profile; "
                "use the profile field instead (model, served_model_name, tensor_parallel, "
                "max_concurrency, context_length, adapters, lora)"
            )
    policy = profile.autoscaling
    reports_kv_cache = resolve_metrics(facts.metrics, profile.metrics).kv_cache_usage is not None
    if policy is not None and policy.target_kv_cache is not None and not reports_kv_cache:
        raise ValueError(
            f"autoscaling.target_kv_cache: engine {profile.engine.value!r} reports no KV-cache "
            "usage metric (and metrics.kv_cache_usage names none); use target_inflight"
        )
    if profile.weights is not None:
        check_weights(profile.weights, profile.model, profile.env, facts)
    check_adapters(profile.adapters, profile.lora, weights=profile.weights, facts=facts)


def _reads_as(adapter: EngineAdapter, arg: str, flag: str) -> bool:
    """Whether the engine's parser reads `arg` as `flag` (spelling, or a prefix it takes)."""
    if not arg.startswith("--"):
        return False
    read = adapter.normalise_flag(arg)
    prefix = adapter.facts.abbreviates_flags and len(read) > len("--x") and flag.startswith(read)
    return read == flag or prefix


class ProfileError(ValueError):
    """A profile file could not be read or is invalid; `problems` are one line each."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


def _printable(text: str) -> str:
    """`text` with line breaks and other control characters escaped: a problem is one line."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _format_location(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif parts:
            parts.append(f".{_printable(item)}")
        else:
            parts.append(_printable(str(item)))
    return "".join(parts)


def describe_validation_error(error: ValidationError) -> list[str]:
    """One line per problem, each starting with the field it is about."""
    problems = []
    for item in error.errors(include_url=False):
        # pydantic locates "after" validators inside nested models on the
        # model itself, and adds union/tag segments that mean nothing to a user.
        loc = tuple(part for part in item["loc"] if not str(part).startswith("function-"))
        field = _format_location(loc)
        message = _printable(str(item["msg"]).removeprefix("Value error, "))
        if item["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; see the profile reference)"
        elif item["type"] == "missing":
            message = "required field is missing"
        if field and not message.startswith(f"{field}:") and not message.startswith(field + "."):
            problems.append(f"{field}: {message}")
        else:
            problems.append(message)
    return problems


def parse_profile_text(text: str | bytes, source: str) -> ModelProfile:
    """Parse and validate a profile from YAML or JSON (the contract's one profile codec)."""
    try:
        document = decode_profile_document(text, source=source)
    except ProfileDocumentError as exc:
        raise ProfileError(source, [exc.problem]) from None
    return profile_from_mapping(document, source)


def profile_from_mapping(document: dict[str, Any], source: str) -> ModelProfile:
    """Validate an already-parsed profile document, then its engine's rules."""
    try:
        profile = ModelProfile.model_validate(document)
    except ValidationError as exc:
        raise ProfileError(source, describe_validation_error(exc)) from None
    try:
        check_engine_rules(profile)
    except ValueError as exc:
        raise ProfileError(source, [str(exc)]) from None
    return profile


def load_profile(path: Path | str) -> ModelProfile:
    """Read and validate one profile file."""
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ProfileError(source, [f"cannot read file: {exc.strerror or exc}"]) from None
    return parse_profile_text(raw, source)


def profile_to_json(profile: ModelProfile) -> str:
    """The canonical JSON form of a profile, as stored in Consul KV."""
    return json.dumps(profile.model_dump(mode="json", by_alias=True, exclude_none=True), indent=2)
