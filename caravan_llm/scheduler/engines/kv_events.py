"""KV-cache events of a replica: what the engine publishes inside its allocation (issue 24).

A vLLM or SGLang replica publishes its KV-cache events (which carry the
prompt's token ids) on a ZeroMQ `ipc://` socket in the allocation's shared
`alloc/` directory, and a small caravan task of the same group, the KV relay
(caravan_llm/kvrelay), reads them there and serves routers only keyed digests
on the group's `kv` port, behind the engine key. This module holds the parts
the engine adapters and rendering share: the cluster config's `kv_events:`
section, the endpoints, and the engine's `--kv-events-config` JSON. Pure.

Why `ipc://` and never tcp: with the docker driver the engine and the relay
are two containers with two network namespaces (Nomad's `host` network mode
gives each its own loopback), while both mount the allocation's `alloc/`
directory at `/alloc`; a Unix socket there is reachable from both and from
nothing outside the node. ZeroMQ limits an ipc path to 107 bytes (sun_path):
`/alloc/kv-events.ipc` is 20; a raw_exec relay sees the host path of the same
directory (`<data_dir>/alloc/<alloc id>/alloc/...`, about 80 bytes under
Nomad's default `/opt/nomad/data`), and the relay refuses a longer one with a
clear error at start (kvrelay/settings.py).
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field

from caravan_llm.scheduler.engines.base import Driver, KvEventsFacts

# The relay's task in the replica's group.
RELAY_TASK_NAME = "kv-relay"
# The topic the engine publishes on and the relay subscribes to (vLLM's default is "").
TOPIC = "kv-events"
# The sockets, in the allocation's shared directory (`${NOMAD_ALLOC_DIR}` is
# `/alloc` in a docker task, the host folder in a raw_exec one).
EVENTS_SOCKET = "kv-events.ipc"
REPLAY_SOCKET = "kv-replay.ipc"
EVENTS_ENDPOINT = f"ipc://${{NOMAD_ALLOC_DIR}}/{EVENTS_SOCKET}"
REPLAY_ENDPOINT = f"ipc://${{NOMAD_ALLOC_DIR}}/{REPLAY_SOCKET}"
# Batches the engine keeps for a relay that missed some (vLLM's default).
BUFFER_STEPS = 10_000
# The production image (`make image`), pinned like the engines' images: a new
# default re-renders, and so restarts, every vLLM and SGLang replica.
DEFAULT_RELAY_IMAGE = "caravan-llm:0.1.0"
# The image's own entrypoint is `caravan`.
RELAY_ARGS = ("kv-relay",)
DEFAULT_RELAY_BINARY = "/usr/local/bin/caravan"
DEFAULT_RELAY_PORT = 8101
# SGLang's page size when the profile sets none and KV events are on: its
# default of 1 would make one event block, and one digest, per token.
DEFAULT_SGLANG_PAGE_SIZE = 16


class KvEventsSettings(BaseModel):
    """The cluster config's `kv_events:` section: the KV relay in every vLLM/SGLang replica."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # None: on exactly when `engine_api_keys` is (the relay needs the engine
    # key to name blocks and to guard its stream).
    enabled: bool | None = None
    # How the relay runs: `docker` with `relay_image` (caravan's image), or
    # `raw_exec` with `relay_binary` (`caravan` installed on the nodes).
    driver: Driver = Driver.DOCKER
    relay_image: str = Field(default=DEFAULT_RELAY_IMAGE, min_length=1)
    relay_binary: str = Field(default=DEFAULT_RELAY_BINARY, min_length=1)
    # The relay's port inside its container (docker only; raw_exec listens on
    # the host port Nomad allocates).
    container_port: int = Field(default=DEFAULT_RELAY_PORT, ge=1, le=65535)
    # The user the relay's docker task runs as. It connects to the engine's
    # Unix socket, which the engine creates with its own user and umask (root
    # and 0755 in the vLLM and SGLang images): connecting needs write access
    # to it, which caravan image's own user (10001) lacks. None: the image's user.
    user: str | None = "root"
    cpu_mhz: int = Field(default=200, ge=10)
    memory_mb: int = Field(default=256, ge=32)
    # Engine blocks the relay keeps (kvrelay `MAX_BLOCKS`); None: its default (2**20).
    max_blocks: int | None = Field(default=None, ge=1, le=2**20)
    # SGLang's `--page-size` when the profile's engine_args set none.
    sglang_page_size: int = Field(default=DEFAULT_SGLANG_PAGE_SIZE, ge=1, le=4096)


def kv_events_config(facts: KvEventsFacts) -> str:
    """The engine's `--kv-events-config` value: publish on the allocation's ipc sockets only."""
    config: dict[str, object] = {}
    if facts.enable_field:
        config["enable_kv_cache_events"] = True
    config.update(
        {
            "publisher": "zmq",
            "endpoint": EVENTS_ENDPOINT,
            "replay_endpoint": REPLAY_ENDPOINT,
            "topic": TOPIC,
            "buffer_steps": BUFFER_STEPS,
        }
    )
    return json.dumps(config, separators=(",", ":"))


def has_flag(args: tuple[str, ...], flag: str) -> bool:
    """Whether `args` set `flag` (`--flag value` or `--flag=value`)."""
    return any(arg == flag or arg.startswith(f"{flag}=") for arg in args)


def kv_events_args(facts: KvEventsFacts) -> list[str]:
    """The engine flags that turn its KV events on (rendered before the profile's own)."""
    return [facts.flag, kv_events_config(facts)]
