"""SGLang, the third engine: its profile rules, policy, rendering and published Meta."""

from __future__ import annotations

from typing import Any

import pytest

from caravan_llm.common.contract import ServiceMetaKey, decode_stream_traits
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.profile_policy import ProfilePolicy, policy_problems
from caravan_llm.scheduler.profiles import ModelProfile, ProfileError, profile_from_mapping
from caravan_llm.scheduler.render import render


def sglang_document(**overrides: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": "qwen3",
        "model": "Qwen/Qwen3-8B",
        "engine": "sglang",
        "gpu": {"class": "h100", "count": 2},
        "tensor_parallel": 2,
    }
    document.update(overrides)
    return document


def make_sglang(**overrides: Any) -> ModelProfile:
    return ModelProfile.model_validate(sglang_document(**overrides))


def problems_of(document: dict[str, Any]) -> list[str]:
    with pytest.raises(ProfileError) as caught:
        profile_from_mapping(document, "p.yaml")
    return caught.value.problems


def task_of(profile: ModelProfile, config: ClusterConfig | None = None) -> dict[str, Any]:
    task: dict[str, Any] = render(profile, 0, config=config or ClusterConfig())["Job"][
        "TaskGroups"
    ][0]["Tasks"][0]
    return task


class TestProfileRules:
    def test_refused_without_a_gpu_class_as_vllm_is(self) -> None:
        document = sglang_document()
        del document["gpu"]

        [problem] = problems_of(document)

        assert problem.startswith("gpu: engine 'sglang' needs a gpu block")

    def test_gpu_count_must_match_tensor_parallel(self) -> None:
        [problem] = problems_of(sglang_document(gpu={"class": "h100", "count": 1}))

        assert "gpu.count (1) must equal tensor_parallel (2) for SGLang" in problem

    @pytest.mark.parametrize(
        ("override", "field"),
        [({"driver": "raw_exec"}, "driver"), ({"nodes": 2}, "nodes")],
    )
    def test_docker_on_one_node_only(self, override: dict[str, Any], field: str) -> None:
        [problem] = problems_of(sglang_document(**override))

        assert problem.startswith(f"{field}: ")
        assert "SGLang" in problem

    @pytest.mark.parametrize("flag", ["--tp", "--model-path", "--max-running-requests"])
    def test_flags_caravan_renders_are_refused_in_engine_args(self, flag: str) -> None:
        [problem] = problems_of(sglang_document(engine_args=[flag, "4"]))

        assert problem.startswith(f"engine_args: {flag} is set by caravan")

    def test_kv_cache_target_is_allowed(self) -> None:
        """SGLang reports KV use (sglang:token_usage), unlike llama.cpp."""
        profile = make_sglang(autoscaling={"target_kv_cache": 0.8})

        assert profile.autoscaling is not None

    def test_its_api_key_variable_is_caravans(self) -> None:
        [problem] = problems_of(sglang_document(secrets={"CARAVAN_ENGINE_API_KEY": "a/b"}))

        assert "carries the engine's API key" in problem


class TestPolicy:
    @pytest.mark.parametrize(
        "args",
        [
            ["--trust-remote-code"],
            ["--enable-custom-logit-processor"],
            # argparse takes an unambiguous prefix: SGLang would read this as the flag above.
            ["--enable-custom-logit"],
            ["--admin-api-key", "mine"],
        ],
    )
    def test_code_loading_and_listener_flags_are_refused(self, args: list[str]) -> None:
        problems = policy_problems(make_sglang(engine_args=args), ProfilePolicy())

        assert len(problems) == 1
        assert problems[0].startswith(f"engine_args: {args[0]}")

    def test_its_logging_config_variable_is_refused(self) -> None:
        profile = make_sglang(env={"SGLANG_LOGGING_CONFIG_PATH": "/tmp/x.json"})

        [problem] = policy_problems(profile, ProfilePolicy())

        assert problem.startswith("env: SGLANG_LOGGING_CONFIG_PATH is refused")

    def test_ordinary_flags_and_the_clusters_image_pass(self) -> None:
        config = ClusterConfig()
        profile = make_sglang(
            engine_args=["--mem-fraction-static", "0.85"], image=config.sglang.image
        )

        assert [] == policy_problems(profile, ProfilePolicy(), cluster_images=config.engine_images)


class TestRender:
    def test_launch_server_with_its_flags_in_the_pinned_image(self) -> None:
        profile = make_sglang(served_model_name="qwen3-8b", context_length=4096)

        task = task_of(profile)

        config = task["Config"]
        assert "docker" == task["Driver"]
        assert config["image"].startswith("lmsysorg/sglang:v")
        assert ["python3", "-m", "sglang.launch_server"] == config["entrypoint"]
        args = config["args"]
        pairs = {flag: args[i + 1] for i, flag in enumerate(args[:-1]) if flag.startswith("--")}
        assert "Qwen/Qwen3-8B" == pairs["--model-path"]
        assert "qwen3-8b" == pairs["--served-model-name"]
        assert "2" == pairs["--tp"]
        assert "0.0.0.0" == pairs["--host"]
        assert "30000" == pairs["--port"]
        assert "256" == pairs["--max-running-requests"]
        assert "4096" == pairs["--context-length"]
        assert "--enable-metrics" in args
        assert config["shm_size"] >= 2 * 1024**3

    def test_api_key_reaches_the_flag_by_reference(self) -> None:
        """SGLang reads no key variable: the template fills one, the flag interpolates it."""
        task = task_of(make_sglang())

        args = task["Config"]["args"]
        assert "${CARAVAN_ENGINE_API_KEY}" == args[args.index("--api-key") + 1]
        [template] = [t for t in task["Templates"] if t["DestPath"] == "secrets/engine-key.env"]
        assert "CARAVAN_ENGINE_API_KEY={{ .api_key }}" in template["EmbeddedTmpl"]
        assert template["Envvars"] is True

    def test_no_key_flag_when_the_cluster_runs_without_engine_keys(self) -> None:
        task = task_of(make_sglang(), ClusterConfig(engine_api_keys=False))

        assert "--api-key" not in task["Config"]["args"]

    def test_meta_publishes_sglang_metrics_capacity_and_traits(self) -> None:
        body = render(make_sglang(max_concurrency=32), 0)

        meta = body["Job"]["TaskGroups"][0]["Services"][0]["Meta"]
        assert "sglang" == meta[ServiceMetaKey.ENGINE]
        assert "32" == meta[ServiceMetaKey.CAPACITY]
        assert "sglang:num_running_reqs" == meta[ServiceMetaKey.METRIC_RUNNING]
        assert "sglang:num_queue_reqs" == meta[ServiceMetaKey.METRIC_WAITING]
        assert "sglang:token_usage" == meta[ServiceMetaKey.METRIC_KV_CACHE]
        traits = decode_stream_traits(meta)
        assert 16 == traits.completion_default_max_tokens
        assert traits.echoes_prefill is False
        assert "/health" == body["Job"]["TaskGroups"][0]["Services"][0]["Checks"][0]["Path"]
