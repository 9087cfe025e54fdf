"""devcluster's Consul going down for its clients and coming back with its state."""

from __future__ import annotations

import time

import aiohttp
import pytest

from caravan_llm.devcluster.consul.server import ConsulConfig, ConsulServer


async def test_consul_down_refuses_connections_and_comes_back_with_its_kv():
    """While down, connections are refused; back up, the same address serves the same KV."""
    async with ConsulServer(ConsulConfig()) as server, aiohttp.ClientSession() as http:
        url = f"http://{server.http_addr}/v1/kv/soak/key"
        async with http.put(url, data=b"kept") as response:
            assert 200 == response.status
        address = server.http_addr

        await server.stop_http()
        with pytest.raises(aiohttp.ClientConnectorError):
            async with http.get(url):
                pass
        await server.start_http()

        async with http.get(f"{url}?raw") as response:
            body = await response.read()
        assert (address, 200, b"kept") == (server.http_addr, response.status, body)


async def test_blocking_queries_block_again_after_an_outage():
    """The outage ended every blocking query; afterwards one waits again for its timeout."""
    async with ConsulServer(ConsulConfig()) as server, aiohttp.ClientSession() as http:
        base = f"http://{server.http_addr}/v1/kv/soak/key"
        async with http.put(base, data=b"one") as response:
            assert 200 == response.status
        async with http.get(base) as response:
            index = int(response.headers["X-Consul-Index"])
        await server.stop_http()
        await server.start_http()
        started = time.monotonic()
        async with http.get(f"{base}?index={index}&wait=400ms") as response:
            waited_index = int(response.headers["X-Consul-Index"])
        waited_s = time.monotonic() - started
        assert index == waited_index
        assert waited_s >= 0.35, f"the blocking query answered after {waited_s:.3f}s"
