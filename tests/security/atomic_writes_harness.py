"""devcluster's Consul, a model service and the scheduler's API in-process, and the CLI.

Used by the atomic-writes and profile-policy security tests. Nomad is never
contacted by the write paths, so the clients point at an unused address.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from caravan_llm.common.consul_api import ConsulClient, ConsulSettings, KVEntry, TxnOp
from caravan_llm.common.contract import KVLayout
from caravan_llm.common.nomad_api import NomadClient, NomadSettings
from caravan_llm.devcluster.consul.server import ConsulConfig, ConsulServer
from caravan_llm.scheduler.api import create_api
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.model_service import ModelService
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.status import StatusReader

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "profiles"
UNUSED_NOMAD = "http://127.0.0.1:9"

TINY = """\
name: {name}
model: /models/tiny.gguf
served_model_name: {served}
engine: llamacpp
replicas: {{min: 1, max: 2}}
"""


def tiny(name: str, served: str | None = None, **extra: str) -> str:
    """A valid CPU llama.cpp profile (YAML), with extra top-level lines appended."""
    text = TINY.format(name=name, served=served or name)
    return text + "".join(f"{key}: {value}\n" for key, value in extra.items())


@dataclass
class Cluster:
    consul: ConsulServer
    client: ConsulClient
    layout: KVLayout
    config: ClusterConfig
    api_url: str = ""

    @property
    def store(self) -> ModelStore:
        return ModelStore(self.client, self.layout)

    def service(self, kv: Any = None, config: ClusterConfig | None = None) -> ModelService:
        store = ModelStore(kv or self.client, self.layout)
        nomad = NomadClient(NomadSettings.from_env({"NOMAD_ADDR": UNUSED_NOMAD}))
        return ModelService(
            store=store,
            status=StatusReader(store=store, nomad=nomad, health=self.client),
            config=config or self.config,
        )

    async def snapshot(self) -> tuple[tuple[str, bytes, int], ...]:
        """Every key under caravan/ with its value and ModifyIndex."""
        _, entries = await self.client.kv_get_recurse(self.layout.prefix)
        return tuple((e.key, e.value, e.modify_index) for e in entries)

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CONSUL_", "NOMAD_"))}
        env.pop("CARAVAN_SCHEDULER_ADDR", None)
        env.update({"CONSUL_HTTP_ADDR": self.consul.http_addr, "NOMAD_ADDR": UNUSED_NOMAD})
        return env


@pytest.fixture
async def writes_cluster() -> AsyncIterator[Cluster]:
    """devcluster's Consul plus the scheduler's HTTP API over it, on free ports."""
    async with ConsulServer(ConsulConfig(session_ttl_min_s=1.0)) as consul:
        settings = ConsulSettings.from_env({"CONSUL_HTTP_ADDR": consul.http_addr})
        async with ConsulClient(settings) as client:
            running = Cluster(consul, client, KVLayout(), ClusterConfig())
            app = create_api(running.service(), CollectorRegistry(), lambda: True)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            running.api_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            try:
                yield running
            finally:
                await runner.cleanup()


async def caravan_cli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    """Run `caravan ARGS` as a user would; (exit code, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.cli",
        *args,
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


class InterferingKV:
    """A KV client that lets `interfere` write to Consul just before each of our transactions.

    Simulates another writer winning the race between our read and our write.
    """

    def __init__(self, client: ConsulClient, interfere: Any, times: int) -> None:
        self._client = client
        self._interfere = interfere
        self._left = times
        self.transactions = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def txn(self, ops: list[TxnOp] | tuple[TxnOp, ...]) -> tuple[KVEntry, ...]:
        self.transactions += 1
        if self._left > 0:
            self._left -= 1
            await self._interfere()
        return await self._client.txn(ops)
