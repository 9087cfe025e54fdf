"""Precise prefix routing (issue 24) against the approximate index, an oracle and the baselines.

    .venv/bin/python bench/prefix_routing.py --offline      # exact, on a virtual clock (~3 min)
    .venv/bin/python bench/prefix_routing.py --out prefix.json   # live processes (~8 min)
    .venv/bin/python bench/prefix_routing.py --quick --targets approx,precise-wait,oracle

Extends `bench/routing_quality.py` (its traces, load generator, fleet and
summaries) with the KV-event path (docs/benchmarks.md, "Precise prefix
routing"). A fleet of 8 simulated vLLM engines (one process) publishes KV
events on ipc:// sockets; a relays process runs one KV relay
(`caravan_llm.kvrelay`) per engine on loopback; the engines are registered
in devcluster's Consul as Nomad would, and placed (profile with the model's
tokenizer, `placements/<model>` with each relay's `kv_port`, the engine key
in devcluster's Nomad Variables) as the scheduler would, so routers verify
them, read their digest streams with the engine key and load the tokenizer.
With `--tokenizer tiny` (default) engines and routers use the tiny models'
HF tokenizer and the routers are `python -m caravan_llm.router` as deployed;
`--tokenizer sim` keeps the simulator's regex tokenizer and launches routers
here with a mirror of it.

Targets, every one on the same trace, interleaved and rotated per repetition:

- `rr`: client round robin straight to the engines;
- `vllm-router-cache_aware`, `vllm-router-power_of_two`: vllm-router 0.1.17;
- `approx`: caravan's router (default policy, `predicted_ttft`) with the
  exact index off (`KV_EVENTS=false`): the approximate index only;
- `precise`: the same router reading every replica's relay stream, every
  setting at its default (`EXACT_PREFIX_BUDGET_MS` 1; live runs 1-4 in
  docs/benchmarks.md ran it at 1.5);
- `precise-wait`: the same with a 50 ms budget (every prompt's digests);
- `oracle`: the same router whose exact index is, per request, a reading of
  every engine's actual state just before the pick (its prefix cache and the
  prompts it is running or queueing, `engine_holds`);
- `-x3`: three routers of that kind, the client dealing requests in turn;
- `precise-events-only[-x3]` (offline only): the events without the
  router's own requests in flight (`KvIndex.hold`);
- `precise-leading[-x3]` (offline only): every request routed as the
  default budget routes one whose tokenizing is not done in time
  (`cached_prefix`): on the digests of its leading ids the router's
  tokenizer had seen before (the chat up to the previous answer, which the
  router never tokenized), its token count the whole prompt's;
  `precise-leading-predicted` (offline only): the same with the count the
  live router uses instead, predicted from the leading ids' tokens per
  character (`model_tokenizer.estimated_tokens`).

Reported per cell: routing_quality's TTFT percentiles, fleet prefix-cache
hit rate (the engines' `vllm:prefix_cache_hits/queries`), prefix missed,
history cached; for caravan's routers the requests whose prefix came from
events (`prefix_source`), `caravan_router_exact_prompts_total` by outcome,
the KV deltas applied, and the CPU seconds of each process.

Each engine's KV cache is a quarter of the trace's working set (the peak,
over the trace, of the distinct full blocks of the prompts of conversations
under way, their system prompts included), so no engine can hold everything
and placement decides what stays cached.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import routing_quality as rq  # noqa: E402 - needs the repository on sys.path
from bench.processes import started  # noqa: E402

MODEL = rq.MODEL
SERVICE = rq.SERVICE
KEY = "bench-engine-key-of-the-prefix-routing-fleet"
TOPIC = "kv-events"
ENGINES = 8
TARGETS = (
    "rr",
    "vllm-router-cache_aware",
    "vllm-router-power_of_two",
    "approx",
    "precise",
    "precise-wait",
    "oracle",
    "approx-x3",
    "precise-x3",
    "precise-wait-x3",
    # Offline only: precise routing without the in-flight blocks (events alone).
    "precise-events-only",
    "precise-events-only-x3",
    # Offline only: every request routed on its leading ids only (`cached_prefix`).
    "precise-leading",
    "precise-leading-x3",
    # Offline only: the same with the token count the live router predicts.
    "precise-leading-predicted",
)
OFFLINE_ONLY = (
    "precise-events-only",
    "precise-events-only-x3",
    "precise-leading",
    "precise-leading-x3",
    "precise-leading-predicted",
)


# -- the fleet and its working set ----------------------------------------------------------


def working_set_blocks(trace: Sequence[rq.TraceRequest], block: int) -> int:
    """Peak distinct full blocks held by conversations under way (their system prompts once)."""
    last_turn_at: dict[int, float] = {}
    for request in trace:
        if request.conversation is not None:
            last_turn_at[request.conversation] = request.at
    system_blocks: dict[int, int] = {}
    history_blocks: dict[int, int] = {}
    started_at: dict[int, float] = {}
    peak = 0
    for request in sorted(trace, key=lambda r: r.at):
        tokens = len(rq._prompt_tokens(request))  # noqa: SLF001 - the bench's own helper
        if request.conversation is None or request.system is None:
            continue
        system = rq._tokens(  # noqa: SLF001
            f"<|im_start|>system\n{request.messages[0][1]}<|im_end|>\n"
        )
        system_blocks[request.system] = system // block
        history_blocks[request.conversation] = tokens // block - system // block
        started_at.setdefault(request.conversation, request.at)
        live = [c for c, end in last_turn_at.items() if c in started_at and end >= request.at]
        used_systems = set(system_blocks)
        held = sum(history_blocks[c] for c in live) + sum(system_blocks[s] for s in used_systems)
        peak = max(peak, held)
    return peak


def fleet_for(trace: Sequence[rq.TraceRequest], cache_share: float) -> rq.Fleet:
    base = rq.Fleet(engines=ENGINES)
    blocks = working_set_blocks(trace, base.block_size)
    return dataclasses.replace(base, kv_blocks=max(256, round(blocks * cache_share)))


# -- the engine's tokens ----------------------------------------------------------------------


def _before_last_answer(messages: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The chat up to its previous answer: what the router tokenized in its earlier turn."""
    earlier = list(messages[:-1])
    if earlier and earlier[-1][0] == "assistant":
        earlier.pop()
    return earlier


