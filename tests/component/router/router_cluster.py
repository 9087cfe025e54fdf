"""Pieces of the router component tests: simulated engines, their Consul registration, a router.

Engines run as subprocesses (`python -m caravan_llm.devcluster.engine`) on 127.0.0.1 and a
free port, and are registered into the in-process devcluster Consul the way
Nomad registers a replica: service `caravan-<model>`, tag `caravan`, Nomad's
service ID for an allocation, the contract's Meta, an HTTP check on `/health`
every second. There is no scheduler here, so `register_replica` also writes
what the scheduler would: the model's profile (when absent) and the
allocation in `caravan/placements/<model>`, so these tests run with endpoint
verification on.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp
import polling
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from caravan_llm.common.consul_api import (
    ConsulClient,
    ConsulSettings,
    HttpCheck,
    ServiceRegistration,
    TtlCheck,
)
from caravan_llm.common.contract import (
    KVLayout,
    PlacedAllocation,
    Placements,
    ServiceMetaKey,
    decode_placements,
    encode_engine_routes,
    encode_placements,
    encode_stream_traits,
    engine_key_path,
    model_service_name,
    nomad_service_id,
    replica_job_id,
)
from caravan_llm.common.nomad_api import QueryResult, Variable, VariableMetadata
from caravan_llm.devcluster.consul.server import ConsulConfig, ConsulServer
from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.wiring.app import RUNTIME, RouterRuntime, app_runner, create_app
from caravan_llm.scheduler.engines.registry import Engine as EngineName
from caravan_llm.scheduler.engines.registry import adapter_for

REPO = Path(__file__).resolve().parents[3]
_BOUND = re.compile(r"bound to (http://[\d.]+:(\d+))")
LAYOUT = KVLayout()


def consul_config() -> ConsulConfig:
    """devcluster's Consul with short reap periods, for tests."""
    return ConsulConfig(
        session_ttl_min_s=1.0, check_reap_interval_s=0.5, deregister_critical_min_s=1.0
    )


@dataclass
class Engine:
    """One simulated engine process."""

    flavor: str
    model: str
    process: subprocess.Popen[bytes]
    log_path: Path
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL, as a crashing node would."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.log_path.unlink(missing_ok=True)


