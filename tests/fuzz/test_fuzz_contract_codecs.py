"""Fuzzing every KV document codec of the contract: each decoder raises only its typed error."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fuzz_strategies import fuzz_settings, hostile_json, json_values, outcome, texts
from hypothesis import example, given
from hypothesis import strategies as st

from caravan_llm.common.contract import (
    ContractError,
    DemandRecord,
    DrainRecord,
    EngineRoute,
    EngineRoutesError,
    ModelFailure,
    ModelView,
    Placements,
    PlacementsError,
    PrefillRateError,
    ScaleOverride,
    ServiceMetaKey,
    StreamTraits,
    StreamTraitsError,
    decode_demand,
    decode_desired_count,
    decode_drain,
    decode_engine_routes,
    decode_metric_names,
    decode_model_view,
    decode_models_revision,
    decode_placements,
    decode_prefill_rate,
    decode_stream_traits,
    encode_demand,
    encode_desired_count,
    encode_drain,
    encode_engine_routes,
    encode_metric_names,
    encode_models_revision,
    encode_placements,
    encode_prefill_rate,
    encode_stream_traits,
)
from caravan_llm.common.engine_metrics import MetricNames

pytestmark = pytest.mark.fuzz

KEY = "caravan/x"
DEEP = b"[" * 100_000
HUGE = b"1" * 5000

# Each KV document decoder with the error it documents, and its encoder when it has one.
DOCUMENT_DECODERS: dict[str, tuple[Callable[[bytes], Any], type[Exception]]] = {
    "placements": (lambda raw: decode_placements(raw, key=KEY, model="m"), PlacementsError),
    "demand": (lambda raw: decode_demand(raw, key=KEY), ContractError),
    "drain": (lambda raw: decode_drain(raw, key=KEY), ContractError),
    "desired": (lambda raw: decode_desired_count(raw, key=KEY), ContractError),
    "models-revision": (lambda raw: decode_models_revision(raw, key=KEY), ContractError),
    "model failure": (ModelFailure.decode, ContractError),
    "scale override": (ScaleOverride.decode, ContractError),
    "model view": (lambda raw: decode_model_view(raw, key=KEY, model="m"), ContractError),
}
META_DECODERS: dict[str, tuple[Callable[[dict[str, Any]], Any], type[Exception]]] = {
    "stream traits": (decode_stream_traits, StreamTraitsError),
    "prefill rate": (decode_prefill_rate, PrefillRateError),
    "routes": (decode_engine_routes, EngineRoutesError),
    "metric names": (decode_metric_names, ContractError),
}
META_KEYS = st.sampled_from(
    [
        ServiceMetaKey.COMPLETION_DEFAULT_MAX_TOKENS,
        ServiceMetaKey.PREFILL_ECHO,
        ServiceMetaKey.PREFILL_TOKENS_PER_S,
        ServiceMetaKey.ROUTES,
        ServiceMetaKey.METRIC_RUNNING,
        ServiceMetaKey.METRIC_WAITING,
        ServiceMetaKey.METRIC_KV_CACHE,
    ]
)
digit_strings = st.sampled_from(["0", "16", "\u00b2", "\u0661", "1" * 5000, " 7 ", "-1", "+1", ""])
shaped_documents = st.fixed_dictionaries(
    {},
    optional=dict.fromkeys(
        (
            "model",
            "allocations",
            "at",
            "waiting",
            "router",
            "since",
            "drain_s",
            "reason",
            "count",
            "until",
            "set_at",
            "name",
            "served_model_name",
            "tokenizer",
        ),
        json_values | digit_strings,
    ),
)


def decodes_or_refuses(decode: Callable[[Any], Any], error: type[Exception], raw: Any) -> Any:
    value, refused = outcome(lambda: decode(raw), error)
    assert refused is None or str(refused)
    return value


@fuzz_settings(2)
@given(
    st.sampled_from(sorted(DOCUMENT_DECODERS)),
    hostile_json(shaped_documents) | st.binary(max_size=64),
)
@example("scale override", b'{"count": 1, "until": 1' + b"0" * 400 + b', "set_at": 1}')
@example("scale override", DEEP)
@example("model failure", DEEP)
@example("desired", HUGE)
@example("models-revision", HUGE)
@example("model view", b"name: m\nserved_model_name: 2024-02-30\n")
def test_every_kv_document_decoder_raises_only_its_typed_error(name: str, raw: bytes) -> None:
    """Any bytes at any KV document decoder: a value, or that decoder's documented error."""
    decode, error = DOCUMENT_DECODERS[name]
    decodes_or_refuses(decode, error, raw)
    decodes_or_refuses(decode, error, raw.decode("utf-8", "replace"))