class EngineTokens:
    """The simulated vLLM's prompt tokens for a chat request, as the engine computes them.

    With a tokenizer directory (`--tokenizer`, the tiny models' HF tokenizer)
    the engine's own `HfTokenizer` (chat template, then `tokenizers`); without
    one the simulator's regex tokenizer and vocabulary ids. As a router's
    `PromptTokens` (for the `sim` launcher and the oracle) it answers at once,
    on the loop. `engine_tokens` are what the engine hashes its blocks from
    (token texts for the regex tokenizer: Python's str hash is per process,
    so only an oracle in the engines' process can use them).
    """

    def __init__(self, tokenizer_dir: str | None) -> None:
        from caravan_llm.devcluster.engine.hf_tokenizer import HfTokenizer  # noqa: PLC0415
        from caravan_llm.devcluster.engine.text import Vocabulary  # noqa: PLC0415

        self._hf = (
            None if tokenizer_dir is None else HfTokenizer.from_directory(Path(tokenizer_dir))
        )
        if tokenizer_dir is not None and self._hf is None:
            raise RuntimeError(f"no tokenizer.json in {tokenizer_dir}")
        self._vocabulary = Vocabulary()
        self._ids: dict[str, int] = {}

    def engine_tokens(
        self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True
    ) -> list[str] | list[int]:
        from caravan_llm.devcluster.engine.text import (  # noqa: PLC0415
            ChatMessage,
            render_chatml,
            tokenize,
        )

        chat = [ChatMessage(role, content) for role, content in messages]
        if self._hf is not None:
            rendered = self._hf.render_chat(chat, add_generation_prompt=add_generation_prompt)
            return self._hf.encode(rendered, add_special_tokens=False)
        return tokenize(render_chatml(chat, add_generation_prompt=add_generation_prompt))

    def leading_ids(
        self, messages: Sequence[tuple[str, str]], token_ids: Sequence[int]
    ) -> list[int]:
        """The ids of the chat up to its last answer: what a router tokenized before.

        The router's tokenizer has seen each earlier request of the
        conversation, so its segment cache holds the chat up to the previous
        turn's question; the previous answer and the new question are new
        text. Cut at the common prefix with the whole prompt's ids.
        """
        earlier = _before_last_answer(messages)
        rendered = self.ids(self.engine_tokens(earlier, add_generation_prompt=False))
        same = 0
        for ours, whole in zip(rendered, token_ids, strict=False):
            if ours != whole:
                break
            same += 1
        return list(token_ids[:same])

    def rendered_chars(
        self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True
    ) -> int:
        """The characters of the chat as the template renders it (what the router counts)."""
        from caravan_llm.devcluster.engine.text import ChatMessage, render_chatml  # noqa: PLC0415

        chat = [ChatMessage(role, content) for role, content in messages]
        if self._hf is not None:
            return len(self._hf.render_chat(chat, add_generation_prompt=add_generation_prompt))
        return len(render_chatml(chat, add_generation_prompt=add_generation_prompt))

    def predicted_tokens(self, messages: Sequence[tuple[str, str]], leading: int) -> int:
        """The prompt's token count as the live router predicts it from `leading` ids."""
        from caravan_llm.router.tokens.model_tokenizer import estimated_tokens  # noqa: PLC0415

        earlier = _before_last_answer(messages)
        leading_chars = self.rendered_chars(earlier, add_generation_prompt=False)
        return estimated_tokens(leading, leading_chars, self.rendered_chars(messages))

    def count(self, text: str) -> int:
        from caravan_llm.devcluster.engine.text import count_tokens  # noqa: PLC0415

        if self._hf is not None:
            return len(self._hf.encode(text, add_special_tokens=False))
        return count_tokens(text)

    def ids(self, tokens: Sequence[str] | Sequence[int]) -> list[int]:
        if self._hf is not None:
            return [int(t) for t in tokens]
        known = self._ids
        out = []
        for token in tokens:
            token_id = known.get(str(token))
            if token_id is None:
                token_id = known[str(token)] = self._vocabulary.id_of(str(token))
            out.append(token_id)
        return out

    @staticmethod
    def messages(payload: Mapping[str, Any]) -> list[tuple[str, str]] | None:
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return None
        return [(str(m.get("role")), str(m.get("content"))) for m in messages]

    async def prompt_token_ids(
        self,
        view: Any,
        route: Any,
        payload: Mapping[str, Any],
        *,
        on_prefix: Callable[[Sequence[int], int], None] | None = None,
    ) -> Sequence[int] | None:
        del view, route, on_prefix
        messages = self.messages(payload)
        return None if messages is None else self.ids(self.engine_tokens(messages))


# -- the engines (and the oracle's router, beside them) --------------------------------------


def engine_argv(
    fleet: rq.Fleet, port: int, seed: int, ipc: Path, replica: int, *, tokenizer_dir: str | None
) -> list[str]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{ipc}/e{replica}.ipc",
        "replay_endpoint": f"ipc://{ipc}/r{replica}.ipc",
        "topic": TOPIC,
    }
    tokenizer = ["--tokenizer", tokenizer_dir] if tokenizer_dir else []
    return [
        "--flavor",
        "vllm",
        *fleet.engine_args(port, seed),
        *tokenizer,
        "--kv-events-config",
        json.dumps(config),
    ]


def run_engines(args: argparse.Namespace) -> None:
    from caravan_llm.devcluster.engine.flags import parse_engine_args  # noqa: PLC0415
    from caravan_llm.devcluster.engine.server import run_engine  # noqa: PLC0415

    fleet = rq.Fleet(engines=ENGINES, kv_blocks=args.kv_blocks)
    ports = [int(p) for p in args.ports.split(",")]
    ids = args.ids.split(",")
    ipc = Path(args.ipc)

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
                            engine_argv(
                                fleet, port, args.seed + i, ipc, i, tokenizer_dir=args.tokenizer
                            ),
                            {},
                        )
                    )
                )
                for i, port in enumerate(ports)
            ]
            for item in running:
                await item.engine.ready.wait()
            if args.oracle_port:
                cores = {
                    endpoint: item.engine.core for endpoint, item in zip(ids, running, strict=True)
                }
                await stack.enter_async_context(oracle_service(args.oracle_port, cores))
            print("engines ready", flush=True)
            await stop.wait()

    asyncio.run(main())


def engine_holds(core: Any, hashes: Sequence[int]) -> int:
    """Leading blocks of `hashes` the engine holds now: cached, or of a sequence it has taken.

    The engine's own state, which no router can see: its prefix cache, and
    the prompts of the sequences running or waiting there (computed or being
    computed, and kept while they run).
    """
    held = int(core._pool.cached_prefix(hashes))  # noqa: SLF001 - the oracle reads the engine
    for seq in (*core._running, *core._waiting):  # noqa: SLF001
        common = 0
        for mine, theirs in zip(seq.spec.block_hashes, hashes, strict=False):
            if mine != theirs:
                break
            common += 1
        held = max(held, common)
    return held


@contextlib.asynccontextmanager
async def oracle_service(port: int, cores: Mapping[str, Any]) -> Any:
    """`POST /oracle/cached` {"hashes": [...]}: how many leading blocks each engine holds, now."""
    from aiohttp import web  # noqa: PLC0415

    async def cached(request: web.Request) -> web.Response:
        hashes = (await request.json())["hashes"]
        counts = {e: engine_holds(core, hashes) for e, core in cores.items()}
        return web.json_response({"counts": counts})

    app = web.Application()
    app.router.add_post("/oracle/cached", cached)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield
    finally:
        await runner.cleanup()


class OracleTokens(EngineTokens):
    """EngineTokens that ask the engines, per prompt, how much of it each one holds right now.

    The engines hash their blocks over the token ids (with a model tokenizer:
    the same in every process), so the oracle names the prompt's blocks as
    each engine does and reads each engine's cache (`oracle_service`) just
    before the router picks; `OracleIndex` answers from that reading.
    """

    def __init__(self, tokenizer_dir: str, block_size: int, oracle_url: str) -> None:
        super().__init__(tokenizer_dir)
        from caravan_llm.common.block_digest import DigestKey  # noqa: PLC0415

        self.block_size = block_size
        self.key = DigestKey.from_secret(KEY)
        self.url = oracle_url + "/oracle/cached"
        self.counts: dict[int, dict[str, int]] = {}
        self.session: aiohttp.ClientSession | None = None

    def _names(self, messages: list[tuple[str, str]]) -> tuple[list[int], Any, Any]:
        from caravan_llm.common.block_digest import block_digests  # noqa: PLC0415
        from caravan_llm.devcluster.engine.batch import prompt_block_hashes  # noqa: PLC0415

        ids = self.ids(self.engine_tokens(messages))
        digests = block_digests(ids, block_size=self.block_size, key=self.key)
        return ids, digests, prompt_block_hashes(ids, self.block_size)

    async def prompt_token_ids(
        self,
        view: Any,
        route: Any,
        payload: Mapping[str, Any],
        *,
        on_prefix: Callable[[Sequence[int], int], None] | None = None,
    ) -> Sequence[int] | None:
        del view, route, on_prefix
        messages = self.messages(payload)
        if messages is None:
            return None
        # Off the loop, as the router's own tokenizers work.
        ids, digests, hashes = await asyncio.to_thread(self._names, messages)
        if digests:
            if self.session is None:
                self.session = aiohttp.ClientSession()
            async with self.session.post(self.url, json={"hashes": list(hashes)}) as response:
                counts = (await response.json())["counts"]
            if len(self.counts) > 4096:
                self.counts.clear()
            self.counts[digests[-1]] = counts
        return ids


