"""The router sends each engine its model's key, read from Nomad Variables, and never the
client's own credentials (issue 12 item 5)."""

from __future__ import annotations

import json

import aiohttp
from router_cluster import (
    FakeEngine,
    KeyVariables,
    chat_body,
    register_replica,
    routable_count,
    running_router,
    wait_until,
)

from caravan_llm.common.consul_api import ConsulClient

MODEL = "tiny"
ENGINE_KEY = "engine-key-of-the-model"


async def test_engine_gets_the_model_key_and_never_the_clients_credentials(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """Upstream, `Authorization` is exactly `Bearer <engine key>`; no `X-Api-Key` passes."""
    async with FakeEngine(MODEL) as fake:
        await register_replica(consul, MODEL, 0, fake.port, check="none")
        async with running_router(consul, nomad=KeyVariables({MODEL: ENGINE_KEY})) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="fake")
            keys = router.runtime.engine_keys
            assert keys is not None
            await wait_until(keys.loaded.is_set, timeout_s=5, what="keys loaded")
            async with http.post(
                router.url + "/v1/chat/completions",
                data=json.dumps(chat_body(MODEL)),
                headers={
                    "Content-Type": "application/json",
                    "Authorization": "Bearer client-key",
                    "X-Api-Key": "client-key",
                },
            ) as response:
                await response.read()
        seen = [(name.lower(), value) for name, value in fake.headers[0].items()]

    assert 200 == response.status
    assert [("authorization", f"Bearer {ENGINE_KEY}")] == [p for p in seen if "auth" in p[0]]
    assert [] == [p for p in seen if p[0] == "x-api-key"]


async def test_without_a_key_source_nothing_is_forwarded(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """A router without Nomad (static setups) sends no Authorization at all."""
    async with FakeEngine(MODEL) as fake:
        await register_replica(consul, MODEL, 0, fake.port, check="none")
        async with running_router(consul) as router:
            assert router.runtime.engine_keys is None
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="fake")
            async with http.post(
                router.url + "/v1/chat/completions",
                json=chat_body(MODEL),
                headers={"Authorization": "Bearer client-key"},
            ) as response:
                await response.read()
        seen = {name.lower() for name in fake.headers[0]}
    assert 200 == response.status
    assert "authorization" not in seen


async def test_an_engine_refusing_the_key_is_a_502_not_the_clients_401(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """An engine's 401 is about the router's key: the client gets an OpenAI-shaped 502."""
    async with FakeEngine(MODEL, mode="status", status=401) as fake:
        await register_replica(consul, MODEL, 0, fake.port, check="none")
        async with running_router(consul, nomad=KeyVariables({MODEL: "stale"})) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="fake")
            for stream in (False, True):
                async with http.post(
                    router.url + "/v1/chat/completions", json=chat_body(MODEL, stream=stream)
                ) as response:
                    body = await response.json()
                assert 502 == response.status
                assert "answered HTTP 401" in body["error"]["message"]
                assert "stale" not in json.dumps(body)
