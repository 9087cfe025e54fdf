"""Operations: the `caravan router` process, its Consul registration and graceful shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import aiohttp
from router_cluster import (
    REPO,
    FakeEngine,
    chat_body,
    read_stream,
    register_replica,
    routable_count,
    running_router,
    wait_until,
)

from caravan_llm.common.consul_api import ConsulClient
from caravan_llm.common.contract import ROUTER_SERVICE
from caravan_llm.devcluster.consul.server import ConsulServer

MODEL = "tiny"


async def test_caravan_router_command_registers_serves_and_deregisters_on_sigterm(
    consul_pair: tuple[ConsulServer, ConsulClient], http: aiohttp.ClientSession
) -> None:
    """`caravan router` prints where it listens, registers `caravan-router`, leaves on SIGTERM."""
    server, consul = consul_pair
    async with FakeEngine(MODEL) as engine:
        await register_replica(consul, MODEL, 0, engine.port, check="none")
        env = {
            **os.environ,
            "CONSUL_HTTP_ADDR": server.http_addr,
            "CARAVAN_ROUTER_LOG_FORMAT": "text",
            "CARAVAN_ROUTER_SHUTDOWN_TIMEOUT_S": "2",
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "caravan_llm.cli",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--policy",
            "least_inflight",
            cwd=REPO,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            assert process.stdout is not None
            line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
            url = line.strip().rsplit(" ", 1)[-1]

            async def registered() -> bool:
                _, entries = await consul.health_service(ROUTER_SERVICE)
                return bool(entries)

            await wait_until(registered, timeout_s=10, what="router registered")
            _, entries = await consul.health_service(ROUTER_SERVICE)

            async def ready() -> bool:
                async with http.get(url + "/health") as response:
                    return response.status == 200

            await wait_until(ready, timeout_s=10, what="router healthy")
            async with http.post(url + "/v1/chat/completions", json=chat_body(MODEL)) as response:
                status = response.status
            process.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(process.wait(), 15)
            _, after = await consul.health_service(ROUTER_SERVICE)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()

    assert line.startswith("caravan router listening on http://127.0.0.1:")
    assert (("caravan-control",), url.rsplit(":", 1)[-1]) == (
        entries[0].tags,
        str(entries[0].port),
    )
    assert (200, 0, ()) == (status, code, after)


async def test_shutdown_leaves_consul_first_and_lets_streams_finish(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """Deregistering comes before closing; a stream in flight at shutdown still completes."""
    async with FakeEngine(MODEL, mode="held", events=3) as engine:
        await register_replica(consul, MODEL, 0, engine.port, check="none")
        async with running_router(consul, register_service=True) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="ep")
            runtime = router.runtime
            port = int(router.url.rsplit(":", 1)[-1])
            await runtime.register(port)
            _, before = await consul.health_service(ROUTER_SERVICE)
            stream = asyncio.create_task(
                http.post(router.url + "/v1/chat/completions", json=chat_body(MODEL, stream=True))
            )
            await wait_until(lambda: engine.in_flight == 1, timeout_s=5, what="stream running")

            await runtime.deregister()
            _, after = await consul.health_service(ROUTER_SERVICE)
            async with http.get(router.url + "/health") as response:
                health_status = response.status
            cleanup = asyncio.create_task(router.runner.cleanup())

            async def stopped_accepting() -> bool:
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    return True
                writer.close()
                await writer.wait_closed()
                return False

            # The stream is released only once shutdown is under way.
            await wait_until(stopped_accepting, timeout_s=5, what="the listener closed")
            engine.release.set()
            response = await stream
            text, _, done = await read_stream(response)
            await cleanup

    assert (1, ()) == (len(before), after)
    assert 503 == health_status
    assert (200, " w0 w1 w2", True) == (response.status, text, done)
