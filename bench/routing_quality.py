"""Which replica a request goes to: time to first token per routing policy, on simulated engines.

    python bench/routing_quality.py --quick          # development: short cells, few targets
    python bench/routing_quality.py                  # the recorded run (docs/benchmarks.md)
    python bench/routing_quality.py --targets rr,caravan-predicted_ttft --workloads shared

A fleet of N simulated vLLM engines (caravan_llm.devcluster.engine; prefill slowed so that
where a request lands decides what it waits for, a small KV cache so that not
every engine can hold every prefix) is registered in devcluster's Consul as
caravan replicas (service, tag and Meta as Nomad renders them). The same
deterministic open-loop trace of streaming chat requests then goes to each
target:

- `rr`, `lor`: client-side round robin / least outstanding requests straight
  to the engines (the baselines; no router in the path);
- `caravan-<policy>`: caravan's router (`python -m caravan_llm.router`), one per policy;
- `vllm-router-<policy>`: vllm-router `cache_aware` and `power_of_two`, when
  the `vllm-router` command is installed (`pip install vllm-router`).

Workloads (each seeded, the same bytes for every target): `shared`, 16 long
system prompts with Zipf popularity, multi-turn conversations whose history
grows by long user turns; `unique`, one-turn prompts of varied length with
nothing shared; `mixed`, unique prompts, mostly short with some very long.
Loads are fractions of the fleet's prefill capacity under round robin
(computed from the trace itself): light, near saturation, over saturation.

Every cell (workload x load x target) starts from cold caches: the engines
and the router are restarted for it. Cells run interleaved (for each
workload and load, every target in turn, rotated per repetition), so that
whatever else runs on the machine hits the targets alike. Reported per cell:
TTFT p50/p90/p99, end-to-end p99, completed requests/s, errors, the fleet's
prefix-cache hit rate (engine counters), the share of requests whose shared
system prompt was not cached where they ran, the share of later turns that
found their whole history cached (both from the engines' `cached_tokens`),
and the largest running+waiting count seen on one engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.processes import started  # noqa: E402 - needs the repository on sys.path

MODEL = "bench"
SERVICE = f"caravan-{MODEL}"

CARAVAN_POLICIES = (
    "round_robin",
    "least_inflight",
    "power_of_two",
    "load_aware",
    "prefix_affinity",
    "predicted_ttft",
)
VLLM_ROUTER_POLICIES = ("cache_aware", "power_of_two")
LOADS = {"light": 0.25, "near": 0.6, "over": 0.85}
WORKLOADS = ("shared", "unique", "mixed")


@dataclass(frozen=True)
class Fleet:
    """The simulated engines: chosen so that placement decides TTFT (printed with the table)."""

    engines: int = 4
    max_num_seqs: int = 32
    block_size: int = 16
    kv_blocks: int = 2048  # 32k tokens of KV each
    chunk_tokens: int = 512  # --max-num-batched-tokens
    prefill_s_per_token: float = 0.0002  # 5k tokens/s before step overhead
    step_s: float = 0.015
    decode_s_per_seq: float = 0.0002
    output_tokens: int = 24

    @property
    def prefill_tokens_per_s(self) -> float:
        """One engine's prefill throughput in full chunks (step overhead included)."""
        return self.chunk_tokens / (self.step_s + self.chunk_tokens * self.prefill_s_per_token)

    @property
    def declared_prefill_tokens_per_s(self) -> int:
        """The profile's `prefill_tokens_per_s`, as an operator would measure it."""
        return round(self.prefill_tokens_per_s)

    def engine_args(self, port: int, seed: int) -> list[str]:
        return [
            "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-model-len", "32768",
            "--max-num-batched-tokens", str(self.chunk_tokens),
            "--block-size", str(self.block_size),
            "--num-gpu-blocks-override", str(self.kv_blocks),
            "--enable-prompt-tokens-details",
            "--sim-load-seconds", "0.1",
            "--sim-prefill-seconds-per-token", str(self.prefill_s_per_token),
            "--sim-step-seconds", str(self.step_s),
            "--sim-decode-seconds-per-seq", str(self.decode_s_per_seq),
            "--sim-output-tokens", str(self.output_tokens),
            "--sim-seed", str(seed),
        ]  # fmt: skip

    def caption(self) -> str:
        return (
            f"{self.engines} simulated vLLM engines: prefill "
            f"{1 / self.prefill_s_per_token:.0f} tokens/s in {self.chunk_tokens}-token chunks "
            f"(step {1e3 * self.step_s:.0f} ms, "
            f"so about {self.prefill_tokens_per_s:.0f} tokens/s), "
            f"{self.kv_blocks * self.block_size} tokens of KV, {self.max_num_seqs} sequences, "
            f"up to {self.output_tokens} output tokens; the profile declares "
            f"prefill_tokens_per_s {self.declared_prefill_tokens_per_s}"
        )


# -- traces ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    at: float  # seconds after the start
    messages: tuple[tuple[str, str], ...]
    system: int | None  # which shared system prompt, if any
    conversation: int | None
    turn: int  # 0 = first


def _words(rng: random.Random, count: int) -> str:
    syllables = ("ka", "lo", "mi", "ra", "te", "su", "no", "vi", "de", "po", "xa", "ge")
    return " ".join(
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(count)
    )


def _system_prompts(count: int, words: int) -> list[str]:
    rng = random.Random(1234)
    return [f"Instructions for assistant {n}. " + _words(rng, words) for n in range(count)]


