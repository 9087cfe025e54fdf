"""The router's connection bounds, measured: memory per stream, 10,000 idle connections, the cap.

    .venv/bin/python bench/router_connections.py                    # the recorded run
    .venv/bin/python bench/router_connections.py --streams 100 --connections 2000 --hold-s 5

Loopback only. One run starts, each in its own process: devcluster's Consul,
a minimal upstream engine (aiohttp) registered as a replica, and three
caravan routers (`python -m caravan_llm.router`, default settings but for the
ones named below), then, with one client (raw asyncio sockets, this process):

1. Memory per idle and per active stream, side by side: router A takes
   `--streams` streams that stay open with nothing flowing (the engine sends
   its first chunk, then nothing), router B the same number of streams that
   flow (a chunk every `--token-interval-s`), both at once. Each router is
   warmed up with a few streams of its kind first; per stream = (RSS with
   the streams open - RSS before) / streams. A's stream idle timeout is
   raised so that its streams stay open while measured.
2. The cap, on router B: its `MAX_CONNECTIONS` is exactly `--streams`, so
   while its streams are open every connection is inside a request, and
   `--newcomers` more connections must each get an immediate 503
   `too_many_connections` with `Retry-After`, never a hang (each is given
   `--newcomer-timeout-s`).
3. Idle keep-alive connections, on router C: `--connections` connections,
   each sends one `GET /v1/models`, reads its answer and stays open (C's
   cap and keep-alive timeout are raised to fit). The router's RSS, open
   descriptors and soft RLIMIT_NOFILE are read from /proc; after
   `--hold-s`, every connection sends a second request on the same socket,
   which shows it was still open.

4. Bursts of held requests, on router D: `--bursts` times, `--burst`
   streaming requests for a second model whose one replica takes one
   request at a time (`capacity` 1) and holds it until the bench opens its
   gate, so the others wait in D's admission queue, as requests do while a
   model has no replica; then the gate opens and all are answered. D's RSS
   is read before the first burst, with each burst held, and after each.
   It shows what a burst leaves behind: the first one raises RSS by the
   allocator's high-water for that many requests, which CPython keeps for
   reuse, and later bursts of the same size reuse it (a leak would add
   another step each time).

Every router and the client raise their soft RLIMIT_NOFILE to the hard limit;
the run stops with a message if the hard limit cannot fit the connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.processes import started  # noqa: E402 - needs the repository on sys.path

MODEL = "bench"
# The model of the held-request bursts (part 4): one request at a time, held at a gate.
HELD_MODEL = "bench-held"
HELD_CHUNKS = 20
WARM_UP_STREAMS = 20
# Descriptors the client keeps for itself beyond its connections.
_CLIENT_RESERVE = 256


def _chunk(content: str) -> bytes:
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


# -- the upstream engine ---------------------------------------------------------------------


def run_upstream(token_interval_s: float) -> None:
    """An engine whose streams either go idle after the first chunk or flow without end."""
    raise_soft_nofile()

    gate = asyncio.Event()
    gate.set()

    async def set_gate(request: web.Request) -> web.Response:
        if (await request.json())["open"]:
            gate.set()
        else:
            gate.clear()
        return web.json_response({"open": gate.is_set()})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        content = body["messages"][-1]["content"]
        idle = "idle" in content
        if "held" in content:
            await gate.wait()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_chunk("first"))
        if "held" in content:
            for _ in range(HELD_CHUNKS):
                await response.write(_chunk(" word"))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        if idle:
            # Open, nothing flowing, until the client (the router) goes away.
            await asyncio.Event().wait()
        while True:
            await asyncio.sleep(token_interval_s)
            await response.write(_chunk(" word"))

    async def plain(request: web.Request) -> web.Response:
        if request.path == "/metrics":
            return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
        if request.path.endswith("models"):
            return web.json_response({"object": "list", "data": [{"id": MODEL}]})
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/bench/gate", set_gate)
    for path in ("/health", "/metrics", "/v1/models"):
        app.router.add_get(path, plain)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        print(f"upstream listening on {runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


async def register_upstream(
    consul_addr: str, port: int, *, model: str = MODEL, capacity: int = 100_000
) -> None:
    from caravan_llm.common.consul_api import (  # noqa: PLC0415 - only the orchestrator needs it
        ConsulClient,
        ConsulSettings,
        HttpCheck,
        ServiceRegistration,
    )

    host, _, consul_port = consul_addr.rpartition(":")
    async with ConsulClient(ConsulSettings(host=host, port=int(consul_port))) as consul:
        await consul.agent_service_register(
            ServiceRegistration(
                name=f"caravan-{model}",
                service_id=f"caravan-{model}-0",
                address="127.0.0.1",
                port=port,
                tags=("caravan",),
                meta={
                    "caravan_model": model,
                    "served_models": model,
                    "engine": "vllm",
                    "replica": "0",
                    "capacity": str(capacity),
                    "metrics_path": "/metrics",
                },
                checks=(HttpCheck(url=f"http://127.0.0.1:{port}/health", interval_s=1.0),),
            )
        )


# -- /proc -----------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    return sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())


def soft_nofile(pid: int) -> int | None:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            value = line.split()[3]
            return None if value == "unlimited" else int(value)
    return None


def raise_soft_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        target = 1_048_576 if hard == resource.RLIM_INFINITY else hard
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def settled_rss(pid: int, samples: int = 5, interval_s: float = 0.2) -> int:
    """The median of a few RSS readings, once the process has had a moment."""
    values = []
    for _ in range(samples):
        await asyncio.sleep(interval_s)
        values.append(rss_bytes(pid))
    return int(statistics.median(values))


# -- the client ------------------------------------------------------------------------------


def _stream_request(
    content: str, *, model: str = MODEL, max_tokens: int = 100_000, close: bool = False
) -> bytes:
    """A raw streaming chat request (`close`: asking the router to close after it)."""
    body = json.dumps(
        {
            "model": model,
            "stream": True,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}],
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
        + ("Connection: close\r\n" if close else "")
        + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class Stream:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    drain: asyncio.Task[None] | None = None


async def open_stream(port: int, kind: str, number: int) -> Stream:
    """A stream through the router, once its first chunk arrived; active ones keep reading."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_stream_request(f"{kind} stream {number}"))
    seen = b""
    async with asyncio.timeout(30):
        while b"data: " not in seen:
            data = await reader.read(65536)
            if not data:
                raise RuntimeError(f"{kind} stream {number} closed: {seen[:200]!r}")
            seen += data
    if not seen.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{kind} stream {number}: {seen[:200]!r}")
    stream = Stream(reader, writer)
    if kind == "active":

        async def drain() -> None:
            while await reader.read(65536):
                pass

        stream.drain = asyncio.create_task(drain())
    return stream


