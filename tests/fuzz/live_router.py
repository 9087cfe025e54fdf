"""A router with one engine, running in a process of its own, for fuzzing over HTTP.

Hypothesis drives plain (synchronous) tests, and its checks of data generation
would see the router's own use of `random` if it ran in the test's process; so
the router, its devcluster Consul and its engine run in a child process
(`python tests/fuzz/live_router.py`), and each example sends raw bytes with
`http.client`. The engine answers every request that reaches it as a healthy
engine would (a chat completion, or a stream), so that any 5xx the router
answers to a client's body is the router's own doing; `set_stream` gives it the
bytes (and the cuts) it streams next, to fuzz the relay. The child's log (its
stderr, the router's own log lines) is kept in a file, to assert that no line
of it is a traceback or an error.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from caravan_llm.common.consul_api import ConsulClient, ConsulSettings, ServiceRegistration
from caravan_llm.common.contract import ServiceMetaKey, model_service_name
from caravan_llm.devcluster.consul.server import ConsulConfig, ConsulServer
from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.wiring.app import RUNTIME, app_runner, create_app

MODEL = "tiny"
ROUTES = "chat_completions,completions,embeddings,responses,messages,tokenize"
_DEFAULT_STREAM = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"ok"},'
    b'"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
)
# Log lines that mean something went wrong inside the router.
_BAD_LOG_MARKS = ("Traceback", '"level": "ERROR"', " ERROR ", "Error handling request")


# -- the child process -----------------------------------------------------------------


@dataclass
class FuzzEngine:
    """An engine that answers whatever reaches it; `POST /fuzz/stream` sets its next stream."""

    stream: tuple[bytes, tuple[int, ...]] | None = None
    port: int = 0
    _runner: web.AppRunner | None = field(default=None, repr=False)

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/fuzz/stream", self._set_stream)
        app.router.add_route("POST", "/{tail:.*}", self._answer)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    async def _set_stream(self, request: web.Request) -> web.Response:
        data = await request.read()
        cuts = request.headers.get("x-cuts", "")
        self.stream = (data, tuple(int(cut) for cut in cuts.split(",") if cut))
        return web.Response(text="ok")

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        payload = json.loads(await request.read())
        if payload.get("stream") is True:
            return await self._stream(request)
        message = {"role": "assistant", "content": "ok"}
        return web.json_response(
            {
                "id": "chatcmpl-fuzz",
                "object": "chat.completion",
                "created": 1,
                "model": MODEL,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            }
        )

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        data, cuts = self.stream or (_DEFAULT_STREAM, ())
        self.stream = None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        edges = sorted({0, len(data), *(cut % max(1, len(data)) for cut in cuts)})
        for start, end in itertools.pairwise(edges):
            await response.write(data[start:end])
        await response.write_eof()
        return response


async def _register(consul: ConsulClient, port: int) -> None:
    meta = {
        ServiceMetaKey.MODEL: MODEL,
        ServiceMetaKey.SERVED_MODELS: MODEL,
        ServiceMetaKey.ENGINE: "vllm",
        ServiceMetaKey.REPLICA: "0",
        ServiceMetaKey.CAPACITY: "64",
        ServiceMetaKey.METRICS_PATH: "/metrics",
        ServiceMetaKey.METRIC_RUNNING: "vllm:num_requests_running",
        ServiceMetaKey.METRIC_WAITING: "vllm:num_requests_waiting",
        ServiceMetaKey.METRIC_KV_CACHE: "",
        ServiceMetaKey.SPEC_HASH: "0123456789abcdef",
        ServiceMetaKey.ROUTES: ROUTES,
    }
    await consul.agent_service_register(
        ServiceRegistration(
            name=model_service_name(MODEL),
            service_id=f"_nomad-task-{uuid.uuid4()}-engine-{model_service_name(MODEL)}-http",
            address="127.0.0.1",
            port=port,
            tags=("caravan", "engine-vllm"),
            meta=meta,
        )
    )


async def _serve(policy: str) -> None:
    """Run Consul, the engine and the router; print the ports; stop when stdin closes."""
    async with AsyncExitStack() as stack:
        consul_server = await stack.enter_async_context(ConsulServer(ConsulConfig()))
        consul = await stack.enter_async_context(
            ConsulClient(
                ConsulSettings(
                    host="127.0.0.1", port=consul_server.http_port, request_timeout_s=5.0
                )
            )
        )
        engine = FuzzEngine()
        await engine.start()
        stack.push_async_callback(engine.stop)
        await _register(consul, engine.port)
        settings = RouterSettings(
            port=0,
            register_service=False,
            consul_wait_s=10.0,
            scrape_interval_s=0.5,
            shutdown_timeout_s=0.5,
            allow_unverified_endpoints=True,
            breaker_cool_down_s=0.0,
            hold_for_replacement=False,
            queue_timeout_s=2.0,
            first_byte_timeout_s=5.0,
            stream_idle_timeout_s=5.0,
            log_format="text",
            policy=policy,
        )
        app = create_app(
            settings, consul=consul, registry=CollectorRegistry(), request_log=lambda _f: None
        )
        runtime = app[RUNTIME]
        runner = app_runner(app, settings)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        for _ in range(1000):
            entry = runtime.state.view.snapshot.for_model(MODEL)
            if runtime.state.synced and entry is not None and entry.endpoints:
                break
            await asyncio.sleep(0.02)
        ports = {"router": int(runner.addresses[0][1]), "engine": engine.port}
        sys.stdout.write(json.dumps(ports) + "\n")
        sys.stdout.flush()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


# -- the test's side --------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def _request(
    port: int, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> Answer:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest(method, path)
        for name, value in headers.items():
            # As bytes: a hostile header may be any UTF-8, which http.client would refuse.
            connection.putheader(name, value.encode("utf-8", "surrogateescape"))
        connection.putheader("Content-Length", str(len(body or b"")))
        connection.endheaders(body)
        response = connection.getresponse()
        return Answer(response.status, dict(response.getheaders()), response.read())
    finally:
        connection.close()


@dataclass
class LiveRouter:
    """The running router and its engine; `send` posts raw bytes, `log_problems` reads its log."""

    port: int
    engine_port: int
    log_path: Path
    # How much of the log `new_log_problems` has read.
    read_to: int = 0

    def send(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> Answer:
        sent = {"Content-Type": "application/json", **(headers or {})}
        return _request(self.port, "POST", path, body, sent)

    def set_stream(self, data: bytes, cuts: tuple[int, ...] = ()) -> None:
        """The bytes the engine streams for the next streaming request, cut after `cuts`."""
        headers = {"x-cuts": ",".join(str(cut) for cut in cuts)}
        assert 200 == _request(self.engine_port, "POST", "/fuzz/stream", data, headers).status

    def in_flight(self) -> float:
        """Requests at the router's endpoints now, from its own `/metrics`."""
        text = _request(self.port, "GET", "/metrics", None, {}).body.decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("caravan_router_endpoint_in_flight{")
        )

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait until nothing is in flight at the router's endpoints; fail if it never is."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight() != 0:
            assert time.monotonic() < deadline, "a request stayed in flight"
            time.sleep(0.01)

    def new_log_problems(self) -> list[str]:
        """Lines of the router's log since the last call that are a traceback or an error."""
        with self.log_path.open("rb") as log:
            log.seek(self.read_to)
            text = log.read()
        self.read_to += len(text)
        lines = text.decode("utf-8", "replace").splitlines()
        return [line for line in lines if any(mark in line for mark in _BAD_LOG_MARKS)]


@contextmanager
def live_router(log_dir: Path, policy: str) -> Iterator[LiveRouter]:
    """The router (balancing by `policy`) in a child process, its engine routable, its log kept."""
    log_path = log_dir / "router.log"
    with log_path.open("wb") as log_file:
        child = subprocess.Popen(
            [sys.executable, __file__, policy],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        try:
            assert child.stdout is not None
            line = child.stdout.readline()
            assert line, f"the router did not start: {log_path.read_text()[-2000:]}"
            ports = json.loads(line)
            yield LiveRouter(ports["router"], ports["engine"], log_path)
        finally:
            assert child.stdin is not None
            assert child.stdout is not None
            child.stdin.close()
            child.stdout.close()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    asyncio.run(_serve(sys.argv[1]))
