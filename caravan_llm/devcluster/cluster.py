"""`DevCluster`: the local stand-in for `consul agent -dev` + `nomad agent -dev` as one unit.

Components start in order and stop in reverse order; each is an async
context manager, so a failure while starting one stops those already up.
Consul comes first because everything else registers into it; Nomad's
simulated nodes then join it as Consul nodes and register their services.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from caravan_llm.devcluster.consul.server import ConsulConfig, ConsulServer
from caravan_llm.devcluster.nomad.server import NomadServer
from caravan_llm.devcluster.nomad.settings import NomadServerSettings, default_nodes


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    consul: ConsulConfig = field(default_factory=ConsulConfig)
    # None runs Consul alone.
    nomad: NomadServerSettings | None = field(
        default_factory=lambda: NomadServerSettings(nodes=default_nodes())
    )


class DevCluster:
    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self._stack: contextlib.AsyncExitStack | None = None
        self._consul: ConsulServer | None = None
        self._nomad: NomadServer | None = None

    @property
    def consul(self) -> ConsulServer:
        if self._consul is None:
            raise RuntimeError("the cluster is not running")
        return self._consul

    @property
    def nomad(self) -> NomadServer:
        if self._nomad is None:
            raise RuntimeError("the cluster is not running, or runs without Nomad")
        return self._nomad

    def exports(self) -> list[str]:
        """Shell lines that point clients at this cluster (never includes tokens)."""
        lines = [
            f"export CONSUL_HTTP_ADDR={self.consul.http_addr}",
            f"export CARAVAN_DNS_PORT={self.consul.dns_port}",
        ]
        if self._nomad is not None:
            lines.append(f"export NOMAD_ADDR={self._nomad.address}")
        return lines

    async def __aenter__(self) -> Self:
        async with contextlib.AsyncExitStack() as stack:
            self._consul = await stack.enter_async_context(ConsulServer(self.config.consul))
            if self.config.nomad is not None:
                self._nomad = await stack.enter_async_context(
                    NomadServer(
                        self.config.nomad,
                        consul_addr=self._consul.http_addr,
                        consul_token=self.config.consul.management_token,
                    )
                )
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()
        self._nomad = None
        self._consul = None