def streamless_index() -> Any:
    """A KvIndex class whose stream calls (the router's KV feed reading the relays) do
    nothing: an oracle built on it is told the engines' caches some other way."""
    from caravan_llm.router.core.kv_index import KvIndex  # noqa: PLC0415

    class StreamlessIndex(KvIndex):
        __slots__ = ()

        def apply_snapshot(self, replica: str, snapshot: Any, now: float) -> Any:
            del replica, snapshot, now
            return "ignored"

        def apply_delta(self, replica: str, delta: Any, now: float) -> Any:
            del replica, delta, now
            return "ignored"

        def heartbeat(self, replica: str, position: Any, now: float) -> Any:
            del replica, position, now
            return "ignored"

        def forget(self, replica: str) -> None:
            del replica

        def retain(self, replicas: Any) -> None:
            del replicas

    return StreamlessIndex


def oracle_index(tokens: OracleTokens) -> Any:
    """A KvIndex whose answers are the engines' caches as read for this very prompt (the
    relays' streams are not followed)."""

    class OracleIndex(streamless_index()):
        __slots__ = ()

        def state(self, replica: str, now: float) -> Any:
            del replica, now
            return "live"

        def block_size(self, replica: str) -> int | None:
            del replica
            return tokens.block_size

        def cached_blocks(
            self, replica: str, digests: Sequence[Any], *, block_size: int, now: float
        ) -> int | None:
            del now
            if block_size != tokens.block_size:
                return None
            if not digests:
                return 0
            counts = tokens.counts.get(digests[-1])
            return None if counts is None else counts.get(replica)

    return OracleIndex()


# -- routers --------------------------------------------------------------------------------


class KeyVariables:
    """Nomad Variables holding the model's engine key (the router's reads only)."""

    def __init__(self) -> None:
        from caravan_llm.common.contract import engine_key_path  # noqa: PLC0415
        from caravan_llm.common.nomad_api import Variable, VariableMetadata  # noqa: PLC0415

        path = engine_key_path(MODEL)
        self.variable = Variable(VariableMetadata("default", path, 5, 5), {"api_key": KEY})

    async def list_variables(
        self, prefix: str = "", *, index: int | None = None, wait_s: float | None = None
    ) -> Any:
        from caravan_llm.common.nomad_api import QueryResult  # noqa: PLC0415

        del wait_s
        if index is not None:
            await asyncio.Event().wait()  # a blocking query: the key never changes here
        meta = self.variable.meta
        return QueryResult(5, [meta] if meta.path.startswith(prefix) else [])

    async def get_variable(self, path: str) -> Any:
        return self.variable if path == self.variable.meta.path else None


@contextlib.asynccontextmanager
async def serving_router(
    consul_addr: str,
    *,
    precise: bool,
    tokens: EngineTokens | None,
    kv: Any = None,
    budget_ms: float | None = None,
) -> Any:
    """A caravan router on this loop (port yielded), with `/bench/stats` for the orchestrator."""
    from aiohttp import web  # noqa: PLC0415
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from caravan_llm.common.consul_api import ConsulClient, ConsulSettings  # noqa: PLC0415
    from caravan_llm.router.settings import RouterSettings  # noqa: PLC0415
    from caravan_llm.router.wiring.app import RUNTIME, app_runner, create_app  # noqa: PLC0415

    settings = RouterSettings(
        port=0,
        register_service=False,
        kv_events=precise,
        log_level="warning",
        # None: the router's default budget.
        **({} if budget_ms is None else {"exact_prefix_budget_ms": budget_ms}),
    )
    sources: dict[str, int] = {}
    # The canonical request line is built only when its logger is at info.
    logging.getLogger("router.proxy").setLevel(logging.INFO)

    served: dict[str, str] = {}

    def request_log(fields: dict[str, Any]) -> None:
        source = str(fields.get("prefix_source"))
        sources[source] = sources.get(source, 0) + 1
        if fields.get("endpoint") is not None:
            served[str(fields.get("request_id"))] = str(fields["endpoint"])

    host, _, port = consul_addr.rpartition(":")
    async with ConsulClient(ConsulSettings(host=host, port=int(port))) as consul:
        app = create_app(
            settings,
            consul=consul,
            registry=CollectorRegistry(),
            request_log=request_log,
            nomad=KeyVariables(),
            prompt_tokens=tokens if precise else None,
        )
        runtime = app[RUNTIME]
        if kv is not None:
            runtime.state.kv = kv

        async def stats(_request: web.Request) -> web.Response:
            now = time.monotonic()
            states: dict[str, int] = {}
            for endpoint in runtime.state.view.snapshot.by_id:
                state = runtime.state.kv.state(endpoint, now)
                states[state] = states.get(state, 0) + 1
            return web.json_response(
                {
                    "prefix_source": sources,
                    "kv_states": states,
                    "cpu_s": time.process_time(),
                    "served": served,
                }
            )

        app.router.add_get("/bench/stats", stats)
        runner = app_runner(app, settings)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            yield int(runner.addresses[0][1])
        finally:
            await runner.cleanup()


def run_router(args: argparse.Namespace) -> None:
    from caravan_llm.router.wiring.server import event_loop_factory  # noqa: PLC0415

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        if args.oracle:
            tokens: EngineTokens = OracleTokens(args.tokenizer, rq.Fleet().block_size, args.oracle)
            # Every request waits for its reading: the oracle is never routed on a guess.
            serving = serving_router(
                args.consul,
                precise=True,
                tokens=tokens,
                kv=oracle_index(tokens),  # type: ignore[arg-type]
                budget_ms=10_000.0,
            )
        else:
            serving = serving_router(
                args.consul, precise=args.precise, tokens=EngineTokens(args.tokenizer)
            )
        async with serving as port:
            print(f"router on http://127.0.0.1:{port}", flush=True)
            await stop.wait()

    with asyncio.Runner(loop_factory=event_loop_factory("auto")) as runner:
        runner.run(main())


def run_relays(args: argparse.Namespace) -> None:
    from caravan_llm.kvrelay.relay import running_relay  # noqa: PLC0415
    from caravan_llm.kvrelay.settings import RelaySettings  # noqa: PLC0415

    ports = [int(p) for p in args.ports.split(",")]
    ipc = Path(args.ipc)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        async with contextlib.AsyncExitStack() as stack:
            for replica, port in enumerate(ports):
                settings = RelaySettings(
                    events_endpoint=f"ipc://{ipc}/e{replica}.ipc",
                    replay_endpoint=f"ipc://{ipc}/r{replica}.ipc",
                    topic=TOPIC,
                    block_size=rq.Fleet().block_size,
                    engine_api_key=KEY,
                    host="127.0.0.1",
                    port=port,
                    log_level="warning",
                )
                await stack.enter_async_context(running_relay(settings))
            print("relays ready", flush=True)
            await stop.wait()

    asyncio.run(main())


