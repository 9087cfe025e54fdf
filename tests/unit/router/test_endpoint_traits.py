"""The router reads how to continue a stream from a replica's published traits, not its engine."""

from __future__ import annotations

from router_builders import SERVICE, health_entry, service_meta, snapshot_of

from caravan_llm.common.contract import (
    OPENAI_STREAM_TRAITS,
    ServiceMetaKey,
    StreamTraits,
    encode_stream_traits,
)
from caravan_llm.router.core.endpoints import snapshot_from_health


def test_traits_come_from_meta_whatever_the_engine_is_called() -> None:
    """An engine name the router has never heard of serves with the traits it publishes."""
    traits = StreamTraits(completion_default_max_tokens=None, echoes_prefill=True)
    meta = service_meta(engine="some-new-engine", **encode_stream_traits(traits))

    endpoint = snapshot_of(health_entry("a", meta=meta)).by_id["a"]

    assert traits == endpoint.traits
    assert "some-new-engine" == endpoint.engine


def test_meta_without_traits_follows_the_openai_api() -> None:
    """A replica that publishes no traits is continued as the OpenAI API says (16, no echo)."""
    endpoint = snapshot_of(health_entry("a", meta=service_meta(engine="llamacpp"))).by_id["a"]

    assert OPENAI_STREAM_TRAITS == endpoint.traits
    assert 16 == endpoint.traits.completion_default_max_tokens


def test_malformed_traits_skip_the_entry_naming_the_key() -> None:
    """A trait value the scheduler never writes makes the entry unroutable, with the key named."""
    meta = service_meta(**{ServiceMetaKey.PREFILL_ECHO: "yes"})

    snapshot, skipped = snapshot_from_health({SERVICE: [health_entry("a", meta=meta)]}, 1)

    assert "a" not in snapshot.by_id
    [entry] = skipped
    assert ServiceMetaKey.PREFILL_ECHO in entry.reason
