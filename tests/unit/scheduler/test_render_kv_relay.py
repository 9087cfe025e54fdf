"""Rendering of a replica's KV events: the engine's flags, the kv-relay task, its port and key."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from nomad_facts import nomad_fact_violations
from profile_builders import make_llamacpp, make_vllm
from pydantic import ValidationError

from caravan_llm.common.contract import KV_PORT_LABEL
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.engines.kv_events import KvEventsSettings
from caravan_llm.scheduler.profiles import ModelProfile, check_engine_rules, load_profile
from caravan_llm.scheduler.render import render

KEY_PATH = "nomad/jobs/caravan-qwen-0"


def make_sglang(**overrides: Any) -> ModelProfile:
    document: dict[str, Any] = {
        "name": "qwen",
        "model": "Qwen/Qwen3-8B",
        "engine": "sglang",
        "gpu": {"class": "h100", "count": 1},
    }
    return ModelProfile.model_validate(document | overrides)


def group_of(body: dict[str, Any]) -> dict[str, Any]:
    group: dict[str, Any] = body["Job"]["TaskGroups"][0]
    return group


def tasks_by_name(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {task["Name"]: task for task in group_of(body)["Tasks"]}


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_vllm_publishes_its_kv_events_on_the_allocations_ipc_sockets() -> None:
    """The engine's --kv-events-config binds ipc sockets in the allocation, with a topic."""
    engine = tasks_by_name(render(make_vllm(), 0))["engine"]
    config = json.loads(flag_value(engine["Config"]["args"], "--kv-events-config"))
    expected = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "ipc://${NOMAD_ALLOC_DIR}/kv-events.ipc",
        "replay_endpoint": "ipc://${NOMAD_ALLOC_DIR}/kv-replay.ipc",
        "topic": "kv-events",
        "buffer_steps": 10000,
    }
    assert expected == config


def test_the_relay_runs_beside_the_engine_which_leads_the_group() -> None:
    """Two tasks: the engine leads (the relay dies with it), the relay reads the same sockets."""
    tasks = tasks_by_name(render(make_vllm(), 0))
    assert ["engine", "kv-relay"] == list(tasks)
    assert tasks["engine"].get("Leader") is True
    relay = tasks["kv-relay"]
    assert "Leader" not in relay
    assert {
        "CARAVAN_KV_RELAY_EVENTS_ENDPOINT": "ipc://${NOMAD_ALLOC_DIR}/kv-events.ipc",
        "CARAVAN_KV_RELAY_REPLAY_ENDPOINT": "ipc://${NOMAD_ALLOC_DIR}/kv-replay.ipc",
        "CARAVAN_KV_RELAY_TOPIC": "kv-events",
    } == relay["Env"]
    assert {
        "image": "caravan-llm:0.1.0",
        "args": ["kv-relay", "--host", "0.0.0.0", "--port", "8101"],
        "ports": [KV_PORT_LABEL],
    } == relay["Config"]
    assert ("docker", "root") == (relay["Driver"], relay["User"])
    # A relay that keeps crashing never fails the replica: the engine serves on.
    assert "delay" == relay["RestartPolicy"]["Mode"]


def test_the_relay_listens_on_a_dynamic_kv_port_of_the_group() -> None:
    """The group's network has the engine's http port and the relay's kv port, both dynamic."""
    network = group_of(render(make_vllm(), 0))["Networks"][0]
    assert [{"Label": "http", "To": 8000}, {"Label": "kv", "To": 8101}] == network["DynamicPorts"]


def test_the_relay_gets_the_engine_key_by_reference_only() -> None:
    """The relay's template reads the replica job's own Variable; no key is in the job."""
    body = render(make_vllm(), 0)
    (template,) = tasks_by_name(body)["kv-relay"]["Templates"]
    assert {
        "EmbeddedTmpl": (
            f'{{{{ with nomadVar "{KEY_PATH}" }}}}\n'
            "CARAVAN_KV_RELAY_ENGINE_API_KEY={{ .api_key }}\n{{ end }}\n"
        ),
        "DestPath": "secrets/engine-key.env",
        "Envvars": True,
        "ChangeMode": "restart",
        "Perms": "0600",
    } == template
    text = json.dumps(body)
    assert "ENGINE_API_KEY=" not in text.replace("ENGINE_API_KEY={{ .api_key }}", "")


def test_the_health_check_restarts_the_engine_alone() -> None:
    """check_restart names the engine, so an unhealthy engine does not restart the relay."""
    (check,) = group_of(render(make_vllm(), 0))["Services"][0]["Checks"]
    assert "engine" == check["TaskName"]


def test_rendered_kv_jobs_meet_nomad_facts() -> None:
    """The two-task groups keep every Nomad fact the single-task ones do."""
    for profile in (make_vllm(), make_sglang()):
        assert [] == nomad_fact_violations(render(profile, 0))


def test_sglang_publishes_without_vllms_enable_field_and_pages_of_a_block() -> None:
    """SGLang's config has no enable field; its page size of 1 becomes the cluster's 16."""
    engine = tasks_by_name(render(make_sglang(), 0))["engine"]
    args = engine["Config"]["args"]
    config = json.loads(flag_value(args, "--kv-events-config"))
    assert "enable_kv_cache_events" not in config
    assert "ipc://${NOMAD_ALLOC_DIR}/kv-events.ipc" == config["endpoint"]
    assert "16" == flag_value(args, "--page-size")


