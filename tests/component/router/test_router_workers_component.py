"""`caravan router --workers 2` against devcluster's Consul: one port, two processes.

Both workers serve (the supervisor's /metrics shows streams in flight on each),
Consul holds one `caravan-router` registration whose check is the supervisor's
/health, SIGTERM deregisters first and then drains both workers (streams held
open across the signal finish whole) and the exit code is 0; a worker that
dies takes the router down in order with exit code 1.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from router_cluster import REPO, FakeEngine, chat_body, read_stream, register_replica, wait_until

from caravan_llm.common.consul_api import ConsulClient
from caravan_llm.common.contract import ROUTER_SERVICE
from caravan_llm.devcluster.consul.server import ConsulServer
from caravan_llm.scheduler.autoscale.loop import router_targets
from caravan_llm.scheduler.autoscale.scrape import scrape_routers

MODEL = "tiny"


@dataclass
class Supervisor:
    process: asyncio.subprocess.Process
    url: str
    admin_url: str


@asynccontextmanager
async def router_with_workers(server: ConsulServer, workers: int) -> AsyncIterator[Supervisor]:
    env = {
        **os.environ,
        "CONSUL_HTTP_ADDR": server.http_addr,
        "CARAVAN_ROUTER_LOG_FORMAT": "text",
        "CARAVAN_ROUTER_SHUTDOWN_TIMEOUT_S": "20",
        "CARAVAN_ROUTER_HEADER_READ_TIMEOUT_S": "1",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "caravan_llm.cli", "router",
        "--host", "127.0.0.1", "--port", "0", "--admin-port", "0",
        "--workers", str(workers), "--policy", "least_inflight",
        cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        admin = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
        public = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
        assert admin.startswith("caravan router admin on http://127.0.0.1:"), admin
        assert public.startswith("caravan router listening on http://127.0.0.1:"), public
        yield Supervisor(process, public.split()[-1], admin.split()[-1])
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def per_worker(http: aiohttp.ClientSession, admin_url: str, name: str) -> dict[str, float]:
    """The sum of one metric's samples per `worker` label, from the supervisor's /metrics."""
    async with http.get(admin_url + "/metrics") as response:
        text = await response.text()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                worker = sample.labels["worker"]
                sums[worker] = sums.get(worker, 0.0) + sample.value
    return sums


def worker_pids(supervisor_pid: int) -> list[int]:
    """The supervisor's worker processes (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children").read_text().split()
    return [
        int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


async def test_two_workers_share_the_port_register_once_and_drain_on_sigterm(
    consul_pair: tuple[ConsulServer, ConsulClient], http: aiohttp.ClientSession
) -> None:
    server, consul = consul_pair
    async with FakeEngine(MODEL, mode="held", events=3) as engine:
        await register_replica(consul, MODEL, 0, engine.port, check="none")
        async with router_with_workers(server, 2) as router:

            async def registered_and_passing() -> bool:
                _, entries = await consul.health_service(ROUTER_SERVICE, passing=True)
                return bool(entries)

            # Passing means Consul's check reached the supervisor's /health and
            # found both workers healthy.
            await wait_until(registered_and_passing, timeout_s=30, what="router passing")
            _, entries = await consul.health_service(ROUTER_SERVICE)
            check_urls = await _check_urls(http, server)
            # The autoscaler finds the merged /metrics through the registration's Meta.
            [scraped] = await scrape_routers(http, router_targets(entries))

            async def both_routable() -> bool:
                known = await per_worker(http, router.admin_url, "caravan_router_endpoints")
                return len(known) == 2 and all(count >= 1 for count in known.values())

            await wait_until(both_routable, timeout_s=30, what="both workers see the engine")

            # A new connection for every stream, so the kernel spreads them over
            # both listeners; stop once each worker holds at least one.
            streams: list[aiohttp.ClientResponse] = []
            fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
            try:

                async def both_serving() -> bool:
                    response = await fresh.post(
                        router.url + "/v1/chat/completions", json=chat_body(MODEL, stream=True)
                    )
                    streams.append(response)
                    in_flight = await per_worker(
                        http, router.admin_url, "caravan_router_endpoint_in_flight"
                    )
                    return len(in_flight) == 2 and all(v >= 1 for v in in_flight.values())

                await wait_until(both_serving, timeout_s=60, what="streams on both workers")
                held = await per_worker(http, router.admin_url, "caravan_router_endpoint_in_flight")

                router.process.send_signal(signal.SIGTERM)

                async def deregistered() -> bool:
                    _, entries = await consul.health_service(ROUTER_SERVICE)
                    return not entries

                # Deregistration comes first, while the streams are still held.
                await wait_until(deregistered, timeout_s=15, what="router deregistered")
                still_running = router.process.returncode is None
                engine.release.set()
                results = [await read_stream(response) for response in streams]
                statuses = [response.status for response in streams]
            finally:
                for response in streams:
                    response.release()
                await fresh.close()
            code = await asyncio.wait_for(router.process.wait(), 40)

    assert len(entries) == 1
    assert entries[0].port == int(router.url.rsplit(":", 1)[-1])
    assert check_urls == [router.admin_url + "/health"]
    assert [target.url for target in router_targets(entries)] == [router.admin_url + "/metrics"]
    assert scraped.failure is None
    assert scraped.report.depth_by_model is not None
    assert sum(held.values()) == len(streams)
    assert still_running
    assert statuses == [200] * len(streams)
    assert [(text, done) for text, _, done in results] == [(" w0 w1 w2", True)] * len(streams)
    assert code == 0


async def test_a_worker_that_dies_stops_the_router_with_exit_code_1(
    consul_pair: tuple[ConsulServer, ConsulClient], http: aiohttp.ClientSession
) -> None:
    server, consul = consul_pair
    async with FakeEngine(MODEL) as engine:
        await register_replica(consul, MODEL, 0, engine.port, check="none")
        async with router_with_workers(server, 2) as router:

            async def registered() -> bool:
                _, entries = await consul.health_service(ROUTER_SERVICE)
                return bool(entries)

            await wait_until(registered, timeout_s=30, what="router registered")
            pids = worker_pids(router.process.pid)
            os.kill(pids[0], signal.SIGKILL)
            code = await asyncio.wait_for(router.process.wait(), 40)
            _, after = await consul.health_service(ROUTER_SERVICE)
            survivor_gone = not Path(f"/proc/{pids[1]}").exists() or _is_zombie(pids[1])

    assert len(pids) == 2
    assert (code, after, survivor_gone) == (1, (), True)


async def test_workers_stop_when_the_supervisor_is_killed(
    consul_pair: tuple[ConsulServer, ConsulClient], http: aiohttp.ClientSession
) -> None:
    """No orphan keeps serving the port unsupervised (and unregistered).

    Also: /health lives on the supervisor's admin listener only, whose own
    errors are OpenAI-shaped JSON, and which closes a client that never
    finishes its headers (408), as a single router's admin listener does.
    """
    server, _ = consul_pair
    async with router_with_workers(server, 2) as router:
        pids = worker_pids(router.process.pid)
        async with http.get(router.url + "/health") as response:
            public_health = response.status
        async with http.get(router.admin_url + "/nope") as response:
            admin_unknown = (response.status, (await response.json())["error"]["code"])
        host, port = router.admin_url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never ends its headers
        await writer.drain()
        slow_answer = await asyncio.wait_for(reader.read(), 15)
        writer.close()
        router.process.kill()
        await router.process.wait()

        async def workers_gone() -> bool:
            return all(not Path(f"/proc/{pid}").exists() or _is_zombie(pid) for pid in pids)

        await wait_until(workers_gone, timeout_s=30, what="workers stopped")
    assert len(pids) == 2
    assert (public_health, admin_unknown) == (404, (404, "not_found"))
    assert slow_answer.startswith(b"HTTP/1.1 408")


def _is_zombie(pid: int) -> bool:
    with suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    return True


async def _check_urls(http: aiohttp.ClientSession, server: ConsulServer) -> list[str]:
    """The HTTP URLs of the router's checks, as the Consul agent holds them."""
    async with http.get(f"http://{server.http_addr}/v1/agent/checks") as response:
        checks = await response.json()
    return [
        check["Definition"]["HTTP"] if "Definition" in check else check.get("HTTP", "")
        for check in checks.values()
        if check.get("ServiceName") == ROUTER_SERVICE
    ]