# -- registration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Placed:
    ids: list[str]
    engine_ports: list[int]
    relay_ports: list[int]


async def place_fleet(
    consul_addr: str,
    nomad_addr: str,
    fleet: rq.Fleet,
    tokenizer_dir: str | None,
    ports: Sequence[int] | None = None,
) -> Placed:
    """Register the engines as Nomad would and place them (with their relays) as the scheduler.

    `ports`: the engines' ports then the relays' (default: free ones, chosen here).
    """
    from caravan_llm.common.consul_api import (  # noqa: PLC0415
        ConsulClient,
        ConsulSettings,
        HttpCheck,
        ServiceRegistration,
    )
    from caravan_llm.common.contract import (  # noqa: PLC0415
        KVLayout,
        PlacedAllocation,
        Placements,
        encode_placements,
        encode_prefill_rate,
        engine_key_path,
        nomad_service_id,
        replica_job_id,
    )

    ports = list(ports) if ports is not None else rq.free_ports(2 * fleet.engines)
    engine_ports, relay_ports = ports[: fleet.engines], ports[fleet.engines :]
    rng = random.Random(7)
    allocs = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in engine_ports]
    ids = [nomad_service_id(alloc, MODEL) for alloc in allocs]
    layout = KVLayout()
    host, _, consul_port = consul_addr.rpartition(":")
    async with ConsulClient(ConsulSettings(host=host, port=int(consul_port))) as consul:
        profile: dict[str, Any] = {
            "name": MODEL,
            "engine": "vllm",
            "replicas": {"min": 0, "max": fleet.engines},
        }
        if tokenizer_dir:
            # Where routers find the model's tokenizer (the engines load the same files).
            profile["tokenizer"] = tokenizer_dir
        await consul.kv_put(layout.model_key(MODEL), json.dumps(profile))
        placements = Placements(
            model=MODEL,
            allocations=tuple(
                PlacedAllocation(
                    alloc_id=alloc,
                    job_id=replica_job_id(MODEL, replica),
                    address="127.0.0.1",
                    port=port,
                    kv_port=relay,
                )
                for replica, (alloc, port, relay) in enumerate(
                    zip(allocs, engine_ports, relay_ports, strict=True)
                )
            ),
        )
        await consul.kv_put(layout.placements_key(MODEL), encode_placements(placements))
        for replica, (service_id, port) in enumerate(zip(ids, engine_ports, strict=True)):
            await consul.agent_service_register(
                ServiceRegistration(
                    name=SERVICE,
                    service_id=service_id,
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
                        **encode_prefill_rate(fleet.declared_prefill_tokens_per_s),
                    },
                    checks=(HttpCheck(url=f"http://127.0.0.1:{port}/health", interval_s=0.5),),
                )
            )
    # The engine key where routers read it (the scheduler's Nomad Variable).
    async with aiohttp.ClientSession() as session:
        url = f"{nomad_addr}/v1/var/{engine_key_path(MODEL)}"
        async with session.put(url, json={"Items": {"api_key": KEY}}) as response:
            response.raise_for_status()
    return Placed(ids, engine_ports, relay_ports)


# -- one cell -------------------------------------------------------------------------------


@dataclass
class PrefixCell(rq.Cell):
    events_share: float | None = None  # of the routers' requests, prefix from events
    kv_events: float | None = None  # deltas the routers applied
    cpu_s: dict[str, float] = field(default_factory=dict)
    kv_blocks: int = 0
    routers: int = 0
    # The routers' caravan_router_exact_prompts_total by outcome.
    exact_prompts: dict[str, float] = field(default_factory=dict)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its reaped children, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(fields[i]) for i in (11, 12)) / ticks


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.json()


async def router_figures(bases: list[str]) -> dict[str, float]:
    """The routers' metrics, each summed over their samples and over the routers."""
    totals: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for base in bases:
            async with session.get(base + "/metrics") as response:
                text = await response.text()
            for line in text.splitlines():
                if line.startswith("caravan_router_kv_streams{") and 'state="live"' in line:
                    name = "kv_streams_live"
                elif line.startswith("caravan_router_exact_prompts_total{"):
                    name = "exact_prompts_" + line.split('outcome="', 1)[1].split('"', 1)[0]
                elif line.startswith("caravan_router_kv_events_total"):
                    name = "kv_events"
                elif line.startswith("caravan_router_kv_resyncs_total{"):
                    name = "kv_resyncs"
                else:
                    continue
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


async def kv_streams_live(bases: list[str], count: int) -> None:
    """Until every router follows every replica's stream (live)."""

    async def check(_session: aiohttp.ClientSession) -> bool:
        for base in bases:
            if (await router_figures([base])).get("kv_streams_live", 0) != count:
                return False
        return True

    await rq.wait_until(check, "every router's KV streams live")


PREFIX_SOURCE = re.compile(r'"prefix_source": ?"(\w+)"')


REQUEST_LINE = re.compile(r'"request_id": ?"([^"]+)".*?"endpoint": ?"([^"]+)"')


def stay_note(cell: rq.Cell) -> str:
    """Where the later turns went: ' (stayed 0.93: cached 0.97, moved 0.40)', or ''."""
    if cell.history_stayed is None:
        return ""
    fmt = rq._fmt  # noqa: SLF001
    return (
        f" (stayed {fmt(cell.history_stayed, 2)}: cached {fmt(cell.history_cached_stayed, 2)},"
        f" moved {fmt(cell.history_cached_moved, 2)};"
        f" early {fmt(cell.history_early, 2)}: cached {fmt(cell.history_cached_early, 2)})"
    )


def request_lines(log: Path) -> tuple[dict[str, int], dict[str, str]]:
    """From a router process's request lines (log level info): its `prefix_source`
    counts, and request id -> the replica that served it."""
    text = log.read_text(errors="replace")
    counts: dict[str, int] = {}
    for match in PREFIX_SOURCE.finditer(text):
        counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts, {match.group(1): match.group(2) for match in REQUEST_LINE.finditer(text)}


def prefix_sources(log: Path) -> dict[str, int]:
    """A router process's `prefix_source` counts, from its request lines (log level info)."""
    return request_lines(log)[0]


