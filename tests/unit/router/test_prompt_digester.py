"""The prompt digester: token ids asked for only when a replica can use them, digests once,
waited for no longer than the budget."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from polling import eventually
from prometheus_client import CollectorRegistry
from router_builders import MODEL, SERVICE, endpoint_entry, live_for, snapshot_of

from caravan_llm.common.block_digest import DigestKey, block_digests
from caravan_llm.common.contract import EngineRoute, ModelView
from caravan_llm.common.kv_stream import KvSnapshot
from caravan_llm.router.core.endpoints import EndpointSnapshot
from caravan_llm.router.core.kv_index import KvIndex
from caravan_llm.router.core.routing_state import KnownModel, RoutingState, RoutingView
from caravan_llm.router.edge.prompt_digests import PromptDigester
from caravan_llm.router.metrics import RouterMetrics

KEY = "sk-engine-key"
TOKENS = tuple(range(100, 164))
PAYLOAD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
CHAT = EngineRoute.CHAT_COMPLETIONS
VIEW = ModelView(name="qwen2-5-7b", served_model_name=MODEL, tokenizer="/models/qwen/tokenizer")
# Long enough that a loaded test machine never misses it when the tokens are ready at once.
BUDGET_S = 5.0


class Tokens:
    """A PromptTokens that counts its calls and answers when `release` is set."""

    def __init__(
        self,
        ids: Sequence[int] | None = TOKENS,
        *,
        held: bool = False,
        leading: Sequence[int] | None = None,
        estimated_tokens: int = 900,
    ) -> None:
        self.ids = ids
        # Handed to `on_prefix` at once, as the tokenizer does with the ids its cache held,
        # with the whole prompt's count it predicts from them.
        self.leading = leading
        self.estimated_tokens = estimated_tokens
        self.calls = 0
        self.views: list[ModelView] = []
        self.release = asyncio.Event()
        if not held:
            self.release.set()
        self.finished = 0

    async def prompt_token_ids(
        self,
        view: ModelView,
        route: EngineRoute,
        payload: Mapping[str, Any],
        *,
        on_prefix: Callable[[Sequence[int], int], None] | None = None,
    ) -> Sequence[int] | None:
        del route, payload
        if on_prefix is not None and self.leading is not None:
            on_prefix(self.leading, self.estimated_tokens)
        self.calls += 1
        self.views.append(view)
        await self.release.wait()
        self.finished += 1
        return self.ids


class Keys:
    def key_for(self, service: str) -> str | None:
        return KEY if service == SERVICE else None


def state_with(
    snapshot: EndpointSnapshot, block_sizes: Mapping[str, int], view: ModelView | None = VIEW
) -> RoutingState:
    state = RoutingState(KvIndex())
    profiles = {MODEL: KnownModel(name="qwen2-5-7b", served_model_name=MODEL, view=view)}
    routing = RoutingView(snapshot=snapshot, profiles=MappingProxyType(profiles))
    state.swap(routing, live_for(snapshot), synced=True)
    for replica, size in block_sizes.items():
        state.kv.apply_snapshot(
            replica, KvSnapshot(epoch=1, seq=0, block_size=size, digests=frozenset()), 0.0
        )
    return state


def relayed(*ids: str) -> EndpointSnapshot:
    snapshot = snapshot_of(*(endpoint_entry(i) for i in ids))
    by_id = {eid: dataclasses.replace(e, kv_port=9000) for eid, e in snapshot.by_id.items()}
    models = {
        name: dataclasses.replace(entry, endpoints=tuple(by_id[e.id] for e in entry.endpoints))
        for name, entry in snapshot.models.items()
    }
    return dataclasses.replace(snapshot, by_id=by_id, models=models)


def outcomes(metrics: RouterMetrics) -> dict[str, float]:
    counted: dict[str, float] = {}
    for family in metrics.registry.collect():
        if family.name == "caravan_router_exact_prompts":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counted[sample.labels["outcome"]] = sample.value
    return counted


async def test_digests_are_computed_once_per_block_size_among_the_streams() -> None:
    """Three replicas in two block sizes: two digest chains, one tokenizer call with the view."""
    state = state_with(relayed("e0", "e1", "e2"), {"e0": 16, "e1": 16, "e2": 32})
    tokens = Tokens()
    digester = PromptDigester(tokens, state, Keys(), budget_s=BUDGET_S)

    prompt = await digester.exact_prompt(MODEL, PAYLOAD, route=CHAT)

    key = DigestKey.from_secret(KEY)
    assert prompt is not None
    assert {
        (SERVICE, 16): block_digests(TOKENS, block_size=16, key=key),
        (SERVICE, 32): block_digests(TOKENS, block_size=32, key=key),
    } == dict(prompt.digests)
    assert [VIEW] == tokens.views


async def test_no_stream_no_key_no_profile_or_no_tokenizer_means_no_exact_prompt() -> None:
    """The tokenizer is not even asked when no replica has a stream; None stays None."""
    without_streams = Tokens()
    without_profile = Tokens()
    no_stream = PromptDigester(
        without_streams, state_with(relayed("e0"), {}), Keys(), budget_s=BUDGET_S
    )
    no_keys = PromptDigester(
        Tokens(), state_with(relayed("e0"), {"e0": 16}), None, budget_s=BUDGET_S
    )
    no_profile = PromptDigester(
        without_profile, state_with(relayed("e0"), {"e0": 16}, None), Keys(), budget_s=BUDGET_S
    )
    no_tokenizer = PromptDigester(
        Tokens(None), state_with(relayed("e0"), {"e0": 16}), Keys(), budget_s=BUDGET_S
    )
    bad_ids = PromptDigester(
        Tokens([2**40] * 16), state_with(relayed("e0"), {"e0": 16}), Keys(), budget_s=BUDGET_S
    )

    answers = [
        await digester.exact_prompt(MODEL, PAYLOAD, route=CHAT)
        for digester in (no_stream, no_keys, no_profile, no_tokenizer, bad_ids)
    ]

    assert [None, None, None, None, None] == answers
    assert (0, 0) == (without_streams.calls, without_profile.calls)


async def test_a_prompt_past_the_budget_routes_approximately_and_finishes_in_the_background() -> (
    None
):
    """Over budget with no leading ids: no digests for the pick, the tokenizing not
    cancelled; it ends, frees its place and hands over the whole prompt's digests, which
    the request's replica then holds (`AdmissionGate.hold_whole`)."""
    metrics = RouterMetrics(CollectorRegistry())
    tokens = Tokens(held=True)
    digester = PromptDigester(
        tokens, state_with(relayed("e0"), {"e0": 16}), Keys(), budget_s=0.01, metrics=metrics
    )

    digested = await digester.digest(MODEL, PAYLOAD, route=CHAT)
    prompt = digested.prompt
    pending_after_budget = digester.pending(MODEL)
    assert digested.whole is not None
    assert not digested.whole.done()
    tokens.release.set()
    whole = await asyncio.wait_for(digested.whole, 5.0)
    assert whole is not None
    key = DigestKey.from_secret(KEY)
    assert {(SERVICE, 16): block_digests(TOKENS, block_size=16, key=key)} == dict(whole.digests)
    await eventually(
        lambda: digester.pending(MODEL) == 0, 5.0, "the background tokenizing done", interval_s=0.01
    )
    released = await digester.exact_prompt(MODEL, PAYLOAD, route=CHAT)

    assert prompt is None
    assert 1 == pending_after_budget
    assert 0 == digester.pending(MODEL)
    assert 2 == tokens.finished
    assert released is not None
    assert {"over_budget": 1.0, "exact": 1.0} == outcomes(metrics)


