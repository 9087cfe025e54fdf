"""Prefix affinity: the hash ring, the load bound and the request key."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from caravan_llm.router.core.affinity import (
    HashRing,
    affinity_key,
    load_bound,
    stable_hash,
    within_load_bound,
)

KEYS = [stable_hash(f"request-{n}") for n in range(4000)]
ENDPOINT_IDS = st.lists(
    st.text(alphabet="abcdefghij-_0123456789", min_size=1, max_size=12),
    min_size=2,
    max_size=8,
    unique=True,
)


class TestHashRing:
    @settings(max_examples=25, deadline=None)
    @given(ENDPOINT_IDS, st.randoms(use_true_random=False))
    def test_same_ids_in_any_order_build_the_same_ring(
        self, ids: list[str], shuffler: random.Random
    ) -> None:
        """Two routers that list the same endpoints differently map every key the same way."""
        shuffled = list(ids)
        shuffler.shuffle(shuffled)

        first = HashRing.build(ids, virtual_nodes=64)
        second = HashRing.build(shuffled, virtual_nodes=64)

        assert first == second
        assert [first.owner(key) for key in KEYS[:500]] == [second.owner(key) for key in KEYS[:500]]

    @settings(max_examples=20, deadline=None)
    @given(ENDPOINT_IDS, st.data())
    def test_removing_an_endpoint_moves_only_its_own_keys(
        self, ids: list[str], data: st.DataObject
    ) -> None:
        """Keys owned by the other endpoints keep their owner when one endpoint leaves."""
        removed = data.draw(st.sampled_from(ids))
        before = HashRing.build(ids, virtual_nodes=64)
        after = HashRing.build([i for i in ids if i != removed], virtual_nodes=64)

        moved = [key for key in KEYS if before.owner(key) != after.owner(key)]

        assert all(before.owner(key) == removed for key in moved)
        assert {key for key in KEYS if before.owner(key) == removed} == set(moved)

    def test_keys_spread_evenly_with_256_virtual_nodes(self) -> None:
        """With 256 virtual nodes each of four endpoints owns roughly a quarter of the keys."""
        ring = HashRing.build(["a", "b", "c", "d"])

        shares = Counter(ring.owner(key) for key in KEYS)

        assert {"a", "b", "c", "d"} == set(shares)
        assert all(0.15 < count / len(KEYS) < 0.35 for count in shares.values())

    def test_walk_visits_every_endpoint_once_starting_at_the_owner(self) -> None:
        """The walk is the key's preference order: its owner first, each endpoint once."""
        ring = HashRing.build(["a", "b", "c", "d"], virtual_nodes=16)

        for key in KEYS[:200]:
            walk = list(ring.walk(key))
            assert ring.owner(key) == walk[0]
            assert sorted(walk) == ["a", "b", "c", "d"]

    def test_empty_ring_has_no_owner_and_no_walk(self) -> None:
        """An empty ring maps nothing."""
        ring = HashRing.build([])

        assert (ring.owner(KEYS[0]), list(ring.walk(KEYS[0]))) == (None, [])

    def test_rejects_zero_virtual_nodes(self) -> None:
        """A ring needs at least one point per endpoint."""
        with pytest.raises(ValueError, match="virtual_nodes"):
            HashRing.build(["a"], virtual_nodes=0)


class TestLoadBound:
    @given(st.lists(st.integers(min_value=0, max_value=500), min_size=1, max_size=20))
    def test_least_loaded_endpoint_is_always_within_the_bound(self, loads: list[int]) -> None:
        """Rounding the bound up means the walk can always place the request somewhere."""
        bound = load_bound(sum(loads), len(loads), 1.25)

        assert within_load_bound(min(loads), bound)

    def test_bound_is_c_times_mean_rounded_up(self) -> None:
        """Eight requests on four endpoints, c=1.25: one more may go where at most 2 are."""
        bound = load_bound(total_in_flight=8, endpoint_count=4, load_factor=1.25)

        assert bound == 3
        assert (within_load_bound(2, bound), within_load_bound(3, bound)) == (True, False)


def chat(*messages: tuple[str, object]) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}