async def run_cell(
    cell: PrefixCell,
    trace: list[rq.TraceRequest],
    *,
    consul_addr: str,
    nomad_addr: str,
    placed: Placed,
    fleet: rq.Fleet,
    vllm_router: str | None,
    system_tokens: list[int],
    seed: int,
    tokenizer_dir: str | None,
    wait_budget_ms: float = 50.0,
    dump_requests: str = "",
) -> None:
    python = sys.executable
    bases = [f"http://127.0.0.1:{port}" for port in placed.engine_ports]
    rq.ENGINE_BASES[:] = bases
    target = cell.target
    kind = target.removesuffix("-x3")
    routers = 3 if target.endswith("-x3") else 1
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="kvb") as ipc:
        command = [
            python, __file__, "engines",
            "--ports", ",".join(map(str, placed.engine_ports)),
            "--ids", ",".join(placed.ids),
            "--ipc", ipc, "--seed", str(seed), "--kv-blocks", str(fleet.kv_blocks),
            "--consul", consul_addr,
        ]  # fmt: skip
        if tokenizer_dir:
            command += ["--tokenizer", tokenizer_dir]
        oracle_port = rq.free_ports(1)[0]
        if kind == "oracle":
            command += ["--oracle-port", str(oracle_port)]
        engines, _ = stack.enter_context(started(command, "engines ready"))
        processes = {"engines": engines.process.pid}
        relays = None
        if kind.startswith("precise"):
            relays, _ = stack.enter_context(
                started(
                    [
                        python, __file__, "relays",
                        "--ports", ",".join(map(str, placed.relay_ports)), "--ipc", ipc,
                    ],
                    "relays ready",
                )
            )  # fmt: skip
            processes["relays"] = relays.process.pid
        await rq.engines_passing(consul_addr, len(bases))
        router_bases: list[str] = []
        router_logs: list[Path] = []
        if kind == "rr":
            urls = [base + "/v1/chat/completions" for base in bases]
        elif kind == "oracle":
            assert tokenizer_dir is not None
            argv = [python, __file__, "router", "--consul", consul_addr]
            argv += ["--tokenizer", tokenizer_dir, "--oracle", f"http://127.0.0.1:{oracle_port}"]
            proc, found = stack.enter_context(started(argv, r"router on (\S+)"))
            processes["router0"] = proc.process.pid
            router_bases = [found.group(1)]
        elif kind in ("approx", "precise", "precise-wait"):
            for n in range(routers):
                if tokenizer_dir:
                    # The router process as deployed: its own tokenizers, from the profile.
                    argv = [python, "-m", "caravan_llm.router"]
                    pattern = r"listening on (http://[\d.]+:\d+)"
                else:
                    argv = [python, __file__, "router", "--consul", consul_addr]
                    argv += ["--precise"] if kind.startswith("precise") else []
                    pattern = r"router on (\S+)"
                env = {
                    **os.environ,
                    "PYTHONPATH": str(REPO),
                    "CONSUL_HTTP_ADDR": consul_addr,
                    "NOMAD_ADDR": nomad_addr,
                    "CARAVAN_ROUTER_PORT": "0",
                    "CARAVAN_ROUTER_REGISTER_SERVICE": "false",
                    "CARAVAN_ROUTER_KV_EVENTS": "true" if kind.startswith("precise") else "false",
                    # Info: the request lines, whose prefix_source is counted.
                    "CARAVAN_ROUTER_LOG_LEVEL": "info",
                }
                if kind == "precise-wait":
                    # Long enough for every prompt's tokens on this machine; the
                    # others run at the router's default budget.
                    env["CARAVAN_ROUTER_EXACT_PREFIX_BUDGET_MS"] = f"{wait_budget_ms:g}"
                else:
                    env.pop("CARAVAN_ROUTER_EXACT_PREFIX_BUDGET_MS", None)
                proc, found = stack.enter_context(started(argv, pattern, env=env))
                processes[f"router{n}"] = proc.process.pid
                router_bases.append(found.group(1))
                if tokenizer_dir:
                    router_logs.append(proc.log)
        else:
            assert vllm_router is not None
            port = rq.free_ports(1)[0]
            argv = [
                vllm_router, "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *bases,
                "--policy", kind.removeprefix("vllm-router-"), "--log-level", "warning",
            ]  # fmt: skip
            proc, _ = stack.enter_context(started(argv, r""))
            processes["vllm-router"] = proc.process.pid
            await rq.http_ok(f"http://127.0.0.1:{port}/health")
            urls = [f"http://127.0.0.1:{port}/v1/chat/completions"]
        if router_bases:
            for base in router_bases:
                await rq.http_ok(base + "/health")
            if kind.startswith("precise"):
                await kv_streams_live(router_bases, len(bases))
            await asyncio.sleep(1.2)  # one engine scrape, for the cost model
            urls = [base + "/v1/chat/completions" for base in router_bases]
        cpu_before = {name: cpu_seconds(pid) for name, pid in processes.items()}
        outcomes, _, peak = await rq.play(trace, "rr", urls, fleet)
        hits, queries = await rq.fleet_cache(bases)
        cell.cpu_s = {
            name: round(cpu_seconds(pid) - cpu_before[name], 2) for name, pid in processes.items()
        }
        if router_bases:
            sources: dict[str, int] = {}
            served: dict[str, str] = {}
            if router_logs:
                read = [request_lines(log) for log in router_logs]
            else:
                stats = [await get_json(base + "/bench/stats") for base in router_bases]
                read = [(stat["prefix_source"], stat["served"]) for stat in stats]
            for counts, replicas in read:
                for source, count in counts.items():
                    sources[source] = sources.get(source, 0) + count
                served.update(replicas)
            for number, outcome in enumerate(outcomes):
                outcome.endpoint = served.get(rq.trace_request_id(number))
            total = sum(sources.values())
            cell.events_share = sources.get("events", 0) / total if total else None
            figures = await router_figures(router_bases)
            cell.kv_events = figures.get("kv_events") if kind.startswith("precise") else None
            cell.exact_prompts = {
                k.removeprefix("exact_prompts_"): v
                for k, v in figures.items()
                if k.startswith("exact_prompts_")
            }
    cell.peak_engine_busy = peak
    cell.hit_rate = hits / queries if queries else math.nan
    cell.kv_blocks = fleet.kv_blocks
    cell.routers = routers if router_bases else 0
    rq.summarise(cell, trace, outcomes, system_tokens, fleet.block_size)
    if dump_requests:
        rq.write_requests(Path(f"{dump_requests}-{cell.target}.json"), trace, outcomes)


# -- offline: the same comparison on a virtual clock ----------------------------------------