def build_trace(
    workload: str, seed: int, duration_s: float, rate_scale: float
) -> list[TraceRequest]:
    """The requests of one cell; `rate_scale` multiplies the arrival rate (load)."""
    rng = random.Random(f"{workload}-{seed}")
    requests: list[TraceRequest] = []
    if workload == "shared":
        systems = _system_prompts(16, 1100)
        weights = [1 / (rank + 1) ** 1.1 for rank in range(16)]
        rate = 1.0 * rate_scale  # conversations per second
        t = rng.expovariate(rate)
        conversation = 0
        while t < duration_s:
            system = rng.choices(range(16), weights)[0]
            history: list[tuple[str, str]] = [("system", systems[system])]
            at = t
            for turn in range(rng.randint(2, 5)):
                history.append(
                    (
                        "user",
                        f"conversation {conversation} turn {turn}: "
                        + _words(rng, rng.randint(150, 450)),
                    )
                )
                requests.append(TraceRequest(at, tuple(history), system, conversation, turn))
                history.append(("assistant", _words(rng, 60)))
                at += rng.uniform(1.5, 3.5)
            conversation += 1
            t += rng.expovariate(rate)
    else:
        rate = 1.0 * rate_scale
        t = rng.expovariate(rate)
        n = 0
        while t < duration_s:
            if workload == "unique":
                length = rng.randint(200, 2500)
            else:  # mixed: mostly short, some very long
                length = rng.randint(2500, 3500) if rng.random() < 0.2 else rng.randint(40, 200)
            text = f"request {seed}-{n}: " + _words(rng, length)
            requests.append(TraceRequest(t, (("user", text),), None, None, 0))
            n += 1
            t += rng.expovariate(rate)
    requests.sort(key=lambda r: r.at)
    return requests


def _tokens(text: str) -> int:
    from caravan_llm.devcluster.engine.text import count_tokens  # noqa: PLC0415

    return count_tokens(text)


def round_robin_work(trace: list[TraceRequest], engines: int) -> float:
    """Mean prefill tokens per request if requests were spread without regard to caches.

    A shared system prompt counts as cached (every engine soon holds the popular
    ones); the history of a later turn is cached with probability 1/engines.
    """
    if not trace:
        return 1.0
    total = 0.0
    for request in trace:
        sizes = [_tokens(text) + 5 for _, text in request.messages]
        if request.system is None:
            total += sum(sizes)
            continue
        new = sizes[-1]
        history = sum(sizes[1:-1])
        total += new + history * (1 - 1 / engines)
    return total / len(trace)


# Seconds of arrivals of the probe a load is calibrated on (the cell length of runs 1-3).
PROBE_S = 12.0


def scaled_trace(
    workload: str, load: float, seed: int, duration_s: float, fleet: Fleet
) -> list[TraceRequest]:
    """The trace at `load` x the fleet's prefill capacity under round robin."""
    return build_trace(workload, seed, duration_s, load_scale(workload, load, seed, fleet))


def load_scale(workload: str, load: float, seed: int, fleet: Fleet) -> float:
    """The `build_trace` rate scale that puts the workload at `load` (see `scaled_trace`)."""
    # A dense probe (many requests), so the work per request and the request
    # rate it is scaled from are not the noise of a dozen samples. Its length
    # is fixed: a longer cell has the same arrival rate, not a new calibration.
    probe_scale = 20.0
    probe = build_trace(workload, seed, PROBE_S, probe_scale)
    per_request = round_robin_work(probe, fleet.engines)
    # Later turns run past the arrival window: the rate is over the whole span.
    span = max((r.at for r in probe), default=PROBE_S)
    requests_per_unit = len(probe) / max(span, 1e-9)
    target_rps = load * fleet.engines * fleet.prefill_tokens_per_s / per_request
    return probe_scale * target_rps / max(requests_per_unit, 1e-9)


# -- the engines (one process, one event loop, N instances) ---------------------------------


def run_engines(ports: list[int], fleet: Fleet, seed: int) -> None:
    from caravan_llm.devcluster.engine.flags import parse_engine_args  # noqa: PLC0415
    from caravan_llm.devcluster.engine.server import run_engine  # noqa: PLC0415

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        async with contextlib.AsyncExitStack() as stack:
            running = [
                await stack.enter_async_context(
                    run_engine(
                        parse_engine_args(
                            ["--flavor", "vllm", *fleet.engine_args(port, seed + i)], {}
                        )
                    )
                )
                for i, port in enumerate(ports)
            ]
            for item in running:
                await item.engine.ready.wait()
            print("engines ready", flush=True)
            await stop.wait()

    asyncio.run(main())


# -- the load generator ---------------------------------------------------------------------


@dataclass
class Outcome:
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    done_at: float | None = None
    # The replica that served it, where the target can say (caravan's request log, the replay).
    endpoint: str | None = None


def _body(request: TraceRequest, fleet: Fleet) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": role, "content": text} for role, text in request.messages],
            "max_tokens": fleet.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


async def _send(
    session: aiohttp.ClientSession, url: str, body: bytes, request_id: str | None = None
) -> Outcome:
    loop = asyncio.get_running_loop()
    started = loop.time()
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    pending = b""
    try:
        headers = {"Content-Type": "application/json"}
        if request_id is not None:
            headers["x-request-id"] = request_id
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                await response.read()
                return Outcome(ok=False)
            finished = False
            async for data in response.content.iter_any():
                pending += data
                while b"\n\n" in pending:
                    event, pending = pending.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue  # SSE comments (a router holding the request)
                    payload = event[6:]
                    if payload == b"[DONE]":
                        finished = True
                        continue
                    if ttft is None:
                        ttft = loop.time() - started
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        return Outcome(ok=False)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
            if not finished:
                return Outcome(ok=False)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return Outcome(ok=False)
    end = loop.time()
    details = (usage or {}).get("prompt_tokens_details") or {}
    return Outcome(
        ok=True,
        ttft_s=ttft,
        e2e_s=end - started,
        prompt_tokens=(usage or {}).get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
        done_at=end,
    )


