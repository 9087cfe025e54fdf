"""Which replica a request goes to, on real engines: prefix-cache hit rate and TTFT per target.

    python bench/routing_quality_real.py --quick     # development: one short pass (~2.5 min)
    python bench/routing_quality_real.py             # the recorded run (docs/benchmarks.md)
    python bench/routing_quality_real.py --plan-only # the workload and the time estimate

The sibling of `bench/routing_quality.py` (whose parts it reuses) on two real
vLLM servers (the CPU build, `make vllm`; `devcluster/vllm_build.py`), one per
core, each with a small KV cache of 128-token blocks, so that where a request
lands decides whether its prefix is still cached there. They are registered
in devcluster's Consul as caravan replicas (service, tag and Meta as Nomad
renders them) and started once for the whole run.

The workload: long shared system prompts (each a whole number of KV blocks,
sized with the engine's own `/tokenize`) with Zipf popularity, each followed
by a short user turn; streaming, a few output tokens, open loop (Poisson
arrivals, seeded: the same bytes for every target). Their blocks together
exceed one replica's cache and fit in two. The default popularity is uniform
(`--zipf 0`): every prompt's blocks must survive in some cache, so where a
request lands decides its hit. With a steep popularity (`--zipf 0.8`) the hot
prompts fit in both caches, round robin already hits on them, and the ceiling
of any router is near round robin's 1.5x (docs/benchmarks.md).

Every engine publishes its KV-cache events on an ipc:// socket in its own
scratch folder, and a KV relay (`python -m caravan_llm.kvrelay`, as a
replica's `kv-relay` task runs it) per engine serves their digests on
loopback. The engines are placed as the scheduler places replicas (profile
with the tiny model's tokenizer, `placements/<model>` with each relay's
`kv_port`, the engine key in devcluster's Nomad Variables), so routers verify
them and read the streams as deployed (bench/prefix_routing.py's `place_fleet`).

Targets, interleaved (each repetition plays every target once, in rotated
order): `rr`, `lor` (client-side round robin / least outstanding requests,
straight to the engines), `caravan` (caravan's router, `python -m caravan_llm.router`,
with its default policy and `KV_EVENTS=false`: the approximate index;
`caravan-<policy>` for another policy), `precise` (the same router reading
the relays' streams, every setting at its default: exact prefix routing),
`precise-wait` (the same, with a 50 ms tokenizing budget: every prompt's
digests), `oracle` (the same router whose exact index is fed in its own
process straight from the engines' ZeroMQ sockets, each batch applied as it
arrives: no relay, no stream, no HTTP hop, and every request waits for its
digests; it knows every engine's cache as the engine's own events describe
it at the moment of the pick, plus, like `precise`, this router's requests in
flight there), and vllm-router's `cache_aware` and `power_of_two` when the
`vllm-router` command is installed.
Before each target both engines' prefix caches are emptied
(`POST /reset_prefix_cache`, hence `VLLM_SERVER_DEV_MODE=1`: a bench, not
production) and their `vllm:prefix_cache_{hits,queries}_total` counters are
read before and after it. Reported per target: the fleet's prefix-cache hit
rate from those counters, the client's TTFT p50/p99, errors, and the ratios
of the default against round robin and against vllm-router's best.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# ruff: noqa: E402 - the imports below need the repository on sys.path
from bench.prefix_routing import (
    KEY,
    Placed,
    place_fleet,
    request_lines,
    router_figures,
    streamless_index,
)
from bench.processes import Proc, started
from bench.routing_quality import (
    ENGINE_BASES,
    MODEL,
    VLLM_ROUTER_POLICIES,
    Fleet,
    Outcome,
    TraceRequest,
    _fmt,
    _percentile,
    _ratio,
    _scalar_metrics,
    _words,
    engines_passing,
    free_ports,
    http_ok,
    play,
    trace_request_id,
    wait_until,
    write_requests,
)
from caravan_llm.devcluster.vllm_build import API_SERVER_MODULE, CPU_BLOCK_SIZE, find_vllm
from caravan_llm.devcluster.vllm_build import missing_build_message as _missing_build

DEFAULT_TARGET = "caravan"  # the router with no policy set: its default (predicted_ttft)
# The KV-event targets (caravan's router with its default policy, on the engines' events).
EVENT_TARGETS = ("precise", "precise-wait", "oracle")
TOPIC = "kv-events"
SERVED_NAME = "tiny"
READY_TIMEOUT_S = 240.0  # 30-80 s on 2 cores; up to ~140 s seen on a loaded machine
# Seconds a cell takes beyond its arrivals: reset, router start (+1 scrape), drain.
STARTUP_S = {
    "rr": 1.0, "lor": 1.0, "caravan": 4.5, "precise": 6.0, "oracle": 7.0, "vllm-router": 3.0,
}  # fmt: skip
SERVERS_S = 70.0  # both servers started together, the trace sized, the engines calibrated


@dataclass(frozen=True)
class Workload:
    prompts: int = 12
    system_blocks: int = 7  # full KV blocks of each rendered system prompt (~900 tokens)
    zipf: float = 0.0  # uniform: eviction decides (see the module docstring)
    rate: float = 8.0  # requests per second, open loop, both engines together
    duration_s: float = 35.0  # seconds of arrivals per cell
    max_tokens: int = 8
    kv_blocks: int = 48  # --num-gpu-blocks-override, per engine
    max_num_seqs: int = 16
    seed: int = 1


# -- the engines ----------------------------------------------------------------------------


def events_endpoints(scratch: str) -> tuple[str, str]:
    """An engine's KV-event and replay sockets, in its own short scratch folder."""
    return f"ipc://{scratch}/kv-events.ipc", f"ipc://{scratch}/kv-replay.ipc"