def offline_cell(
    cell: PrefixCell,
    trace: list[rq.TraceRequest],
    fleet: rq.Fleet,
    system_tokens: list[int],
    *,
    lag_s: float,
    tokens_of: EngineTokens,
) -> None:
    """Replay the trace on a virtual clock: the engines' batch core and relays, the routers' core.

    As `routing_quality --offline` (exact, the same on every machine; no wire,
    no admission queue, no tokenizing time), with the KV-event path: each
    engine step's cache events go through the relay's own state
    (`RelayState`: digests from the events' token ids) and reach every
    router's `KvIndex` `lag_s` later; a router holds its requests' blocks in
    flight (`hold`/`release`) as the admission gate does. `oracle` reads
    each engine's cache and queues directly at decision time. `-x3` targets
    run three routers, each with its own live state, picker memory, exact
    index and scrape, the requests dealt to them in turn.
    """
    import heapq  # noqa: PLC0415

    from caravan_llm.common.block_digest import DigestKey  # noqa: PLC0415
    from caravan_llm.common.consul_api import HealthEntry  # noqa: PLC0415
    from caravan_llm.common.contract import encode_prefill_rate  # noqa: PLC0415
    from caravan_llm.common.engine_metrics import EngineLoad  # noqa: PLC0415
    from caravan_llm.devcluster.engine.batch import (  # noqa: PLC0415
        BatchCore,
        BlockEvicted,
        BlocksStored,
        PerfModel,
        SequenceSpec,
        prompt_block_hashes,
    )
    from caravan_llm.kvrelay.state import (  # noqa: PLC0415
        ClearedAll,
        RelayState,
        RemovedBlocks,
        StoredBlocks,
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
        begin_prefill,
        end_prefill,
        peer_rate_of,
        record_cache_figures,
    )
    from caravan_llm.router.core.endpoints import snapshot_from_health  # noqa: PLC0415
    from caravan_llm.router.core.kv_index import KvIndex  # noqa: PLC0415
    from caravan_llm.router.core.live_state import Outcome as RouterOutcome  # noqa: PLC0415
    from caravan_llm.router.core.live_state import (  # noqa: PLC0415
        finish_request,
        own_counts,
        reconcile_live_state,
        record_load,
        start_request,
    )
    from caravan_llm.router.core.prefix_index import prompt_shape  # noqa: PLC0415
    from caravan_llm.router.core.prompt_digests import (  # noqa: PLC0415
        endpoint_digests,
        events_cached,
        exact_prompt,
    )

    kind = cell.target.removesuffix("-x3")
    routers = 3 if cell.target.endswith("-x3") else 1
    block = fleet.block_size
    perf = PerfModel(
        max_num_seqs=fleet.max_num_seqs,
        kv_cache_tokens=fleet.kv_blocks * block,
        block_size=block,
        max_batched_tokens=fleet.chunk_tokens,
        step_seconds=fleet.step_s,
        decode_seconds_per_seq=fleet.decode_s_per_seq,
        prefill_seconds_per_token=fleet.prefill_s_per_token,
    )
    cores = [BatchCore(perf, record_cache_events=True) for _ in range(fleet.engines)]
    key = DigestKey.from_secret(KEY)
    relays = [RelayState(epoch=i + 1, block_size=block, key=key) for i in range(fleet.engines)]
    relay_seq = [0] * fleet.engines
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
    by_id = {e: dataclasses.replace(x, kv_port=30000) for e, x in snapshot.by_id.items()}
    models = {
        name: dataclasses.replace(m, endpoints=tuple(by_id[e.id] for e in m.endpoints))
        for name, m in snapshot.models.items()
    }
    snapshot = dataclasses.replace(snapshot, by_id=by_id, models=models)
    config = BalancerConfig()
    breaker = BreakerPolicy()
    policy = Policy.PREDICTED_TTFT
    engine_hash: dict[int, int] = {}

    class Oracle:
        """The engines' own state at decision time (what no router can see)."""

        def block_size(self, replica: str) -> int | None:
            del replica
            return block

        def cached_blocks(
            self, replica: str, digests: Sequence[Any], *, block_size: int, now: float
        ) -> int | None:
            del block_size, now
            hashes = []
            for digest in digests:
                if digest not in engine_hash:
                    break
                hashes.append(engine_hash[digest])
            return engine_holds(cores[ids.index(replica)], hashes)

    @dataclass
    class Router:
        live: Any
        memory: Any
        kv: Any

    fleet_routers = []
    for n in range(routers):
        kv = KvIndex(stale_after_s=1e9)
        for i, replica in enumerate(ids):
            kv.apply_snapshot(replica, relays[i].snapshot(), 0.0)
        fleet_routers.append(
            Router(reconcile_live_state({}, snapshot), PickerMemory(rng=random.Random(n)), kv)
        )

    events: list[tuple[float, int, str, Any]] = []
    sequence = 0

    def push(at: float, what: str, data: Any) -> None:
        nonlocal sequence
        sequence += 1
        heapq.heappush(events, (at, sequence, what, data))

    for number, request in enumerate(trace):
        push(request.at, "arrive", number)
    for n in range(routers):
        push(n / routers, "scrape", n)
    push(0.0, "sample", None)
    plans: list[Any] = [None] * fleet.engines
    outcomes = [rq.Outcome(ok=False) for _ in trace]
    started_at = [0.0] * len(trace)
    owners: dict[str, tuple[int, int, Any, Any, Router | None, tuple[Any, ...]]] = {}
    cursor = 0
    peak = 0
    exact_used = 0
    routed = 0

    def step(engine: int, now: float) -> None:
        if plans[engine] is None:
            plans[engine] = cores[engine].schedule(now)
            if plans[engine] is not None:
                push(now + plans[engine].duration, "step", engine)

    def relay_step(engine: int, cache_events: Sequence[Any], now: float) -> None:
        mapped: list[Any] = []
        for event in cache_events:
            if isinstance(event, BlocksStored):
                mapped.append(
                    StoredBlocks(
                        event.block_hashes, event.parent_block_hash, event.token_ids, block
                    )
                )
            elif isinstance(event, BlockEvicted):
                mapped.append(RemovedBlocks((event.block_hash,)))
            else:
                mapped.append(ClearedAll())
        applied = relays[engine].apply(relay_seq[engine], mapped)
        relay_seq[engine] += 1
        if applied.delta is not None:
            push(now + lag_s, "delta", (engine, applied.delta))

    while events:
        now, _, what, data = heapq.heappop(events)
        if what == "arrive":
            request = trace[data]
            tokens = rq._prompt_tokens(request)  # noqa: SLF001
            token_ids = tokens_of.ids(tokens)
            prefill = None
            lease = None
            router: Router | None = None
            held: tuple[Any, ...] = ()
            if kind == "rr":
                engine = cursor % fleet.engines
                cursor += 1
                outcomes[data].endpoint = ids[engine]
            else:
                router = fleet_routers[cursor % routers]
                cursor += 1
                messages = [{"role": role, "content": text} for role, text in request.messages]
                shape = prompt_shape({"messages": messages}, config.cost.shape)
                exact = None
                view: Any = None
                if kind.startswith("precise-leading"):
                    leading = tokens_of.leading_ids(request.messages, token_ids)
                    count = (
                        tokens_of.predicted_tokens(request.messages, len(leading))
                        if kind == "precise-leading-predicted"
                        else len(token_ids)
                    )
                    exact = dataclasses.replace(
                        exact_prompt(leading, keys={SERVICE: key}, kinds=[(SERVICE, block)]),
                        tokens=count,
                    )
                    view = router.kv
                elif kind != "approx":
                    exact = exact_prompt(token_ids, keys={SERVICE: key}, kinds=[(SERVICE, block)])
                    view = router.kv if kind.startswith("precise") else Oracle()
                    if kind == "oracle":
                        engine_hash.update(
                            zip(
                                exact.digests[SERVICE, block],
                                prompt_block_hashes(tokens, block),
                                strict=False,
                            )
                        )
                features = RequestFeatures(model=MODEL, prompt=shape, exact=exact)
                result = pick(
                    snapshot, router.live, features, policy, now,
                    config=config, memory=router.memory, kv=view,
                )  # fmt: skip
                if isinstance(result, Picked):
                    endpoint = result.endpoint
                else:  # every engine full: the real router would queue it
                    busy = [c.stats().running + c.stats().waiting for c in cores]
                    endpoint = snapshot.by_id[ids[busy.index(min(busy))]]
                engine = ids.index(endpoint.id)
                outcomes[data].endpoint = endpoint.id
                lease = start_request(router.live, endpoint.id, breaker, now)
                events_now = None if view is None else events_cached(view, endpoint, exact, now)
                routed += 1
                exact_used += events_now is not None
                if shape is not None:
                    prefill = begin_prefill(
                        router.live, endpoint, shape, now, config.cost,
                        max_age_s=config.load_max_age_s,
                        peer=peer_rate_of(snapshot, router.live, MODEL), events=events_now,
                    )  # fmt: skip
                if kind in ("precise", "precise-wait") or kind.startswith("precise-leading"):
                    held = endpoint_digests(router.kv, endpoint, exact)
                    router.kv.hold(endpoint.id, held)
            started_at[data] = now
            request_id = str(data)
            owners[request_id] = (data, engine, prefill, lease, router, held)
            cores[engine].submit(
                SequenceSpec(
                    request_id=request_id,
                    prompt_len=len(tokens),
                    block_hashes=prompt_block_hashes(tokens, block),
                    output_len=fleet.output_tokens,
                    prompt_token_ids=tuple(token_ids),
                ),
                now,
            )
            step(engine, now)
        elif what == "step":
            plan = plans[data]
            plans[data] = None
            done = cores[data].complete(plan, now)
            if done.cache_events:
                relay_step(data, done.cache_events, now)
            for first in done.first_tokens:
                number, _, prefill, _, router, _ = owners[first.request_id]
                outcomes[number].ttft_s = now - started_at[number]
                outcomes[number].prompt_tokens = first.prompt_len
                outcomes[number].cached_tokens = first.cached_tokens
                if prefill is not None and router is not None:
                    end_prefill(router.live, prefill, now, config.cost, first_token=True)
            for finished in done.finished:
                number, engine, _, lease, router, held = owners.pop(finished.request_id)
                outcomes[number].ok = True
                outcomes[number].e2e_s = now - started_at[number]
                outcomes[number].done_at = now
                if router is not None and lease is not None:
                    finish_request(router.live, lease, RouterOutcome.SUCCESS, breaker, now)
                    if held:
                        router.kv.release(ids[engine], held)
            step(data, now)
        elif what == "delta":
            engine, delta = data
            for router in fleet_routers:
                router.kv.apply_delta(ids[engine], delta, now)
        elif what == "scrape":
            router = fleet_routers[data]
            for engine, core in enumerate(cores):
                stats = core.stats()
                load = EngineLoad(
                    running=float(stats.running),
                    waiting=float(stats.waiting),
                    kv_cache_usage=stats.kv_cache_usage,
                )
                own = own_counts(router.live, ids[engine])
                record_load(router.live, ids[engine], load, now, own_before=own)
                figures = CacheFigures(
                    kv_cache_tokens=perf.kv_cache_tokens,
                    prefix_queries=float(stats.prefix_queries_tokens),
                    prefix_hits=float(stats.prefix_hits_tokens),
                )
                record_cache_figures(router.live, ids[engine], figures, config.cost)
            if owners or any(e[2] == "arrive" for e in events):
                push(now + 1.0, "scrape", data)
        elif what == "sample":
            peak = max([peak, *(c.stats().running + c.stats().waiting for c in cores)])
            if owners or any(e[2] == "arrive" for e in events):
                push(now + 0.5, "sample", None)
    hits = sum(core.stats().prefix_hits_tokens for core in cores)
    queries = sum(core.stats().prefix_queries_tokens for core in cores)
    cell.peak_engine_busy = peak
    cell.hit_rate = hits / queries if queries else math.nan
    cell.kv_blocks = fleet.kv_blocks
    cell.routers = routers if kind != "rr" else 0
    cell.events_share = exact_used / routed if routed and kind != "approx" else None
    rq.summarise(cell, trace, outcomes, system_tokens, block)