def write_requests(path: Path, trace: list[TraceRequest], outcomes: list[Outcome]) -> None:
    """Every request of a cell (`--dump-requests`): when it was sent, its system prompt,
    conversation and turn, the replica that served it (where the target can say), its
    prompt and cached tokens, and its TTFT."""
    rows = [
        {
            "at": r.at, "system": r.system, "conversation": r.conversation, "turn": r.turn,
            "endpoint": o.endpoint, "cached": o.cached_tokens, "prompt": o.prompt_tokens,
            "ttft": o.ttft_s,
        }
        for r, o in zip(trace, outcomes, strict=True)
    ]  # fmt: skip
    path.write_text(json.dumps(rows))


def trace_request_id(number: int) -> str:
    """The `x-request-id` of the trace's request `number` (a router's request log names it)."""
    return f"trace-{number}"


async def play(
    trace: list[TraceRequest], target: str, urls: list[str], fleet: Fleet
) -> tuple[list[Outcome], float, int]:
    """Send the trace open loop; the client-side policies pick among `urls` themselves."""
    loop = asyncio.get_running_loop()
    outstanding = [0] * len(urls)
    cursor = 0
    peak = 0
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        stop = asyncio.Event()

        async def sample_engines() -> None:
            nonlocal peak
            while not stop.is_set():
                for base in engine_bases:
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                        async with session.get(base + "/metrics") as response:
                            text = await response.text()
                        figures = _scalar_metrics(text)
                        busy = figures.get("vllm:num_requests_running", 0) + figures.get(
                            "vllm:num_requests_waiting", 0
                        )
                        peak = max(peak, int(busy))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)

        engine_bases = ENGINE_BASES
        sampler = asyncio.create_task(sample_engines())

        async def one(number: int, request: TraceRequest) -> Outcome:
            nonlocal cursor
            body = _body(request, fleet)
            if target == "rr":
                index = cursor % len(urls)
                cursor += 1
            elif target == "lor":
                fewest = min(outstanding)
                choices = [i for i, n in enumerate(outstanding) if n == fewest]
                index = choices[cursor % len(choices)]
                cursor += 1
            else:
                index = 0
            outstanding[index] += 1
            try:
                return await _send(session, urls[index], body, trace_request_id(number))
            finally:
                outstanding[index] -= 1

        begin = loop.time()
        tasks = []
        for number, request in enumerate(trace):
            delay = begin + request.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(number, request)))
        outcomes = list(await asyncio.gather(*tasks))
        stop.set()
        await sampler
    for outcome in outcomes:
        if outcome.done_at is not None:
            outcome.done_at -= begin
    return outcomes, begin, peak


ENGINE_BASES: list[str] = []


