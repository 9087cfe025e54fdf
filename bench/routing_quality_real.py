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

Targets, interleaved (each repetition plays every target once, in rotated
order): `rr`, `lor` (client-side round robin / least outstanding requests,
straight to the engines), `caravan` (caravan's router, `python -m caravan_llm.router`,
with its default policy; `caravan-<policy>` for another), and vllm-router's
`cache_aware` and `power_of_two` when the `vllm-router` command is installed.
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
    register_engines,
    wait_until,
)
from caravan_llm.devcluster.vllm_build import API_SERVER_MODULE, CPU_BLOCK_SIZE, find_vllm
from caravan_llm.devcluster.vllm_build import missing_build_message as _missing_build

DEFAULT_TARGET = "caravan"  # the router with no policy set: its default (predicted_ttft)
SERVED_NAME = "tiny"
READY_TIMEOUT_S = 240.0  # 30-80 s on 2 cores; up to ~140 s seen on a loaded machine
# Seconds a cell takes beyond its arrivals: reset, router start (+1 scrape), drain.
STARTUP_S = {"rr": 1.0, "lor": 1.0, "caravan": 4.5, "vllm-router": 3.0}
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


def server_command(python: str, model: str, port: int, workload: Workload) -> list[str]:
    # Served as `tiny` and as the benches' model name, which the Consul Meta and
    # the traces of routing_quality use (vLLM takes several served names).
    return [
        python, "-W", "ignore::DeprecationWarning", "-m", API_SERVER_MODULE,
        "--model", model, "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", SERVED_NAME, MODEL,
        "--max-model-len", "2048", "--enable-prefix-caching", "--enforce-eager",
        "--num-gpu-blocks-override", str(workload.kv_blocks),
        "--max-num-seqs", str(workload.max_num_seqs),
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
    ttfts: list[float] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else math.nan


@contextlib.asynccontextmanager
async def target_urls(
    target: str, bases: list[str], consul_addr: str, vllm_router: str | None
) -> Any:
    """The URLs one target's requests go to, with its router (if any) up until the block ends."""
    if target in ("rr", "lor"):
        yield [base + "/v1/chat/completions" for base in bases]
        return
    with contextlib.ExitStack() as stack:
        if target.startswith("caravan"):
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO),
                "CONSUL_HTTP_ADDR": consul_addr,
                "CARAVAN_ROUTER_PORT": "0",
                "CARAVAN_ROUTER_REGISTER_SERVICE": "false",
                # Registered directly: no Nomad allocation behind them to verify them by.
                "CARAVAN_ROUTER_ALLOW_UNVERIFIED_ENDPOINTS": "true",
                "CARAVAN_ROUTER_LOG_LEVEL": os.environ.get(
                    "CARAVAN_BENCH_ROUTER_LOG_LEVEL", "warning"
                ),
            }
            if target != DEFAULT_TARGET:
                env["CARAVAN_ROUTER_POLICY"] = target.removeprefix("caravan-")
            _, match = stack.enter_context(
                started(
                    [sys.executable, "-m", "caravan_llm.router"],
                    r"listening on http://[\d.]+:(\d+)",
                    env=env,
                )
            )
            base = f"http://127.0.0.1:{match.group(1)}"
            await http_ok(base + "/health")
            await asyncio.sleep(1.2)  # one engine scrape, for the load-reading policies
        else:
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
        yield [base + "/v1/chat/completions"]


async def run_cell(
    cell: Cell,
    trace: list[TraceRequest],
    *,
    fleet: Fleet,
    bases: list[str],
    consul_addr: str,
    vllm_router: str | None,
) -> None:
    await reset_caches(bases)
    async with target_urls(cell.target, bases, consul_addr, vllm_router) as urls:
        before = await counters(bases)
        ENGINE_BASES[:] = bases  # for play()'s running+waiting sampler
        outcomes, _, peak = await play(trace, cell.target, urls, fleet)
        after = await counters(bases)
    summarise(cell, outcomes, before, after, peak)


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
    return total


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
        "| engine split | peak busy |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    totals = {t: pooled([c for c in cells if c.target == t]) for t in targets}
    for target, c in totals.items():
        split = "/".join(f"{q / c.queries:.2f}" for q in c.engine_queries) if c.queries else "-"
        print(
            f"| {target} | {c.requests} | {c.errors} | {_fmt(c.hit_rate, 3)} | "
            f"{_fmt(c.ttft_ms['p50'], 1)} | {_fmt(c.ttft_ms['p99'], 1)} | {split} | "
            f"{c.peak_engine_busy} |"
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
    mine = totals.get(DEFAULT_TARGET)
    if mine is None:
        return
    rr = totals.get("rr")
    peers = [c for t, c in totals.items() if t.startswith("vllm-router-")]
    best_peer = max(peers, key=lambda c: c.hit_rate, default=None)
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
    targets = text.split(",") if text else ["rr", "lor", DEFAULT_TARGET]
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
        if t not in ("rr", "lor", DEFAULT_TARGET)
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
                ],
                r"CONSUL_HTTP_ADDR=([\d.:]+)",
            )
        )
        consul_addr = consul.group(1)
        ports = free_ports(2)
        bases = [f"http://127.0.0.1:{port}" for port in ports]
        procs = []
        for core, port in enumerate(ports):
            tmpdir = tempfile.mkdtemp(prefix="cvl-")
            stack.callback(shutil.rmtree, tmpdir, ignore_errors=True)  # after the stop below
            command = server_command(str(build.python), str(build.model), port, workload)
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
        asyncio.run(register_engines(consul_addr, ports, fleet))
        asyncio.run(engines_passing(consul_addr, 2))
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
                        cell, trace, fleet=fleet, bases=bases, consul_addr=consul_addr,
                        vllm_router=vllm_router,
                    )
                )  # fmt: skip
                cell.wall_s = time.monotonic() - cell_began
                cells.append(cell)
                print(
                    f"  {target} rep {rep}: hit rate {_fmt(cell.hit_rate, 3)}, TTFT p50 "
                    f"{_fmt(cell.ttft_ms['p50'], 1)} ms, p99 {_fmt(cell.ttft_ms['p99'], 1)} ms, "
                    f"errors {cell.errors} ({cell.wall_s:.0f} s)",
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


def main() -> int:
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