# -- tables ---------------------------------------------------------------------------------


def print_cells(cells: list[PrefixCell], fleet: rq.Fleet, working_set: int) -> None:
    print(
        f"\n{fleet.caption()}; {fleet.engines} engines, KV {fleet.kv_blocks} blocks "
        f"({fleet.kv_blocks * fleet.block_size} tokens) each = "
        f"{fleet.kv_blocks / working_set:.2f} of the working set ({working_set} blocks); "
        f"cores: {os.cpu_count()}\n"
    )
    header = (
        "| target | rep | requests | errors | TTFT p50 ms | p90 | p99 | fleet hit rate "
        "| prefix missed | history cached | prefix from events | exact prompts "
        "| KV deltas applied | CPU s |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for c in cells:
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in c.cpu_s.items())
        exact = ", ".join(f"{k} {v:.0f}" for k, v in sorted(c.exact_prompts.items()) if v) or "-"
        print(
            f"| {c.target} | {c.rep} | {c.requests} | {c.errors} | "
            f"{rq._fmt(c.ttft_ms.get('p50'))} | {rq._fmt(c.ttft_ms.get('p90'))} | "  # noqa: SLF001
            f"{rq._fmt(c.ttft_ms.get('p99'))} | {rq._fmt(c.hit_rate, 3)} | "  # noqa: SLF001
            f"{rq._fmt(c.prefix_missed, 3)} | {rq._fmt(c.history_cached, 3)} | "  # noqa: SLF001
            f"{rq._fmt(c.events_share, 3)} | {exact} | {rq._fmt(c.kv_events)} | {cpu} |"  # noqa: SLF001
        )


def _mean(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None and not math.isnan(v)]
    return sum(known) / len(known) if known else None


def mean_cells(cells: Sequence[PrefixCell]) -> dict[str, PrefixCell]:
    """Per target, its first cell with the hit rate, history share and TTFT percentiles
    replaced by their means over the target's repetitions (a missing figure is left out
    of its mean; a figure no repetition has stays missing)."""
    by_target: dict[str, list[PrefixCell]] = {}
    for cell in cells:
        by_target.setdefault(cell.target, []).append(cell)
    means: dict[str, PrefixCell] = {}
    for target, group in by_target.items():
        hit_rate = _mean(c.hit_rate for c in group)
        quantiles = {q for c in group for q in c.ttft_ms}
        ttft_ms = {q: _mean(c.ttft_ms.get(q) for c in group) for q in sorted(quantiles)}
        means[target] = dataclasses.replace(
            group[0],
            hit_rate=math.nan if hit_rate is None else hit_rate,
            history_cached=_mean(c.history_cached for c in group),
            ttft_ms={q: v for q, v in ttft_ms.items() if v is not None},
        )
    return means


