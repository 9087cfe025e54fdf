"""caravan's keyed, chained block digests."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from caravan_llm.common.block_digest import DigestKey, block_digest, block_digests

KEY = DigestKey.from_secret("engine-key")
tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)


def test_the_encoding_is_pinned() -> None:
    """A known input has a known digest: relays and routers of any version agree."""
    key = DigestKey.from_secret("pinned-secret")
    tokens = list(range(8))
    assert (4894756910306617660, 3336870920575228005) == block_digests(
        tokens, block_size=4, key=key
    )
    assert (17248782701707559067, 4499305384115813408) == block_digests(
        tokens, block_size=4, key=key, extra="tiny-lora"
    )


def test_only_full_blocks_have_digests() -> None:
    """300 tokens in blocks of 128 give two digests, and fewer than a block give none."""
    assert 2 == len(block_digests(list(range(300)), block_size=128, key=KEY))
    assert () == block_digests(list(range(127)), block_size=128, key=KEY)
    assert () == block_digests([], block_size=128, key=KEY)


def test_equal_prefixes_share_digests_and_then_part() -> None:
    """Two prompts that share three blocks share three digests, and no more."""
    shared = list(range(12))
    first = block_digests([*shared, 1, 2, 3, 4], block_size=4, key=KEY)
    second = block_digests([*shared, 1, 2, 3, 5], block_size=4, key=KEY)
    assert first[:3] == second[:3]
    assert first[3] != second[3]


def test_a_digest_names_its_whole_prefix() -> None:
    """The same block after different prefixes has different digests (chained)."""
    block = [7, 7, 7, 7]
    assert (
        block_digests([1, 2, 3, 4, *block], block_size=4, key=KEY)[1]
        != block_digests([1, 2, 3, 5, *block], block_size=4, key=KEY)[1]
    )
    assert len(set(block_digests(block * 3, block_size=4, key=KEY))) == 3


def test_key_extra_order_and_block_size_change_every_digest() -> None:
    """Another key, extra key, block order or block size shares no digest."""
    tokens = list(range(16))
    base = set(block_digests(tokens, block_size=4, key=KEY))
    others = [
        block_digests(tokens, block_size=4, key=DigestKey.from_secret("other-key")),
        block_digests(tokens, block_size=4, key=KEY, extra="tiny-lora"),
        block_digests(tokens, block_size=4, key=KEY, extra=""),
        block_digests([*tokens[4:8], *tokens[:4], *tokens[8:]], block_size=4, key=KEY),
        block_digests(tokens, block_size=8, key=KEY),
        block_digests(tokens, block_size=2, key=KEY),
    ]
    for other in others:
        assert set() == base & set(other)
    assert block_digests(tokens, block_size=4, key=KEY, extra="a") != block_digests(
        tokens, block_size=4, key=KEY, extra="b"
    )


def test_a_chain_continues_from_its_parent() -> None:
    """Digesting a continuation from the last digest gives the whole sequence's chain."""
    head, tail = list(range(8)), list(range(100, 110))
    whole = block_digests(head + tail, block_size=4, key=KEY, extra="l")
    first = block_digests(head, block_size=4, key=KEY, extra="l")
    assert whole == first + block_digests(tail, block_size=4, key=KEY, extra="l", parent=first[-1])
    assert whole[2] == block_digest(first[-1], tail[:4], key=KEY, extra="l")
    assert whole[0] == block_digest(None, head[:4], key=KEY, extra="l")


@given(prefix=tokens_st, first=tokens_st, second=tokens_st, block_size=st.integers(1, 6))
def test_shared_full_blocks_share_digests(
    prefix: list[int], first: list[int], second: list[int], block_size: int
) -> None:
    """Any two sequences agree on exactly the digests of the full blocks they share."""
    a = block_digests(prefix + first, block_size=block_size, key=KEY)
    b = block_digests(prefix + second, block_size=block_size, key=KEY)
    shared_blocks = 0
    for i in range(min(len(a), len(b))):
        span = slice(i * block_size, (i + 1) * block_size)
        if (prefix + first)[span] != (prefix + second)[span]:
            break
        shared_blocks += 1
    agree = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        agree += 1
    assert shared_blocks == agree
    assert all(0 <= d < 2**64 for d in a)


def test_the_key_never_shows() -> None:
    """A key's repr says nothing of its material; the same secret as str or bytes is one key."""
    key = DigestKey.from_secret("hunter2")
    assert "hunter2" not in repr(key)
    assert key.material.hex() not in repr(key)
    assert key == DigestKey.from_secret(b"hunter2")
    assert key != DigestKey.from_secret("hunter3")
    assert 32 == len(key.material)
    assert key.material != b"hunter2"


def test_an_empty_secret_still_makes_a_key() -> None:
    """An engine without a key gets a (public) digest key, not an error."""
    assert 1 == len(block_digests([1, 2], block_size=2, key=DigestKey.from_secret("")))


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, -1], "got -1 at index 1"),
        ([2**32, 0], "got 4294967296 at index 0"),
        ([1, "2"], "got '2' at index 1"),
    ],
)
def test_bad_token_ids_are_named(tokens: list[object], message: str) -> None:
    """A token id outside [0, 2**32) is refused with its value and position."""
    with pytest.raises(ValueError, match=message):
        block_digests(tokens, block_size=2, key=KEY)  # type: ignore[arg-type]


def test_bad_arguments_are_refused() -> None:
    """Block size below 1, an empty block, a parent out of range, a bad key size: ValueError."""
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        block_digests([1], block_size=0, key=KEY)
    with pytest.raises(ValueError, match="block_tokens"):
        block_digest(None, [], key=KEY)
    with pytest.raises(ValueError, match="parent"):
        block_digests([1], block_size=1, key=KEY, parent=2**64)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="material must be 1 to 64 bytes, got 65"):
        DigestKey(bytes(65))
    with pytest.raises(ValueError, match="got 0"):
        DigestKey(b"")
