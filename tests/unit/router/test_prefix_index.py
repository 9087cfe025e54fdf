"""Prompt shapes (block-hash chains) and the per-endpoint prefix index."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from caravan_llm.router.core.prefix_index import BlockIndex, ShapeConfig, block_chain, prompt_shape

SHAPE = ShapeConfig(block_chars=16, chars_per_token=4.0, key_blocks=2)


def chat(system: str, *turns: str) -> dict[str, object]:
    messages = [{"role": "system", "content": system}]
    messages += [
        {"role": "user" if i % 2 == 0 else "assistant", "content": text}
        for i, text in enumerate(turns)
    ]
    return {"model": "m", "messages": messages}


class TestPromptShape:
    def test_shared_system_prompt_shares_leading_blocks(self) -> None:
        """Two conversations under one system prompt share its blocks, then part ways."""
        system = "You are a careful assistant. " * 8
        first = prompt_shape(chat(system, "What is the capital of France?"), SHAPE)
        second = prompt_shape(chat(system, "Write a haiku about the sea, please."), SHAPE)
        assert first is not None
        assert second is not None
        shared = len(system) // SHAPE.block_chars
        assert first.blocks[:shared] == second.blocks[:shared]
        assert first.blocks[shared + 1 :] != second.blocks[shared + 1 :]
        assert first.ring_key == second.ring_key  # cold placement follows the prefix

    def test_a_later_turn_extends_the_earlier_prompt(self) -> None:
        """A conversation's next turn starts with every full block of the turn before."""
        system = "System prompt text that is long enough. " * 3
        turn1 = prompt_shape(chat(system, "first question here"), SHAPE)
        turn2 = prompt_shape(
            chat(system, "first question here", "an answer", "second question"), SHAPE
        )
        assert turn1 is not None
        assert turn2 is not None
        # The first turn's last block may be cut mid-message; all before it match.
        assert turn2.blocks[: len(turn1.blocks) - 1] == turn1.blocks[:-1]
        assert turn2.tokens > turn1.tokens

    def test_names_are_chained(self) -> None:
        """The same block text after a different prefix has a different name."""
        block = "x" * 16
        assert block_chain("a" * 16 + block, 16)[1] != block_chain("b" * 16 + block, 16)[1]
        assert block_chain(block * 2, 16)[0] != block_chain(block * 2, 16)[1]

    def test_completions_and_token_ids(self) -> None:
        text = prompt_shape({"model": "m", "prompt": "y" * 40}, SHAPE)
        ids = prompt_shape({"model": "m", "prompt": [1, 2, 3, 4, 5]}, SHAPE)
        batch = prompt_shape({"model": "m", "prompt": ["z" * 33, "other"]}, SHAPE)
        assert text is not None
        assert (len(text.blocks), text.tokens) == (2, 10)
        assert ids is not None
        assert ids.tokens == 5
        assert batch is not None
        assert len(batch.blocks) == 2

    def test_no_prompt_has_no_shape(self) -> None:
        assert prompt_shape({"model": "m", "input": "embed me"}, SHAPE) is None
        assert prompt_shape({"model": "m", "messages": []}, SHAPE) is None
        assert prompt_shape({"model": "m", "messages": "not a list"}, SHAPE) is None

    def test_short_prompt_still_has_a_ring_key(self) -> None:
        shape = prompt_shape({"model": "m", "prompt": "hi"}, SHAPE)
        assert shape is not None
        assert shape.blocks == ()
        assert shape.ring_key is not None

    def test_same_prompt_same_names_in_every_process(self) -> None:
        """Names are a blake2b chain, not Python's salted hash()."""
        first = hashlib.blake2b(b"a" * 16, digest_size=8).digest()
        second = hashlib.blake2b(first + b"b" * 16, digest_size=8).digest()
        assert block_chain("a" * 16 + "b" * 16 + "c", 16) == (
            int.from_bytes(first, "big"),
            int.from_bytes(second, "big"),
        )


class TestBlockIndex:
    def test_matched_counts_leading_blocks(self) -> None:
        index = BlockIndex()
        index.record((1, 2, 3), capacity_blocks=10)
        assert index.matched((1, 2, 3, 4)) == 3
        assert index.matched((1, 9, 3)) == 1
        assert index.matched((9, 1)) == 0

    def test_chain_tail_is_evicted_before_its_head(self) -> None:
        """A shared system prompt outlives the conversations under it."""
        index = BlockIndex()
        index.record((1, 2, 3, 4, 5, 6), capacity_blocks=8)
        index.record((1, 2, 10, 11, 12), capacity_blocks=8)
        assert len(index) == 8
        assert index.matched((1, 2)) == 2
        assert index.matched((1, 2, 10, 11, 12)) == 5
        assert index.matched((1, 2, 3, 4)) == 4  # 5 and 6 went first

    def test_shrink_to_a_smaller_capacity(self) -> None:
        index = BlockIndex()
        index.record(tuple(range(10)), capacity_blocks=10)
        index.shrink(4)
        assert len(index) == 4
        assert index.matched(tuple(range(10))) == 4
        index.shrink(0)
        assert len(index) == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 40), min_size=0, max_size=30),
            st.integers(0, 25),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_belief_never_exceeds_capacity(records: list[tuple[list[int], int]]) -> None:
    """Whatever is sent, the index holds at most the capacity it was last given.

    And the prompt just recorded is believed cached as far as capacity allows.
    """
    index = BlockIndex()
    for blocks, capacity in records:
        chain = tuple(dict.fromkeys(blocks))  # a chain has no repeated names
        index.record(chain, capacity)
        assert len(index) <= capacity
        assert index.matched(chain) == min(len(chain), capacity)


def test_a_responses_request_has_the_shape_of_the_same_chat() -> None:
    """instructions + input items are cut into the same blocks as the chat they describe."""
    system = "You are a careful assistant. " * 8
    question = "What is the capital of France?"
    responses = {
        "instructions": system,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": question}]}],
    }

    as_chat = prompt_shape(chat(system, question), SHAPE)
    as_responses = prompt_shape(responses, SHAPE, responses=True)

    assert as_chat is not None
    assert as_chat == as_responses
