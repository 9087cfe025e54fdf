"""The router reads and parses each request body once, at its edge."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import aiohttp
import pytest
from aiohttp import web_request
from router_cluster import (
    Engine,
    chat_body,
    register_replica,
    routable_count,
    running_router,
    wait_until,
)

from caravan_llm.common.consul_api import ConsulClient

MODEL = "tiny"
KEY = "sk-parse-once-key"


async def test_each_request_body_is_read_and_parsed_once(
    consul: ConsulClient,
    tiny_engines: list[Engine],
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unary and streamed, with a key and a priority header: one read, one json.loads each."""
    await register_replica(consul, MODEL, 0, tiny_engines[0].port)
    bodies = [
        json.dumps(chat_body(MODEL, "count my parses", seed=1)).encode(),
        json.dumps(chat_body(MODEL, "and my reads", stream=True, max_tokens=4, seed=2)).encode(),
    ]
    parses: Counter[bytes] = Counter()
    reads: Counter[bytes] = Counter()
    real_loads = json.loads
    real_read = web_request.BaseRequest.read

    def counting_loads(text: str | bytes, *args: Any, **kwargs: Any) -> Any:
        raw = text.encode() if isinstance(text, str) else bytes(text)
        if raw in bodies:
            parses[raw] += 1
        return real_loads(text, *args, **kwargs)

    async def counting_read(self: web_request.BaseRequest) -> bytes:
        data = await real_read(self)
        if data in bodies:
            reads[data] += 1
        return data

    monkeypatch.setattr(json, "loads", counting_loads)
    monkeypatch.setattr(web_request.BaseRequest, "read", counting_read)
    statuses = []
    async with running_router(consul, api_keys=KEY) as router:
        await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="1 replica")
        for body in bodies:
            async with http.post(
                router.url + "/v1/chat/completions",
                data=body,
                headers={
                    "Authorization": f"Bearer {KEY}",
                    "Content-Type": "application/json",
                    "x-caravan-priority": "5",
                },
            ) as response:
                await response.read()
                statuses.append(response.status)

    assert [200, 200] == statuses
    assert dict.fromkeys(bodies, 1) == dict(parses)
    assert dict.fromkeys(bodies, 1) == dict(reads)