async def test_a_model_with_its_queue_full_is_not_tokenized_at_all() -> None:
    """Past max_pending prompts in flight, a request is not handed to the tokenizer (busy)."""
    metrics = RouterMetrics(CollectorRegistry())
    tokens = Tokens(held=True)
    digester = PromptDigester(
        tokens,
        state_with(relayed("e0"), {"e0": 16}),
        Keys(),
        budget_s=0.0,
        metrics=metrics,
        max_pending=2,
    )

    answers = [await digester.exact_prompt(MODEL, PAYLOAD, route=CHAT) for _ in range(3)]
    await asyncio.sleep(0)
    calls = tokens.calls
    tokens.release.set()
    await eventually(
        lambda: digester.pending(MODEL) == 0, 5.0, "the background tokenizing done", interval_s=0.01
    )

    assert [None, None, None] == answers
    assert 2 == calls
    assert {"over_budget": 2.0, "busy": 1.0} == outcomes(metrics)


async def test_a_failing_tokenizer_costs_the_request_its_exact_prompt_only() -> None:
    """A tokenizer that raises (its bug, or its shutdown) gives None, not an error."""

    class Broken:
        async def prompt_token_ids(
            self,
            view: ModelView,
            route: EngineRoute,
            payload: Mapping[str, Any],
            *,
            on_prefix: Callable[[Sequence[int], int], None] | None = None,
        ) -> Sequence[int] | None:
            del view, route, payload, on_prefix
            raise RuntimeError("cannot schedule new futures after shutdown")

    digester = PromptDigester(
        Broken(), state_with(relayed("e0"), {"e0": 16}), Keys(), budget_s=BUDGET_S
    )

    assert await digester.exact_prompt(MODEL, PAYLOAD, route=CHAT) is None
    assert 0 == digester.pending(MODEL)


async def test_past_the_budget_the_leading_ids_at_hand_name_the_prompts_first_blocks() -> None:
    """Over budget with the cached system prompt's ids at hand: their digests, counted apart."""
    metrics = RouterMetrics(CollectorRegistry())
    leading = TOKENS[:40]
    tokens = Tokens(held=True, leading=leading)
    digester = PromptDigester(
        tokens, state_with(relayed("e0"), {"e0": 16}), Keys(), budget_s=0.05, metrics=metrics
    )

    prompt = await digester.exact_prompt(MODEL, PAYLOAD, route=CHAT)
    tokens.release.set()
    await eventually(
        lambda: digester.pending(MODEL) == 0, 5.0, "the background tokenizing done", interval_s=0.01
    )

    assert prompt is not None
    key = DigestKey.from_secret(KEY)
    assert {(SERVICE, 16): block_digests(leading, block_size=16, key=key)} == dict(prompt.digests)
    assert 2 == len(prompt.digests[SERVICE, 16])
    assert 900 == prompt.tokens  # the tokenizer's prediction for the whole prompt
    assert {"cached_prefix": 1.0} == outcomes(metrics)


