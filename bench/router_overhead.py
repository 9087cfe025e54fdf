"""What the router adds to each request, measured against going direct and against vllm-router.

    .venv/bin/python bench/router_overhead.py            # everything, prints the table
    .venv/bin/python bench/router_overhead.py --quick    # shorter phases
    .venv/bin/python bench/router_overhead.py --per-core-only --cores 1,2   # throughput per core

One run starts, each in its own process: a minimal upstream (aiohttp, a
fixed chat completion, or a stream of 16 chunks with no delay), devcluster's
Consul with the upstream registered as a replica (service, tag, Meta, as
Nomad would), caravan's router (`python -m caravan_llm.router`, one process, default
settings: prefix affinity, JSON logs to a file) and, when the `vllm-router`
command is found (PATH or $CARAVAN_BENCH_VLLM_ROUTER), vllm-router with the
upstream as its static worker. Then the same load goes to each target:

- unary at a fixed rate (default 500 requests/s, open loop): latency p50/p99,
  and the added latency = target minus direct;
- unary at fixed concurrency (wrk when installed, else the aiohttp load
  generator): requests/s of one router process, with latency;
- streaming at a fixed rate: time to the first chunk and to the end.

Throughput per core (`--cores 1,2`, the default up to the machine's cores):
for each core count n, caravan's router with `CARAVAN_ROUTER_WORKERS=n` and
vllm-router with `TOKIO_WORKER_THREADS=n`, each pinned with `taskset` to the
same n cores (vllm-router has no thread-count flag; tokio reads that
variable), take the same closed-loop load in turn: requests/s, per core, and
caravan / vllm-router at the same n, measured side by side in one run. The
load generator and the upstream are not pinned: on a machine with few cores
they compete with the routers for the same cores.

The load generator is another process (aiohttp for the fixed-rate phases,
wrk for throughput), so it does not share the router's event loop; on a
small machine every process shares the same cores, so read ratios, not
absolutes, and look at the core count printed with the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.processes import started  # noqa: E402 - needs the repository on sys.path

MODEL = "bench"
STREAM_CHUNKS = 16
CHAT_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}
)
STREAM_BODY = json.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 16,
        "stream": True,
    }
)
_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "a fixed answer of a few words"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11},
    }
).encode()


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


_STREAM_EVENTS = [_chunk({"role": "assistant", "content": ""})]
_STREAM_EVENTS += [_chunk({"content": f" w{i}"}) for i in range(STREAM_CHUNKS)]
_STREAM_EVENTS += [_chunk({}, "stop") + b"data: [DONE]\n\n"]


# -- the upstream ---------------------------------------------------------------------


async def _upstream_chat(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    if b'"stream":true' not in body.replace(b" ", b""):
        return web.Response(body=_COMPLETION, content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in _STREAM_EVENTS:
        # One write per event, as an engine does per token.
        await response.write(event)
    await response.write_eof()
    return response


async def _upstream_plain(request: web.Request) -> web.Response:
    if request.path == "/metrics":
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
    if request.path.endswith("models"):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
    return web.Response(text="ok")


def run_upstream(port: int) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _upstream_chat)
    for path in ("/health", "/metrics", "/v1/models", "/get_model_info", "/get_server_info"):
        app.router.add_get(path, _upstream_plain)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        print(f"upstream listening on {runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# -- the load generator -------------------------------------------------------------------


def _percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def _fixed_rate(
    url: str, *, rate: float, duration_s: float, warmup_s: float, stream: bool
) -> dict[str, Any]:
    """Open loop: a request every 1/rate seconds; latency (and time to first chunk)."""
    body = (STREAM_BODY if stream else CHAT_BODY).encode()
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    first_chunks: list[float] = []
    errors = 0
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(measure: bool) -> None:
            nonlocal errors
            started = loop.time()
            first: float | None = None
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    if stream:
                        async for _ in response.content.iter_any():
                            if first is None:
                                first = loop.time() - started
                    else:
                        await response.read()
                    ok = response.status == 200
            except aiohttp.ClientError:
                ok = False
            if not measure:
                return
            if not ok:
                errors += 1
                return
            latencies.append(loop.time() - started)
            if first is not None:
                first_chunks.append(first)

        tasks: list[asyncio.Task[None]] = []
        begin = loop.time()
        total = int(rate * (warmup_s + duration_s))
        for index in range(total):
            due = begin + index / rate
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(measure=index >= rate * warmup_s)))
        sent_s = loop.time() - begin
        await asyncio.gather(*tasks)
    return {
        "p50_ms": 1e3 * _percentile(latencies, 0.5),
        "p99_ms": 1e3 * _percentile(latencies, 0.99),
        "ttfb_p50_ms": 1e3 * _percentile(first_chunks, 0.5),
        "ttfb_p99_ms": 1e3 * _percentile(first_chunks, 0.99),
        "rate": total / sent_s,
        "errors": errors,
        "count": len(latencies),
    }


async def _closed_loop(url: str, *, concurrency: int, duration_s: float) -> dict[str, Any]:
    body = CHAT_BODY.encode()
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + duration_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            while loop.time() < stop_at:
                started = loop.time()
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                latencies.append(loop.time() - started)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {
        "rps": len(latencies) / duration_s,
        "p50_ms": 1e3 * _percentile(latencies, 0.5),
        "p99_ms": 1e3 * _percentile(latencies, 0.99),
    }


def run_load(args: argparse.Namespace) -> None:
    if args.mode == "closed":
        result = asyncio.run(
            _closed_loop(args.url, concurrency=args.concurrency, duration_s=args.duration)
        )
    else:
        result = asyncio.run(
            _fixed_rate(
                args.url,
                rate=args.rate,
                duration_s=args.duration,
                warmup_s=args.warmup,
                stream=args.mode == "stream",
            )
        )
    print(json.dumps(result), flush=True)


def _load(url: str, mode: str, **options: float) -> dict[str, Any]:
    command = [sys.executable, __file__, "load", "--url", url, "--mode", mode]
    for name, value in options.items():
        command += [f"--{name}", str(value)]
    output = subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    return dict(json.loads(output.stdout.strip().splitlines()[-1]))


_WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '%s'
"""