def test_a_profiles_own_page_size_is_kept() -> None:
    """An SGLang profile that sets --page-size gets no second one."""
    args = tasks_by_name(render(make_sglang(engine_args=["--page-size", "64"]), 0))["engine"][
        "Config"
    ]["args"]
    assert 1 == args.count("--page-size")
    assert "64" == flag_value(args, "--page-size")


def test_llamacpp_replicas_render_no_relay() -> None:
    """llama.cpp publishes no KV events: one task, one port, no flag."""
    body = render(make_llamacpp(), 0)
    assert ["engine"] == list(tasks_by_name(body))
    assert ["http"] == [p["Label"] for p in group_of(body)["Networks"][0]["DynamicPorts"]]
    assert "kv-events" not in json.dumps(body)


def test_without_engine_keys_kv_events_are_off_by_default() -> None:
    """A cluster with engine_api_keys false renders no relay and no events flag."""
    body = render(make_vllm(), 0, config=ClusterConfig(engine_api_keys=False))
    assert ["engine"] == list(tasks_by_name(body))
    assert "--kv-events-config" not in tasks_by_name(body)["engine"]["Config"]["args"]


def test_kv_events_can_be_turned_off() -> None:
    """kv_events.enabled false renders the replica as before issue 24."""
    config = ClusterConfig(kv_events=KvEventsSettings(enabled=False))
    body = render(make_vllm(), 0, config=config)
    assert ["engine"] == list(tasks_by_name(body))
    assert "Leader" not in tasks_by_name(body)["engine"]


def test_kv_events_on_without_engine_keys_is_refused_by_name() -> None:
    """The relay needs the engine key: asking for it without keys names both settings."""
    with pytest.raises(ValidationError, match=r"kv_events\.enabled.*engine_api_keys"):
        ClusterConfig.model_validate({"engine_api_keys": False, "kv_events": {"enabled": True}})


def test_a_raw_exec_relay_listens_on_the_host_port() -> None:
    """raw_exec: caravan's binary on the node, the kv port without `To`, no user."""
    config = ClusterConfig.model_validate({"kv_events": {"driver": "raw_exec"}})
    body = render(make_vllm(), 0, config=config)
    relay = tasks_by_name(body)["kv-relay"]
    assert {"command": "/usr/local/bin/caravan", "args": ["kv-relay"]} == relay["Config"]
    assert "User" not in relay
    assert {"Label": "kv"} == group_of(body)["Networks"][0]["DynamicPorts"][1]


@pytest.mark.parametrize("flag", ["--kv-events-config", "--kv_events_config", "--kv-events"])
def test_a_profile_may_not_set_its_own_kv_events_config(flag: str) -> None:
    """--kv-events-config is caravan's, in any spelling vLLM reads as it: a profile's could
    publish token ids outside the allocation (argparse keeps the last value)."""
    profile = make_vllm(engine_args=[flag, '{"endpoint": "tcp://*:5557"}'])
    with pytest.raises(ValueError, match=f"{flag} is set by caravan"):
        check_engine_rules(profile)


EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples" / "profiles").glob("*.yaml"))
# Where a publisher may listen: an ipc socket inside the allocation (or loopback).
_INSIDE = re.compile(r"^(ipc://\$\{NOMAD_ALLOC_DIR\}/|tcp://127\.0\.0\.1:|tcp://\[::1\]:)")


def _publisher_endpoints(body: dict[str, Any]) -> list[str]:
    """Every endpoint a rendered job's KV events are published or read on."""
    found: list[str] = []
    for task in group_of(body)["Tasks"]:
        args = task["Config"].get("args", [])
        for index, arg in enumerate(args[:-1]):
            if arg == "--kv-events-config":
                config = json.loads(args[index + 1])
                found += [
                    config[name] for name in ("endpoint", "replay_endpoint") if name in config
                ]
        env = task.get("Env") or {}
        found += [value for name, value in env.items() if name.endswith("_ENDPOINT")]
    return found


@pytest.mark.parametrize("driver", ["docker", "raw_exec"], ids=["relay-docker", "relay-raw-exec"])
def test_no_rendered_publisher_ever_listens_outside_the_allocation(driver: str) -> None:
    """Every example profile, every replica index, each relay driver: the engines' KV events are
    on ipc:// sockets in the allocation (never tcp://*, never a routable address)."""
    config = ClusterConfig.model_validate({"kv_events": {"driver": driver}})
    endpoints: list[str] = []
    for profile in [*(load_profile(path) for path in EXAMPLES), make_vllm(), make_sglang()]:
        for replica in (0, 1, 3):
            body = render(profile, replica, config=config)
            assert "tcp://*" not in json.dumps(body)
            assert "tcp://0.0.0.0" not in json.dumps(body)
            endpoints += _publisher_endpoints(body)
    assert endpoints  # the examples do publish KV events
    assert [] == [endpoint for endpoint in endpoints if not _INSIDE.match(endpoint)]
