"""The router's preflight: the grants its tokens need, each with a probe
(caravan_llm/common/preflight.py).

* nomad: variables read on `nomad/jobs/caravan-engine-keys/models/*`, for the
  engines' API keys (`engine_api_keys`; without it the engines refuse every
  request with 401). Probe: read a key that does not exist (404, or 403).
* consul: `key_prefix "<prefix>"` read, for profiles, placements and drain
  markers. Probe: read a key that does not exist.
* consul: `key_prefix "<prefix>demand/"` write, for the cold-start demand
  signal. Probe: a check-and-set write that cannot succeed.
* consul: `key_prefix "<prefix>adapter-demand/"` write, for the LoRA
  adapters' demand figures (issue 25). Probe: the same impossible write.

A Nomad variables *list* without the grant is not refused but comes back
empty (Nomad filters it), which is why a router without a Nomad token used
to look healthy: the read probe is what tells.
"""

from __future__ import annotations

from typing import Protocol

from caravan_llm.common.consul_api import KVEntry
from caravan_llm.common.contract import ENGINE_KEY_PREFIX, KVLayout, engine_key_path
from caravan_llm.common.preflight import IMPOSSIBLE_CAS_INDEX, PROBE_NAME, Capability
from caravan_llm.router.feeds.engine_keys import VariableReader


class PreflightConsul(Protocol):
    """The Consul calls the probes make (caravan_llm.common.consul_api.ConsulClient)."""

    async def kv_get(
        self, key: str, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, KVEntry | None]: ...

    async def kv_put(self, key: str, value: bytes | str, *, cas: int | None = None) -> bool: ...


def router_capabilities(
    layout: KVLayout, consul: PreflightConsul, nomad: VariableReader | None
) -> list[Capability]:
    """What this router must be allowed; the Nomad grant only when it reads engine keys."""
    capabilities = []
    if nomad is not None:
        capabilities.append(
            Capability(
                "nomad",
                f"variables read on {ENGINE_KEY_PREFIX}*",
                lambda: nomad.get_variable(engine_key_path(PROBE_NAME)),
            )
        )
    capabilities += [
        Capability(
            "consul",
            f'key_prefix "{layout.prefix}" read',
            lambda: consul.kv_get(f"{layout.prefix}{PROBE_NAME}"),
        ),
        Capability(
            "consul",
            f'key_prefix "{layout.demand}" write',
            lambda: consul.kv_put(f"{layout.demand}{PROBE_NAME}", b"", cas=IMPOSSIBLE_CAS_INDEX),
        ),
        Capability(
            "consul",
            f'key_prefix "{layout.adapter_demand}" write',
            lambda: consul.kv_put(
                f"{layout.adapter_demand}{PROBE_NAME}", b"", cas=IMPOSSIBLE_CAS_INDEX
            ),
        ),
    ]
    return capabilities
