"""`DevCluster`: the local stand-in for `consul agent -dev` (+ Nomad, later) as one unit.

Components start in order and stop in reverse order; each is an async
context manager, so a failure while starting one stops those already up.
Consul comes first because everything else registers into it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from devcluster.consul.server import ConsulConfig, ConsulServer


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    consul: ConsulConfig = field(default_factory=ConsulConfig)


class DevCluster:
    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self._stack: contextlib.AsyncExitStack | None = None
        self._consul: ConsulServer | None = None

    @property
    def consul(self) -> ConsulServer:
        if self._consul is None:
            raise RuntimeError("the cluster is not running")
        return self._consul

    def exports(self) -> list[str]:
        """Shell lines that point clients at this cluster (never includes tokens)."""
        return [
            f"export CONSUL_HTTP_ADDR={self.consul.http_addr}",
            f"export CARAVAN_DNS_PORT={self.consul.dns_port}",
        ]

    async def __aenter__(self) -> Self:
        async with contextlib.AsyncExitStack() as stack:
            self._consul = await stack.enter_async_context(ConsulServer(self.config.consul))
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
        self._consul = None