async def test_routed_on_leading_ids_the_whole_prompts_digests_follow_when_tokenized() -> None:
    """`digest` gives the leading ids' digests for the pick and, once the tokenizer is done,
    the whole prompt's (which extend them); a prompt tokenized in time has no such sequel."""
    leading = TOKENS[:40]
    tokens = Tokens(held=True, leading=leading)
    digester = PromptDigester(tokens, state_with(relayed("e0"), {"e0": 16}), Keys(), budget_s=0.05)

    digested = await digester.digest(MODEL, PAYLOAD, route=CHAT)
    assert digested.prompt is not None
    assert digested.whole is not None
    assert not digested.whole.done()
    tokens.release.set()
    whole = await asyncio.wait_for(digested.whole, 5.0)

    key = DigestKey.from_secret(KEY)
    assert whole is not None
    assert {(SERVICE, 16): block_digests(TOKENS, block_size=16, key=key)} == dict(whole.digests)
    assert whole.digests[SERVICE, 16][:2] == digested.prompt.digests[SERVICE, 16]
    in_time = await digester.digest(MODEL, PAYLOAD, route=CHAT)
    assert in_time.prompt is not None
    assert in_time.whole is None


async def test_the_whole_prompt_is_none_when_the_tokenizer_fails_late() -> None:
    """Past the budget, then the tokenizer gives up: the pick keeps its leading digests and
    the sequel says None (nothing more to hold)."""
    tokens = Tokens(None, held=True, leading=TOKENS[:40])
    digester = PromptDigester(tokens, state_with(relayed("e0"), {"e0": 16}), Keys(), budget_s=0.05)
    digested = await digester.digest(MODEL, PAYLOAD, route=CHAT)
    assert digested.prompt is not None
    assert digested.whole is not None
    tokens.release.set()
    assert await asyncio.wait_for(digested.whole, 5.0) is None


async def test_of_two_hand_overs_the_longest_leading_ids_count() -> None:
    """The history found on the loop, then the thread's shorter cached ids: the longest win."""

    class Twice(Tokens):
        async def prompt_token_ids(
            self,
            view: ModelView,
            route: EngineRoute,
            payload: Mapping[str, Any],
            *,
            on_prefix: Callable[[Sequence[int], int], None] | None = None,
        ) -> Sequence[int] | None:
            if on_prefix is not None:
                on_prefix(TOKENS[:48], 700)
            return await super().prompt_token_ids(view, route, payload, on_prefix=on_prefix)

    tokens = Twice(held=True, leading=TOKENS[:20])
    digester = PromptDigester(tokens, state_with(relayed("e0"), {"e0": 16}), Keys(), budget_s=0.05)

    prompt = await digester.exact_prompt(MODEL, PAYLOAD, route=CHAT)
    tokens.release.set()
    await eventually(
        lambda: digester.pending(MODEL) == 0, 5.0, "the background tokenizing done", interval_s=0.01
    )

    assert prompt is not None
    key = DigestKey.from_secret(KEY)
    assert block_digests(TOKENS[:48], block_size=16, key=key) == prompt.digests[SERVICE, 16]
    assert 700 == prompt.tokens


async def test_leading_ids_shorter_than_a_block_leave_the_request_approximate() -> None:
    """Leading ids that fill no block name nothing: over budget, None."""
    metrics = RouterMetrics(CollectorRegistry())
    tokens = Tokens(held=True, leading=TOKENS[:15])
    digester = PromptDigester(
        tokens, state_with(relayed("e0"), {"e0": 16}), Keys(), budget_s=0.05, metrics=metrics
    )

    prompt = await digester.exact_prompt(MODEL, PAYLOAD, route=CHAT)
    tokens.release.set()
    await eventually(
        lambda: digester.pending(MODEL) == 0, 5.0, "the background tokenizing done", interval_s=0.01
    )

    assert prompt is None
    assert {"over_budget": 1.0} == outcomes(metrics)


async def test_a_prompt_tokenized_in_time_counts_its_own_tokens_not_the_estimate() -> None:
    """Within the budget the whole prompt's ids are used, leading ids or not."""
    tokens = Tokens(leading=TOKENS[:40])
    digester = PromptDigester(
        tokens, state_with(relayed("e0"), {"e0": 16}), Keys(), budget_s=BUDGET_S
    )

    prompt = await digester.exact_prompt(MODEL, PAYLOAD, route=CHAT)

    assert prompt is not None
    assert len(TOKENS) == prompt.tokens
    assert 4 == len(prompt.digests[SERVICE, 16])