def server_command(
    python: str, model: str, port: int, workload: Workload, scratch: str
) -> list[str]:
    # Served as `tiny` and as the benches' model name, which the Consul Meta and
    # the traces of routing_quality use (vLLM takes several served names).
    events, replay = events_endpoints(scratch)
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events,
        "replay_endpoint": replay,
        "topic": TOPIC,
    }
    return [
        python, "-W", "ignore::DeprecationWarning", "-m", API_SERVER_MODULE,
        "--model", model, "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", SERVED_NAME, MODEL,
        "--max-model-len", "2048", "--enable-prefix-caching", "--enforce-eager",
        "--num-gpu-blocks-override", str(workload.kv_blocks),
        "--max-num-seqs", str(workload.max_num_seqs),
        "--kv-events-config", json.dumps(kv_events),
    ]  # fmt: skip


def server_env(core: int, tmpdir: str) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        # For POST /reset_prefix_cache between targets (a bench, not production).
        "VLLM_SERVER_DEV_MODE": "1",
        # Short and private: ZMQ ipc paths must stay under 107 bytes, and vLLM
        # leaves its vllm_dist_* files here.
        "TMPDIR": tmpdir,
    }


async def wait_ready(procs: list[Proc], bases: list[str]) -> float:
    """Until every server's /health answers 200 (the port refuses before); seconds taken."""
    began = time.monotonic()

    async def one(proc: Proc, base: str) -> None:
        async def check(session: aiohttp.ClientSession) -> bool:
            if proc.process.poll() is not None:
                tail = proc.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM at {base} exited ({proc.process.returncode}):\n{tail}")
            async with session.get(base + "/health") as response:
                return response.status == 200

        try:
            await wait_until(check, f"{base}/health", READY_TIMEOUT_S)
        except RuntimeError as exc:
            if "timed out" in str(exc):
                tail = proc.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{exc}; its log ends:\n{tail}") from exc
            raise

    await asyncio.gather(*(one(p, b) for p, b in zip(procs, bases, strict=True)))
    return time.monotonic() - began


async def counters(bases: list[str]) -> list[tuple[float, float]]:
    """(prefix-cache hits, queries) per engine, in tokens, from its /metrics."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for base in bases:
            async with session.get(base + "/metrics") as response:
                figures = _scalar_metrics(await response.text())
            out.append(
                (
                    figures.get("vllm:prefix_cache_hits_total", 0.0),
                    figures.get("vllm:prefix_cache_queries_total", 0.0),
                )
            )
    return out


async def reset_caches(bases: list[str]) -> None:
    """Empty every engine's prefix cache; it fails while blocks are held, so retry a while."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for base in bases:
            for _ in range(100):
                async with session.post(base + "/reset_prefix_cache") as response:
                    if response.status != 200:
                        raise RuntimeError(
                            f"{base}/reset_prefix_cache: {response.status} "
                            f"{await response.text()} (VLLM_SERVER_DEV_MODE unset?)"
                        )
                    if (await response.json()).get("success"):
                        break
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError(f"{base}/reset_prefix_cache kept failing")
            # vLLM publishes the reset (AllBlocksCleared) with its next step's batch: a
            # prompt shorter than a block makes that step and caches nothing.
            body = {"model": MODEL, "prompt": "flush", "max_tokens": 1}
            async with session.post(base + "/v1/completions", json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"{base}/v1/completions: {response.status}")


async def calibrate(bases: list[str], system_texts: list[str]) -> float:
    """Prefill tokens/s of one engine (cold prompt, one output token), as an operator measures.

    Also warms each engine up (the first requests after start are slow).
    """
    rates = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for base in bases:
            for n, text in enumerate([*system_texts[:2], *system_texts[-2:]]):
                messages = [
                    {"role": "system", "content": f"calibration {base} {n}. {text}"},
                    {"role": "user", "content": text},
                ]
                body = {"model": MODEL, "messages": messages, "max_tokens": 1}
                began = time.monotonic()
                async with session.post(base + "/v1/chat/completions", json=body) as response:
                    answer = await response.json()
                elapsed = time.monotonic() - began
                if n >= 2:  # the first two warm up
                    rates.append(answer["usage"]["prompt_tokens"] / elapsed)
    return sorted(rates)[len(rates) // 2]


# -- the workload ---------------------------------------------------------------------------


async def _rendered_system_tokens(session: aiohttp.ClientSession, base: str, text: str) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": text}],
        "add_generation_prompt": False,
    }
    async with session.post(base + "/tokenize", json=body) as response:
        return int((await response.json())["count"])


