"""The router's settings: one frozen `RouterSettings`, read once by the wiring.

Every field can be set as `CARAVAN_ROUTER_<FIELD>` in the environment (the
`caravan router` flags override a few). Units are in the names. Where Consul
is comes from the standard `CONSUL_HTTP_ADDR` / `CONSUL_HTTP_TOKEN` variables
instead (`caravan_llm.common.consul_api.ConsulSettings.from_env`), so the router reads
them exactly as the Consul CLI does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from caravan_llm.common.contract import KVLayout
from caravan_llm.router.core.admission import AdmissionPolicy
from caravan_llm.router.core.balancer import BalancerConfig, Policy
from caravan_llm.router.core.breaker import BreakerPolicy
from caravan_llm.router.core.cost_model import CostConfig
from caravan_llm.router.core.prefix_index import ShapeConfig

MIB = 1024 * 1024


class RouterSettings(BaseSettings):
    """Everything the router process is configured with."""

    model_config = SettingsConfigDict(
        env_prefix="CARAVAN_ROUTER_",
        env_nested_delimiter="__",
        frozen=True,
        extra="forbid",
    )

    # -- listener ---------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    # Largest request body accepted; above it the answer is 413.
    max_body_bytes: int = Field(default=16 * MIB, ge=1024)
    # Bearer keys clients must present (comma-separated in the environment); empty = open.
    api_keys: Annotated[tuple[SecretStr, ...], NoDecode] = ()
    # Retired: the client's Authorization never reaches an engine; the router sends
    # each engine its model's key (`engine_api_keys`). Setting it true is an error.
    forward_authorization: bool = False
    # Read the engines' API keys from Nomad Variables (nomad/jobs/caravan-engine-keys/...) with the
    # router's own Nomad token (NOMAD_ADDR, NOMAD_TOKEN, NOMAD_NAMESPACE, NOMAD_REGION,
    # NOMAD_CACERT, ...) and send them upstream as `Authorization: Bearer <key>`.
    engine_api_keys: bool = True

    # -- routing ----------------------------------------------------------------
    policy: Policy = Policy.PREDICTED_TTFT
    affinity_prefix_chars: int = Field(default=100, ge=1)
    load_factor: float = Field(default=1.25, ge=1.0)
    # A request with no x-caravan-priority header gets this (lower goes first).
    default_priority: int = 0

    # -- upstream ---------------------------------------------------------------
    connect_timeout_s: float = Field(default=2.0, gt=0)
    # Until the engine's response headers (non-streaming: the whole body, which
    # only comes once the completion is generated; streaming: the first event).
    first_byte_timeout_s: float = Field(default=300.0, gt=0)
    # Longest silence between two events of a stream before the engine counts as dead.
    stream_idle_timeout_s: float = Field(default=60.0, gt=0)
    # Endpoints one request may try before its first byte reaches the client.
    max_attempts: int = Field(default=3, ge=1)
    # Continuations of one stream after its engine died mid-stream (0 = no failover).
    max_failovers: int = Field(default=2, ge=0)
    breaker_failure_threshold: int = Field(default=5, ge=1)
    breaker_cool_down_s: float = Field(default=10.0, ge=0)
    # An engine's HTTP 500 is blamed on the request's input (400 to the client, nothing
    # counted against the replica) only from a replica whose last verdict was a success
    # at most this long ago, and when no other replica answers the same request
    # (caravan_llm.router.core.input_fault).
    input_fault_window_s: float = Field(default=60.0, ge=0)
    # Connections the shared client pool keeps to all engines together.
    connector_limit: int = Field(default=4096, ge=1)
    # How long an idle pooled connection to an engine is reused. Below the engines'
    # own idle keep-alive (5 s in uvicorn, so vLLM and SGLang, and in llama-server's
    # cpp-httplib), so that no request goes out on a connection the engine closes
    # for idleness ("Server disconnected": a retry, an attempt spent).
    upstream_keepalive_s: float = Field(default=4.0, gt=0)

    # -- admission --------------------------------------------------------------
    queue_max_per_model: int = Field(default=256, ge=0)
    queue_timeout_s: float = Field(default=30.0, gt=0)
    cold_start_timeout_s: float = Field(default=300.0, gt=0)
    # How often a streaming client held for a cold start gets an SSE comment.
    cold_start_keepalive_s: float = Field(default=5.0, gt=0)
    # When the last replica of a model dies under a retry or a stream, hold the
    # request (streams: SSE comments every cold_start_keepalive_s) for its
    # replacement, up to rebuild_timeout_s, instead of failing it; and hold the
    # requests that find (or, queued, see) every replica of a declared model out
    # (breakers open, critical) the same way, instead of queueing them for
    # queue_timeout_s. False: neither.
    hold_for_replacement: bool = True
    # The expected rebuild time, bounded: how long such a request is held for the
    # rebuild of its model's replicas. None: cold_start_timeout_s (Nomad's down
    # detection, 10-30 s with its defaults, then a cold start of the replica).
    rebuild_timeout_s: float | None = Field(default=None, gt=0)
    # How often, at most, the demand signal of one model is written to KV.
    demand_interval_s: float = Field(default=5.0, gt=0)
    retry_after_s: int = Field(default=1, ge=1)
    cold_start_retry_after_s: int = Field(default=10, ge=1)

    # -- LoRA adapters (issue 25; router/edge/adapter_loader.py) -----------------------
    # Longest a request waits for its adapter to be loaded on its replica.
    adapter_load_timeout_s: float = Field(default=60.0, gt=0)
    # After an engine refuses an adapter's source, requests for it fail at once this long.
    adapter_failure_backoff_s: float = Field(default=30.0, ge=0)
    # An adapter this router loaded counts as held there without the scheduler's
    # document saying so for this long; after, the next request loads it again
    # (an "already loaded" answer is a success).
    adapter_confirm_after_s: float = Field(default=30.0, gt=0)
    # How often this router writes its adapter demand (`adapter-demand/<model>/<router>`),
    # and the window its requests per second are counted over.
    adapter_demand_interval_s: float = Field(default=5.0, gt=0)
    adapter_demand_window_s: float = Field(default=60.0, gt=0)

    # -- discovery and load -----------------------------------------------------
    kv_prefix: str = "caravan/"
    # Longest wait of one Consul blocking query.
    consul_wait_s: float = Field(default=60.0, gt=0, le=600)
    scrape_interval_s: float = Field(default=1.0, gt=0)
    scrape_timeout_s: float = Field(default=0.5, gt=0)
    # An engine scrape older than this is unknown, which the balancer reads as saturated.
    load_max_age_s: float = Field(default=5.0, gt=0)
    # UNSAFE: route to Consul services tagged `caravan` that no scheduler placed
    # (and by the served names their own Meta claims). Only for setups without
    # Nomad: benchmarks, static endpoints. docs/security.md, "Endpoint verification".
    allow_unverified_endpoints: bool = False

    # -- operations ---------------------------------------------------------------
    # Register this router in Consul as `caravan-router` with an HTTP check on /health.
    register_service: bool = True
    # The address other machines reach this router at (default: the bind host, or
    # the machine's hostname when bound to every interface).
    advertise_address: str | None = None
    # How long in-flight requests may run on after a shutdown signal.
    shutdown_timeout_s: float = Field(default=30.0, ge=0)
    # auto: uvloop when it is installed (about a third less CPU per request,
    # docs/benchmarks.md), else asyncio's own loop.
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "text"] = "json"
    # Processes serving the one port (SO_REUSEPORT), each with its own event loop,
    # Consul watches, scrapes and admission state; the parent registers in Consul
    # and serves /health and /metrics for all of them (router/wiring/workers.py).
    workers: int = Field(default=1, ge=1, le=256)

    # -- hardening (router/README.md, docs/security.md "Router hardening") --------
    # Named keys with a priority ceiling and a rate limit: a YAML/JSON list of
    # {name, key, max_priority, rps, burst} (router/edge/api_keys.py); adds to api_keys.
    api_keys_file: Path | None = None
    # Honour x-caravan-priority from clients when no API key is configured (with
    # keys, each key's max_priority bounds it instead).
    trust_priority_header: bool = False
    # From a connection's opening (or the first byte of its next request) to the
    # end of the request headers; slower clients get 408 and are closed.
    header_read_timeout_s: float = Field(default=10.0, gt=0)
    # From the end of the headers to the end of the body.
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    # How long an idle keep-alive connection stays open.
    keepalive_timeout_s: float = Field(default=30.0, gt=0)
    # Client connections open at once; None = from the process's descriptor
    # limit (half of it less 64, for the upstream connections and the rest).
    max_connections: int | None = Field(default=None, ge=1)
    # Longest request line and header field (aiohttp's max_line_size /
    # max_field_size); longer ones get 431.
    max_header_field_bytes: int = Field(default=8190, ge=1024, le=1024 * 1024)
    # JSON nesting a request body may have; deeper ones get 400.
    max_json_depth: int = Field(default=64, ge=2, le=512)
    # A separate listener for /health and /metrics (None = on the public port).
    admin_host: str = "127.0.0.1"
    admin_port: int | None = Field(default=None, ge=0, le=65535)

    # -- predicted_ttft cost model (router/core/cost_model.py) ---------------------------
    # Prompts are cut into blocks of this many characters for the prefix index.
    prefix_block_chars: int = Field(default=128, ge=16)
    # Characters per token when the router estimates a prompt's tokens.
    chars_per_token: float = Field(default=4.0, gt=0)
    # Prefill rate assumed for an endpoint whose Meta declares none (the scheduler
    # publishes the profile's `prefill_tokens_per_s`, else its engine's default),
    # until the router has learned the endpoint's own.
    other_prefill_tokens_per_s: float = Field(default=5000.0, gt=0)
    # Retired: one rate per engine named here; the scheduler publishes each replica's
    # rate in its Meta now (the router knows no engine). Setting either is an error.
    vllm_prefill_tokens_per_s: float | None = None
    llamacpp_prefill_tokens_per_s: float | None = None
    # KV capacity the prefix index assumes for an engine that does not report one.
    default_kv_cache_tokens: int = Field(default=65536, ge=1)

    # -- the exact prefix index (router/feeds/kv_feed.py, issue 24) -------------------
    # Read each placed replica's KV relay stream (its placement's kv_port) into the
    # exact index; off: the approximate prefix index alone.
    kv_events: bool = True
    # A replica's stream not heard from (not even a heartbeat: the relay sends one
    # every 2 s) for this long is stale: its requests use the approximate index, and
    # the connection is dropped and opened again.
    kv_events_stale_after_s: float = Field(default=6.0, gt=0)
    # Reconnect delays of a failed stream: from min, doubling up to max (with jitter).
    kv_events_backoff_min_s: float = Field(default=0.5, gt=0)
    kv_events_backoff_max_s: float = Field(default=10.0, gt=0)
    # How long a request waits for its prompt's token ids (for the exact index)
    # before it is routed on the approximate index; the tokenizing goes on in the
    # background and warms the model's segment cache for the next turn. 0: never
    # wait (every request is routed approximately and only warms the cache).
    exact_prefix_budget_ms: float = Field(default=1.0, ge=0)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(key.strip() for key in value.split(",") if key.strip())
        return value

    @field_validator("kv_prefix")
    @classmethod
    def _valid_prefix(cls, value: str) -> str:
        KVLayout(value)  # raises naming the prefix
        return value

    @field_validator("forward_authorization")
    @classmethod
    def _forwarding_retired(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "forward_authorization is retired: clients' Authorization headers are never "
                "sent to engines; the router sends each engine its model's key "
                "(engine_api_keys, docs/security.md)"
            )
        return value

    @field_validator("vllm_prefill_tokens_per_s", "llamacpp_prefill_tokens_per_s")
    @classmethod
    def _engine_rates_retired(cls, value: float | None) -> float | None:
        if value is not None:
            raise ValueError(
                "per-engine prefill rates are retired: each replica's Meta carries its "
                "rate (the profile's prefill_tokens_per_s, else its engine's default); "
                "other_prefill_tokens_per_s is the one fallback for a replica without one"
            )
        return value

    @model_validator(mode="after")
    def _timeouts_fit(self) -> RouterSettings:
        if self.scrape_timeout_s > self.scrape_interval_s:
            raise ValueError(
                f"scrape_timeout_s ({self.scrape_timeout_s}) must not exceed "
                f"scrape_interval_s ({self.scrape_interval_s})"
            )
        if self.kv_events_backoff_min_s > self.kv_events_backoff_max_s:
            raise ValueError(
                f"kv_events_backoff_min_s ({self.kv_events_backoff_min_s}) must not exceed "
                f"kv_events_backoff_max_s ({self.kv_events_backoff_max_s})"
            )
        return self

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(self.kv_prefix)

    def balancer_config(self) -> BalancerConfig:
        return BalancerConfig(
            breaker=BreakerPolicy(
                failure_threshold=self.breaker_failure_threshold,
                cool_down_s=self.breaker_cool_down_s,
            ),
            load_max_age_s=self.load_max_age_s,
            load_factor=self.load_factor,
            cost=CostConfig(
                shape=ShapeConfig(
                    block_chars=self.prefix_block_chars, chars_per_token=self.chars_per_token
                ),
                other_prefill_tokens_per_s=self.other_prefill_tokens_per_s,
                default_kv_cache_tokens=self.default_kv_cache_tokens,
            ),
        )

    def admission_policy(self) -> AdmissionPolicy:
        return AdmissionPolicy(
            max_queue_per_model=self.queue_max_per_model,
            queue_timeout_s=self.queue_timeout_s,
            cold_start_hold_s=self.cold_start_timeout_s,
            retry_after_s=self.retry_after_s,
            cold_start_retry_after_s=self.cold_start_retry_after_s,
            rebuild_hold_s=self.rebuild_timeout_s,
            hold_for_rebuild=self.hold_for_replacement,
        )
