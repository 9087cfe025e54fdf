"""Rendering a profile into the Nomad job of one replica."""

from __future__ import annotations

import json
from typing import Any

import pytest
from nomad_facts import nomad_fact_violations
from profile_builders import make_llamacpp, make_vllm

from caravan_llm.common.contract import ServiceMetaKey
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.gpu_classes import GpuClass
from caravan_llm.scheduler.render import PlacementHints, RenderError, render, spec_hash


def group_of(body: dict[str, Any]) -> dict[str, Any]:
    group: dict[str, Any] = body["Job"]["TaskGroups"][0]
    return group


def task_of(body: dict[str, Any]) -> dict[str, Any]:
    task: dict[str, Any] = group_of(body)["Tasks"][0]
    return task


def test_job_id_and_meta_identify_the_replica():
    """The job is `caravan-<name>-<replica>` with model, replica, engine and spec hash in Meta."""
    body = render(make_vllm(), 3)
    job = body["Job"]
    assert job["ID"] == "caravan-qwen-3"
    assert job["Meta"]["caravan_model"] == "qwen"
    assert job["Meta"]["caravan_replica"] == "3"
    assert job["Meta"]["caravan_engine"] == "vllm"
    assert job["Meta"]["caravan_spec_hash"] == spec_hash(make_vllm(), 3)


def test_vllm_task_uses_docker_with_documented_flags():
    """vLLM runs the configured image with --model, --served-model-name, TP and port."""
    profile = make_vllm(
        served_model_name="qwen2.5",
        tensor_parallel=2,
        gpu={"class": "h100", "count": 2},
        engine_args=["--enable-prefix-caching"],
    )
    task = task_of(render(profile, 0))
    assert task["Driver"] == "docker"
    args = task["Config"]["args"]
    assert args[:8] == [
        "--model",
        "Qwen/Qwen2.5-7B-Instruct",
        "--served-model-name",
        "qwen2.5",
        "--tensor-parallel-size",
        "2",
        "--port",
        "8000",
    ]
    assert args[-1] == "--enable-prefix-caching"
    assert task["Config"]["image"].startswith("vllm/vllm-openai:")
    assert task["Config"]["ports"] == ["http"]
    assert task["Config"]["shm_size"] == 2 * 4 * 1024**3
    port = group_of(render(profile, 0))["Networks"][0]["DynamicPorts"][0]
    assert port == {"Label": "http", "To": 8000}


def test_vllm_gpu_request_selects_the_class_models_and_memory():
    """The device request asks nvidia/gpu with the class's NVML names and a memory floor."""
    task = task_of(render(make_vllm(gpu={"class": "h100", "count": 1}), 0))
    [device] = task["Resources"]["Devices"]
    assert device["Name"] == "nvidia/gpu"
    assert device["Count"] == 1
    assert device["Constraints"] == [
        {
            "LTarget": "${device.model}",
            "RTarget": "NVIDIA H100 80GB HBM3,NVIDIA H100 PCIe",
            "Operand": "set_contains_any",
        },
        {"LTarget": "${device.attr.memory}", "RTarget": "77481 MiB", "Operand": ">="},
    ]
    single = task_of(render(make_vllm(gpu={"class": "l4", "count": 1}), 0))
    assert single["Resources"]["Devices"][0]["Constraints"][0] == {
        "LTarget": "${device.model}",
        "RTarget": "NVIDIA L4",
        "Operand": "=",
    }


def test_unknown_gpu_class_lists_the_known_ones():
    """An unknown GPU class is an error naming gpu.class and listing the known classes."""
    with pytest.raises(RenderError) as caught:
        render(make_vllm(gpu={"class": "h900", "count": 1}), 0)
    assert caught.value.field == "gpu.class"
    assert "h900" in str(caught.value)
    assert "h100" in str(caught.value)
    assert "a100-80gb" in str(caught.value)


def test_cluster_config_adds_gpu_classes():
    """A cluster config can add a GPU class that profiles then use."""
    config = ClusterConfig(
        gpu_classes={"mi300x": GpuClass(models=("AMD MI300X",), memory_mib=196608)}
    )
    task = task_of(render(make_vllm(gpu={"class": "mi300x", "count": 1}), 0, config=config))
    assert task["Resources"]["Devices"][0]["Constraints"][0]["RTarget"] == "AMD MI300X"