async def system_prompts(base: str, workload: Workload) -> tuple[list[str], list[int]]:
    """Texts whose rendered system message just exceeds `system_blocks` full KV blocks.

    A few tokens past the boundary, so the block boundary falls inside the
    system prompt (every full block is shared) and the user turn shares a
    partial last block with its tail (never cached: vLLM caches full blocks).
    """
    target = workload.system_blocks * CPU_BLOCK_SIZE + 4
    texts: list[str] = []
    counts: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for number in range(workload.prompts):
            words = _words(random.Random(f"system-{workload.seed}-{number}"), 3000).split()
            low, high = 1, len(words)
            while low < high:  # the fewest words that reach `target` tokens
                middle = (low + high) // 2
                text = f"Instructions for assistant {number}. " + " ".join(words[:middle])
                if await _rendered_system_tokens(session, base, text) >= target:
                    high = middle
                else:
                    low = middle + 1
            text = f"Instructions for assistant {number}. " + " ".join(words[:low])
            texts.append(text)
            counts.append(await _rendered_system_tokens(session, base, text))
    return texts, counts


async def prompt_lengths(base: str, trace: list[TraceRequest]) -> list[int]:
    """Every request's prompt tokens (rendered with the generation prompt), by `/tokenize`."""

    async def one(session: aiohttp.ClientSession, request: TraceRequest) -> int:
        body = {
            "model": MODEL,
            "messages": [{"role": role, "content": text} for role, text in request.messages],
            "add_generation_prompt": True,
        }
        async with session.post(base + "/tokenize", json=body) as response:
            return int((await response.json())["count"])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        return list(await asyncio.gather(*(one(session, r) for r in trace)))


def build_trace(workload: Workload, systems: list[str], duration_s: float) -> list[TraceRequest]:
    rng = random.Random(f"real-{workload.seed}")
    weights = [1 / (rank + 1) ** workload.zipf for rank in range(len(systems))]
    requests = []
    t = rng.expovariate(workload.rate)
    number = 0
    while t < duration_s:
        system = rng.choices(range(len(systems)), weights)[0]
        user = f"request {number}: " + _words(rng, rng.randint(8, 20))
        messages = (("system", systems[system]), ("user", user))
        requests.append(TraceRequest(t, messages, system, number, 0))
        number += 1
        t += rng.expovariate(workload.rate)
    return requests


# -- the targets ----------------------------------------------------------------------------


@dataclass
class Cell:
    target: str
    rep: int
    requests: int = 0
    errors: int = 0
    ttft_ms: dict[str, float] = field(default_factory=dict)
    hits: float = 0.0
    queries: float = 0.0
    engine_queries: list[float] = field(default_factory=list)
    peak_engine_busy: int = 0
    wall_s: float = math.nan
    # caravan's routers: share of requests whose prefix came from events (request log),
    # caravan_router_exact_prompts_total by outcome, KV deltas applied.
    events_share: float | None = None
    exact_prompts: dict[str, float] = field(default_factory=dict)
    kv_events: float | None = None
    kv_resyncs: float | None = None
    ttfts: list[float] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else math.nan


@dataclass(frozen=True)
class RealFleet:
    """Where the run's parts are: devcluster, the engines, their event sockets and relays."""

    consul_addr: str
    nomad_addr: str
    bases: list[str]
    placed: Placed
    events: list[str]  # each engine's KV-event endpoint (ipc://), in `bases`' order
    tokenizer: str  # the tiny model's folder: its tokenizer


@dataclass
class Target:
    """One target's URLs, and its caravan router (base URL, process log), if it has one."""

    urls: list[str]
    router: str | None = None
    log: Path | None = None


def _router_env(target: str, real: RealFleet) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "CONSUL_HTTP_ADDR": real.consul_addr,
        "NOMAD_ADDR": real.nomad_addr,
        "CARAVAN_ROUTER_PORT": "0",
        "CARAVAN_ROUTER_REGISTER_SERVICE": "false",
        # The approximate index (`caravan`, `caravan-<policy>`) or the engines' events.
        "CARAVAN_ROUTER_KV_EVENTS": "true" if target in EVENT_TARGETS else "false",
        # Info: the request lines, whose prefix_source is counted.
        "CARAVAN_ROUTER_LOG_LEVEL": "info",
        "CARAVAN_ROUTER_LOG_FORMAT": "json",
    }
    if target == "precise-wait":
        env["CARAVAN_ROUTER_EXACT_PREFIX_BUDGET_MS"] = "50"
    elif target.startswith("caravan-"):
        env["CARAVAN_ROUTER_POLICY"] = target.removeprefix("caravan-")
    return env


