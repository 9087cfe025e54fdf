"""The routing latency precise prefix routing adds, side by side with the approximate index.

    .venv/bin/python bench/exact_prefix_latency.py                  # the tiny models' tokenizer
    .venv/bin/python bench/exact_prefix_latency.py --tokenizer DIR  # any tokenizer.json directory

Per chat request, on one event loop, the router's routing work timed both ways:

- `approximate`: `prompt_shape` (the approximate index's naming of the prompt)
  and `balancer.pick` with `predicted_ttft` over 4 replicas, without the exact index;
- `exact`: the same plus what precise routing adds: `PromptDigester.exact_prompt`
  (the real `Tokenizers`: the model's worker thread and back, at most the budget,
  then the block digests) and the exact index's lookups inside `pick` (every
  replica has a live stream; one holds the conversation's blocks).

`added` is exact minus approximate for the same request. Scenarios (as in
bench/tokenize_cost.py): `next turn` (a conversation's history seen before,
then a new ~64-token turn), `shared system` (a system prompt seen before, then
a new question), `cold` (every piece new: a new document). Each at 1k and 8k
prompt tokens, in the block sizes of vLLM on GPUs (16) and of the CPU build
(128), with the router's default budget and with an unbounded one (what exact
routing would cost if it always waited). `exact %` is the share of requests
routed on the exact index (the rest went over budget: `prefix_source:
approximate`, their tokenizing finished in the background).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tokenize_cost import QUESTION_TOKENS, Texts, chat, corpus, percentiles

from caravan_llm.common.block_digest import DigestKey, block_digests
from caravan_llm.common.consul_api import HealthEntry
from caravan_llm.common.contract import EngineRoute, ModelView
from caravan_llm.common.kv_stream import KvSnapshot
from caravan_llm.devcluster.tiny_tokenizer import write_tokenizer
from caravan_llm.router.core.balancer import (
    BalancerConfig,
    PickerMemory,
    Policy,
    RequestFeatures,
    pick,
)
from caravan_llm.router.core.endpoints import EndpointSnapshot, snapshot_from_health
from caravan_llm.router.core.kv_index import KvIndex
from caravan_llm.router.core.live_state import reconcile_live_state
from caravan_llm.router.core.prefix_index import prompt_shape
from caravan_llm.router.core.routing_state import KnownModel, RoutingState, RoutingView
from caravan_llm.router.edge.prompt_digests import PromptDigester
from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.tokens.model_tokenizer import load_model_tokenizer
from caravan_llm.router.tokens.prompt import prompt_token_ids
from caravan_llm.router.tokens.registry import Tokenizers

MODEL = "bench"
SERVICE = "caravan-bench"
KEY = "bench-engine-key"
REPLICAS = 4
CHAT = EngineRoute.CHAT_COMPLETIONS
UNBOUNDED_S = 10.0


class Keys:
    def key_for(self, service: str) -> str | None:
        return KEY if service == SERVICE else None


def entry(index: int) -> HealthEntry:
    endpoint_id = f"e{index}"
    node = f"client-{index}"
    return HealthEntry.from_api({
        "Node": {"ID": node, "Node": node, "Address": "10.0.0.1", "Datacenter": "dc1"},
        "Service": {
            "ID": endpoint_id, "Service": SERVICE, "Tags": ["caravan", "engine-vllm"],
            "Address": "10.0.0.1", "Port": 20000 + index,
            "Meta": {"caravan_model": MODEL, "engine": "vllm", "served_models": MODEL,
                     "replica": str(index), "capacity": "64"},
        },
        "Checks": [
            {"Node": node, "CheckID": "serfHealth", "Status": "passing", "ServiceID": ""},
            {"Node": node, "CheckID": f"c-{endpoint_id}", "Status": "passing",
             "ServiceID": endpoint_id, "ServiceName": SERVICE, "Type": "http"},
        ],
    })  # fmt: skip


def relayed_snapshot() -> EndpointSnapshot:
    snapshot, _ = snapshot_from_health({SERVICE: [entry(i) for i in range(REPLICAS)]}, 1)
    by_id = {eid: dataclasses.replace(e, kv_port=9000) for eid, e in snapshot.by_id.items()}
    models = {
        name: dataclasses.replace(model, endpoints=tuple(by_id[e.id] for e in model.endpoints))
        for name, model in snapshot.models.items()
    }
    return dataclasses.replace(snapshot, by_id=by_id, models=models)


class Router:
    """The routing state and the two routing paths of one router."""

    def __init__(self, view: ModelView, budget_s: float, tokens: Any) -> None:
        self.state = RoutingState(KvIndex(stale_after_s=3600.0))
        snapshot = relayed_snapshot()
        profiles = {MODEL: KnownModel(name=MODEL, served_model_name=MODEL, view=view)}
        self.state.swap(
            RoutingView(snapshot=snapshot, profiles=MappingProxyType(profiles)),
            reconcile_live_state({}, snapshot),
            synced=True,
        )
        self.settings = RouterSettings()
        self.config: BalancerConfig = self.settings.balancer_config()
        self.shape = self.config.cost.shape
        self.memory = PickerMemory()
        self.digester = PromptDigester(tokens, self.state, Keys(), budget_s=budget_s)
        self.exact_used = 0

    def hold(self, block_size: int, ids: tuple[int, ...] | None) -> None:
        """Every replica live in `block_size`; e0 holds the blocks of `ids`."""
        now = time.monotonic()
        for index in range(REPLICAS):
            held = (
                block_digests(ids, block_size=block_size, key=DigestKey.from_secret(KEY))
                if index == 0 and ids is not None
                else ()
            )
            self.state.kv.apply_snapshot(
                f"e{index}",
                KvSnapshot(epoch=index + 1, seq=0, block_size=block_size, digests=frozenset(held)),
                now,
            )

    def approximate(self, payload: dict[str, Any]) -> float:
        started = time.perf_counter()
        shape = prompt_shape(payload, self.shape)
        features = RequestFeatures(MODEL, prompt=shape, route=CHAT)
        pick(
            self.state.view.snapshot,
            self.state.live,
            features,
            Policy.PREDICTED_TTFT,
            time.monotonic(),
            config=self.config,
            memory=self.memory,
        )
        return time.perf_counter() - started

    async def exact(self, payload: dict[str, Any]) -> float:
        started = time.perf_counter()
        shape = prompt_shape(payload, self.shape)
        exact = await self.digester.exact_prompt(MODEL, payload, route=CHAT)
        features = RequestFeatures(MODEL, prompt=shape, route=CHAT, exact=exact)
        pick(
            self.state.view.snapshot,
            self.state.live,
            features,
            Policy.PREDICTED_TTFT,
            time.monotonic(),
            config=self.config,
            memory=self.memory,
            kv=self.state.kv,
        )
        elapsed = time.perf_counter() - started
        self.exact_used += exact is not None
        return elapsed


async def scenario(
    router: Router, payloads: list[dict[str, Any]]
) -> tuple[list[float], list[float], list[float]]:
    approximate: list[float] = []
    exact: list[float] = []
    added: list[float] = []
    for payload in payloads:
        a = router.approximate(payload)
        e = await router.exact(payload)
        # The background tokenizing of a request over budget is not the next one's cost.
        await router.digester.settled()
        approximate.append(a)
        exact.append(e)
        added.append(e - a)
    return approximate, exact, added


async def run(directory: Path, runs: int, budget_s: float) -> None:
    texts = Texts(directory, corpus())
    tokenizer = load_model_tokenizer(directory)
    view = ModelView(name=MODEL, tokenizer=str(directory))
    for budget_name, budget in (("default", budget_s), ("unbounded", UNBOUNDED_S)):
        for block_size in (16, 128):
            for size in (1024, 8192):
                body = size - QUESTION_TOKENS
                history = [texts.take(body // 4) for _ in range(4)]
                system = texts.take(body)
                cases = {
                    "next turn": [
                        chat(history[0], *history[1:], texts.take(QUESTION_TOKENS))
                        for _ in range(runs)
                    ],
                    "shared system": [
                        chat(system, texts.take(QUESTION_TOKENS)) for _ in range(runs)
                    ],
                    "cold": [
                        chat(texts.take(body), texts.take(QUESTION_TOKENS)) for _ in range(runs)
                    ],
                }
                for name, payloads in cases.items():
                    tokens = Tokenizers()
                    router = Router(view, budget, tokens)
                    try:
                        # The conversation so far, as the engine holds it and the router saw it.
                        seen = {
                            "next turn": chat(history[0], *history[1:]),
                            "shared system": chat(system, "warm"),
                            "cold": None,
                        }[name]
                        ids = (
                            None
                            if seen is None
                            else prompt_token_ids(tokenizer, CHAT, seen, use_cache=False)
                        )
                        router.hold(block_size, ids)
                        warm = seen if seen is not None else chat(texts.take(body), "warm")
                        await tokens.prompt_token_ids(view, CHAT, warm)
                        approximate, exact, added = await scenario(router, payloads)
                    finally:
                        tokens.close()
                    a50, _ = percentiles(approximate)
                    e50, e99 = percentiles(exact)
                    d50, d99 = percentiles(added)
                    share = 100 * router.exact_used / len(payloads)
                    print(
                        f"{budget_name:>9} {block_size:>5} {size:>6} {name:<14}"
                        f" {a50:>8.2f} {e50:>8.2f} {e99:>8.2f} {d50:>8.2f} {d99:>8.2f}"
                        f" {share:>7.0f}"
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer.json directory")
    parser.add_argument("--runs", type=int, default=60, help="requests per cell")
    parser.add_argument(
        "--budget-ms",
        type=float,
        default=RouterSettings().exact_prefix_budget_ms,
        help="the router's exact_prefix_budget_ms (default: the router's default)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        directory: Path = args.tokenizer or Path(scratch)
        if args.tokenizer is None:
            write_tokenizer(directory)
        print(f"tokenizer: {directory}; budget {args.budget_ms} ms; {REPLICAS} replicas")
        print(
            f"{'budget':>9} {'block':>5} {'prompt':>6} {'scenario':<14} {'appr p50':>8}"
            f" {'ex p50':>8} {'ex p99':>8} {'add p50':>8} {'add p99':>8} {'exact %':>7}"
        )
        asyncio.run(run(directory, args.runs, args.budget_ms / 1000))


if __name__ == "__main__":
    main()