class TestAffinityKey:
    def test_later_turns_of_a_conversation_share_the_key(self) -> None:
        """A follow-up turn repeats the system prompt and first user message, so keeps the key."""
        first = chat(("system", "You are terse."), ("user", "What is Nomad?"))
        later = chat(
            ("system", "You are terse."),
            ("user", "What is Nomad?"),
            ("assistant", "A scheduler."),
            ("user", "And Consul?"),
        )

        assert affinity_key(first) == affinity_key(later)

    def test_different_first_message_or_system_prompt_changes_the_key(self) -> None:
        """Another conversation, or the same question under another system prompt, differs."""
        base = affinity_key(chat(("system", "S"), ("user", "Q")))

        assert base != affinity_key(chat(("system", "S"), ("user", "Other")))
        assert base != affinity_key(chat(("system", "T"), ("user", "Q")))
        assert base != affinity_key(chat(("user", "Q")))

    def test_only_the_first_n_chars_count(self) -> None:
        """Messages that agree on their first N characters share the key."""
        shared = "x" * 20

        assert affinity_key(chat(("user", shared + "tail one")), prefix_chars=20) == affinity_key(
            chat(("user", shared + "other tail")), prefix_chars=20
        )
        assert affinity_key(chat(("user", shared + "a")), prefix_chars=21) != affinity_key(
            chat(("user", shared + "b")), prefix_chars=21
        )

    def test_content_parts_read_as_their_text(self) -> None:
        """A list of content parts keys on its text parts, ignoring images."""
        parts = [
            {"type": "text", "text": "Describe "},
            {"type": "image_url", "image_url": {"url": "data:..."}},
            {"type": "text", "text": "this."},
        ]

        assert affinity_key(chat(("user", parts))) == affinity_key(chat(("user", "Describe this.")))

    @pytest.mark.parametrize(
        ("prompt", "same_as"),
        [
            ("Once upon a time", "Once upon a time"),
            (["Once upon a time", "ignored second prompt"], "Once upon a time"),
        ],
    )
    def test_completion_prompt_keys_on_its_start(self, prompt: object, same_as: str) -> None:
        """A completions prompt (or the first of a batch) keys on its first characters."""
        assert affinity_key({"prompt": same_as}) == affinity_key({"prompt": prompt})

    def test_token_id_prompts_key_on_their_first_tokens(self) -> None:
        """Token-id prompts that share their first N tokens share the key."""
        assert affinity_key({"prompt": [1, 2, 3, 4]}, prefix_chars=3) == affinity_key(
            {"prompt": [[1, 2, 3, 9]]}, prefix_chars=3
        )

    @pytest.mark.parametrize(
        "body",
        [
            {"model": "m"},
            {"messages": []},
            {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": ""}]},
            {"messages": [{"role": "assistant", "content": "hi"}]},
            {"messages": ["not a message"]},
            {"prompt": ""},
            {"prompt": [{"weird": True}]},
        ],
    )
    def test_nothing_to_key_on_gives_none(self, body: dict[str, object]) -> None:
        """A body with no prompt text has no affinity (the balancer then goes by load)."""
        assert affinity_key(body) is None

    def test_lone_surrogates_do_not_break_hashing(self) -> None:
        """JSON can decode to lone surrogates; they hash instead of raising."""
        assert affinity_key(chat(("user", "bad \ud800 text"))) is not None

    def test_key_is_the_same_in_another_process(self) -> None:
        """The key does not depend on Python's per-process hash seed."""
        code = (
            "from caravan_llm.router.core.affinity import affinity_key;"
            "print(affinity_key({'messages': [{'role': 'user', 'content': 'hello'}]}))"
        )
        results = {
            subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONHASHSEED": seed},
            ).stdout.strip()
            for seed in ("1", "2")
        }

        assert {str(affinity_key(chat(("user", "hello"))))} == results


def test_a_responses_request_keys_on_its_instructions_and_first_user_input() -> None:
    """`instructions` + `input` name the conversation as system + user messages do in a chat."""
    chat = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Plan a route."},
        ]
    }
    as_string = {"instructions": "You are terse.", "input": "Plan a route."}
    as_items = {
        "instructions": "You are terse.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Plan a route."}]},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ],
    }
    other = {"instructions": "You are verbose.", "input": "Plan a route."}

    keys = [affinity_key(chat)] + [
        affinity_key(body, responses=True) for body in (as_string, as_items, other)
    ]

    assert keys[0] is not None
    assert keys[0] == keys[1] == keys[2]
    assert keys[3] != keys[0]


def test_an_anthropic_request_keys_on_its_top_level_system() -> None:
    """Anthropic's `system` field is the system prompt of its messages."""
    messages = [{"role": "user", "content": "Plan a route."}]
    plain = affinity_key({"messages": messages})
    with_system = affinity_key({"system": "You are terse.", "messages": messages})
    as_chat = affinity_key(
        {"messages": [{"role": "system", "content": "You are terse."}, *messages]}
    )

    assert with_system == as_chat
    assert plain != with_system


def test_embeddings_inputs_give_no_affinity() -> None:
    """An embeddings `input` is no conversation: no key, as before."""
    assert affinity_key({"input": "embed me"}) is None
    assert affinity_key({"input": ["one", "two"]}, responses=True) is None