def _wrk(url: str, *, concurrency: int, duration_s: float) -> dict[str, Any] | None:
    wrk = shutil.which("wrk")
    if wrk is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(_WRK_SCRIPT % CHAT_BODY)
    try:
        output = subprocess.run(
            [
                wrk,
                "-t1",
                f"-c{concurrency}",
                f"-d{int(duration_s)}s",
                "--latency",
                "-s",
                script.name,
                url,
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    finally:
        Path(script.name).unlink()
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))  # type: ignore[union-attr]
    latency = dict(re.findall(r"\s+(50|99)%\s+([\d.]+\w+)", output))
    return {"rps": rps, "p50_ms": _ms(latency["50"]), "p99_ms": _ms(latency["99"])}


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(\w+)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


# -- orchestration --------------------------------------------------------------------------


async def _register_upstream(consul_addr: str, port: int) -> None:
    from caravan_llm.common.consul_api import (  # noqa: PLC0415
        ConsulClient,
        ConsulSettings,
        HttpCheck,
        ServiceRegistration,
    )

    host, _, consul_port = consul_addr.rpartition(":")
    async with ConsulClient(ConsulSettings(host=host, port=int(consul_port))) as consul:
        await consul.agent_service_register(
            ServiceRegistration(
                name=f"caravan-{MODEL}",
                service_id=f"caravan-{MODEL}-0",
                address="127.0.0.1",
                port=port,
                tags=("caravan",),
                meta={
                    "caravan_model": MODEL,
                    "served_models": MODEL,
                    "engine": "vllm",
                    "replica": "0",
                    "capacity": "4096",
                    "metrics_path": "/metrics",
                },
                checks=(HttpCheck(url=f"http://127.0.0.1:{port}/health", interval_s=1.0),),
            )
        )


def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    async def poll() -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.post(
                        url, data=CHAT_BODY, headers={"Content-Type": "application/json"}
                    ) as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} never answered 200")
                await asyncio.sleep(0.2)

    asyncio.run(poll())


