"""LoRA adapters with Zipf popularity: caravan's placement and routing against random placement.

    python bench/adapter_placement.py            # the recorded run (docs/benchmarks.md)
    python bench/adapter_placement.py --quick    # development: short phases

Issue 25's benchmark. 20 adapters of one base model, asked for with Zipf
popularity (exponent `--zipf`, 1.0 by default: the i-th most popular is asked
for in proportion to 1/i), on 4 simulated vLLM replicas with `--max-loras 4`
(16 GPU slots for 20 adapters). The simulated vLLM charges what vLLM's LoRA
manager does (devcluster/engine/lora_slots.py): reading an adapter (0.5 s)
holds the engine, a batch mixes at most `max_loras` adapters.

Two arms, one run, the same request trace (open loop, Poisson arrivals,
streamed completions of unique prompts, so no prefix cache helps either):

- `caravan`: devcluster with caravan's scheduler and router
  (`caravan_llm.cli.local_stack`). The profile declares the 20 adapters with
  `lora.max_loras: 4`; the scheduler places them by its plan (weighted by the
  demand the router writes) and loads them through the engines' API; the
  router sends each request to a replica that holds its adapter (the load
  cost is in its cost model) and has it loaded on demand where none does;
- `random`: the baseline. 4 simulated vLLMs with the same flags, run by the
  bench. Each adapter is loaded on a random replica with a free slot (the
  four left over are loaded nowhere); requests go to the replica with the
  fewest requests in flight (ties at random), with no regard to adapters;
  an adapter the replica does not hold is loaded there first (lazy loading),
  and a replica that holds 4 already first unloads the one its requests used
  least recently (never one a request in flight uses), so it is never asked
  to hold more than `max_loras` either.

Each arm gets a warm-up phase (the same trace shape, another seed: caravan's
demand signal and the baseline's lazy loads settle), then the measured
phase. Time to first token is measured at the client (first streamed chunk),
so a request held for a load counts its wait. Reported: TTFT p50/p99,
errors, requests that waited for a load, and, from the engines' own state
(`--sim-lora-state-dir`, written by each simulated vLLM), the most adapters
each replica was ever asked to hold (registered through the API), held in
its GPU slots and mixed in one batch, and how often it read an adapter from
disk; for caravan, its adapter events in the measured phase (the router's
on-demand loads and evictions, the scheduler's loads and unloads) and the
router's loads by the adapter's popularity rank. The run fails (exit 1)
when any replica exceeded `max_loras` or the p50 ratio (caravan / random)
is above 0.7.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ADAPTERS = 20
REPLICAS = 4
MAX_LORAS = 4
RANK = 8
MODEL = "qwen2-5-7b"
BASE_MODEL = "Qwen/Qwen2.5-7B-Instruct"
SERVED = "qwen2.5-7b-instruct"
P50_BAR = 0.7


def sim_env(args: argparse.Namespace) -> dict[str, str]:
    """The simulated vLLM's knobs for both arms (its defaults but for these)."""
    return {
        "CARAVAN_SIM_LOAD_SECONDS": "0.5",
        "CARAVAN_SIM_LORA_LOAD_SECONDS": str(args.lora_load_s),
    }


@dataclass(frozen=True, slots=True)
class TraceRequest:
    at: float  # seconds after the phase starts
    adapter: str
    prompt: str
    max_tokens: int


@dataclass(slots=True)
class Outcome:
    ok: bool
    ttft_s: float | None = None
    error: str | None = None


class EventCounter(logging.Handler):
    """Counts the adapter events caravan logs (the router's loads, the scheduler's passes)."""

    EVENTS = frozenset(
        {"adapter_loaded", "adapter_evicted", "adapter_load_failed", "lora_loaded", "lora_unloaded"}
    )

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.counts: dict[str, int] = {}
        self.by_adapter: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        name = record.getMessage()
        if name in self.EVENTS:
            self.counts[name] = self.counts.get(name, 0) + 1
            adapter = getattr(record, "adapter", None)
            if name in {"adapter_loaded", "lora_loaded"} and isinstance(adapter, str):
                key = f"{name}:{adapter}"
                self.by_adapter[key] = self.by_adapter.get(key, 0) + 1


@dataclass(slots=True)
class ArmResult:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    # Requests the arm held for an adapter load (caravan: the router's log; random: the bench).
    waited_for_load: int = 0
    engines: list[dict[str, Any]] = field(default_factory=list)
    # caravan: its adapter events in the measured phase (router loads, scheduler loads/unloads).
    events: dict[str, int] = field(default_factory=dict)
    # caravan: the router's on-demand loads, by the adapter's popularity rank (1: hottest).
    loads_by_rank: dict[int, int] = field(default_factory=dict)

    def ttfts(self) -> list[float]:
        return sorted(o.ttft_s for o in self.outcomes if o.ok and o.ttft_s is not None)

    def errors(self) -> int:
        return sum(1 for o in self.outcomes if not o.ok)