async def close_streams(streams: list[Stream]) -> None:
    for stream in streams:
        if stream.drain is not None:
            stream.drain.cancel()
        stream.writer.close()
    for stream in streams:
        with contextlib.suppress(ConnectionError):
            await stream.writer.wait_closed()


async def open_many(count: int, opener: Any, batch: int = 200) -> list[Any]:
    opened: list[Any] = []
    for start in range(0, count, batch):
        size = min(batch, count - start)
        opened += await asyncio.gather(*(opener(start + i) for i in range(size)))
    return opened


async def stream_memory(pid: int, port: int, kind: str, count: int) -> dict[str, Any]:
    """RSS before and with `count` streams of `kind` open on one router."""
    warm = await open_many(WARM_UP_STREAMS, lambda n: open_stream(port, kind, n))
    await close_streams(warm)
    before = await settled_rss(pid)
    fds_before = open_fds(pid)
    streams = await open_many(count, lambda n: open_stream(port, kind, n))
    with_streams = await settled_rss(pid)
    fds = open_fds(pid)
    return {
        "kind": kind,
        "streams": count,
        "rss_before_bytes": before,
        "rss_with_bytes": with_streams,
        "per_stream_bytes": (with_streams - before) / count,
        "fds_per_stream": (fds - fds_before) / count,
        "open": streams,
    }


async def newcomer(port: int, timeout_s: float) -> dict[str, Any]:
    """One connection to a router at its cap: what it answered, and how fast."""
    started_at = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: bench\r\n\r\n")
            raw = await reader.read()
            writer.close()
    except TimeoutError:
        return {"status": "hang", "seconds": timeout_s}
    except ConnectionError as exc:
        return {"status": type(exc).__name__, "seconds": time.monotonic() - started_at}
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode(errors="replace").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return {
        "status": int(lines[0].split()[1]) if lines[0].startswith("HTTP/1.1") else lines[0],
        "retry_after": headers.get("Retry-After"),
        "connection": headers.get("Connection"),
        "code": code,
        "seconds": time.monotonic() - started_at,
    }


