"""The prompt digester: token ids asked for only when a replica can use them, digests once."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from router_builders import MODEL, SERVICE, endpoint_entry, live_for, snapshot_of

from caravan_llm.common.block_digest import DigestKey, block_digests
from caravan_llm.common.contract import EngineRoute
from caravan_llm.common.kv_stream import KvSnapshot
from caravan_llm.router.core.endpoints import EndpointSnapshot
from caravan_llm.router.core.kv_index import KvIndex
from caravan_llm.router.core.routing_state import RoutingState, RoutingView
from caravan_llm.router.edge.prompt_digests import PromptDigester

KEY = "sk-engine-key"
TOKENS = tuple(range(100, 164))
PAYLOAD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class Tokens:
    """A PromptTokens that counts its calls."""

    def __init__(self, ids: Sequence[int] | None = TOKENS) -> None:
        self.ids = ids
        self.calls = 0

    def prompt_token_ids(
        self, model: str, payload: Mapping[str, Any], *, route: EngineRoute
    ) -> Sequence[int] | None:
        del model, payload, route
        self.calls += 1
        return self.ids


class Keys:
    def key_for(self, service: str) -> str | None:
        return KEY if service == SERVICE else None


def state_with(snapshot: EndpointSnapshot, block_sizes: Mapping[str, int]) -> RoutingState:
    state = RoutingState(KvIndex())
    state.swap(RoutingView(snapshot=snapshot), live_for(snapshot), synced=True)
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


def test_digests_are_computed_once_per_block_size_among_the_streams() -> None:
    """Three replicas in two block sizes: two digest chains, one tokenizer call."""
    state = state_with(relayed("e0", "e1", "e2"), {"e0": 16, "e1": 16, "e2": 32})
    tokens = Tokens()
    digester = PromptDigester(tokens, state, Keys())

    prompt = digester.exact_prompt(MODEL, PAYLOAD, route=EngineRoute.CHAT_COMPLETIONS)

    key = DigestKey.from_secret(KEY)
    assert prompt is not None
    assert {
        (SERVICE, 16): block_digests(TOKENS, block_size=16, key=key),
        (SERVICE, 32): block_digests(TOKENS, block_size=32, key=key),
    } == dict(prompt.digests)
    assert 1 == tokens.calls


def test_no_stream_no_key_or_no_tokenizer_means_no_exact_prompt() -> None:
    """The tokenizer is not even asked when no replica has a stream; None stays None."""
    without_streams = Tokens()
    no_stream = PromptDigester(without_streams, state_with(relayed("e0"), {}), Keys())
    no_keys = PromptDigester(Tokens(), state_with(relayed("e0"), {"e0": 16}), None)
    no_tokenizer = PromptDigester(Tokens(None), state_with(relayed("e0"), {"e0": 16}), Keys())
    bad_ids = PromptDigester(Tokens([2**40] * 16), state_with(relayed("e0"), {"e0": 16}), Keys())

    answers = [
        digester.exact_prompt(MODEL, PAYLOAD, route=EngineRoute.CHAT_COMPLETIONS)
        for digester in (no_stream, no_keys, no_tokenizer, bad_ids)
    ]

    assert [None, None, None, None] == answers
    assert 0 == without_streams.calls