def adapter_names() -> list[str]:
    return [f"lora-{i:02d}" for i in range(ADAPTERS)]


def zipf_weights(count: int, exponent: float) -> list[float]:
    raw = [1.0 / (rank**exponent) for rank in range(1, count + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def build_trace(
    *, rate: float, duration_s: float, exponent: float, seed: int, max_tokens: int, words: int
) -> list[TraceRequest]:
    """Poisson arrivals at `rate`; adapters drawn by Zipf popularity; unique prompts."""
    rng = random.Random(seed)
    names = adapter_names()
    # Which adapter is the most popular is itself drawn, so that names say nothing.
    popularity = names[:]
    rng.shuffle(popularity)
    weights = zipf_weights(len(popularity), exponent)
    trace: list[TraceRequest] = []
    at = rng.expovariate(rate)
    while at < duration_s:
        adapter = rng.choices(popularity, weights)[0]
        prompt = " ".join(f"w{rng.randrange(100_000)}" for _ in range(words))
        trace.append(TraceRequest(at=at, adapter=adapter, prompt=prompt, max_tokens=max_tokens))
        at += rng.expovariate(rate)
    return trace


def popularity_order(args: argparse.Namespace) -> list[str]:
    """The adapters, most popular first, as the measured trace draws them (`build_trace`)."""
    rng = random.Random(args.seed)
    names = adapter_names()
    rng.shuffle(names)
    return names


def percentile(values: Sequence[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


# -- sending ---------------------------------------------------------------------------------


async def send(
    http: aiohttp.ClientSession, url: str, headers: Mapping[str, str], request: TraceRequest
) -> Outcome:
    """One streamed completion; TTFT is the time to its first data chunk."""
    body = {
        "model": request.adapter,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "stream": True,
    }
    started = time.monotonic()
    ttft: float | None = None
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers=dict(headers)) as reply:
            if reply.status != 200:
                text = (await reply.text())[:200]
                return Outcome(ok=False, error=f"HTTP {reply.status}: {text}")
            async for line in reply.content:
                if ttft is None and line.startswith(b"data: ") and b"[DONE]" not in line:
                    ttft = time.monotonic() - started
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome(ok=False, error=type(exc).__name__)
    return Outcome(ok=ttft is not None, ttft_s=ttft, error=None if ttft else "no chunk")


async def play(
    trace: Sequence[TraceRequest],
    send_one: Any,
) -> list[Outcome]:
    """Send each request at its time (open loop); all outcomes, in trace order."""
    start = time.monotonic()

    async def one(request: TraceRequest) -> Outcome:
        await asyncio.sleep(max(0.0, start + request.at - time.monotonic()))
        result: Outcome = await send_one(request)
        return result

    return list(await asyncio.gather(*(one(r) for r in trace)))


# -- the engines' side -----------------------------------------------------------------------


def engine_states(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def make_adapters(root: Path) -> dict[str, str]:
    """Each adapter's folder (a peft `adapter_config.json`, what the simulated vLLM reads)."""
    paths: dict[str, str] = {}
    for name in adapter_names():
        folder = root / "loras" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps({"r": RANK, "peft_type": "LORA"}))
        paths[name] = str(folder)
    return paths


# -- the random arm --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def engine_argv(port: int) -> list[str]:
    """The flags caravan renders for the profile's vLLM (tests/golden/*-lora.job.json), less
    the KV events (the baseline has no router to read them)."""
    return [
        sys.executable,
        "-m",
        "caravan_llm.devcluster.engine",
        "--flavor",
        "vllm",
        "--model",
        BASE_MODEL,
        "--served-model-name",
        SERVED,
        "--tensor-parallel-size",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        "64",
        "--max-model-len",
        "8192",
        "--gpu-memory-utilization",
        "0.90",
        "--enable-prefix-caching",
        "--enable-lora",
        "--max-loras",
        str(MAX_LORAS),
        "--max-lora-rank",
        "16",
    ]


@contextlib.asynccontextmanager
async def baseline_engines(state_dir: Path, knobs: Mapping[str, str]) -> AsyncIterator[list[str]]:
    env = {
        **os.environ,
        **knobs,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "CARAVAN_SIM_LORA_STATE_DIR": str(state_dir),
    }
    ports = [free_port() for _ in range(REPLICAS)]
    processes = [
        subprocess.Popen(  # noqa: ASYNC220 - started once, before the measured phases
            engine_argv(port),
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 60
            for url in urls:
                while True:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.get(f"{url}/health") as reply:
                            if reply.status == 200:
                                break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"baseline engine {url} did not get ready")
                    await asyncio.sleep(0.1)
        yield urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


class LazyBalancer:
    """Least requests in flight, blind to adapters; loads an adapter where a request lands."""

    def __init__(
        self, http: aiohttp.ClientSession, urls: list[str], sources: Mapping[str, str], seed: int
    ) -> None:
        self._http = http
        self._urls = urls
        self._sources = sources
        self._rng = random.Random(seed)
        self._inflight = dict.fromkeys(urls, 0)
        # url -> adapter -> when a request last used it there (least recently used goes first).
        self._held: dict[str, dict[str, float]] = {url: {} for url in urls}
        self._loading: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._locks = {url: asyncio.Lock() for url in urls}
        # url -> adapter -> requests of it in flight there (never unloaded under them).
        self._in_use: dict[str, dict[str, int]] = {url: {} for url in urls}
        self.waited_for_load = 0

    async def place_randomly(self) -> None:
        """Each adapter on a random replica with a free slot; those left over nowhere."""
        names = list(self._sources)
        self._rng.shuffle(names)
        for name in names:
            room = [u for u in self._urls if len(self._held[u]) < MAX_LORAS]
            if not room:
                break
            await self._load(self._rng.choice(room), name)

    async def send(self, request: TraceRequest) -> Outcome:
        fewest = min(self._inflight.values())
        url = self._rng.choice([u for u, n in self._inflight.items() if n == fewest])
        self._inflight[url] += 1
        try:
            started = time.monotonic()
            if request.adapter not in self._held[url]:
                self.waited_for_load += 1
            # A loop: another load may unload it again before this request marks it in use.
            while request.adapter not in self._held[url]:
                key = (url, request.adapter)
                task = self._loading.get(key)
                if task is None:
                    task = asyncio.get_running_loop().create_task(self._load(url, request.adapter))
                    self._loading[key] = task
                    task.add_done_callback(functools.partial(self._loaded, key))
                await asyncio.shield(task)
            self._held[url][request.adapter] = time.monotonic()
            in_use = self._in_use[url]
            in_use[request.adapter] = in_use.get(request.adapter, 0) + 1
            held_for = time.monotonic() - started
            try:
                outcome = await send(self._http, url, {}, request)
            finally:
                in_use[request.adapter] -= 1
            if outcome.ttft_s is not None:
                # The wait for the load counts, as a router holding the request would count it.
                outcome.ttft_s += held_for
            return outcome
        finally:
            self._inflight[url] -= 1

    def _loaded(self, key: tuple[str, str], _: asyncio.Task[None]) -> None:
        self._loading.pop(key, None)

    async def _load(self, url: str, name: str) -> None:
        async with self._locks[url]:
            held = self._held[url]
            if name in held:
                return
            while len(held) >= MAX_LORAS and all(  # noqa: ASYNC110 - polls counts requests change
                self._in_use[url].get(n, 0) for n in held
            ):
                # Every adapter there is in use: wait for one to be free (no request of an
                # adapter that was unloaded under it).
                await asyncio.sleep(0.01)
            if len(held) >= MAX_LORAS:
                idle = [n for n in held if not self._in_use[url].get(n, 0)]
                victim = min(idle, key=lambda n: held[n])
                # Out of `held` first: no request may pick it while the unload is under way.
                del held[victim]
                await self._post(url, "/v1/unload_lora_adapter", {"lora_name": victim})
            await self._post(
                url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": self._sources[name]}
            )
            held[name] = time.monotonic()

    async def _post(self, url: str, path: str, body: dict[str, str]) -> None:
        async with self._http.post(f"{url}{path}", json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"{path} {body}: HTTP {reply.status} {await reply.text()}")


async def run_random(
    args: argparse.Namespace, warmup: list[TraceRequest], measured: list[TraceRequest], work: Path
) -> ArmResult:
    state = work / "random-state"
    state.mkdir()
    sources = make_adapters(work / "random")
    result = ArmResult("random")
    async with baseline_engines(state, sim_env(args)) as urls, aiohttp.ClientSession() as http:
        balancer = LazyBalancer(http, urls, sources, seed=args.seed)
        await balancer.place_randomly()
        await play(warmup, balancer.send)
        balancer.waited_for_load = 0
        result.outcomes = await play(measured, balancer.send)
        result.waited_for_load = balancer.waited_for_load
    result.engines = engine_states(state)
    return result


# -- the caravan arm -------------------------------------------------------------------------


def lora_profile(sources: Mapping[str, str]) -> Any:
    from caravan_llm.scheduler.profiles import ModelProfile, load_profile  # noqa: PLC0415

    profile = load_profile(REPO / "examples" / "profiles" / "qwen-vllm-h100.yaml")
    document = profile.model_dump(mode="json", by_alias=True, exclude_none=True)
    document.update(
        drain_s=1,
        replicas={"min": REPLICAS, "max": REPLICAS},
        adapters=[{"name": n, "source": s, "rank": RANK} for n, s in sources.items()],
        lora={"max_loras": MAX_LORAS, "max_lora_rank": 16},
    )
    document.pop("autoscaling", None)
    return ModelProfile.model_validate(document)


async def run_caravan(
    args: argparse.Namespace, warmup: list[TraceRequest], measured: list[TraceRequest], work: Path
) -> ArmResult:
    from caravan_llm.cli.local_stack import StackOptions, local_stack  # noqa: PLC0415
    from caravan_llm.common.contract import KVLayout, decode_model_adapters  # noqa: PLC0415
    from caravan_llm.router.settings import RouterSettings  # noqa: PLC0415
    from caravan_llm.scheduler.model_store import ModelStore  # noqa: PLC0415

    state = work / "caravan-state"
    state.mkdir()
    sources = make_adapters(work / "caravan")
    lines: list[dict[str, Any]] = []
    # The stack's engines inherit the bench's environment (devcluster's drivers).
    os.environ.update({**sim_env(args), "CARAVAN_SIM_LORA_STATE_DIR": str(state)})
    options = StackOptions(
        prefer_real_llama_server=False,
        gpus_per_node=4,
        autoscale=False,
        work_dir=work,
        resync_s=1.0,
        router=RouterSettings(
            port=0,
            scrape_interval_s=0.5,
            log_level="warning",
            adapter_demand_interval_s=1.0,
        ),
        request_log=lines.append,
    )
    result = ArmResult("caravan")
    profile = lora_profile(sources)
    # The router's canonical request lines (`request_log`) are written at info level.
    logging.getLogger("router.proxy").setLevel(logging.INFO)
    async with local_stack(options) as stack:
        assert stack.router is not None
        router = stack.router
        await ModelStore(stack.scheduler.consul, KVLayout()).submit([profile])

        deadline = time.monotonic() + 180
        while True:
            _, entry = await stack.scheduler.consul.kv_get(KVLayout().adapters_key(profile.name))
            if entry is not None:
                document = decode_model_adapters(entry.value, key=entry.key, model=profile.name)
                replicas = document.replicas
                if len(replicas) == REPLICAS and all(
                    r.desired and set(r.loaded) == set(r.desired) for r in replicas
                ):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("caravan did not place the adapters in 180 s")
            await asyncio.sleep(0.5)

        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 60
            while True:
                async with http.get(f"{router.base_url}/v1/models", headers=router.headers) as r:
                    ids = {m["id"] for m in (await r.json()).get("data", [])}
                if set(sources) <= ids:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the router did not list the adapters in 60 s")
                await asyncio.sleep(0.5)

            async def send_one(request: TraceRequest) -> Outcome:
                return await send(http, router.base_url, router.headers, request)

            await play(warmup, send_one)
            lines.clear()
            counter = EventCounter()
            watched = [
                logging.getLogger("router.adapter_loader"),
                logging.getLogger("caravan_llm.scheduler.lora.apply"),
            ]
            for logger in watched:
                logger.addHandler(counter)
                logger.setLevel(logging.INFO)
            try:
                result.outcomes = await play(measured, send_one)
            finally:
                for logger in watched:
                    logger.removeHandler(counter)
            result.events = dict(sorted(counter.counts.items()))
        result.waited_for_load = sum(1 for line in lines if line.get("adapter_load_s") is not None)
        ranks = {name: rank for rank, name in enumerate(popularity_order(args), start=1)}
        result.loads_by_rank = {
            ranks[key.split(":", 1)[1]]: count
            for key, count in counter.by_adapter.items()
            if key.startswith("adapter_loaded:")
        }
    result.engines = engine_states(state)
    return result


# -- report ----------------------------------------------------------------------------------


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def report(results: list[ArmResult], args: argparse.Namespace, measured: int) -> bool:
    print(
        f"\n{ADAPTERS} adapters, Zipf exponent {args.zipf}, {REPLICAS} simulated vLLM replicas "
        f"with max_loras {MAX_LORAS}; {args.rate:g} requests/s, {measured} measured requests "
        f"after {args.warmup_s:g} s of warm-up; adapter read {args.lora_load_s:g} s"
    )
    print(
        f"{'arm':<8} {'ok':>5} {'errors':>6} {'p50 ms':>7} {'p99 ms':>7} {'waited':>6}  "
        "engines: most asked to hold / in slots / in one batch, disk reads"
    )
    limits_ok = True
    for arm in results:
        ttfts = arm.ttfts()
        per_engine = ", ".join(
            f"{e['max_registered']}/{e['max_active']}/{e['max_batch_adapters']} {e['disk_loads']}"
            for e in arm.engines
        )
        over = [
            e
            for e in arm.engines
            if max(e["max_registered"], e["max_active"] or 0, e["max_batch_adapters"] or 0)
            > MAX_LORAS
        ]
        limits_ok = limits_ok and not over and len(arm.engines) == REPLICAS
        print(
            f"{arm.name:<8} {len(ttfts):>5} {arm.errors():>6} {fmt_ms(percentile(ttfts, 0.5)):>7} "
            f"{fmt_ms(percentile(ttfts, 0.99)):>7} {arm.waited_for_load:>6}  {per_engine}"
        )
        if arm.events:
            print(f"  {arm.name} adapter events while measured: {arm.events}")
            print(f"  router loads by popularity rank: {dict(sorted(arm.loads_by_rank.items()))}")
        errors = sorted({o.error for o in arm.outcomes if o.error})
        if errors:
            print(f"  {arm.name} errors: {errors[:5]}")
    by_name = {arm.name: arm for arm in results}
    if set(by_name) != {"caravan", "random"}:
        return limits_ok
    caravan_p50 = percentile(by_name["caravan"].ttfts(), 0.5)
    random_p50 = percentile(by_name["random"].ttfts(), 0.5)
    caravan_p99 = percentile(by_name["caravan"].ttfts(), 0.99)
    random_p99 = percentile(by_name["random"].ttfts(), 0.99)
    ratio = None if not caravan_p50 or not random_p50 else caravan_p50 / random_p50
    ratio99 = None if not caravan_p99 or not random_p99 else caravan_p99 / random_p99
    print(
        f"TTFT p50 caravan/random = {'-' if ratio is None else f'{ratio:.2f}'} "
        f"(bar: <= {P50_BAR}); p99 ratio {'-' if ratio99 is None else f'{ratio99:.2f}'}"
    )
    print(f"no replica over max_loras ({MAX_LORAS}), from the engines' state: {limits_ok}")
    return ratio is not None and ratio <= P50_BAR and limits_ok


async def main_async(args: argparse.Namespace) -> bool:
    warmup = build_trace(
        rate=args.rate,
        duration_s=args.warmup_s,
        exponent=args.zipf,
        seed=args.seed + 1,
        max_tokens=args.max_tokens,
        words=args.words,
    )
    measured = build_trace(
        rate=args.rate,
        duration_s=args.duration_s,
        exponent=args.zipf,
        seed=args.seed,
        max_tokens=args.max_tokens,
        words=args.words,
    )
    with tempfile.TemporaryDirectory(prefix="caravan-adapters-") as folder:
        work = Path(folder)
        results = []
        for arm in args.arms.split(","):
            started = time.monotonic()
            runner = run_caravan if arm == "caravan" else run_random
            results.append(await runner(args, warmup, measured, work))
            print(f"  arm {arm}: {time.monotonic() - started:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(  # noqa: ASYNC240 - once, after the measured phases
            json.dumps(
                [
                    {
                        "arm": a.name,
                        "ttfts": a.ttfts(),
                        "errors": a.errors(),
                        "waited_for_load": a.waited_for_load,
                        "engines": a.engines,
                    }
                    for a in results
                ]
            )
        )
    return report(results, args, len(measured))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases (development)")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of popularity")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--duration-s", type=float, default=60.0, help="measured phase")
    parser.add_argument("--warmup-s", type=float, default=30.0, help="warm-up phase")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--words", type=int, default=150, help="prompt length in words")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--lora-load-s", type=float, default=0.5, help="the simulated vLLM's adapter read time"
    )
    parser.add_argument("--arms", default="random,caravan", help="which arms, in this order")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args()
    if args.quick:
        args.duration_s, args.warmup_s = 15.0, 10.0
    return 0 if asyncio.run(main_async(args)) else 1


if __name__ == "__main__":
    sys.exit(main())