def test_llamacpp_raw_exec_binds_the_nomad_port_without_to():
    """llama.cpp on raw_exec listens on NOMAD_IP/PORT of the http label, with no `To`."""
    body = render(make_llamacpp(served_model_name="tiny-chat", max_concurrency=3), 0)
    task = task_of(body)
    assert task["Driver"] == "raw_exec"
    assert task["Config"]["command"] == "/usr/local/bin/llama-server"
    assert task["Config"]["args"] == [
        "-m",
        "/models/tiny.gguf",
        "--host",
        "${NOMAD_IP_http}",
        "--port",
        "${NOMAD_PORT_http}",
        "--metrics",
        "--parallel",
        "3",
        "--ctx-size",
        "12288",
        "--alias",
        "tiny-chat",
        "-t",
        "1",
        "--cache-ram",
        "0",
    ]
    assert group_of(body)["Networks"][0]["DynamicPorts"] == [{"Label": "http"}]
    assert "Devices" not in task["Resources"]


@pytest.mark.parametrize("flag", ["--cache-ram", "-cram", "--cache-ram=512"])
def test_llamacpp_prompt_cache_is_off_unless_the_profile_sets_it(flag: str) -> None:
    """llama-server's host-memory prompt cache is off by default; engine_args can turn it on."""
    off = task_of(render(make_llamacpp(), 0))["Config"]["args"]
    assert off[off.index("--cache-ram") + 1] == "0"
    value = [] if "=" in flag else ["512"]
    args = task_of(render(make_llamacpp(engine_args=[flag, *value]), 0))["Config"]["args"]
    assert "0" not in [args[i + 1] for i, arg in enumerate(args) if arg in {"--cache-ram", "-cram"}]
    assert args[-1 - len(value) :] == [flag, *value]


def test_llamacpp_gpu_on_docker_offloads_layers():
    """llama.cpp with a GPU on docker uses the CUDA image, -ngl and a device request."""
    profile = make_llamacpp(driver="docker", gpu={"class": "l4", "count": 1})
    body = render(profile, 0)
    task = task_of(body)
    assert task["Driver"] == "docker"
    assert task["Config"]["image"] == ClusterConfig().llamacpp.cuda_image
    assert task["Config"]["volumes"] == ["/models:/models:ro"]
    assert "-ngl" in task["Config"]["args"]
    assert task["Resources"]["Devices"][0]["Name"] == "nvidia/gpu"
    assert group_of(body)["Networks"][0]["DynamicPorts"] == [{"Label": "http", "To": 8080}]


def test_service_carries_the_router_contract():
    """The Consul service is `caravan-<name>`, tagged caravan, with the contract Meta."""
    body = render(make_vllm(served_model_name="qwen2.5", max_concurrency=32), 1)
    [service] = group_of(body)["Services"]
    assert service["Name"] == "caravan-qwen"
    assert "caravan" in service["Tags"]
    meta = service["Meta"]
    assert meta[ServiceMetaKey.SERVED_MODELS] == "qwen2.5"
    assert meta[ServiceMetaKey.ENGINE] == "vllm"
    assert meta[ServiceMetaKey.CAPACITY] == "32"
    assert meta[ServiceMetaKey.METRIC_RUNNING] == "vllm:num_requests_running"
    assert meta[ServiceMetaKey.METRIC_KV_CACHE] == "vllm:kv_cache_usage_perc"
    assert meta[ServiceMetaKey.GPU_CLASS] == "h100"
    assert meta[ServiceMetaKey.REPLICA] == "1"
    assert meta[ServiceMetaKey.SPEC_HASH] == body["Job"]["Meta"]["caravan_spec_hash"]
    assert all(isinstance(value, str) for value in meta.values())