def print_acceptance(cells: list[PrefixCell]) -> None:
    by_rep: dict[int | str, dict[str, PrefixCell]] = {}
    for c in cells:
        by_rep.setdefault(c.rep, {})[c.target] = c
    reps = len(by_rep)
    if reps > 1:
        # One repetition's hit rate moves by 1-3% with the machine's timing: the
        # ratios of the means over every repetition are the figure to read.
        by_rep[f"mean of {reps}"] = mean_cells(cells)
    print("\nAcceptance (issue 24), per repetition and precise variant:\n")
    print(
        "| rep | precise | hit rate / approx | / oracle | / best vllm-router | / rr "
        "| x3: TTFT p50 / approx-x3 | x3: p99 / approx-x3 | history cached | TTFT p50 / rr |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rep, group in by_rep.items():

        def hit(target: str, group: dict[str, PrefixCell] = group) -> float | None:
            cell = group.get(target)
            return None if cell is None else cell.hit_rate

        def ttft(target: str, q: str, group: dict[str, PrefixCell] = group) -> float | None:
            cell = group.get(target)
            return None if cell is None else cell.ttft_ms.get(q)

        peers = [h for h in (hit("vllm-router-cache_aware"), hit("vllm-router-power_of_two")) if h]
        for variant in ("precise", "precise-wait"):
            mine = group.get(variant)
            if mine is None and group.get(variant + "-x3") is None:
                continue
            row = [
                str(rep),
                variant,
                rq._ratio(hit(variant), hit("approx")),  # noqa: SLF001
                rq._ratio(hit(variant), hit("oracle")),  # noqa: SLF001
                rq._ratio(hit(variant), max(peers) if peers else None),  # noqa: SLF001
                rq._ratio(hit(variant), hit("rr")),  # noqa: SLF001
                rq._ratio(ttft(variant + "-x3", "p50"), ttft("approx-x3", "p50")),  # noqa: SLF001
                rq._ratio(ttft(variant + "-x3", "p99"), ttft("approx-x3", "p99")),  # noqa: SLF001
                rq._fmt(None if mine is None else mine.history_cached, 3),  # noqa: SLF001
                rq._ratio(ttft(variant, "p50"), ttft("rr", "p50")),  # noqa: SLF001
            ]
            print("| " + " | ".join(row) + " |")


# -- orchestration --------------------------------------------------------------------------


def orchestrate(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    targets = args.targets.split(",")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        print(f"unknown targets: {unknown} (known: {', '.join(TARGETS)})", file=sys.stderr)
        return 2
    vllm_router = os.environ.get("CARAVAN_BENCH_VLLM_ROUTER") or shutil.which(
        "vllm-router", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    )
    if vllm_router is None:
        skipped = [t for t in targets if t.startswith("vllm-router-")]
        if skipped:
            print(f"vllm-router not installed: {skipped} skipped")
        targets = [t for t in targets if not t.startswith("vllm-router-")]
    if not args.offline and any(t in OFFLINE_ONLY for t in targets):
        print(f"offline only: {list(OFFLINE_ONLY)} skipped")
        targets = [t for t in targets if t not in OFFLINE_ONLY]
    if args.tokenizer == "sim" and "oracle" in targets:
        # The engines hash the regex tokenizer's token texts: per process, unknowable outside.
        print("the oracle needs --tokenizer tiny: skipped")
        targets = [t for t in targets if t != "oracle"]
    tokenizer_dir: str | None = None
    scratch = tempfile.TemporaryDirectory(prefix="kvb-tok")
    if args.tokenizer == "tiny":
        from caravan_llm.devcluster.tiny_tokenizer import write_tokenizer  # noqa: PLC0415

        write_tokenizer(Path(scratch.name))
        tokenizer_dir = scratch.name
    # The trace's token counts (load calibration, working set, history cached) in the
    # engines' tokens: routing_quality's helpers read these two module functions.
    tokens = EngineTokens(tokenizer_dir)
    rq._tokens = tokens.count  # noqa: SLF001
    rq._prompt_tokens = lambda r: tokens.engine_tokens(r.messages)  # noqa: SLF001
    probe = rq.Fleet(engines=ENGINES)
    trace, duration = rq.cell_trace(
        args.workload, args.load, args.seed, args.duration, min_requests=0, fleet=probe
    )
    working_set = working_set_blocks(trace, probe.block_size)
    fleet = fleet_for(trace, args.cache_share)
    print(
        f"{args.workload}/{args.load}: {len(trace)} requests over {duration:.0f} s; working set "
        f"{working_set} blocks; KV per engine {fleet.kv_blocks} blocks; "
        f"{args.reps} repetition(s) of {len(targets)} targets; tokenizer {args.tokenizer}",
        flush=True,
    )
    system_tokens = [
        rq._tokens(f"<|im_start|>system\n{text}<|im_end|>\n")  # noqa: SLF001
        for text in rq._system_prompts(16, 1100)  # noqa: SLF001
    ]
    cells: list[PrefixCell] = []
    began = time.monotonic()
    if args.offline:
        for target in (t for t in targets if not t.startswith("vllm-router-")):
            cell = PrefixCell(args.workload, args.load, target, 0, duration_s=duration)
            offline_cell(
                cell, trace, fleet, system_tokens, lag_s=args.lag_ms / 1e3, tokens_of=tokens
            )
            cells.append(cell)
            print(
                f"  {target}: TTFT p50 {cell.ttft_ms['p50']:.0f} ms, "
                f"p99 {cell.ttft_ms['p99']:.0f} ms, hit rate {cell.hit_rate:.3f}, "
                f"history {rq._fmt(cell.history_cached, 3)}{stay_note(cell)}",  # noqa: SLF001
                flush=True,
            )
        scratch.cleanup()
        print_cells(cells, fleet, working_set)
        print_acceptance(cells)
        return 0
    with (
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
        ) as (_, found),
        scratch,
    ):
        consul_addr, nomad_addr = found.group(1), found.group(2)
        placed = asyncio.run(place_fleet(consul_addr, nomad_addr, fleet, tokenizer_dir))
        for rep in range(args.reps):
            order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
            for target in order:
                cell = PrefixCell(args.workload, args.load, target, rep, duration_s=duration)
                cell_began = time.monotonic()
                asyncio.run(
                    run_cell(
                        cell, trace, consul_addr=consul_addr, nomad_addr=nomad_addr,
                        placed=placed, fleet=fleet, vllm_router=vllm_router,
                        system_tokens=system_tokens, seed=args.seed, tokenizer_dir=tokenizer_dir,
                        wait_budget_ms=args.wait_budget_ms, dump_requests=args.dump_requests,
                    )
                )  # fmt: skip
                cell.wall_s = time.monotonic() - cell_began
                cells.append(cell)
                print(
                    f"  {target} rep {rep}: TTFT p50 {cell.ttft_ms['p50']:.0f} ms, "
                    f"p99 {cell.ttft_ms['p99']:.0f} ms, hit rate {cell.hit_rate:.3f}, "
                    f"history {rq._fmt(cell.history_cached, 3)}{stay_note(cell)}, "  # noqa: SLF001
                    f"events {rq._fmt(cell.events_share, 2)}, errors {cell.errors} "  # noqa: SLF001
                    f"({cell.wall_s:.0f} s)",
                    flush=True,
                )
                if args.out:
                    Path(args.out).write_text(json.dumps([asdict(c) for c in cells], indent=1))
    print_cells(cells, fleet, working_set)
    print_acceptance(cells)
    print(f"\ntotal wall time: {(time.monotonic() - began) / 60:.1f} min")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    engines = sub.add_parser("engines", help="(internal) the simulated engines")
    engines.add_argument("--ports", required=True)
    engines.add_argument("--ids", required=True)
    engines.add_argument("--ipc", required=True)
    engines.add_argument("--seed", type=int, default=0)
    engines.add_argument("--kv-blocks", type=int, required=True)
    engines.add_argument("--consul", required=True)
    engines.add_argument("--oracle-port", type=int, default=0)
    engines.add_argument("--tokenizer", default=None)
    relays = sub.add_parser("relays", help="(internal) one KV relay per engine")
    relays.add_argument("--ports", required=True)
    relays.add_argument("--ipc", required=True)
    router = sub.add_parser("router", help="(internal) a caravan router")
    router.add_argument("--consul", required=True)
    router.add_argument("--precise", action="store_true")
    router.add_argument("--tokenizer", default=None)
    router.add_argument("--oracle", default="", help="the engines' oracle service URL")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--workload", default="shared", choices=rq.WORKLOADS)
    parser.add_argument("--load", default="near", choices=tuple(rq.LOADS))
    parser.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals")
    parser.add_argument(
        "--cache-share", type=float, default=0.25, help="each engine's KV / the working set"
    )
    parser.add_argument(
        "--tokenizer",
        default="tiny",
        choices=("tiny", "sim"),
        help="tiny: the engines and the router processes use the tiny models' HF tokenizer "
        "(the router as deployed); sim: the simulator's regex tokenizer, routers launched "
        "here with a mirror of it (no tokenizing budget)",
    )
    parser.add_argument(
        "--wait-budget-ms",
        type=float,
        default=50.0,
        help="precise-wait's EXACT_PREFIX_BUDGET_MS (50: every prompt's digests)",
    )
    parser.add_argument(
        "--dump-requests",
        default="",
        metavar="PREFIX",
        help="live cells: write each request's replica, cached tokens and TTFT to "
        "PREFIX-<target>.json",
    )
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="", help="write every cell as JSON here (as it goes)")
    parser.add_argument("--quick", action="store_true", help="6 s of arrivals")
    parser.add_argument(
        "--offline",
        action="store_true",
        help="replay on a virtual clock (batch cores, relay states, routers' core): exact",
    )
    parser.add_argument(
        "--lag-ms", type=float, default=20.0, help="offline: engine step to router KvIndex"
    )
    args = parser.parse_args()
    if args.command == "engines":
        run_engines(args)
        return 0
    if args.command == "relays":
        run_relays(args)
        return 0
    if args.command == "router":
        run_router(args)
        return 0
    if args.quick:
        args.duration = 6.0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