@fuzz_settings()
@given(
    st.sampled_from(sorted(META_DECODERS)),
    st.dictionaries(META_KEYS, json_values | digit_strings | texts, max_size=4),
)
@example("stream traits", {ServiceMetaKey.COMPLETION_DEFAULT_MAX_TOKENS: "\u00b2"})
@example("stream traits", {ServiceMetaKey.COMPLETION_DEFAULT_MAX_TOKENS: "1" * 5000})
@example("prefill rate", {ServiceMetaKey.PREFILL_TOKENS_PER_S: "1" * 5000})
@example("stream traits", {ServiceMetaKey.PREFILL_ECHO: []})
def test_every_service_meta_decoder_raises_only_its_typed_error(
    name: str, meta: dict[str, Any]
) -> None:
    """Any Meta values at any Meta decoder: a value, or that decoder's documented error."""
    decode, error = META_DECODERS[name]
    decodes_or_refuses(decode, error, meta)


placed = st.fixed_dictionaries(
    {
        "alloc_id": st.uuids().map(str),
        "job_id": st.text(min_size=1, max_size=8),
        "address": st.text(min_size=1, max_size=8),
        "port": st.integers(1, 65535),
        "node": st.text(max_size=8),
        "kv_port": st.none() | st.integers(1, 65535),
    }
)


@fuzz_settings()
@given(
    st.lists(placed, max_size=3),
    st.builds(
        DemandRecord,
        at=st.floats(allow_nan=False, allow_infinity=False),
        waiting=st.integers(0, 2**70),
        router=st.text(max_size=8),
    ),
    st.builds(
        DrainRecord,
        model=st.text(min_size=1, max_size=8),
        since=st.floats(allow_nan=False, allow_infinity=False),
        drain_s=st.floats(min_value=0, allow_infinity=False),
        reason=st.text(max_size=8),
    ),
    st.integers(min_value=0, max_value=2**70),
)
def test_what_the_writers_encode_the_readers_decode(
    allocations: list[dict[str, Any]], demand: DemandRecord, drain: DrainRecord, count: int
) -> None:
    """Every codec round-trips what its writer writes, so fuzzing the readers loses nothing."""
    placements = Placements.model_validate({"model": "m", "allocations": allocations})
    decoded = decode_placements(encode_placements(placements), key=KEY, model="m")
    assert sorted(placements.allocations, key=lambda a: a.alloc_id) == list(decoded.allocations)
    assert demand == decode_demand(encode_demand(demand), key=KEY)
    assert drain == decode_drain(encode_drain(drain), key=KEY)
    assert count == decode_desired_count(encode_desired_count(count), key=KEY)
    assert count == decode_models_revision(encode_models_revision(count), key=KEY)


@fuzz_settings()
@given(
    st.builds(StreamTraits, st.none() | st.integers(1, 2**70), st.booleans()),
    st.none() | st.integers(1, 2**70),
    st.frozensets(st.sampled_from(EngineRoute), min_size=1),
    st.builds(MetricNames, st.none() | texts, st.none() | texts, st.none() | texts),
)
def test_what_render_publishes_in_meta_the_readers_decode(
    traits: StreamTraits, rate: int | None, routes: frozenset[EngineRoute], names: MetricNames
) -> None:
    """Service Meta codecs round-trip (a blank metric name reads as not exposed)."""
    assert traits == decode_stream_traits(encode_stream_traits(traits))
    assert rate == decode_prefill_rate(encode_prefill_rate(rate))
    assert routes == decode_engine_routes(encode_engine_routes(routes))
    decoded = decode_metric_names(encode_metric_names(names))
    assert (names.running or None, names.waiting or None, names.kv_cache_usage or None) == (
        decoded.running,
        decoded.waiting,
        decoded.kv_cache_usage,
    )


@fuzz_settings()
@given(
    st.integers(0, 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=0, max_value=1e6),
    st.text(min_size=1, max_size=20),
)
def test_override_and_failure_records_round_trip(
    count: int, set_at: float, hold_s: float, reason: str
) -> None:
    """A scale override and a failure record decode to what was encoded."""
    override = ScaleOverride(count=count, until=set_at + hold_s, set_at=set_at)
    assert override == ScaleOverride.decode(override.encode())
    failure = ModelFailure(reason=reason, since=set_at)
    assert failure == ModelFailure.decode(failure.encode())


def test_model_view_reads_a_json_profile() -> None:
    """The model view of a stored JSON profile is its name and served name."""
    raw = json.dumps({"name": "m", "served_model_name": "s", "engine": "vllm"}).encode()
    assert ModelView(name="m", served_model_name="s") == decode_model_view(raw, key=KEY, model="m")