def test_llamacpp_metrics_have_no_kv_cache_name():
    """llama.cpp's mapping has running and waiting names and no KV-cache metric."""
    meta = group_of(render(make_llamacpp(), 0))["Services"][0]["Meta"]
    assert meta[ServiceMetaKey.METRIC_RUNNING] == "llamacpp:requests_processing"
    assert meta[ServiceMetaKey.METRIC_WAITING] == "llamacpp:requests_deferred"
    assert meta[ServiceMetaKey.METRIC_KV_CACHE] == ""


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({}, ("llamacpp:requests_processing", "llamacpp:requests_deferred", "")),
        ({"running": "my_running"}, ("my_running", "", "")),
        (
            {"running": "r", "waiting": "w", "kv_cache_usage": "k"},
            ("r", "w", "k"),
        ),
        ({"waiting": "w"}, ("llamacpp:requests_processing", "w", "")),
    ],
)
def test_metric_override_follows_the_seed_rule(
    override: dict[str, str], expected: tuple[str, str, str]
):
    """Empty override = the engine's names; naming running is complete; else gaps use the
    engine's own names (a llama.cpp profile never gets vLLM's)."""
    meta = group_of(render(make_llamacpp(metrics=override), 0))["Services"][0]["Meta"]
    actual = (
        meta[ServiceMetaKey.METRIC_RUNNING],
        meta[ServiceMetaKey.METRIC_WAITING],
        meta[ServiceMetaKey.METRIC_KV_CACHE],
    )
    assert expected == actual


def test_health_check_and_lifecycle_are_sized_for_model_load():
    """Checks use /health; grace, healthy deadline and shutdown delay follow the profile."""
    body = render(make_vllm(startup_timeout_s=1200, drain_s=20), 0)
    group = group_of(body)
    [check] = group["Services"][0]["Checks"]
    assert check["Type"] == "http"
    assert check["Path"] == "/health"
    assert check["CheckRestart"]["Grace"] == 1200 * 10**9
    assert body["Job"]["Update"]["HealthCheck"] == "checks"
    assert body["Job"]["Update"]["HealthyDeadline"] == 1200 * 10**9
    assert group["ShutdownDelay"] == 20 * 10**9
    assert group["ReschedulePolicy"]["Unlimited"] is True


def test_cpu_replicas_avoid_sibling_nodes_softly():
    """CPU replicas get a negative-weight affinity against siblings' nodes, never a pin."""
    hints = PlacementHints(sibling_nodes=frozenset({"node-b", "node-a"}))
    job = render(make_llamacpp(), 2, hints)["Job"]
    assert job["Affinities"] == [
        {
            "LTarget": "${node.unique.id}",
            "RTarget": "node-a,node-b",
            "Operand": "set_contains_any",
            "Weight": -100,
        }
    ]
    constraint_targets = [c["LTarget"] for c in job["Constraints"]]
    assert "${node.unique.id}" not in constraint_targets


def test_gpu_replicas_ignore_sibling_hints():
    """GPU replicas bin-pack: sibling hints add nothing to their job."""
    hints = PlacementHints(sibling_nodes=frozenset({"node-a"}))
    assert render(make_vllm(), 0, hints) == render(make_vllm(), 0)


def test_hints_do_not_change_the_spec_hash():
    """Placement hints never change the spec hash."""
    hints = PlacementHints(sibling_nodes=frozenset({"n1"}))
    with_hints = render(make_llamacpp(), 0, hints)["Job"]["Meta"]["caravan_spec_hash"]
    without = render(make_llamacpp(), 0)["Job"]["Meta"]["caravan_spec_hash"]
    assert with_hints == without


def test_changed_profile_changes_the_spec_hash():
    """Any rendered change (here the image) changes the spec hash."""
    assert spec_hash(make_vllm(), 0) != spec_hash(make_vllm(image="vllm/vllm-openai:v0.12.0"), 0)


def test_multi_node_vllm_is_refused_by_rendering():
    """nodes > 1 renders to a clear not-supported-yet error about `nodes`."""
    with pytest.raises(RenderError) as caught:
        render(make_vllm(nodes=2), 0)
    assert caught.value.field == "nodes"
    assert "not supported" in str(caught.value)


def test_rendering_is_deterministic_json():
    """Rendering twice gives byte-identical JSON."""
    profile = make_vllm(env={"B": "2", "A": "1"})
    assert json.dumps(render(profile, 0)) == json.dumps(render(profile, 0))


@pytest.mark.parametrize("profile", [make_vllm(), make_llamacpp(), make_llamacpp(driver="docker")])
def test_rendered_jobs_meet_nomad_facts(profile):
    """Rendered jobs satisfy every rule of the facts sheet that applies."""
    assert nomad_fact_violations(render(profile, 0, PlacementHints(frozenset({"x"})))) == []


def test_cpu_replicas_run_in_the_default_pool_and_gpu_replicas_in_any():
    """CPU replicas stay in Nomad's `default` pool; GPU replicas may use every pool."""
    assert render(make_llamacpp(), 0)["Job"]["NodePool"] == "default"
    assert render(make_vllm(), 0)["Job"]["NodePool"] == "all"