def measure_all(targets: dict[str, str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each phase `reps` times, the targets interleaved (and rotated) so that whatever
    else runs on the machine hits them alike; the median of the repetitions is kept."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {"unary": [], "stream": [], "throughput": []} for name in targets
    }
    names = list(targets)
    for rep in range(args.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            url = targets[name]
            runs[name]["unary"].append(
                _load(url, "unary", rate=args.rate, duration=args.duration, warmup=args.warmup)
            )
            runs[name]["stream"].append(
                _load(
                    url, "stream", rate=args.stream_rate, duration=args.duration, warmup=args.warmup
                )
            )
            runs[name]["throughput"].append(
                _wrk(url, concurrency=args.concurrency, duration_s=args.duration)
                or _load(url, "closed", concurrency=args.concurrency, duration=args.duration)
            )
    return {
        name: {phase: _median_row(rows) for phase, rows in phases.items()}
        for name, phases in runs.items()
    }


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for key in rows[0]:
        values = sorted(row[key] for row in rows)
        merged[key] = values[len(values) // 2]
        if key == "p99_ms":
            merged["p99_spread"] = (values[0], values[-1])
    return merged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    upstream = sub.add_parser("upstream")
    upstream.add_argument("--port", type=int, default=0)
    load = sub.add_parser("load")
    load.add_argument("--url", required=True)
    load.add_argument("--mode", choices=["unary", "stream", "closed"], required=True)
    load.add_argument("--rate", type=float, default=500)
    load.add_argument("--duration", type=float, default=5)
    load.add_argument("--warmup", type=float, default=1)
    load.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rate", type=float, default=500.0, help="unary requests/s (open loop)")
    parser.add_argument("--stream-rate", type=float, default=100.0, help="streams/s (open loop)")
    parser.add_argument("--concurrency", type=int, default=32, help="connections for throughput")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per phase")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds not measured")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every phase")
    parser.add_argument("--quick", action="store_true", help="3-second phases, one repetition")
    parser.add_argument(
        "--cores",
        default=None,
        help="core counts of the per-core throughput phase, e.g. 1,2 (default: 1,2 up to "
        "the machine's cores; 0 = skip the phase)",
    )
    parser.add_argument(
        "--per-core-only", action="store_true", help="run only the per-core throughput phase"
    )
    args = parser.parse_args()
    if args.command == "upstream":
        run_upstream(args.port)
        return 0
    if args.command == "load":
        run_load(args)
        return 0
    if args.quick:
        args.duration, args.warmup, args.reps = 3.0, 1.0, 1
    args.cores = _core_counts(args.cores)
    return orchestrate(args)


def _core_counts(text: str | None) -> list[int]:
    available = os.cpu_count() or 1
    if text is None:
        return [n for n in (1, 2) if n <= available]
    counts = [int(part) for part in text.split(",") if part.strip()]
    if any(n < 0 or n > available for n in counts):
        raise SystemExit(f"--cores: each count must be within 0..{available} (this machine)")
    return [n for n in counts if n > 0]


def orchestrate(args: argparse.Namespace) -> int:
    python = sys.executable
    with contextlib.ExitStack() as stack:
        upstream_proc, up = stack.enter_context(
            started([python, __file__, "upstream"], r"upstream listening on (\d+)")
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
        upstream_port = int(up.group(1))
        consul_addr = consul.group(1)
        asyncio.run(_register_upstream(consul_addr, upstream_port))
        targets = {"direct": f"http://127.0.0.1:{upstream_port}/v1/chat/completions"}

        env = {
            **os.environ,
            "CONSUL_HTTP_ADDR": consul_addr,
            "CARAVAN_ROUTER_PORT": "0",
            "CARAVAN_ROUTER_REGISTER_SERVICE": "false",
            # The upstream is registered by hand, with no Nomad and no scheduler
            # to place it: only the unsafe setting lets the router use it.
            "CARAVAN_ROUTER_ALLOW_UNVERIFIED_ENDPOINTS": "true",
        }
        # On PATH, or beside this interpreter (`.venv/bin/python bench/...` without activating).
        vllm_router = (
            os.environ.get("CARAVAN_BENCH_VLLM_ROUTER")
            or shutil.which("vllm-router")
            or shutil.which("vllm-router", path=str(Path(sys.executable).parent))
        )
        if vllm_router is None:
            print("vllm-router not found (pip install vllm-router==0.1.17): row skipped")
        if args.per_core_only:
            per_core = _per_core(
                stack,
                args,
                env=env,
                vllm_router=vllm_router,
                upstream_port=upstream_port,
                upstream_pid=upstream_proc.process.pid,
                direct=targets["direct"],
            )
            print_per_core(per_core, args)
            return 0
        _, router = stack.enter_context(
            started(
                [python, "-m", "caravan_llm.router"], r"listening on http://[\d.]+:(\d+)", env=env
            )
        )
        targets["caravan"] = f"http://127.0.0.1:{router.group(1)}/v1/chat/completions"
        if vllm_router is not None:
            port = _free_port()
            stack.enter_context(started(_vllm_command(vllm_router, port, upstream_port), _READY))
            targets["vllm-router"] = f"http://127.0.0.1:{port}/v1/chat/completions"
        for url in targets.values():
            _wait_http(url)
        results = measure_all(targets, args)
        per_core = (
            _per_core(
                stack,
                args,
                env=env,
                vllm_router=vllm_router,
                upstream_port=upstream_port,
                upstream_pid=upstream_proc.process.pid,
                direct=targets["direct"],
            )
            if args.cores
            else None
        )
    print_table(results, args)
    if per_core is not None:
        print_per_core(per_core, args)
    return 0


_READY = r"(?i)ready|listening|started"


def _vllm_command(vllm_router: str, port: int, upstream_port: int) -> list[str]:
    return [
        vllm_router, "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", f"http://127.0.0.1:{upstream_port}",
        "--policy", "round_robin", "--log-level", "warning",
        # Its metrics listener, on a port of its own (two vllm-routers run side by side).
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
    ]  # fmt: skip


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(stat[11]) + int(stat[12])) / tick
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue
    return total


def _pinned(command: list[str], cores: int) -> list[str]:
    """`command` on cores 0..cores-1 (taskset), or as it is where taskset is missing."""
    taskset = shutil.which("taskset")
    return [taskset, "-c", f"0-{cores - 1}", *command] if taskset else command


def _per_core(
    stack: contextlib.ExitStack,
    args: argparse.Namespace,
    *,
    env: dict[str, str],
    vllm_router: str | None,
    upstream_port: int,
    upstream_pid: int,
    direct: str,
) -> dict[int, dict[str, dict[str, Any]]]:
    """Closed-loop throughput of caravan with n workers and vllm-router with n threads,
    each pinned to the same n cores, for every n in args.cores; interleaved, medians."""
    targets: dict[tuple[int, str], str] = {}
    pids: dict[tuple[int, str], int] = {(0, "direct"): upstream_pid}
    for cores in args.cores:
        caravan_env = {**env, "CARAVAN_ROUTER_WORKERS": str(cores)}
        command = _pinned([sys.executable, "-m", "caravan_llm.router"], cores)
        proc, router = stack.enter_context(
            started(command, r"listening on http://[\d.]+:(\d+)", env=caravan_env)
        )
        targets[cores, "caravan"] = f"http://127.0.0.1:{router.group(1)}/v1/chat/completions"
        pids[cores, "caravan"] = proc.process.pid
        if vllm_router is not None:
            port = _free_port()
            vllm_env = {**os.environ, "TOKIO_WORKER_THREADS": str(cores)}
            proc, _ = stack.enter_context(
                started(
                    _pinned(_vllm_command(vllm_router, port, upstream_port), cores),
                    _READY,
                    env=vllm_env,
                )
            )
            targets[cores, "vllm-router"] = f"http://127.0.0.1:{port}/v1/chat/completions"
            pids[cores, "vllm-router"] = proc.process.pid
    for url in targets.values():
        _wait_http(url)
    keys = [(0, "direct"), *targets]
    urls = {(0, "direct"): direct, **targets}
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {key: [] for key in keys}
    for rep in range(args.reps):
        order = keys[rep % len(keys) :] + keys[: rep % len(keys)]
        for key in order:
            url = urls[key]
            cpu_before = _tree_cpu_s(pids[key])
            row = _wrk(url, concurrency=args.concurrency, duration_s=args.duration) or _load(
                url, "closed", concurrency=args.concurrency, duration=args.duration
            )
            cpu_s = _tree_cpu_s(pids[key]) - cpu_before
            # Requests per CPU-second of the process tree: what one core would serve,
            # whatever else the machine's cores were doing meanwhile.
            row["per_cpu_s"] = row["rps"] * args.duration / cpu_s if cpu_s > 0 else float("nan")
            runs[key].append(row)
    table: dict[int, dict[str, dict[str, Any]]] = {}
    for (cores, name), rows in runs.items():
        table.setdefault(cores, {})[name] = _median_row(rows)
    return table


def print_per_core(table: dict[int, dict[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    pinned = "pinned with taskset" if shutil.which("taskset") else "NOT pinned (no taskset)"
    generator = "wrk -t1" if shutil.which("wrk") else "the aiohttp closed-loop generator"
    print(
        f"\nthroughput per core: cores {os.cpu_count()}, {generator} with {args.concurrency} "
        f"connections, {args.duration:.0f}s per target, median of {args.reps} interleaved "
        f"repetitions; routers {pinned} to cores 0..n-1, load generator and upstream not "
        f"pinned (direct, unpinned: {table[0]['direct']['rps']:.0f} req/s)\n"
    )
    header = (
        "| cores n | caravan (n workers) req/s | per core | req per CPU-s | p99 ms | "
        "vllm-router (n threads) req/s | per core | req per CPU-s | p99 ms | "
        "caravan / vllm-router req/s | per CPU-s |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for cores in sorted(n for n in table if n > 0):
        row = table[cores]
        caravan, peer = row["caravan"], row.get("vllm-router")
        peer_cells = (
            f"{peer['rps']:.0f} | {peer['rps'] / cores:.0f} | {peer['per_cpu_s']:.0f} | "
            f"{peer['p99_ms']:.2f} | {caravan['rps'] / peer['rps']:.2f}x | "
            f"{caravan['per_cpu_s'] / peer['per_cpu_s']:.2f}x"
            if peer is not None
            else "- | - | - | - | - | -"
        )
        print(
            f"| {cores} | {caravan['rps']:.0f} | {caravan['rps'] / cores:.0f} | "
            f"{caravan['per_cpu_s']:.0f} | {caravan['p99_ms']:.2f} | {peer_cells} |"
        )
    print(
        "\nreq per CPU-s: requests served / CPU seconds of the router's process tree "
        "(caravan: supervisor and workers) during the phase, so other load on the machine "
        "does not count against it"
    )


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    direct = results["direct"]
    peer = results.get("vllm-router")
    print(f"\ncores: {os.cpu_count()}  python: {sys.version.split()[0]}")
    print(
        f"unary at {args.rate:.0f}/s, streams ({STREAM_CHUNKS} chunks) at "
        f"{args.stream_rate:.0f}/s, throughput with {args.concurrency} connections; "
        f"{args.duration:.0f}s per phase, median of {args.reps} interleaved repetitions\n"
    )
    header = (
        "| path | unary p50 ms | unary p99 ms | added p50 ms | added p99 ms | "
        "stream first-chunk p50 ms | stream p99 ms | "
        f"req/s (c={args.concurrency}) | req/s vs direct | req/s vs vllm-router |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, row in results.items():
        unary, stream, throughput = row["unary"], row["stream"], row["throughput"]
        added50 = unary["p50_ms"] - direct["unary"]["p50_ms"]
        added99 = unary["p99_ms"] - direct["unary"]["p99_ms"]
        vs_peer = (
            f"{throughput['rps'] / peer['throughput']['rps']:.2f}x" if peer is not None else "-"
        )
        print(
            f"| {name} | {unary['p50_ms']:.2f} | {unary['p99_ms']:.2f} | {added50:+.2f} | "
            f"{added99:+.2f} | {stream['ttfb_p50_ms']:.2f} | {stream['p99_ms']:.2f} | "
            f"{throughput['rps']:.0f} | {throughput['rps'] / direct['throughput']['rps']:.2f}x | "
            f"{vs_peer} |"
        )
    errors = {
        name: row["unary"]["errors"] + row["stream"]["errors"] for name, row in results.items()
    }
    print(
        f"\nerrors (median run): {errors}; achieved unary rate: "
        + ", ".join(f"{n} {r['unary']['rate']:.0f}/s" for n, r in results.items())
    )
    print(
        "unary p99 min..max over repetitions: "
        + ", ".join(
            f"{n} {r['unary']['p99_spread'][0]:.2f}..{r['unary']['p99_spread'][1]:.2f} ms"
            for n, r in results.items()
        )
    )


if __name__ == "__main__":
    sys.exit(main())