@contextlib.asynccontextmanager
async def target_urls(target: str, real: RealFleet, vllm_router: str | None) -> Any:
    """One target's URLs, with its router (if any) up until the block ends."""
    bases = real.bases
    if target in ("rr", "lor"):
        yield Target([base + "/v1/chat/completions" for base in bases])
        return
    with contextlib.ExitStack() as stack:
        if target.startswith("caravan") or target in EVENT_TARGETS:
            if target == "oracle":
                command = [
                    sys.executable, __file__, "oracle-router",
                    "--consul", real.consul_addr, "--nomad", real.nomad_addr,
                    "--events", ",".join(real.events), "--ids", ",".join(real.placed.ids),
                ]  # fmt: skip
                pattern = r"oracle router listening on (http://[\d.]+:\d+)"
            else:
                command = [sys.executable, "-m", "caravan_llm.router"]
                pattern = r"listening on (http://[\d.]+:\d+)"
            proc, match = stack.enter_context(
                started(command, pattern, env=_router_env(target, real))
            )
            base = match.group(1)
            await http_ok(base + "/health")
            if target in EVENT_TARGETS:
                await streams_live(base, len(bases))
            await asyncio.sleep(1.2)  # one engine scrape, for the load-reading policies
            yield Target([base + "/v1/chat/completions"], base, proc.log)
            return
        assert vllm_router is not None
        port = free_ports(1)[0]
        command = [
            vllm_router, "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *bases,
            "--policy", target.removeprefix("vllm-router-"), "--log-level", "warning",
        ]  # fmt: skip
        stack.enter_context(started(command, r""))
        base = f"http://127.0.0.1:{port}"
        await http_ok(base + "/health")
        yield Target([base + "/v1/chat/completions"])


async def streams_live(base: str, count: int) -> None:
    """Until the router follows every replica's KV stream (state live)."""

    async def check(_session: aiohttp.ClientSession) -> bool:
        return (await router_figures([base])).get("kv_streams_live", 0) == count

    await wait_until(check, f"{base}: {count} KV streams live")


async def run_cell(
    cell: Cell,
    trace: list[TraceRequest],
    *,
    fleet: Fleet,
    real: RealFleet,
    vllm_router: str | None,
    dump_requests: str = "",
) -> None:
    bases = real.bases
    await reset_caches(bases)
    async with target_urls(cell.target, real, vllm_router) as target:
        before = await counters(bases)
        ENGINE_BASES[:] = bases  # for play()'s running+waiting sampler
        outcomes, _, peak = await play(trace, cell.target, target.urls, fleet)
        after = await counters(bases)
        if target.router is not None and target.log is not None:
            sources, served = request_lines(target.log)
            for number, outcome in enumerate(outcomes):
                outcome.endpoint = served.get(trace_request_id(number))
            total = sum(sources.values())
            cell.events_share = sources.get("events", 0) / total if total else None
            figures = await router_figures([target.router])
            cell.kv_events = figures.get("kv_events")
            cell.kv_resyncs = figures.get("kv_resyncs")
            cell.exact_prompts = {
                k.removeprefix("exact_prompts_"): v
                for k, v in figures.items()
                if k.startswith("exact_prompts_")
            }
    summarise(cell, outcomes, before, after, peak)
    if dump_requests:
        write_requests(Path(f"{dump_requests}-{cell.target}-{cell.rep}.json"), trace, outcomes)


def summarise(
    cell: Cell,
    outcomes: list[Outcome],
    before: list[tuple[float, float]],
    after: list[tuple[float, float]],
    peak: int,
) -> None:
    cell.requests = len(outcomes)
    cell.errors = sum(not o.ok for o in outcomes)
    cell.ttfts = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
    cell.ttft_ms = {q: 1e3 * _percentile(cell.ttfts, f) for q, f in (("p50", 0.5), ("p99", 0.99))}
    cell.hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    cell.engine_queries = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    cell.queries = sum(cell.engine_queries)
    cell.peak_engine_busy = peak


def pooled(cells: list[Cell]) -> Cell:
    """One target over every repetition: counters summed, TTFTs pooled."""
    total = Cell(cells[0].target, -1)
    total.requests = sum(c.requests for c in cells)
    total.errors = sum(c.errors for c in cells)
    total.ttfts = [t for c in cells for t in c.ttfts]
    total.ttft_ms = {q: 1e3 * _percentile(total.ttfts, f) for q, f in (("p50", 0.5), ("p99", 0.99))}
    total.hits = sum(c.hits for c in cells)
    total.queries = sum(c.queries for c in cells)
    total.engine_queries = [sum(q) for q in zip(*(c.engine_queries for c in cells), strict=True)]
    total.peak_engine_busy = max(c.peak_engine_busy for c in cells)
    shares = [(c.events_share, c.requests) for c in cells if c.events_share is not None]
    if shares:
        total.events_share = sum(s * n for s, n in shares) / sum(n for _, n in shares)
    for c in cells:
        for outcome, count in c.exact_prompts.items():
            total.exact_prompts[outcome] = total.exact_prompts.get(outcome, 0.0) + count
    return total


# -- the oracle -----------------------------------------------------------------------------


def oracle_index() -> Any:
    """A KvIndex fed in this process from the engines' own sockets (`feed_engine`).

    The router's KV feed still reads the relays' streams into it; those calls
    are ignored. A replica is live from its first reading on, never stale:
    its set is the engine's events applied as they arrive.
    """
    from caravan_llm.router.core.kv_index import KvIndex  # noqa: PLC0415

    class OracleIndex(streamless_index()):
        __slots__ = ("fed",)

        def __init__(self) -> None:
            super().__init__()
            self.fed: set[str] = set()

        def feed_snapshot(self, replica: str, snapshot: Any, now: float) -> None:
            self.fed.add(replica)
            KvIndex.apply_snapshot(self, replica, snapshot, now)

        def feed_delta(self, replica: str, delta: Any, now: float) -> None:
            KvIndex.apply_delta(self, replica, delta, now)

        def state(self, replica: str, now: float) -> Any:
            if replica in self.fed and not self.needs_snapshot(replica):
                return "live"
            return super().state(replica, now)

    return OracleIndex()


