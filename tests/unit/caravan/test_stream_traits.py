"""The stream traits codec: what a rendered job publishes is what the router reads back."""

from __future__ import annotations

import pytest

from caravan_llm.common.contract import (
    OPENAI_STREAM_TRAITS,
    ServiceMetaKey,
    StreamTraits,
    StreamTraitsError,
    decode_stream_traits,
    encode_stream_traits,
)


@pytest.mark.parametrize(
    "traits",
    [
        StreamTraits(),
        StreamTraits(completion_default_max_tokens=None, echoes_prefill=True),
        StreamTraits(completion_default_max_tokens=128, echoes_prefill=False),
        StreamTraits(None, echoes_prefill=True, keeps_stream_connections=False),
    ],
)
def test_round_trip(traits: StreamTraits) -> None:
    """Encoding then decoding gives the same traits, and every Meta value is a string."""
    meta = encode_stream_traits(traits)

    assert all(isinstance(value, str) for value in meta.values())
    assert traits == decode_stream_traits(meta)


def test_stream_keepalive_is_written_only_when_false() -> None:
    """Engines that keep their connections publish the Meta (and spec hash) they had before."""
    assert ServiceMetaKey.STREAM_KEEPALIVE not in encode_stream_traits(StreamTraits())
    closing = encode_stream_traits(StreamTraits(keeps_stream_connections=False))
    assert "false" == closing[ServiceMetaKey.STREAM_KEEPALIVE]


def test_missing_keys_take_the_openai_defaults() -> None:
    assert OPENAI_STREAM_TRAITS == decode_stream_traits({})
    assert StreamTraits(16, False, keeps_stream_connections=True) == OPENAI_STREAM_TRAITS


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (ServiceMetaKey.COMPLETION_DEFAULT_MAX_TOKENS, "0"),
        (ServiceMetaKey.COMPLETION_DEFAULT_MAX_TOKENS, "-3"),
        (ServiceMetaKey.COMPLETION_DEFAULT_MAX_TOKENS, "sixteen"),
        (ServiceMetaKey.PREFILL_ECHO, "True"),
        (ServiceMetaKey.PREFILL_ECHO, ""),
        (ServiceMetaKey.STREAM_KEEPALIVE, "no"),
    ],
)
def test_bad_values_are_refused_naming_the_key(key: str, value: str) -> None:
    with pytest.raises(StreamTraitsError, match=key):
        decode_stream_traits({key: value})