def _scalar_metrics(text: str) -> dict[str, float]:
    """Sum of every sample per name (labels ignored), for the few figures read here."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        with contextlib.suppress(ValueError, IndexError):
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


# -- orchestration --------------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """Ports that are free now, below the ephemeral range (32768 on Linux).

    The engines are restarted on the same ports for every cell; a port from
    the ephemeral range could meanwhile be taken by any outgoing connection.
    """
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


async def register_engines(consul_addr: str, ports: list[int], fleet: Fleet) -> None:
    from caravan_llm.common.consul_api import (  # noqa: PLC0415
        ConsulClient,
        ConsulSettings,
        HttpCheck,
        ServiceRegistration,
    )
    from caravan_llm.common.contract import encode_prefill_rate  # noqa: PLC0415

    host, _, consul_port = consul_addr.rpartition(":")
    async with ConsulClient(ConsulSettings(host=host, port=int(consul_port))) as consul:
        for replica, port in enumerate(ports):
            await consul.agent_service_register(
                ServiceRegistration(
                    name=SERVICE,
                    service_id=f"{SERVICE}-{replica}",
                    address="127.0.0.1",
                    port=port,
                    tags=("caravan",),
                    meta={
                        "caravan_model": MODEL,
                        "served_models": MODEL,
                        "engine": "vllm",
                        "replica": str(replica),
                        "capacity": str(fleet.max_num_seqs),
                        "metrics_path": "/metrics",
                        # What an operator measures and puts in the profile.
                        **encode_prefill_rate(fleet.declared_prefill_tokens_per_s),
                    },
                    checks=(HttpCheck(url=f"http://127.0.0.1:{port}/health", interval_s=0.5),),
                )
            )


async def wait_until(check: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                if await check(session):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            await asyncio.sleep(0.1)


async def engines_passing(consul_addr: str, count: int) -> None:
    async def check(session: aiohttp.ClientSession) -> bool:
        async with session.get(f"http://{consul_addr}/v1/health/service/{SERVICE}?passing=1") as r:
            return len(await r.json()) == count

    await wait_until(check, "engines passing in Consul")


async def http_ok(url: str) -> None:
    async def check(session: aiohttp.ClientSession) -> bool:
        async with session.get(url) as response:
            return response.status == 200

    await wait_until(check, url)


async def fleet_cache(bases: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    async with aiohttp.ClientSession() as session:
        for base in bases:
            async with session.get(base + "/metrics") as response:
                figures = _scalar_metrics(await response.text())
            hits += figures.get("vllm:prefix_cache_hits_total", 0.0)
            queries += figures.get("vllm:prefix_cache_queries_total", 0.0)
    return hits, queries


@dataclass
class Cell:
    workload: str
    load: str
    target: str
    rep: int
    requests: int = 0
    errors: int = 0
    ttft_ms: dict[str, float] = field(default_factory=dict)
    e2e_p99_ms: float = math.nan
    completed_per_s: float = math.nan
    hit_rate: float = math.nan
    prefix_missed: float | None = None
    history_cached: float | None = None
    # Of the later turns: the share sent to the replica of the conversation's previous
    # turn, and the history-cached share among those that stayed and those that moved
    # (None where the target does not say which replica served a request).
    history_stayed: float | None = None
    history_cached_stayed: float | None = None
    history_cached_moved: float | None = None
    # Of the later turns: the share sent before the previous turn's first token (its
    # prompt not yet computed there), and the history-cached share among those.
    history_early: float | None = None
    history_cached_early: float | None = None
    # Requests per replica (all, and first turns: where new conversations start).
    per_replica: dict[str, int] = field(default_factory=dict)
    first_turns_per_replica: dict[str, int] = field(default_factory=dict)
    peak_engine_busy: int = 0
    duration_s: float = math.nan  # seconds of arrivals
    wall_s: float = math.nan  # the whole cell: start, play, drain, stop


def _percentile(values: list[float], fraction: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def summarise(
    cell: Cell,
    trace: list[TraceRequest],
    outcomes: list[Outcome],
    system_tokens: list[int],
    block: int,
) -> None:
    cell.requests = len(outcomes)
    cell.errors = sum(not o.ok for o in outcomes)
    ttfts = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
    cell.ttft_ms = {f"p{int(q * 100)}": 1e3 * _percentile(ttfts, q) for q in (0.5, 0.9, 0.99)}
    cell.e2e_p99_ms = 1e3 * _percentile([o.e2e_s for o in outcomes if o.ok and o.e2e_s], 0.99)
    done = [o.done_at for o in outcomes if o.ok and o.done_at is not None]
    span = max(done) - trace[0].at if done and trace else math.nan
    cell.completed_per_s = len(done) / span if span and span > 0 else math.nan
    shared = [(r, o) for r, o in zip(trace, outcomes, strict=True) if r.system is not None and o.ok]
    if shared:
        cell.prefix_missed = sum(
            (o.cached_tokens or 0) < (system_tokens[r.system] // block) * block - block  # type: ignore[index]
            for r, o in shared
        ) / len(shared)
        previous: dict[int, tuple[TraceRequest, Outcome]] = {}
        later = cached = 0
        # (stayed, found its history) per later turn whose replicas are both known.
        placed: list[tuple[bool, bool]] = []
        early: list[bool] = []
        for request, outcome in sorted(shared, key=lambda item: item[0].at):
            conversation = request.conversation
            assert conversation is not None
            if outcome.endpoint is not None:
                served = outcome.endpoint
                cell.per_replica[served] = cell.per_replica.get(served, 0) + 1
                if request.turn == 0:
                    first = cell.first_turns_per_replica
                    first[served] = first.get(served, 0) + 1
            if request.turn > 0 and conversation in previous:
                before, served_before = previous[conversation]
                later += 1
                # Every block of the previous turn's prompt that this one can share was cached.
                history = shareable_history(before, request, block)
                found = (outcome.cached_tokens or 0) >= history
                cached += found
                first_token = served_before.ttft_s
                if first_token is not None and before.at + first_token > request.at:
                    early.append(found)
                if outcome.endpoint is not None and served_before.endpoint is not None:
                    placed.append((outcome.endpoint == served_before.endpoint, found))
            previous[conversation] = (request, outcome)
        cell.history_cached = cached / later if later else None
        cell.history_early = len(early) / later if later else None
        cell.history_cached_early = sum(early) / len(early) if early else None
        # A router's last request lines may still be in its log buffer: judged on the
        # later turns whose two replicas are known, when they are most of them.
        if placed and len(placed) >= 0.9 * later:
            stayed = [found for stay, found in placed if stay]
            moved = [found for stay, found in placed if not stay]
            cell.history_stayed = len(stayed) / len(placed)
            cell.history_cached_stayed = sum(stayed) / len(stayed) if stayed else None
            cell.history_cached_moved = sum(moved) / len(moved) if moved else None


def _prompt_tokens(request: TraceRequest) -> list[str]:
    from caravan_llm.devcluster.engine.text import ChatMessage, render_chatml, tokenize  # noqa: PLC0415

    messages = [ChatMessage(role, text) for role, text in request.messages]
    return tokenize(render_chatml(messages, add_generation_prompt=True))


def shareable_history(previous: TraceRequest, current: TraceRequest, block: int) -> int:
    """The previous turn's prompt tokens that the current turn's prompt can find cached.

    Their common token prefix, in full blocks. Not the whole previous prompt:
    its last token (the generation prompt's newline) is tokenized together
    with the reply's first word in the next turn, so a previous prompt that
    ends on a block boundary can never share its last block, on any engine.
    """
    common = 0
    for mine, theirs in zip(_prompt_tokens(previous), _prompt_tokens(current), strict=False):
        if mine != theirs:
            break
        common += 1
    return common // block * block


async def run_cell(
    cell: Cell,
    trace: list[TraceRequest],
    *,
    consul_addr: str,
    ports: list[int],
    fleet: Fleet,
    vllm_router: str | None,
    system_tokens: list[int],
    seed: int,
) -> None:
    python = sys.executable
    bases = [f"http://127.0.0.1:{port}" for port in ports]
    ENGINE_BASES[:] = bases
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            started(
                [
                    python,
                    __file__,
                    "engines",
                    "--ports",
                    ",".join(map(str, ports)),
                    "--seed",
                    str(seed),
                ],
                r"engines ready",
            )
        )
        await engines_passing(consul_addr, len(ports))
        if cell.target in ("rr", "lor"):
            urls = [base + "/v1/chat/completions" for base in bases]
        elif cell.target.startswith("caravan-"):
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO),
                "CONSUL_HTTP_ADDR": consul_addr,
                "CARAVAN_ROUTER_PORT": "0",
                "CARAVAN_ROUTER_REGISTER_SERVICE": "false",
                # The engines are registered directly, with no Nomad allocation or
                # scheduler placement behind them to verify them by.
                "CARAVAN_ROUTER_ALLOW_UNVERIFIED_ENDPOINTS": "true",
                "CARAVAN_ROUTER_POLICY": cell.target.removeprefix("caravan-"),
                "CARAVAN_ROUTER_LOG_LEVEL": os.environ.get(
                    "CARAVAN_BENCH_ROUTER_LOG_LEVEL", "warning"
                ),
            }
            _, match = stack.enter_context(
                started(
                    [python, "-m", "caravan_llm.router"],
                    r"listening on http://[\d.]+:(\d+)",
                    env=env,
                )
            )
            base = f"http://127.0.0.1:{match.group(1)}"
            await http_ok(base + "/health")
            await asyncio.sleep(1.2)  # one engine scrape, for the load-reading policies
            urls = [base + "/v1/chat/completions"]
        else:
            assert vllm_router is not None
            port = free_ports(1)[0]
            command = [
                vllm_router, "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *bases,
                "--policy", cell.target.removeprefix("vllm-router-"), "--log-level", "warning",
            ]  # fmt: skip
            # Readiness is its /health answering, polled below (the log line varies).
            stack.enter_context(started(command, r""))
            await http_ok(f"http://127.0.0.1:{port}/health")
            urls = [f"http://127.0.0.1:{port}/v1/chat/completions"]
        outcomes, _, peak = await play(trace, cell.target, urls, fleet)
        hits, queries = await fleet_cache(bases)
    cell.peak_engine_busy = peak
    cell.hit_rate = hits / queries if queries else math.nan
    summarise(cell, trace, outcomes, system_tokens, fleet.block_size)


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.{digits}f}"


def print_tables(cells: list[Cell], fleet: Fleet, args: argparse.Namespace) -> None:
    print(
        f"\n{fleet.caption()}; cores: {os.cpu_count()}; at least {args.duration:.0f} s of "
        f"arrivals and {args.min_requests} requests per cell, seed {args.seed}\n"
    )
    header = (
        "| workload | load | target | rep | requests | errors | TTFT p50 ms | p90 | p99 | "
        "e2e p99 ms | done/s | fleet hit rate | prefix missed | history cached | peak busy |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for c in cells:
        print(
            f"| {c.workload} | {c.load} | {c.target} | {c.rep} | {c.requests} | {c.errors} | "
            f"{_fmt(c.ttft_ms.get('p50'))} | {_fmt(c.ttft_ms.get('p90'))} | "
            f"{_fmt(c.ttft_ms.get('p99'))} | "
            f"{_fmt(c.e2e_p99_ms)} | {_fmt(c.completed_per_s, 2)} | {_fmt(c.hit_rate, 3)} | "
            f"{_fmt(c.prefix_missed, 3)} | {_fmt(c.history_cached, 3)} | {c.peak_engine_busy} |"
        )
    print("\nRatios against client-side round robin in the same repetition (TTFT p50 / p99):\n")
    print(
        "| workload | load | target | rep | p50 / RR | p99 / RR "
        "| p50 / best(RR, LOR) | p99 / best(RR, LOR) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    by_key = {(c.workload, c.load, c.rep, c.target): c for c in cells}
    for c in cells:
        rr = by_key.get((c.workload, c.load, c.rep, "rr"))
        lor = by_key.get((c.workload, c.load, c.rep, "lor"))
        if rr is None or c.target == "rr":
            continue
        best50 = min(x.ttft_ms["p50"] for x in (rr, lor) if x is not None)
        best99 = min(x.ttft_ms["p99"] for x in (rr, lor) if x is not None)
        print(
            f"| {c.workload} | {c.load} | {c.target} | {c.rep} | "
            f"{c.ttft_ms['p50'] / rr.ttft_ms['p50']:.2f} | "
            f"{c.ttft_ms['p99'] / rr.ttft_ms['p99']:.2f} | "
            f"{c.ttft_ms['p50'] / best50:.2f} | {c.ttft_ms['p99'] / best99:.2f} |"
        )


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or math.isnan(value) or math.isnan(base) or base <= 0:
        return "-"
    return f"{value / base:.2f}"


def _best(cells: list[Cell], quantile: str) -> float | None:
    values = [
        c.ttft_ms[quantile] for c in cells if not math.isnan(c.ttft_ms.get(quantile, math.nan))
    ]
    return min(values) if values else None


def print_acceptance(cells: list[Cell], default: str) -> None:
    """Issue 13's acceptance ratios of the default policy, per workload, load and repetition."""
    by_group: dict[tuple[str, str, int], dict[str, Cell]] = {}
    for c in cells:
        by_group.setdefault((c.workload, c.load, c.rep), {})[c.target] = c
    print(f"\nAcceptance ratios of `{default}` (same workload, load and repetition):\n")
    print(
        "| workload | load | rep | p50 / RR | p99 / RR | p50 / best(RR,LOR) | p99 / best(RR,LOR) "
        "| p50 / best vllm-router | p99 / best vllm-router | prefix missed / RR's "
        "| history cached | errors (all targets) | peak busy (default) |"
    )
    print("|" + "---|" * 13)
    for (workload, load, rep), group in by_group.items():
        mine = group.get(default)
        if mine is None:
            continue
        rr = group.get("rr")
        baselines = [c for c in (rr, group.get("lor")) if c is not None]
        peers = [c for t, c in group.items() if t.startswith("vllm-router-")]
        row = [
            workload, load, str(rep),
            _ratio(mine.ttft_ms["p50"], rr.ttft_ms["p50"] if rr else None),
            _ratio(mine.ttft_ms["p99"], rr.ttft_ms["p99"] if rr else None),
            _ratio(mine.ttft_ms["p50"], _best(baselines, "p50")),
            _ratio(mine.ttft_ms["p99"], _best(baselines, "p99")),
            _ratio(mine.ttft_ms["p50"], _best(peers, "p50")),
            _ratio(mine.ttft_ms["p99"], _best(peers, "p99")),
            _ratio(mine.prefix_missed, rr.prefix_missed if rr else None),
            _fmt(mine.history_cached, 2),
            str(sum(c.errors for c in group.values())),
            str(mine.peak_engine_busy),
        ]  # fmt: skip
        print("| " + " | ".join(row) + " |")


@dataclass(frozen=True)
class PlannedCells:
    """One workload and load: its trace, and how many times each target plays it."""

    workload: str
    load: str
    trace: list[TraceRequest]
    duration_s: float
    reps: int


def cell_trace(
    workload: str, load: str, seed: int, duration_s: float, *, min_requests: int, fleet: Fleet
) -> tuple[list[TraceRequest], float]:
    """The cell's trace: `duration_s` of arrivals, longer until it holds `min_requests`.

    A light cell has few requests per second; with fewer than about 100 its
    p99 is its single worst request, so it runs longer instead.
    """
    scale = load_scale(workload, LOADS[load], seed, fleet)
    trace = build_trace(workload, seed, duration_s, scale)
    while len(trace) < min_requests:
        # As long as the rate so far says, and one second more each time that falls short.
        needed = math.ceil(duration_s * min_requests / max(len(trace), 1))
        duration_s = max(duration_s + 1.0, float(needed))
        trace = build_trace(workload, seed, duration_s, scale)
    return trace, duration_s


# Seconds a cell takes beyond its arrivals, measured on a 2-core machine: engines
# (re)started and passing in Consul, the router up with one scrape, the last answers.
STARTUP_S = {"rr": 1.5, "lor": 1.5, "caravan": 3.0, "vllm-router": 2.5}
DRAIN_S = {"light": 1.0, "near": 1.5, "over": 3.0}


def estimated_wall_s(plan: list[PlannedCells], targets: list[str]) -> float:
    total = 0.0
    for planned in plan:
        last = planned.trace[-1].at if planned.trace else 0.0
        for target in targets:
            family = "vllm-router" if target.startswith("vllm-router-") else target.split("-")[0]
            startup = STARTUP_S.get(family, 3.0)
            total += planned.reps * (startup + last + DRAIN_S.get(planned.load, 4.0))
    return total


def parse_repeats(text: str) -> set[tuple[str, str]]:
    """`unique/light,mixed/over` -> {(workload, load), ...}; bad names raise ValueError."""
    chosen: set[tuple[str, str]] = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        workload, _, load = item.partition("/")
        if workload not in WORKLOADS or load not in LOADS:
            raise ValueError(
                f"--repeat: {item!r} is not workload/load (workloads {', '.join(WORKLOADS)}; "
                f"loads {', '.join(LOADS)})"
            )
        chosen.add((workload, load))
    return chosen


# -- offline replay -------------------------------------------------------------------------


def offline_cell(
    cell: Cell, trace: list[TraceRequest], fleet: Fleet, system_tokens: list[int]
) -> None:
    """Replay the trace on a virtual clock: the engines' batch core, the router's pure picker.

    No processes, sockets or CPU contention, so the figures are exact and the
    same on every machine: what the policy does, apart from the noise of a
    shared machine. The router parts are the ones it runs (`pick`,
    `start_request`, `begin_prefill`, `end_prefill`, `record_load`,
    `record_cache_figures`, a scrape every second); a request takes no time
    on the wire, and the admission queue is not modelled (a pick that finds
    every endpoint full goes to the least loaded).
    """
    import heapq  # noqa: PLC0415

    from caravan_llm.common.consul_api import HealthEntry  # noqa: PLC0415
    from caravan_llm.common.contract import encode_prefill_rate  # noqa: PLC0415
    from caravan_llm.common.engine_metrics import EngineLoad  # noqa: PLC0415
    from caravan_llm.devcluster.engine.batch import (  # noqa: PLC0415
        BatchCore,
        PerfModel,
        SequenceSpec,
        StepPlan,
        prompt_block_hashes,
    )
    from caravan_llm.router.core.balancer import (  # noqa: PLC0415
        BalancerConfig,
        Picked,
        PickerMemory,
        Policy,
        RequestFeatures,
        pick,
    )
    from caravan_llm.router.core.breaker import BreakerPolicy  # noqa: PLC0415
    from caravan_llm.router.core.cost_model import (  # noqa: PLC0415
        CacheFigures,
        Prefill,
        begin_prefill,
        end_prefill,
        peer_rate_of,
        record_cache_figures,
    )
    from caravan_llm.router.core.endpoints import snapshot_from_health  # noqa: PLC0415
    from caravan_llm.router.core.live_state import (  # noqa: PLC0415
        Lease,
        finish_request,
        own_counts,
        reconcile_live_state,
        record_load,
        start_request,
    )
    from caravan_llm.router.core.live_state import Outcome as RouterOutcome  # noqa: PLC0415
    from caravan_llm.router.core.prefix_index import prompt_shape  # noqa: PLC0415

    perf = PerfModel(
        max_num_seqs=fleet.max_num_seqs,
        kv_cache_tokens=fleet.kv_blocks * fleet.block_size,
        block_size=fleet.block_size,
        max_batched_tokens=fleet.chunk_tokens,
        step_seconds=fleet.step_s,
        decode_seconds_per_seq=fleet.decode_s_per_seq,
        prefill_seconds_per_token=fleet.prefill_s_per_token,
    )
    cores = [BatchCore(perf) for _ in range(fleet.engines)]
    ids = [f"{SERVICE}-{replica}" for replica in range(fleet.engines)]
    entries = [
        HealthEntry.from_api({
            "Node": {"Node": "bench", "Address": "127.0.0.1"},
            "Service": {
                "ID": service_id, "Service": SERVICE, "Tags": ["caravan"],
                "Address": "127.0.0.1", "Port": 20000 + replica,
                "Meta": {
                    "caravan_model": MODEL, "served_models": MODEL, "engine": "vllm",
                    "replica": str(replica), "capacity": str(fleet.max_num_seqs),
                    "metrics_path": "/metrics",
                    **encode_prefill_rate(fleet.declared_prefill_tokens_per_s),
                },
            },
            "Checks": [],
        })
        for replica, service_id in enumerate(ids)
    ]  # fmt: skip
    snapshot, _ = snapshot_from_health({SERVICE: entries}, 1)
    live = reconcile_live_state({}, snapshot)
    config = BalancerConfig()
    memory = PickerMemory(rng=random.Random(cell.rep))
    breaker = BreakerPolicy()
    policy = (
        Policy(cell.target.removeprefix("caravan-")) if cell.target.startswith("caravan-") else None
    )

    events: list[tuple[float, int, str, Any]] = []
    sequence = 0

    def push(at: float, kind: str, data: Any) -> None:
        nonlocal sequence
        sequence += 1
        heapq.heappush(events, (at, sequence, kind, data))

    for number, request in enumerate(trace):
        push(request.at, "arrive", number)
    push(0.0, "scrape", None)
    push(0.0, "sample", None)
    plans: list[StepPlan | None] = [None] * fleet.engines
    outcomes = [Outcome(ok=False) for _ in trace]
    started_at = [0.0] * len(trace)
    owners: dict[str, tuple[int, int, Prefill | None, Lease | None]] = {}
    outstanding = [0] * fleet.engines
    cursor = 0
    peak = 0

    def step(engine: int, now: float) -> None:
        if plans[engine] is None:
            plans[engine] = cores[engine].schedule(now)
            if plans[engine] is not None:
                push(now + plans[engine].duration, "step", engine)  # type: ignore[union-attr]

    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            request = trace[data]
            messages = [{"role": role, "content": text} for role, text in request.messages]
            tokens = _prompt_tokens(request)
            prefill: Prefill | None = None
            lease: Lease | None = None
            if cell.target == "rr":
                engine = cursor % fleet.engines
                cursor += 1
            elif cell.target == "lor":
                fewest = min(outstanding)
                choices = [i for i, n in enumerate(outstanding) if n == fewest]
                engine = choices[cursor % len(choices)]
                cursor += 1
            else:
                assert policy is not None
                shape = prompt_shape({"messages": messages}, config.cost.shape)
                features = RequestFeatures(model=MODEL, prompt=shape)
                result = pick(snapshot, live, features, policy, now, config=config, memory=memory)
                if isinstance(result, Picked):
                    endpoint = result.endpoint
                else:  # every engine full: the real router would queue it
                    endpoint = snapshot.by_id[ids[outstanding.index(min(outstanding))]]
                engine = ids.index(endpoint.id)
                lease = start_request(live, endpoint.id, breaker, now)
                if shape is not None:
                    prefill = begin_prefill(
                        live, endpoint, shape, now, config.cost,
                        max_age_s=config.load_max_age_s, peer=peer_rate_of(snapshot, live, MODEL),
                    )  # fmt: skip
            outstanding[engine] += 1
            started_at[data] = now
            request_id = str(data)
            owners[request_id] = (data, engine, prefill, lease)
            cores[engine].submit(
                SequenceSpec(
                    request_id=request_id,
                    prompt_len=len(tokens),
                    block_hashes=prompt_block_hashes(tokens, fleet.block_size),
                    output_len=fleet.output_tokens,
                ),
                now,
            )
            step(engine, now)
        elif kind == "step":
            plan = plans[data]
            assert plan is not None
            plans[data] = None
            result_of_step = cores[data].complete(plan, now)
            for first in result_of_step.first_tokens:
                number, _, prefill, _ = owners[first.request_id]
                outcomes[number].ttft_s = now - started_at[number]
                outcomes[number].prompt_tokens = first.prompt_len
                outcomes[number].cached_tokens = first.cached_tokens
                if prefill is not None:
                    end_prefill(live, prefill, now, config.cost, first_token=True)
            for finished in result_of_step.finished:
                number, engine, _, lease = owners.pop(finished.request_id)
                outcomes[number].ok = True
                outcomes[number].e2e_s = now - started_at[number]
                outcomes[number].done_at = now
                outstanding[engine] -= 1
                if lease is not None:
                    finish_request(live, lease, RouterOutcome.SUCCESS, breaker, now)
            step(data, now)
        elif kind == "scrape":
            for engine, core in enumerate(cores):
                stats = core.stats()
                load = EngineLoad(
                    running=float(stats.running),
                    waiting=float(stats.waiting),
                    kv_cache_usage=stats.kv_cache_usage,
                )
                own = own_counts(live, ids[engine])
                record_load(live, ids[engine], load, now, own_before=own)
                figures = CacheFigures(
                    kv_cache_tokens=perf.kv_cache_tokens,
                    prefix_queries=float(stats.prefix_queries_tokens),
                    prefix_hits=float(stats.prefix_hits_tokens),
                )
                record_cache_figures(live, ids[engine], figures, config.cost)
            if owners or events:
                push(now + 1.0, "scrape", None)
        elif kind == "sample":
            peak = max([peak, *(c.stats().running + c.stats().waiting for c in cores)])
            if owners or any(e[2] != "scrape" for e in events):
                push(now + 0.5, "sample", None)
    hits = sum(core.stats().prefix_hits_tokens for core in cores)
    queries = sum(core.stats().prefix_queries_tokens for core in cores)
    cell.peak_engine_busy = peak
    cell.hit_rate = hits / queries if queries else math.nan
    summarise(cell, trace, outcomes, system_tokens, fleet.block_size)


def orchestrate(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C, so every started process is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    fleet = Fleet(engines=args.engines)
    # On PATH, or beside this interpreter (`.venv/bin/python bench/...` without activating).
    vllm_router = (
        os.environ.get("CARAVAN_BENCH_VLLM_ROUTER")
        or shutil.which("vllm-router")
        or shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    )
    targets = args.targets.split(",") if args.targets else None
    if targets is None:
        targets = ["rr", "lor", *(f"caravan-{p}" for p in CARAVAN_POLICIES)]
        if vllm_router is not None:
            targets += [f"vllm-router-{p}" for p in VLLM_ROUTER_POLICIES]
    if args.offline:
        # Replayed through the router's picker; vllm-router has no pure core to replay.
        vllm_router = None
    if vllm_router is None:
        dropped = [t for t in targets if t.startswith("vllm-router-")]
        if dropped:
            print(f"vllm-router not installed: {dropped} skipped")
        targets = [t for t in targets if not t.startswith("vllm-router-")]
    unknown = [
        t for t in targets
        if t not in ("rr", "lor")
        and t.removeprefix("caravan-") not in CARAVAN_POLICIES
        and t.removeprefix("vllm-router-") not in VLLM_ROUTER_POLICIES
    ]  # fmt: skip
    if unknown:
        print(f"unknown targets: {unknown}", file=sys.stderr)
        return 2
    workloads = args.workloads.split(",")
    loads = args.loads.split(",")
    bad = [w for w in workloads if w not in WORKLOADS] + [x for x in loads if x not in LOADS]
    if bad:
        print(f"unknown workloads or loads: {bad}", file=sys.stderr)
        return 2
    try:
        repeated = parse_repeats(args.repeat)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    plan: list[PlannedCells] = []
    for workload in workloads:
        for load in loads:
            trace, duration_s = cell_trace(
                workload,
                load,
                args.seed,
                args.duration,
                min_requests=args.min_requests,
                fleet=fleet,
            )
            reps = args.repeat_reps if (workload, load) in repeated else args.reps
            plan.append(PlannedCells(workload, load, trace, duration_s, reps))
    for planned in plan:
        print(
            f"{planned.workload}/{planned.load}: {len(planned.trace)} requests over "
            f"{planned.duration_s:.0f} s, {planned.reps} repetition(s) of {len(targets)} targets"
        )
    estimate = estimated_wall_s(plan, targets)
    print(f"estimated wall time: {estimate / 60:.1f} min", flush=True)
    if args.plan_only:
        return 0
    began = time.monotonic()
    system_tokens = [
        _tokens(f"<|im_start|>system\n{text}<|im_end|>\n") for text in _system_prompts(16, 1100)
    ]
    cells: list[Cell] = []
    if args.offline:
        for planned in plan:
            for rep in range(planned.reps):
                for target in targets:
                    cell = Cell(planned.workload, planned.load, target, rep)
                    cell.duration_s = planned.duration_s
                    offline_cell(cell, planned.trace, fleet, system_tokens)
                    cells.append(cell)
                    print(
                        f"  {planned.workload}/{planned.load} {target} rep {rep}: "
                        f"TTFT p50 {cell.ttft_ms['p50']:.0f} ms, p99 {cell.ttft_ms['p99']:.0f} ms",
                        flush=True,
                    )
        print_tables(cells, fleet, args)
        print_acceptance(cells, args.default_target)
        return 0
    with started(
        [sys.executable, "-m", "caravan_llm.devcluster", "--consul-port", "0", "--dns-port", "0"],
        r"CONSUL_HTTP_ADDR=([\d.:]+)",
    ) as (_, consul):
        consul_addr = consul.group(1)
        ports = free_ports(fleet.engines)
        asyncio.run(register_engines(consul_addr, ports, fleet))
        for planned in plan:
            workload, load, trace = planned.workload, planned.load, planned.trace
            print(f"{workload}/{load}:", flush=True)
            for rep in range(planned.reps):
                order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
                for target in order:
                    cell = Cell(workload, load, target, rep, duration_s=planned.duration_s)
                    cell_began = time.monotonic()
                    for attempt in (1, 2):
                        try:
                            asyncio.run(
                                    run_cell(
                                        cell, trace, consul_addr=consul_addr, ports=ports,
                                        fleet=fleet, vllm_router=vllm_router,
                                        system_tokens=system_tokens, seed=args.seed,
                                    )
                                )  # fmt: skip
                            break
                        except RuntimeError as exc:
                            # Something did not start (a port taken meanwhile): once more.
                            print(f"  {target}: {exc}; attempt {attempt}", flush=True)
                            if attempt == 2:
                                raise
                    cell.wall_s = time.monotonic() - cell_began
                    cells.append(cell)
                    print(
                        f"  {target} rep {rep}: TTFT p50 {cell.ttft_ms['p50']:.0f} ms, "
                        f"p99 {cell.ttft_ms['p99']:.0f} ms, errors {cell.errors} "
                        f"({cell.wall_s:.0f} s)",
                        flush=True,
                    )
    print_tables(cells, fleet, args)
    print_acceptance(cells, args.default_target)
    wall = time.monotonic() - began
    print(f"\ntotal wall time: {wall / 60:.1f} min (estimated {estimate / 60:.1f} min)")
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(c) for c in cells], indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    engines = sub.add_parser("engines", help="(internal) run the simulated engines")
    engines.add_argument("--ports", required=True)
    engines.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--targets", default="", help="comma-separated (default: all)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--loads", default=",".join(LOADS))
    parser.add_argument(
        "--duration", type=float, default=10.0, help="seconds of arrivals per cell, at least"
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=300,
        help="a cell with fewer requests runs longer (its p99 is then the 4th worst, not "
        "one opening burst's; docs/benchmarks.md)",
    )
    parser.add_argument("--reps", type=int, default=1, help="repetitions of every cell")
    parser.add_argument(
        "--repeat",
        default="",
        help="workload/load cells to repeat --repeat-reps times, e.g. unique/light,mixed/over",
    )
    parser.add_argument("--repeat-reps", type=int, default=2)
    parser.add_argument(
        "--default-target",
        default="caravan-predicted_ttft",
        help="whose acceptance ratios are printed",
    )
    parser.add_argument(
        "--plan-only", action="store_true", help="print the cells and the time estimate, stop"
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="replay on a virtual clock (batch core + the router's picker): exact, no processes",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="", help="write every cell as JSON here")
    parser.add_argument(
        "--quick", action="store_true", help="6 s cells; rr, lor, two caravan policies"
    )
    args = parser.parse_args()
    if args.command == "engines":
        run_engines([int(p) for p in args.ports.split(",")], Fleet(), args.seed)
        return 0
    if args.quick:
        args.duration = 6.0
        args.min_requests = 0
        if not args.targets:
            args.targets = "rr,lor,caravan-prefix_affinity,caravan-predicted_ttft"
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