async def feed_engine(index: Any, replica: str, endpoint: str) -> None:
    """Apply one engine's KV-event batches to `index` as they arrive, named as its relay names
    them (the relay's own `RelayState`, keyed with the engine key), with no relay in between."""
    import zmq  # noqa: PLC0415
    import zmq.asyncio  # noqa: PLC0415

    from caravan_llm.common.block_digest import DigestKey  # noqa: PLC0415
    from caravan_llm.kvrelay.events import relay_events  # noqa: PLC0415
    from caravan_llm.kvrelay.state import RelayState  # noqa: PLC0415
    from caravan_llm.kvrelay.wire import KvWireError, decode_frame  # noqa: PLC0415

    state = RelayState(epoch=1, block_size=CPU_BLOCK_SIZE, key=DigestKey.from_secret(KEY))
    index.feed_snapshot(replica, state.snapshot(), time.monotonic())
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(endpoint)
    try:
        while True:
            parts = await sub.recv_multipart()
            try:
                batch = decode_frame(parts)
            except KvWireError:
                continue
            applied = state.apply(batch.seq, relay_events(batch).events)
            now = time.monotonic()
            if applied.reset is not None:
                index.feed_snapshot(replica, state.snapshot(), now)
            elif applied.delta is not None:
                index.feed_delta(replica, applied.delta, now)
    finally:
        sub.close(linger=0)


def run_oracle_router(argv: list[str]) -> int:
    """The `oracle` target's router: caravan's router (default policy, its own tokenizers)
    whose exact index is `oracle_index`, fed by `feed_engine`; every request waits for its
    digests."""
    parser = argparse.ArgumentParser(prog="routing_quality_real.py oracle-router")
    parser.add_argument("--consul", required=True)
    parser.add_argument("--nomad", required=True)
    parser.add_argument("--events", required=True, help="the engines' KV-event endpoints")
    parser.add_argument("--ids", required=True, help="their endpoint ids, in the same order")
    args = parser.parse_args(argv)

    from aiohttp import web  # noqa: PLC0415
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from caravan_llm.common.consul_api import ConsulClient, ConsulSettings  # noqa: PLC0415
    from caravan_llm.common.log_format import configure_logging  # noqa: PLC0415
    from caravan_llm.common.nomad_api import NomadClient, NomadSettings  # noqa: PLC0415
    from caravan_llm.router.settings import RouterSettings  # noqa: PLC0415
    from caravan_llm.router.tokens.registry import Tokenizers  # noqa: PLC0415
    from caravan_llm.router.wiring.app import RUNTIME, app_runner, create_app  # noqa: PLC0415

    # Info: the request lines (as the other caravan targets write them), counted by the bench.
    configure_logging("info", "json")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        settings = RouterSettings(
            port=0, register_service=False, kv_events=True, exact_prefix_budget_ms=10_000.0
        )
        host, _, port = args.consul.rpartition(":")
        tokenizers = Tokenizers()
        async with (
            ConsulClient(ConsulSettings(host=host, port=int(port))) as consul,
            NomadClient(NomadSettings.from_env({"NOMAD_ADDR": args.nomad})) as nomad,
        ):
            app = create_app(
                settings,
                consul=consul,
                registry=CollectorRegistry(),
                nomad=nomad,
                prompt_tokens=tokenizers,
            )
            index = oracle_index()
            app[RUNTIME].state.kv = index
            feeds = [
                asyncio.create_task(feed_engine(index, replica, endpoint))
                for replica, endpoint in zip(
                    args.ids.split(","), args.events.split(","), strict=True
                )
            ]
            runner = app_runner(app, settings)
            await runner.setup()
            try:
                await web.TCPSite(runner, "127.0.0.1", 0).start()
                print(
                    f"oracle router listening on http://127.0.0.1:{runner.addresses[0][1]}",
                    flush=True,
                )
                await stop.wait()
            finally:
                for feed in feeds:
                    feed.cancel()
                await asyncio.gather(*feeds, return_exceptions=True)
                await runner.cleanup()
                tokenizers.close()

    asyncio.run(main())
    return 0


# -- the report -----------------------------------------------------------------------------


def caption(workload: Workload, counts: list[int], prefill_rate: float, reps: int) -> str:
    working = workload.prompts * workload.system_blocks
    return (
        f"2 real vLLM 0.32 (CPU) servers, one core each, tiny model, eager, "
        f"{workload.kv_blocks} KV blocks of {CPU_BLOCK_SIZE} tokens each, "
        f"max {workload.max_num_seqs} sequences; {workload.prompts} system prompts of "
        f"{min(counts)}-{max(counts)} tokens ({workload.system_blocks} full blocks each, "
        f"{working} blocks in all: {working / workload.kv_blocks:.2f} x one cache), "
        f"Zipf {workload.zipf}, short user turns, {workload.max_tokens} output tokens, streamed; "
        f"{workload.rate:g} requests/s open loop, "
        f"{workload.duration_s:.0f} s of arrivals per cell, "
        f"{reps} repetition(s) of every target, interleaved; caches reset before each cell; "
        f"measured prefill {prefill_rate:.0f} tokens/s per engine (declared in Meta); "
        f"seed {workload.seed}; cores: {os.cpu_count()}"
    )