async def models_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> tuple[int, bool]:
    """GET /v1/models on an open connection: (status, whether the server keeps it open)."""
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: bench\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    match = re.search(rb"Content-Length: (\d+)", head, re.IGNORECASE)
    if match is None:
        raise RuntimeError(f"no Content-Length: {head[:200]!r}")
    await reader.readexactly(int(match.group(1)))
    return int(head.split()[1]), b"connection: close" not in head.lower()


async def keepalive_connections(pid: int, port: int, count: int, hold_s: float) -> dict[str, Any]:
    """`count` idle keep-alive connections held on one router, then used again."""
    before = await settled_rss(pid)
    fds_before = open_fds(pid)

    async def one(_: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        status, kept = await models_request(reader, writer)
        if (status, kept) != (200, True):
            raise RuntimeError(f"first request: {status}, keep-alive {kept}")
        return reader, writer

    opened_at = time.monotonic()
    connections = await open_many(count, one, batch=500)
    open_s = time.monotonic() - opened_at
    held = await settled_rss(pid)
    fds = open_fds(pid)
    await asyncio.sleep(hold_s)
    fds_after_hold = open_fds(pid)

    async def again(pair: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> bool:
        try:
            async with asyncio.timeout(30):
                answer = await models_request(*pair)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            return False
        return answer == (200, True)

    reused = 0
    for start in range(0, count, 500):
        reused += sum(await asyncio.gather(*(again(p) for p in connections[start : start + 500])))
    for _, writer in connections:
        writer.close()
    return {
        "connections": count,
        "open_s": open_s,
        "rss_before_bytes": before,
        "rss_held_bytes": held,
        "per_connection_bytes": (held - before) / count,
        "router_fds_before": fds_before,
        "router_fds_held": fds,
        "router_fds_after_hold": fds_after_hold,
        "router_soft_nofile": soft_nofile(pid),
        "hold_s": hold_s,
        "reused_after_hold": reused,
    }


async def held_request(port: int, burst: int, number: int) -> bool:
    """One streaming request for the held model, on its own connection; whether it was
    answered whole."""
    request = _stream_request(
        f"held burst {burst} request {number}", model=HELD_MODEL, max_tokens=100, close=True
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        raw = await reader.read()
    finally:
        writer.close()
    return raw.startswith(b"HTTP/1.1 200") and b"[DONE]" in raw


async def set_gate(upstream_port: int, *, is_open: bool) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://127.0.0.1:{upstream_port}/bench/gate", json={"open": is_open}
        ) as response,
    ):
        response.raise_for_status()


async def queue_depth(port: int) -> float:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    match = re.search(
        rf'^caravan_router_queue_depth{{model="{HELD_MODEL}"}} (\S+)$', text, re.MULTILINE
    )
    return float(match.group(1)) if match else 0.0


async def held_bursts(
    pid: int, port: int, upstream_port: int, size: int, bursts: int
) -> dict[str, Any]:
    """Router D's RSS before, during and after each burst of `size` queued requests."""
    warm = await asyncio.gather(*(held_request(port, -1, n) for n in range(WARM_UP_STREAMS)))
    if not all(warm):
        raise RuntimeError(f"warm-up: {warm.count(False)} held requests not answered")
    before = await settled_rss(pid)
    rows = []
    for burst in range(bursts):
        await set_gate(upstream_port, is_open=False)
        tasks = [asyncio.create_task(held_request(port, burst, n)) for n in range(size)]
        deadline = time.monotonic() + 60
        # All but the one the replica took (a few more may be on their way in).
        while (depth := await queue_depth(port)) < size - 4:
            if time.monotonic() > deadline:
                raise RuntimeError(f"burst {burst}: only {depth:.0f} queued after 60 s")
            await asyncio.sleep(0.2)
        held = await settled_rss(pid)
        await set_gate(upstream_port, is_open=True)
        answered = sum(await asyncio.gather(*tasks))
        rows.append(
            {
                "queued": depth,
                "held_rss_bytes": held,
                "after_rss_bytes": await settled_rss(pid, samples=10, interval_s=0.3),
                "answered": answered,
            }
        )
    return {"size": size, "rss_before_bytes": before, "bursts": rows}


# -- orchestration ---------------------------------------------------------------------------


def router_env(consul_addr: str, **settings: str) -> dict[str, str]:
    return {
        **os.environ,
        "CONSUL_HTTP_ADDR": consul_addr,
        "CARAVAN_ROUTER_PORT": "0",
        "CARAVAN_ROUTER_REGISTER_SERVICE": "false",
        "CARAVAN_ROUTER_LOG_LEVEL": "warning",
        # The upstream is registered by hand (no Nomad, no scheduler to place it).
        "CARAVAN_ROUTER_ALLOW_UNVERIFIED_ENDPOINTS": "true",
        **{f"CARAVAN_ROUTER_{name.upper()}": value for name, value in settings.items()},
    }


async def wait_routable(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stream = await open_stream(port, "idle", -1)
        except (OSError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
            continue
        await close_streams([stream])
        return


async def measure(args: argparse.Namespace, routers: dict[str, tuple[int, int]]) -> dict[str, Any]:
    for _, port in routers.values():
        await wait_routable(port)
    (idle_pid, idle_port), (active_pid, active_port) = routers["idle"], routers["active"]
    idle, active = await asyncio.gather(
        stream_memory(idle_pid, idle_port, "idle", args.streams),
        stream_memory(active_pid, active_port, "active", args.streams),
    )
    # Router B is at its cap with every connection inside a request.
    newcomers = await asyncio.gather(
        *(newcomer(active_port, args.newcomer_timeout_s) for _ in range(args.newcomers))
    )
    await close_streams(idle.pop("open") + active.pop("open"))
    keepalive_pid, keepalive_port = routers["keepalive"]
    keepalive = await keepalive_connections(
        keepalive_pid, keepalive_port, args.connections, args.hold_s
    )
    bursts_pid, bursts_port = routers["bursts"]
    bursts = await held_bursts(bursts_pid, bursts_port, args.upstream_port, args.burst, args.bursts)
    return {
        "idle": idle,
        "active": active,
        "newcomers": newcomers,
        "keepalive": keepalive,
        "bursts": bursts,
    }


def orchestrate(args: argparse.Namespace) -> int:
    soft = raise_soft_nofile()
    needed = args.connections + 2 * args.streams + args.newcomers + args.burst + _CLIENT_RESERVE
    if soft < needed:
        print(f"error: the client needs {needed} open files; RLIMIT_NOFILE allows {soft}")
        return 2
    python = sys.executable
    with contextlib.ExitStack() as stack:
        _, up = stack.enter_context(
            started(
                [python, __file__, "upstream", "--token-interval-s", str(args.token_interval_s)],
                r"upstream listening on (\d+)",
            )
        )
        _, consul = stack.enter_context(
            started(
                [
                    python,
                    "-m",
                    "caravan_llm.devcluster",
                    "--consul-port",
                    "0",
                    "--dns-port",
                    "0",
                    "--nomad-port",
                    "0",
                ],
                r"CONSUL_HTTP_ADDR=([\d.:]+)",
            )
        )
        consul_addr = consul.group(1)
        args.upstream_port = int(up.group(1))
        asyncio.run(register_upstream(consul_addr, args.upstream_port))
        asyncio.run(
            register_upstream(consul_addr, args.upstream_port, model=HELD_MODEL, capacity=1)
        )
        settings = {
            # A: its idle streams stay open while measured.
            "idle": {"stream_idle_timeout_s": "600"},
            # B: at its cap once its streams are open.
            "active": {"max_connections": str(args.streams)},
            # C: room for the connections, and they stay open while held.
            "keepalive": {
                "max_connections": str(args.connections + 64),
                "keepalive_timeout_s": str(max(600.0, 4 * args.hold_s)),
            },
            # D: every request of a burst waits in its queue, however long the burst.
            "bursts": {
                "max_connections": str(args.burst + 64),
                "queue_max_per_model": str(args.burst + 16),
                "queue_timeout_s": "300",
            },
        }
        routers: dict[str, tuple[int, int]] = {}
        for name, extra in settings.items():
            proc, match = stack.enter_context(
                started(
                    [python, "-m", "caravan_llm.router"],
                    r"listening on http://[\d.]+:(\d+)",
                    env=router_env(consul_addr, **extra),
                )
            )
            routers[name] = (proc.process.pid, int(match.group(1)))
        results = asyncio.run(measure(args, routers))
    results["machine"] = {"cores": os.cpu_count(), "python": sys.version.split()[0]}
    results["args"] = {k: v for k, v in vars(args).items() if k not in {"command", "json"}}
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def report(results: dict[str, Any]) -> None:
    kib = 1024
    idle, active, keepalive = results["idle"], results["active"], results["keepalive"]
    print(f"\nmemory per stream ({idle['streams']} of each, at once, one router each)")
    print("| stream | RSS before | RSS with | per stream | descriptors per stream |")
    print("|---|---|---|---|---|")
    for row in (idle, active):
        print(
            f"| {row['kind']} | {row['rss_before_bytes'] / kib / kib:.1f} MiB "
            f"| {row['rss_with_bytes'] / kib / kib:.1f} MiB "
            f"| {row['per_stream_bytes'] / kib:.1f} KiB | {row['fds_per_stream']:.2f} |"
        )
    statuses: dict[str, int] = {}
    for answer in results["newcomers"]:
        key = (
            f"{answer['status']} {answer.get('code')} Retry-After={answer.get('retry_after')} "
            f"Connection={answer.get('connection')}"
        )
        statuses[key] = statuses.get(key, 0) + 1
    slowest = max(answer["seconds"] for answer in results["newcomers"])
    print(f"\nat the cap ({active['streams']} streams in progress): {statuses}")
    print(f"  slowest answer {slowest * 1000:.1f} ms")
    print(
        f"\n{keepalive['connections']} idle keep-alive connections: opened in "
        f"{keepalive['open_s']:.1f} s; RSS {keepalive['rss_before_bytes'] / kib / kib:.1f} -> "
        f"{keepalive['rss_held_bytes'] / kib / kib:.1f} MiB "
        f"({keepalive['per_connection_bytes'] / kib:.1f} KiB each); router descriptors "
        f"{keepalive['router_fds_before']} -> {keepalive['router_fds_held']} "
        f"({keepalive['router_fds_after_hold']} after {keepalive['hold_s']:.0f} s) of a soft "
        f"limit of {keepalive['router_soft_nofile']}; {keepalive['reused_after_hold']} reused "
        "on the same socket after the hold"
    )
    bursts = results["bursts"]
    before = bursts["rss_before_bytes"]
    print(
        f"\n{len(bursts['bursts'])} bursts of {bursts['size']} held requests (router D): "
        f"RSS before {before / kib / kib:.1f} MiB"
    )
    print("| burst | queued | RSS held | RSS after | after - before | answered |")
    print("|---|---|---|---|---|---|")
    for number, row in enumerate(bursts["bursts"], 1):
        print(
            f"| {number} | {row['queued']:.0f} | {row['held_rss_bytes'] / kib / kib:.1f} MiB "
            f"| {row['after_rss_bytes'] / kib / kib:.1f} MiB "
            f"| {(row['after_rss_bytes'] - before) / kib / kib:+.1f} MiB | {row['answered']} |"
        )
    rows = bursts["bursts"]
    if len(rows) > 1:
        first = rows[0]["after_rss_bytes"] - before
        later = rows[-1]["after_rss_bytes"] - rows[0]["after_rss_bytes"]
        print(
            f"  step of the first burst {first / kib / kib:.1f} MiB; bursts 2-{len(rows)} "
            f"added {later / kib / kib:+.1f} MiB ({later / first:.2f} of the first step)"
            if first
            else f"  no step after burst 1; bursts 2-{len(rows)} added {later / kib:+.0f} KiB"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="run", choices=["run", "upstream"])
    parser.add_argument("--streams", type=int, default=500, help="idle and active streams, each")
    parser.add_argument("--token-interval-s", type=float, default=0.2)
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--hold-s", type=float, default=30.0)
    parser.add_argument("--newcomers", type=int, default=50)
    parser.add_argument("--newcomer-timeout-s", type=float, default=5.0)
    parser.add_argument("--burst", type=int, default=500, help="held requests per burst")
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.command == "upstream":
        run_upstream(args.token_interval_s)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