def test_cluster_config_and_profile_choose_the_node_pool():
    """The cluster config sets each kind's pool; a profile's `node_pool` wins."""
    config = ClusterConfig.model_validate({"node_pools": {"cpu": "cpu", "gpu": "gpu"}})
    assert render(make_llamacpp(), 0, config=config)["Job"]["NodePool"] == "cpu"
    assert render(make_vllm(), 0, config=config)["Job"]["NodePool"] == "gpu"
    kept = make_vllm(node_pool="h100-team")
    assert render(kept, 0, config=config)["Job"]["NodePool"] == "h100-team"
    assert spec_hash(kept, 0) != spec_hash(make_vllm(), 0)


@pytest.mark.parametrize("name", ["", "gpu pool", "gpu/a", "x" * 129])
def test_invalid_node_pool_names_are_refused_by_name(name: str):
    """A pool name Nomad would refuse is an error that names the value."""
    with pytest.raises(ValueError, match="node pool name"):
        make_vllm(node_pool=name)
    with pytest.raises(ValueError, match="node pool name"):
        ClusterConfig.model_validate({"node_pools": {"gpu": name}})


def test_default_engine_images_are_pinned_builds():
    """Every default engine image names a version, never a floating tag."""
    config = ClusterConfig()
    assert config.vllm.image.startswith("vllm/vllm-openai:v")
    cpu, cuda = config.llamacpp.image, config.llamacpp.cuda_image
    assert cpu.startswith("ghcr.io/ggml-org/llama.cpp:server-b")
    assert cuda.startswith("ghcr.io/ggml-org/llama.cpp:server-cuda-b")
    # One llama.cpp build for CPU and GPU replicas.
    assert cpu.rsplit("-", 1)[1] == cuda.rsplit("-", 1)[1]


def test_llamacpp_docker_picks_the_cpu_or_cuda_image():
    """llama.cpp on docker runs the CPU image without a GPU and the CUDA image with one."""
    config = ClusterConfig()
    cpu = task_of(render(make_llamacpp(driver="docker"), 0, config=config))
    gpu = task_of(render(make_llamacpp(driver="docker", gpu={"class": "l4"}), 0, config=config))
    assert cpu["Config"]["image"] == config.llamacpp.image
    assert gpu["Config"]["image"] == config.llamacpp.cuda_image


def test_restart_policy_defaults_to_nomads_and_follows_the_cluster_config():
    """Two restarts 15 s apart in 30 min (Nomad's service default) unless the operator says."""
    policy = group_of(render(make_llamacpp(), 0))["RestartPolicy"]
    assert (policy["Attempts"], policy["Delay"], policy["Interval"], policy["Mode"]) == (
        2,
        15 * 10**9,
        30 * 60 * 10**9,
        "fail",
    )
    config = ClusterConfig(restart_attempts=4, restart_delay_s=3)
    policy = group_of(render(make_llamacpp(), 0, config=config))["RestartPolicy"]
    assert (policy["Attempts"], policy["Delay"]) == (4, 3 * 10**9)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"restart_attempts": 11}, "restart_attempts"),
        ({"restart_delay_s": 0}, "restart_delay_s"),
        ({"restart_attempts": 10, "restart_delay_s": 181}, "restart interval"),
    ],
)
def test_restart_policy_nomad_would_refuse_is_refused_by_name(fields: dict[str, int], named: str):
    with pytest.raises(ValueError, match=named):
        ClusterConfig.model_validate(fields)


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        (make_vllm(prefill_tokens_per_s=8000), "8000"),
        (make_vllm(), "20000"),
        (make_llamacpp(), "2000"),
        (make_vllm(engine="sglang"), "5000"),
    ],
    ids=["declared", "vllm-default", "llamacpp-default", "sglang-default"],
)
def test_every_replicas_service_meta_publishes_its_prefill_rate(profile, expected: str):
    """The profile's declared prefill rate, else its engine's default, is always in Meta."""
    key = ServiceMetaKey.PREFILL_TOKENS_PER_S
    assert expected == group_of(render(profile, 0))["Services"][0]["Meta"][key]


def test_a_prefill_rate_below_one_token_per_second_is_refused():
    """A declared prefill rate of zero is refused by name."""
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        make_vllm(prefill_tokens_per_s=0)