def print_report(cells: list[Cell], targets: list[str], text: str) -> None:
    print(f"\n{text}\n")
    header = (
        "| target | requests | errors | fleet hit rate | TTFT p50 ms | TTFT p99 ms "
        "| engine split | peak busy | prefix from events | exact prompts |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    totals = {t: pooled([c for c in cells if c.target == t]) for t in targets}
    for target, c in totals.items():
        split = "/".join(f"{q / c.queries:.2f}" for q in c.engine_queries) if c.queries else "-"
        events = "-" if c.events_share is None else f"{c.events_share:.2f}"
        exact = ", ".join(f"{k} {v:.0f}" for k, v in sorted(c.exact_prompts.items()) if v) or "-"
        print(
            f"| {target} | {c.requests} | {c.errors} | {_fmt(c.hit_rate, 3)} | "
            f"{_fmt(c.ttft_ms['p50'], 1)} | {_fmt(c.ttft_ms['p99'], 1)} | {split} | "
            f"{c.peak_engine_busy} | {events} | {exact} |"
        )
    reps = sorted({c.rep for c in cells})
    if len(reps) > 1:
        print("\nPer repetition (fleet hit rate, TTFT p50 ms):\n")
        print("| target | " + " | ".join(f"rep {r}" for r in reps) + " |")
        print("|---|" + "---|" * len(reps))
        for target in targets:
            row = []
            for rep in reps:
                mine = [c for c in cells if c.target == target and c.rep == rep]
                row.append(
                    f"{_fmt(mine[0].hit_rate, 3)}, {_fmt(mine[0].ttft_ms['p50'], 1)}"
                    if mine
                    else "-"
                )
            print(f"| {target} | " + " | ".join(row) + " |")
    rr = totals.get("rr")
    peers = [c for t, c in totals.items() if t.startswith("vllm-router-")]
    best_peer = max(peers, key=lambda c: c.hit_rate, default=None)
    print_precise_ratios(totals, rr, best_peer)
    mine = totals.get(DEFAULT_TARGET)
    if mine is None:
        return
    hit_rr = _ratio(mine.hit_rate, rr.hit_rate if rr else None)
    hit_peer = _ratio(mine.hit_rate, best_peer.hit_rate if best_peer else None)
    ttft_rr = _ratio(mine.ttft_ms["p50"], rr.ttft_ms["p50"] if rr else None)
    print(f"\nRatios of `{DEFAULT_TARGET}` (caravan's default policy), all repetitions pooled:\n")
    print(
        "| hit rate / rr's | hit rate / best vllm-router's | TTFT p50 / rr's "
        "| best vllm-router | errors (all targets) |"
    )
    print("|---|---|---|---|---|")
    print(
        f"| {hit_rr} | {hit_peer} | {ttft_rr} | "
        f"{best_peer.target if best_peer else '-'} | {sum(c.errors for c in cells)} |"
    )
    checks = [
        ("hit rate >= 1.5 x rr's", hit_rr, lambda r: r >= 1.5),
        ("hit rate >= best vllm-router's", hit_peer, lambda r: r >= 1.0),
        ("TTFT p50 <= rr's", ttft_rr, lambda r: r <= 1.0),
    ]
    print()
    for name, value, passes in checks:
        verdict = "n/a" if value == "-" else ("yes" if passes(float(value)) else "NO")
        print(f"- {name}: {verdict} ({value})")


def print_precise_ratios(totals: dict[str, Cell], rr: Cell | None, best_peer: Cell | None) -> None:
    """Issue 24's bar on real engines: precise routing's fleet hit rate against the
    approximate index (`caravan`) and the oracle, and against rr and vllm-router's best."""
    approx, oracle = totals.get(DEFAULT_TARGET), totals.get("oracle")
    for name in ("precise", "precise-wait"):
        precise = totals.get(name)
        if precise is None:
            continue
        against = {
            "approximate index": approx,
            "oracle": oracle,
            "rr": rr,
            "best vllm-router": best_peer,
        }
        ratios = {
            k: _ratio(precise.hit_rate, v.hit_rate if v else None) for k, v in against.items()
        }
        print(f"\nFleet hit rate of `{name}`, all repetitions pooled, over:\n")
        print("| " + " | ".join(ratios) + " |")
        print("|" + "---|" * len(ratios))
        print("| " + " | ".join(ratios.values()) + " |")
        print()
        for label, base, bar in (
            (">= the approximate index's", approx, 1.0),
            ("within 5% of the oracle's", oracle, 0.95),
        ):
            print(f"- {name} {label}: {precise_verdict(precise, base, bar)}")


def precise_verdict(precise: Cell, base: Cell | None, bar: float) -> str:
    """Whether precise's pooled hit rate over `base`'s reaches `bar`, judged on the
    unrounded ratio (a table's 1.00 can be 0.997), which it prints to 4 decimals."""
    if base is None or math.isnan(precise.hit_rate) or not base.hit_rate > 0:
        return "n/a (-)"
    ratio = precise.hit_rate / base.hit_rate
    return f"{'yes' if ratio >= bar else 'NO'} ({ratio:.4f})"


# -- orchestration --------------------------------------------------------------------------


def estimated_wall_s(workload: Workload, targets: list[str], reps: int) -> float:
    per_target = sum(
        STARTUP_S.get("vllm-router" if t.startswith("vllm-router") else t.split("-")[0], 4.5)
        for t in targets
    )
    return SERVERS_S + reps * (per_target + len(targets) * (workload.duration_s + 1.5))


def find_vllm_router() -> str | None:
    # On PATH, or beside this interpreter (`.venv/bin/python bench/...` without activating).
    return (
        os.environ.get("CARAVAN_BENCH_VLLM_ROUTER")
        or shutil.which("vllm-router")
        or shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    )


def choose_targets(text: str, vllm_router: str | None) -> list[str]:
    targets = text.split(",") if text else ["rr", "lor", DEFAULT_TARGET, "precise", "oracle"]
    if not text and vllm_router is not None:
        targets += [f"vllm-router-{p}" for p in VLLM_ROUTER_POLICIES]
    if vllm_router is None:
        dropped = [t for t in targets if t.startswith("vllm-router-")]
        if dropped or not text:
            print(f"vllm-router not installed: {dropped or 'its policies'} skipped")
        targets = [t for t in targets if not t.startswith("vllm-router-")]
    return targets


def orchestrate(args: argparse.Namespace, workload: Workload) -> int:
    # SIGTERM unwinds like Ctrl-C, so every started process is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    build = find_vllm()
    if build is None:
        print(_missing_build(), file=sys.stderr)
        return 2
    vllm_router = find_vllm_router()
    targets = choose_targets(args.targets, vllm_router)
    unknown = [
        t for t in targets
        if t not in ("rr", "lor", DEFAULT_TARGET, *EVENT_TARGETS)
        and not t.startswith("caravan-")
        and t.removeprefix("vllm-router-") not in VLLM_ROUTER_POLICIES
    ]  # fmt: skip
    if unknown:
        print(f"unknown targets: {unknown}", file=sys.stderr)
        return 2
    working = workload.prompts * workload.system_blocks
    print(
        f"targets: {', '.join(targets)}; {args.reps} repetition(s); "
        f"~{workload.rate * workload.duration_s:.0f} requests per cell; working set {working} "
        f"blocks vs {workload.kv_blocks} per engine ({2 * workload.kv_blocks} in two)"
    )
    if not workload.kv_blocks < working <= 2 * workload.kv_blocks:
        print("  warning: the working set does not exceed one cache and fit in two")
    estimate = estimated_wall_s(workload, targets, args.reps)
    print(f"estimated wall time: {estimate / 60:.1f} min", flush=True)
    if args.plan_only:
        return 0
    began = time.monotonic()
    cells: list[Cell] = []
    with contextlib.ExitStack() as stack:
        _, consul = stack.enter_context(
            started(
                [
                    sys.executable,
                    "-m",
                    "caravan_llm.devcluster",
                    "--consul-port",
                    "0",
                    "--dns-port",
                    "0",
                    "--nomad-port",
                    "0",
                    "--nodes",
                    "0",
                ],
                r"CONSUL_HTTP_ADDR=([\d.:]+)[\s\S]*?NOMAD_ADDR=(\S+)",
            )
        )
        consul_addr, nomad_addr = consul.group(1), consul.group(2)
        ports = free_ports(4)  # the engines', then their relays'
        bases = [f"http://127.0.0.1:{port}" for port in ports[:2]]
        procs = []
        scratches = []
        for core, port in enumerate(ports[:2]):
            tmpdir = tempfile.mkdtemp(prefix="cvl-")
            scratches.append(tmpdir)
            stack.callback(shutil.rmtree, tmpdir, ignore_errors=True)  # after the stop below
            command = server_command(str(build.python), str(build.model), port, workload, tmpdir)
            proc, _ = stack.enter_context(
                started(command, r"", env=server_env(core, tmpdir), new_session=True)
            )
            procs.append(proc)
        ready_s = asyncio.run(wait_ready(procs, bases))
        print(f"vLLM servers ready in {ready_s:.0f} s", flush=True)
        systems, counts = asyncio.run(system_prompts(bases[0], workload))
        prefill_rate = asyncio.run(calibrate(bases, systems))
        fleet = Fleet(
            engines=2,
            max_num_seqs=workload.max_num_seqs,
            block_size=CPU_BLOCK_SIZE,
            kv_blocks=workload.kv_blocks,
            chunk_tokens=2048,
            prefill_s_per_token=1 / prefill_rate,
            step_s=0.0,
            output_tokens=workload.max_tokens,
        )
        # Placed as the scheduler places replicas: the engine key in Nomad Variables, the
        # relays' ports in `placements/<model>`, the tiny model's tokenizer in the profile.
        placed = asyncio.run(
            place_fleet(consul_addr, nomad_addr, fleet, str(build.model), ports=ports)
        )
        for scratch, port in zip(scratches, placed.relay_ports, strict=True):
            stack.enter_context(started(*relay_command(scratch, port)))
            asyncio.run(http_ok(f"http://127.0.0.1:{port}/health"))
        asyncio.run(engines_passing(consul_addr, 2))
        real = RealFleet(
            consul_addr=consul_addr,
            nomad_addr=nomad_addr,
            bases=bases,
            placed=placed,
            events=[events_endpoints(scratch)[0] for scratch in scratches],
            tokenizer=str(build.model),
        )
        trace = build_trace(workload, systems, workload.duration_s)
        lengths = asyncio.run(prompt_lengths(bases[0], trace))
        # The user turn must stay in the partial block after the shared ones (with the
        # output), or each request would leave a full block of its own in the cache.
        limit = (workload.system_blocks + 1) * CPU_BLOCK_SIZE - workload.max_tokens
        if max(lengths, default=0) > limit:
            print(f"  warning: prompts up to {max(lengths)} tokens, over {limit}")
        print(
            f"system prompts {min(counts)}-{max(counts)} tokens, whole prompts "
            f"{min(lengths, default=0)}-{max(lengths, default=0)}; "
            f"{len(trace)} requests per cell; "
            f"prefill {prefill_rate:.0f} tokens/s per engine; set up in "
            f"{time.monotonic() - began:.0f} s",
            flush=True,
        )
        for rep in range(args.reps):
            order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
            for target in order:
                cell = Cell(target, rep)
                cell_began = time.monotonic()
                asyncio.run(
                    run_cell(
                        cell, trace, fleet=fleet, real=real, vllm_router=vllm_router,
                        dump_requests=args.dump_requests,
                    )
                )  # fmt: skip
                cell.wall_s = time.monotonic() - cell_began
                cells.append(cell)
                events = (
                    ""
                    if cell.events_share is None
                    else f", prefix from events {cell.events_share:.2f}, KV deltas applied "
                    f"{cell.kv_events or 0:.0f}, resyncs {cell.kv_resyncs or 0:.0f}"
                )
                print(
                    f"  {target} rep {rep}: hit rate {_fmt(cell.hit_rate, 3)}, TTFT p50 "
                    f"{_fmt(cell.ttft_ms['p50'], 1)} ms, p99 {_fmt(cell.ttft_ms['p99'], 1)} ms, "
                    f"errors {cell.errors}{events} ({cell.wall_s:.0f} s)",
                    flush=True,
                )
    print_report(cells, targets, caption(workload, counts, prefill_rate, args.reps))
    wall = time.monotonic() - began
    print(f"\ntotal wall time: {wall / 60:.1f} min (estimated {estimate / 60:.1f} min)")
    if args.out:
        rows = [
            {**{k: v for k, v in vars(c).items() if k != "ttfts"}, "hit_rate": c.hit_rate}
            for c in cells
        ]
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


def relay_command(scratch: str, port: int) -> tuple[list[str], str, dict[str, str]]:
    """A KV relay for the engine whose sockets are in `scratch`, as a replica's task runs it."""
    events, replay = events_endpoints(scratch)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "CARAVAN_KV_RELAY_EVENTS_ENDPOINT": events,
        "CARAVAN_KV_RELAY_REPLAY_ENDPOINT": replay,
        "CARAVAN_KV_RELAY_TOPIC": TOPIC,
        "CARAVAN_KV_RELAY_ENGINE_API_KEY": KEY,
        "CARAVAN_KV_RELAY_HOST": "127.0.0.1",
        "CARAVAN_KV_RELAY_PORT": str(port),
        "CARAVAN_KV_RELAY_LOG_LEVEL": "warning",
    }
    return [sys.executable, "-m", "caravan_llm.kvrelay"], r"", env


