"""The scheduler writes and reads its Consul documents through caravan_llm/common/contract.py's
codecs."""

from __future__ import annotations

import pytest
from profile_builders import make_llamacpp, make_vllm

from caravan_llm.common.consul_api import KVEntry
from caravan_llm.common.contract import (
    DemandRecord,
    DrainRecord,
    KVLayout,
    decode_metric_names,
    decode_model_view,
    encode_demand,
    encode_desired_count,
    encode_drain,
)
from caravan_llm.common.engine_metrics import MetricNames
from caravan_llm.scheduler.cluster_config import CLUSTER_CONFIG_CODEC, ClusterConfig
from caravan_llm.scheduler.engines.llamacpp import LLAMACPP_METRIC_NAMES
from caravan_llm.scheduler.engines.vllm import VLLM_METRIC_NAMES
from caravan_llm.scheduler.model_store import parse_desired_state
from caravan_llm.scheduler.profiles import ModelProfile, profile_to_json
from caravan_llm.scheduler.render import render

LAYOUT = KVLayout()


def entry(key: str, value: bytes | str) -> KVEntry:
    raw = value.encode() if isinstance(value, str) else value
    return KVEntry(key, raw, 0, None, 0, 1, 1)


@pytest.mark.parametrize(
    "profile",
    [
        make_llamacpp(name="plain"),
        make_vllm(name="named", served_model_name="Qwen/Qwen2.5-7B-Instruct"),
    ],
    ids=["name", "served_model_name"],
)
def test_the_router_view_of_a_stored_profile_serves_the_scheduler_name(
    profile: ModelProfile,
) -> None:
    """decode_model_view of what the scheduler stores answers to the profile's served_name."""
    stored = profile_to_json(profile)
    view = decode_model_view(stored, key=LAYOUT.model_key(profile.name), model=profile.name)
    assert profile.served_name == view.served_name


def test_desired_state_reads_what_the_codecs_write() -> None:
    """Demand, drain markers, desired counts and the cluster config round-trip through KV."""
    profile = make_llamacpp(name="chat")
    demand = DemandRecord(at=1700000000.5, waiting=4, router="r1")
    drain = DrainRecord(model="chat", since=1700000001.0, drain_s=30.0, reason="scale_down")
    config = ClusterConfig()
    entries = (
        entry(LAYOUT.model_key("chat"), profile_to_json(profile)),
        entry(LAYOUT.desired_key("chat"), encode_desired_count(2)),
        entry(LAYOUT.demand_key("chat"), encode_demand(demand)),
        entry(LAYOUT.draining_key("caravan-chat-1"), encode_drain(drain)),
        entry(LAYOUT.cluster_config, CLUSTER_CONFIG_CODEC.encode(config)),
    )

    state = parse_desired_state(entries, LAYOUT, index=7)

    assert ({"chat": 2}, {"chat": demand}, {"caravan-chat-1": drain}, config) == (
        dict(state.stored_counts),
        dict(state.demand),
        dict(state.draining),
        state.cluster_config,
    )


def test_unreadable_documents_are_left_out_not_guessed() -> None:
    """A bad count, demand or drain marker is skipped (None is not 0), the rest still read."""
    entries = (
        entry(LAYOUT.desired_key("a"), b"-3"),
        entry(LAYOUT.demand_key("a"), b'{"waiting": 2}'),
        entry(LAYOUT.draining_key("caravan-a-0"), b'{"model": "a"}'),
        entry(LAYOUT.desired_key("b"), b"1"),
    )
    state = parse_desired_state(entries, LAYOUT, index=1)
    assert ({"b": 1}, {}, {}) == (
        dict(state.stored_counts),
        dict(state.demand),
        dict(state.draining),
    )


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        (make_vllm(), VLLM_METRIC_NAMES),
        (make_llamacpp(), LLAMACPP_METRIC_NAMES),
        (
            make_llamacpp(metrics={"running": "my_running"}),
            MetricNames(running="my_running", waiting=None, kv_cache_usage=None),
        ),
    ],
    ids=["vllm", "llamacpp", "override"],
)
def test_readers_decode_the_metric_names_render_resolved(
    profile: ModelProfile, expected: MetricNames
) -> None:
    """The router and the autoscaler read from rendered Meta exactly the names render resolved."""
    [service] = render(profile, 0)["Job"]["TaskGroups"][0]["Services"]
    assert expected == decode_metric_names(service["Meta"])
