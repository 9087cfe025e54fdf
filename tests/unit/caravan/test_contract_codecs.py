"""contract.py codecs: what a writer encodes, readers decode back; bad input names its key."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from caravan_llm.common.contract import (
    MODEL_NAME_PATTERN,
    ContractError,
    DemandRecord,
    DrainRecord,
    JsonCodec,
    ModelView,
    decode_demand,
    decode_desired_count,
    decode_drain,
    decode_metric_names,
    decode_model_view,
    decode_models_revision,
    encode_demand,
    encode_desired_count,
    encode_drain,
    encode_metric_names,
    encode_models_revision,
    served_name_of,
)
from caravan_llm.common.engine_metrics import MetricNames

KEY = "caravan/some/key"
finite = st.floats(allow_nan=False, allow_infinity=False)
model_names = st.from_regex(MODEL_NAME_PATTERN, fullmatch=True).filter(lambda n: len(n) <= 40)


@given(st.integers(min_value=0, max_value=10**12))
def test_desired_count_round_trips(count: int) -> None:
    """A desired count decodes to what was encoded."""
    assert count == decode_desired_count(encode_desired_count(count), key=KEY)


@given(st.integers(min_value=0, max_value=10**12))
def test_models_revision_round_trips(revision: int) -> None:
    """The models-revision counter decodes to what was encoded."""
    assert revision == decode_models_revision(encode_models_revision(revision), key=KEY)


@pytest.mark.parametrize("raw", [b"", b"-1", b"two", b"1.5", b"\xff", b"1e3"])
def test_a_bad_count_names_its_key(raw: bytes) -> None:
    """A desired count that is not a non-negative integer is refused, naming the key."""
    with pytest.raises(ContractError, match=f"^{KEY}: the desired count"):
        decode_desired_count(raw, key=KEY)


def test_negative_counts_are_never_written() -> None:
    """The writers cannot encode a negative count."""
    with pytest.raises(ValueError, match="negative"):
        encode_desired_count(-1)
    with pytest.raises(ValueError, match="negative"):
        encode_models_revision(-1)


@settings(max_examples=50)
@given(
    st.builds(
        DemandRecord,
        at=finite,
        waiting=st.integers(min_value=0, max_value=10**9),
        router=st.text(max_size=20),
    )
)
def test_demand_round_trips(record: DemandRecord) -> None:
    """A router's demand record decodes, in the scheduler, to the same record."""
    assert record == decode_demand(encode_demand(record), key=KEY)


def test_demand_reads_what_earlier_routers_wrote() -> None:
    """The JSON routers wrote before the codec still decodes; `waiting` defaults to 1."""
    old = json.dumps({"at": 1700000000.125, "router": "r1", "waiting": 3})
    assert DemandRecord(at=1700000000.125, router="r1", waiting=3) == decode_demand(old, key=KEY)
    assert 1 == decode_demand('{"at": 5}', key=KEY).waiting


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("{nope", "not JSON"),
        ('{"waiting": 2}', "at: "),
        ('{"at": 1, "waiting": -1}', "waiting: "),
        ('{"at": "soon"}', "at: "),
        ("[]", "document: "),
    ],
)
def test_a_bad_demand_record_names_key_and_field(raw: str, problem: str) -> None:
    """An unreadable demand record is refused, naming the key and what is wrong."""
    with pytest.raises(ContractError) as caught:
        decode_demand(raw, key=KEY)
    assert str(caught.value).startswith(f"{KEY}: {problem}")


@settings(max_examples=50)
@given(
    st.builds(
        DrainRecord,
        model=model_names,
        since=finite,
        drain_s=st.floats(min_value=0, max_value=1e6),
        reason=st.text(max_size=30),
    )
)
def test_drain_record_round_trips(record: DrainRecord) -> None:
    """A drain marker decodes to the record the scheduler wrote."""
    assert record == decode_drain(encode_drain(record), key=KEY)


def test_drain_reads_what_earlier_schedulers_wrote() -> None:
    """The JSON written before the codec ({model, since, drain_s, reason}) still decodes."""
    old = json.dumps({"model": "m", "since": 10.5, "drain_s": 30.0, "reason": "scale"})
    assert DrainRecord(model="m", since=10.5, drain_s=30.0, reason="scale") == decode_drain(
        old, key=KEY
    )


def test_a_drain_record_without_its_model_is_refused() -> None:
    """A drain marker missing a field names it."""
    with pytest.raises(ContractError, match=f"^{KEY}: model: "):
        decode_drain('{"since": 1, "drain_s": 2}', key=KEY)


@given(model_names, st.one_of(st.none(), st.text(min_size=1, max_size=30)))
def test_the_served_name_defaults_to_the_name(name: str, served: str | None) -> None:
    """A model view answers to its served_model_name, else to its name."""
    raw = json.dumps({"name": name, "served_model_name": served, "engine": "vllm"})
    view = decode_model_view(raw, key=KEY, model=name)
    assert (served or name) == view.served_name == served_name_of(name, served)


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("{nope", "not JSON"),
        ('{"served_model_name": "x"}', "name: "),
        ('{"name": "m", "served_model_name": 3}', "served_model_name: "),
        ('{"name": "other"}', "name 'other' does not match its key"),
    ],
)
def test_a_bad_model_view_names_key_and_field(raw: str, problem: str) -> None:
    """A profile the router cannot read is refused, naming the key and the problem."""
    with pytest.raises(ContractError) as caught:
        decode_model_view(raw, key=KEY, model="m")
    assert str(caught.value).startswith(f"{KEY}: {problem}")


def test_a_json_codec_names_the_field_in_error() -> None:
    """JsonCodec is what cluster-config uses: encode, decode back, and refuse naming the field."""
    codec = JsonCodec(ModelView)
    view = ModelView(name="m", served_model_name="M")
    assert view == codec.decode(codec.encode(view), key=KEY)
    with pytest.raises(ContractError, match=f"^{KEY}: name: "):
        codec.decode('{"name": "Not A Name"}', key=KEY)


metric_name = st.from_regex(r"[a-z_:][a-z0-9_:]{0,30}", fullmatch=True)


@given(metric_name, st.none() | metric_name, st.none() | metric_name)
def test_stated_metric_names_round_trip(
    running: str, waiting: str | None, kv_cache_usage: str | None
) -> None:
    """Names rendered into Meta (running always stated) decode unchanged, blanks as None."""
    names = MetricNames(running=running, waiting=waiting, kv_cache_usage=kv_cache_usage)
    assert names == decode_metric_names(encode_metric_names(names))


def test_meta_without_metric_names_reads_as_not_exposed() -> None:
    """Meta is read as written (the scheduler renders every name): no names means none exposed."""
    nothing = MetricNames(running=None, waiting=None, kv_cache_usage=None)
    assert nothing == decode_metric_names({})
    assert nothing == decode_metric_names({"metric_running": "", "metric_waiting": 3})