def main() -> int:
    if sys.argv[1:2] == ["oracle-router"]:
        return run_oracle_router(sys.argv[2:])
    defaults = Workload()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="", help="comma-separated (default: all)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of every target")
    parser.add_argument("--duration", type=float, default=defaults.duration_s)
    parser.add_argument("--rate", type=float, default=defaults.rate, help="requests/s")
    parser.add_argument("--prompts", type=int, default=defaults.prompts)
    parser.add_argument("--system-blocks", type=int, default=defaults.system_blocks)
    parser.add_argument("--zipf", type=float, default=defaults.zipf)
    parser.add_argument("--kv-blocks", type=int, default=defaults.kv_blocks)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", default="", help="write every cell as JSON here")
    parser.add_argument(
        "--dump-requests",
        default="",
        metavar="PREFIX",
        help="write each cell's requests (replica, TTFT) to PREFIX-<target>-<rep>.json",
    )
    parser.add_argument(
        "--plan-only", action="store_true", help="print the plan and the time estimate, stop"
    )
    parser.add_argument(
        "--quick", action="store_true", help="one repetition of 12 s cells (development)"
    )
    args = parser.parse_args()
    if args.quick:
        args.reps = 1
        args.duration = min(args.duration, 12.0)
    workload = Workload(
        prompts=args.prompts,
        system_blocks=args.system_blocks,
        zipf=args.zipf,
        rate=args.rate,
        duration_s=args.duration,
        max_tokens=args.max_tokens,
        kv_blocks=args.kv_blocks,
        seed=args.seed,
    )
    return orchestrate(args, workload)


if __name__ == "__main__":
    sys.exit(main())