def start_engine(
    model: str,
    *,
    flavor: str = "vllm",
    max_num_seqs: int = 64,
    sim: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Engine:
    """Start a simulated engine on a free port and wait until it says where it is bound
    (`env`: variables added to this process's environment, such as `VLLM_API_KEY`)."""
    knobs = {"load_seconds": "0", "step_seconds": "0.005", "output_tokens": "16"}
    knobs.update(sim or {})
    args = [
        sys.executable,
        "-m",
        "caravan_llm.devcluster.engine",
        "--flavor",
        flavor,
        "--host",
        "127.0.0.1",
    ]
    args += ["--port", "0"]
    if flavor == "vllm":
        args += [
            "--model",
            model,
            "--served-model-name",
            model,
            "--max-num-seqs",
            str(max_num_seqs),
        ]
    else:
        args += ["-m", f"/models/{model}.gguf", "--alias", model, "--metrics"]
        args += ["--parallel", str(max_num_seqs)]
    for name, value in knobs.items():
        args += ["--sim-" + name.replace("_", "-"), value]
    args += list(extra_args)
    handle, name = tempfile.mkstemp(prefix="caravan-engine-", suffix=".log")
    log_path = Path(name)
    with os.fdopen(handle, "wb") as log_file:
        process = subprocess.Popen(
            args,
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env} if env is not None else None,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = _BOUND.search(log_path.read_text(errors="replace"))
        if match:
            engine = Engine(flavor, model, process, log_path, int(match.group(2)))
            _wait_listening(engine, deadline)
            return engine
        if process.poll() is not None:
            break
        time.sleep(0.05)
    process.kill()
    process.wait()
    output = log_path.read_text(errors="replace")
    log_path.unlink(missing_ok=True)
    raise RuntimeError(f"engine did not start: {output[-2000:]}")


def _wait_listening(engine: Engine, deadline: float) -> None:
    import socket  # noqa: PLC0415

    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", engine.port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"engine on port {engine.port} never listened")


def replica_meta(
    model: str, replica: int, *, flavor: str = "vllm", capacity: int = 64
) -> dict[str, str]:
    """The service Meta the scheduler renders for a replica (contract 4)."""
    if flavor == "vllm":
        running, waiting, kv = (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
        )
    else:
        running, waiting, kv = "llamacpp:requests_processing", "llamacpp:requests_deferred", ""
    return {
        ServiceMetaKey.MODEL: model,
        ServiceMetaKey.SERVED_MODELS: model,
        ServiceMetaKey.ENGINE: flavor,
        ServiceMetaKey.REPLICA: str(replica),
        ServiceMetaKey.CAPACITY: str(capacity),
        ServiceMetaKey.METRICS_PATH: "/metrics",
        ServiceMetaKey.METRIC_RUNNING: running,
        ServiceMetaKey.METRIC_WAITING: waiting,
        ServiceMetaKey.METRIC_KV_CACHE: kv,
        ServiceMetaKey.SPEC_HASH: "0123456789abcdef",
        **encode_stream_traits(adapter_for(EngineName(flavor)).facts.stream_traits),
        **encode_engine_routes(adapter_for(EngineName(flavor)).facts.routes),
    }


async def register_replica(
    consul: ConsulClient,
    model: str,
    replica: int,
    port: int,
    *,
    flavor: str = "vllm",
    capacity: int = 64,
    check: str = "http",
    kv_port: int | None = None,
) -> str:
    """Register a replica as Nomad would, and place it as the scheduler would; returns its id.

    `check`: "http" (on /health every 1s), "ttl" (set by the test), or "none"
    (Consul then reads the instance as passing). `kv_port`: its KV relay's port
    on 127.0.0.1, published in the placement.
    """
    alloc_id = str(uuid.uuid4())
    service_id = nomad_service_id(alloc_id, model)
    # cas=0 creates only: a profile the test declared itself is kept.
    await consul.kv_put(LAYOUT.model_key(model), json.dumps(_profile(model)), cas=0)
    await place_allocation(
        consul,
        model,
        PlacedAllocation(
            alloc_id=alloc_id,
            job_id=replica_job_id(model, replica),
            address="127.0.0.1",
            port=port,
            kv_port=kv_port,
        ),
    )
    checks: tuple[HttpCheck | TtlCheck, ...] = ()
    if check == "http":
        checks = (HttpCheck(url=f"http://127.0.0.1:{port}/health", interval_s=1.0, timeout_s=1.0),)
    elif check == "ttl":
        checks = (TtlCheck(ttl_s=600.0, check_id=f"ttl-{service_id}", initial_status="passing"),)
    await consul.agent_service_register(
        ServiceRegistration(
            name=model_service_name(model),
            service_id=service_id,
            address="127.0.0.1",
            port=port,
            tags=("caravan", f"engine-{flavor}"),
            meta=replica_meta(model, replica, flavor=flavor, capacity=capacity),
            checks=checks,
        )
    )
    return service_id


async def place_allocation(consul: ConsulClient, model: str, alloc: PlacedAllocation) -> None:
    """Add an allocation to the model's placements document, as the scheduler publishes it."""
    key = LAYOUT.placements_key(model)
    for _ in range(100):
        _, entry = await consul.kv_get(key)
        current = (
            decode_placements(entry.value, key=key, model=model)
            if entry is not None
            else Placements(model=model)
        )
        updated = Placements(model=model, allocations=(*current.allocations, alloc))
        cas = entry.modify_index if entry is not None else 0
        if await consul.kv_put(key, encode_placements(updated), cas=cas):
            return
    raise AssertionError(f"could not update {key}")


def _profile(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "engine": "vllm", "replicas": {"min": 0, "max": 2}, **fields}


async def declare_model(consul: ConsulClient, name: str, **fields: Any) -> None:
    """Write a profile to KV as `caravan submit` would (only the fields the router reads)."""
    await consul.kv_put(LAYOUT.model_key(name), json.dumps(_profile(name, **fields)))


@dataclass
class RouterUnderTest:
    url: str
    runtime: RouterRuntime
    registry: CollectorRegistry
    runner: web.AppRunner = field(repr=False)

    def metric(self, name: str, **labels: str) -> float | None:
        """The value of one sample of the router's registry; None when it is absent."""
        value = self.registry.get_sample_value(name, labels)
        return None if value is None else float(value)


@asynccontextmanager
async def running_router(
    consul: ConsulClient, *, nomad: Any = None, **overrides: Any
) -> AsyncIterator[RouterUnderTest]:
    """A router on this event loop, on a free port, synced with Consul before it is yielded
    (`nomad`: where it reads the engines' API keys from, if anywhere)."""
    values: dict[str, Any] = {
        "port": 0,
        "register_service": False,
        "consul_wait_s": 10.0,
        "scrape_interval_s": 0.5,
        "scrape_timeout_s": 0.5,
        "shutdown_timeout_s": 2.0,
        "log_format": "text",
    }
    clock: Callable[[], float] = overrides.pop("clock", time.monotonic)
    # Passed to create_app as they are: where request lines go, the prompts' token ids.
    app_options = {
        name: overrides.pop(name) for name in ("request_log", "prompt_tokens") if name in overrides
    }
    values.update(overrides)
    settings = RouterSettings(**values)
    registry = CollectorRegistry()
    app = create_app(
        settings, consul=consul, registry=registry, clock=clock, nomad=nomad, **app_options
    )
    runner = app_runner(app, settings)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = int(runner.addresses[0][1])
        runtime = app[RUNTIME]
        await wait_until(lambda: runtime.state.synced, timeout_s=10.0, what="router synced")
        yield RouterUnderTest(f"http://127.0.0.1:{port}", runtime, registry, runner)
    finally:
        await runner.cleanup()


class ManualClock:
    """A monotonic clock that moves only when the test advances it."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@asynccontextmanager
async def running_consul() -> AsyncIterator[tuple[ConsulServer, ConsulClient]]:
    async with ConsulServer(consul_config()) as server:
        settings = ConsulSettings(host="127.0.0.1", port=server.http_port, request_timeout_s=5.0)
        async with ConsulClient(settings) as client:
            yield server, client


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]], *, timeout_s: float, what: str
) -> None:
    """Poll until `condition` holds; fail the test naming `what` if it never does."""
    await polling.eventually(condition, timeout_s, what, interval_s=0.05)


def routable_count(router: RouterUnderTest, model: str) -> int:
    """Endpoints of the model the router would send new requests to (passing or warning)."""
    runtime = router.runtime
    entry = runtime.state.view.snapshot.for_model(model)
    if entry is None:
        return 0
    live = runtime.state.live
    return sum(
        1
        for endpoint in entry.endpoints
        if endpoint.status.value != "critical"
        and not (endpoint.id in live and live[endpoint.id].draining)
    )


def chat_body(model: str, text: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


async def read_stream(response: aiohttp.ClientResponse) -> tuple[str, list[dict[str, Any]], bool]:
    """(the text of choice 0, every JSON event, whether `[DONE]` came) of an SSE answer."""
    return parse_sse(await response.read())


def parse_sse(raw: bytes) -> tuple[str, list[dict[str, Any]], bool]:
    """(the text of choice 0, every JSON event, whether `[DONE]` came) of SSE bytes."""
    events: list[dict[str, Any]] = []
    done = False
    for event in raw.split(b"\n\n"):
        for line in event.split(b"\n"):
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                done = True
            else:
                events.append(json.loads(payload))
    text = "".join(
        choice.get("delta", {}).get("content") or choice.get("text") or ""
        for event in events
        for choice in event.get("choices", [])
    )
    return text, events, done


async def engine_metric(session: aiohttp.ClientSession, engine: Engine, name: str) -> float:
    """The sum of one metric's samples in an engine's /metrics."""
    async with session.get(engine.url + "/metrics") as response:
        text = await response.text()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


class FakeEngine:
    """An in-process engine whose behaviour the test sets, counting what it receives.

    modes: "ok" answers (streams `events` content chunks), "status" answers
    `status` with an error body, "die" breaks the connection after `events`
    chunks, "held" streams one chunk then waits for `release` before the rest,
    "hang" never answers, "stall" streams `events` chunks then goes silent,
    "abort" streams `events` chunks then ends as vLLM does on SIGTERM (a chunk
    with `finish_reason: "abort"`, a usage chunk, `[DONE]`).
    """

    def __init__(self, model: str, *, mode: str = "ok", events: int = 5, status: int = 503) -> None:
        self.model = model
        self.mode = mode
        self.events = events
        self.status = status
        self.requests = 0
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        # The client port of each chat request: one per connection the router opened.
        self.peer_ports: list[int] = []
        self.release = asyncio.Event()
        self.in_flight = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def __aexit__(self, *_: object) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _embeddings(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.bodies.append(await request.json())
        vector = {"object": "embedding", "index": 0, "embedding": [0.25, -0.5]}
        return web.json_response({"object": "list", "data": [vector], "model": self.model})

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text=f"vllm:num_requests_running {self.in_flight}\n")

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        chunk = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        self.headers.append(dict(request.headers))
        peer = None if request.transport is None else request.transport.get_extra_info("peername")
        if peer is not None:
            self.peer_ports.append(int(peer[1]))
        body = await request.json()
        self.bodies.append(body)
        if self.mode == "hang":
            await asyncio.Event().wait()
        if self.mode == "status":
            error = {
                "error": {"message": "fake failure", "type": "server_error", "code": self.status}
            }
            return web.json_response(error, status=self.status)
        words = [f" w{i}" for i in range(self.events)]
        if not body.get("stream"):
            message = {"role": "assistant", "content": "".join(words)}
            return web.json_response(
                {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "created": 1,
                    "model": self.model,
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {
                        "prompt_tokens": 1,
                        "completion_tokens": self.events,
                        "total_tokens": 1 + self.events,
                    },
                },
                headers={"openai-processing-ms": "1"},
            )
        self.in_flight += 1
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(self._chunk({"role": "assistant", "content": ""}))
            for index, word in enumerate(words):
                await response.write(self._chunk({"content": word}))
                if self.mode == "held" and index == 0:
                    await self.release.wait()
                if self.mode == "stall" and index == self.events - 1:
                    await asyncio.Event().wait()
                if self.mode == "abort" and index == self.events - 1:
                    usage = {
                        "id": "chatcmpl-fake",
                        "choices": [],
                        "usage": {"completion_tokens": 3},
                    }
                    await response.write(
                        self._chunk({}, "abort")
                        + b"data: " + json.dumps(usage).encode() + b"\n\n"
                        + b"data: [DONE]\n\n"
                    )  # fmt: skip
                    await response.write_eof()
                    return response
                if self.mode == "die" and index == self.events - 1:
                    # Behaviour, not a wait: the last event leaves before the connection dies.
                    await asyncio.sleep(0.01)
                    if request.transport is not None:
                        request.transport.abort()
                    return response
            await response.write(self._chunk({}, "stop") + b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.in_flight -= 1


class KeyVariables:
    """Nomad Variables holding one model's engine key (the router's reads only)."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self.vars = {
            engine_key_path(model): Variable(
                VariableMetadata("default", engine_key_path(model), 5, 5), {"api_key": key}
            )
            for model, key in keys.items()
        }

    async def list_variables(
        self, prefix: str = "", *, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[VariableMetadata]]:
        del wait_s
        if index is not None:
            await asyncio.Event().wait()  # a blocking query: nothing changes in this test
        return QueryResult(5, [v.meta for p, v in self.vars.items() if p.startswith(prefix)])

    async def get_variable(self, path: str) -> Variable | None:
        return self.vars.get(path)
