"""The KV relay's settings: one frozen `RelaySettings`, read once by the wiring.

Every field can be set as `CARAVAN_KV_RELAY_<FIELD>` in the environment (the
`caravan kv-relay` flags override a few). Units are in the names. Inside a
Nomad allocation the listener comes from the `kv` port's variables
(`NOMAD_IP_kv`, `NOMAD_PORT_kv`) and the engine key from the variable the
engine's own task reads it from (`VLLM_API_KEY` for vLLM,
`CARAVAN_ENGINE_API_KEY` for SGLang), rendered by the same Nomad Variables
template; `CARAVAN_KV_RELAY_*` wins when both are set.
"""

from __future__ import annotations

import ipaddress
from typing import Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from caravan_llm.common.kv_stream import MAX_BLOCK_SIZE, MAX_DIGESTS
from caravan_llm.kvrelay.state import DEFAULT_MAX_BLOCKS

ENV_PREFIX = "CARAVAN_KV_RELAY_"
# The Nomad port label a replica job gives the relay's listener.
PORT_LABEL = "kv"
DEFAULT_PORT = 8101
# Where the engines' tasks read their API key (scheduler/engines/vllm.py, sglang.py).
ENGINE_KEY_ENVS = ("VLLM_API_KEY", "CARAVAN_ENGINE_API_KEY")
_LOCALHOST = "localhost"
# ZeroMQ's longest ipc path: sockaddr_un's sun_path (108 bytes) less its NUL.
MAX_IPC_PATH_BYTES = 107


class EndpointNotLocalError(ValueError):
    """An events endpoint that could let token ids leave the allocation; not retryable."""

    retryable = False


def check_local_endpoint(endpoint: str) -> str:
    """`endpoint` when it stays inside the allocation: `ipc://<path>` or loopback `tcp://`.

    KV events carry the prompt's token ids and ZeroMQ has no authentication,
    so `tcp://*:...`, a routable address or any other transport is refused
    (EndpointNotLocalError, naming the endpoint's transport and host only), and
    so is an ipc path longer than ZeroMQ takes (it would fail at connect).
    """
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc":
        if not rest or "*" in rest:
            raise EndpointNotLocalError(
                "an ipc:// endpoint needs a socket path, e.g. ipc:///run/kv"
            )
        size = len(rest.encode())
        if size > MAX_IPC_PATH_BYTES:
            raise EndpointNotLocalError(
                f"the ipc:// socket path is {size} bytes, and ZeroMQ takes at most "
                f"{MAX_IPC_PATH_BYTES} (a Unix socket's sun_path): use a shorter path "
                "(in a Nomad allocation, ipc://${NOMAD_ALLOC_DIR}/... under a shorter "
                "client data_dir, or the docker driver, where it is /alloc/...)"
            )
        return endpoint
    if scheme != "tcp":
        raise EndpointNotLocalError(
            f"the endpoint must be ipc://<path> or a loopback tcp://127.0.0.1:<port>, "
            f"got the transport {scheme[:16]!r}"
        )
    try:
        parts = urlsplit(endpoint)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise EndpointNotLocalError("a tcp:// endpoint is tcp://<loopback host>:<port>") from None
    if host is None or port is None or port == 0 or parts.path or parts.username:
        raise EndpointNotLocalError("a tcp:// endpoint is tcp://<loopback host>:<port>")
    if host != _LOCALHOST:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise EndpointNotLocalError(
                f"a tcp:// endpoint must be on loopback (127.0.0.1, ::1, localhost): the events "
                f"carry token ids and must not leave the allocation; got the host {host[:64]!r}"
            )
    return endpoint


def relay_binds(endpoint: str) -> bool:
    """Whether the relay binds its SUB socket on `endpoint` (else it connects).

    vLLM's publisher binds `ipc://` and connects to a concrete `tcp://` address
    (shared/docs/vllm-cpu.md, section 5): the relay does the other.
    """
    return endpoint.startswith("tcp://")


class RelaySettings(BaseSettings):
    """Everything the KV relay process is configured with."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        frozen=True,
        extra="forbid",
        populate_by_name=True,
        env_ignore_empty=True,
    )

    # -- the engine's events (inside the allocation) ------------------------------
    events_endpoint: str = Field(
        description="the engine's KV-event PUB endpoint: ipc://<path> (the engine binds, the "
        "relay connects) or a loopback tcp://127.0.0.1:<port> (the relay binds); anything "
        "else is refused",
    )
    replay_endpoint: str | None = Field(
        default=None,
        description="the engine's replay endpoint (same rule); missed batches are asked for "
        "there, else a gap starts a new epoch",
    )
    topic: str = Field(default="kv-events", description="the engine's KV-event topic")
    block_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_BLOCK_SIZE,
        description="the engine's KV block size in tokens (vLLM's --block-size; 16 on GPU, 128 "
        "on the CPU build); events of another size are skipped; unset: learned from the "
        "events (the first size stored while no block is held)",
    )
    engine_api_key: SecretStr = Field(
        min_length=1,
        validation_alias=AliasChoices(f"{ENV_PREFIX}ENGINE_API_KEY", *ENGINE_KEY_ENVS),
        description="the model's engine API key: names blocks (keyed digests) and guards the "
        "stream; read from the engine task's own variable",
    )
    # -- the stream (to routers) --------------------------------------------------
    host: str = Field(
        default="127.0.0.1",
        validation_alias=AliasChoices(f"{ENV_PREFIX}HOST", f"NOMAD_IP_{PORT_LABEL}"),
        description="where the digest stream listens",
    )
    port: int = Field(
        default=DEFAULT_PORT,
        ge=0,
        le=65535,
        validation_alias=AliasChoices(f"{ENV_PREFIX}PORT", f"NOMAD_PORT_{PORT_LABEL}"),
        description="the digest stream's port (0 = any free)",
    )
    max_blocks: int = Field(
        default=DEFAULT_MAX_BLOCKS,
        ge=1,
        le=MAX_DIGESTS,
        description="engine blocks kept at most (at least the engine's num_gpu_blocks)",
    )
    heartbeat_interval_s: float = Field(
        default=2.0, gt=0, le=60, description="how often each stream gets a heartbeat"
    )
    subscriber_queue_max: int = Field(
        default=1024,
        ge=1,
        description="messages queued per router; one that falls further behind is "
        "disconnected (it reconnects and gets a fresh snapshot)",
    )
    max_subscribers: int = Field(
        default=64, ge=1, description="streams served at once; more get 503"
    )
    replay_timeout_s: float = Field(
        default=5.0, gt=0, description="how long a replay from the engine may take"
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "text"] = "json"

    @field_validator("events_endpoint", "replay_endpoint")
    @classmethod
    def _inside_the_allocation(cls, value: str | None) -> str | None:
        return None if value is None else check_local_endpoint(value)
