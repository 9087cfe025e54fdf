"""The model profile's schema and cross-field rules."""

from __future__ import annotations

from typing import Any

import pytest
from profile_builders import llamacpp_document, make_llamacpp, make_vllm, vllm_document

from caravan_llm.scheduler.profiles import (
    Engine,
    ProfileError,
    parse_profile_text,
    profile_from_mapping,
    profile_to_json,
)


def problems_of(document: dict[str, Any]) -> list[str]:
    with pytest.raises(ProfileError) as caught:
        profile_from_mapping(document, "p.yaml")
    return caught.value.problems


def test_minimal_vllm_profile_gets_defaults():
    """A minimal vLLM profile validates and fills the documented defaults."""
    profile = make_vllm()
    assert profile.served_name == "qwen"
    assert profile.tensor_parallel == 1
    assert profile.nodes == 1
    assert (profile.replicas.min, profile.replicas.max, profile.replicas.start) == (1, 1, 1)
    assert profile.engine is Engine.VLLM


def test_served_model_name_overrides_name():
    """`served_model_name` is the OpenAI model id when given."""
    assert make_vllm(served_model_name="qwen2.5-7b").served_name == "qwen2.5-7b"


def test_vllm_without_gpu_is_refused_naming_gpu():
    """vLLM without a gpu block is an error about the `gpu` field."""
    document = vllm_document()
    del document["gpu"]
    [problem] = problems_of(document)
    assert problem.startswith("gpu:")
    assert "vllm" in problem


def test_llamacpp_may_omit_gpu():
    """llama.cpp without a gpu block runs on the CPU."""
    assert make_llamacpp().uses_gpu is False


@pytest.mark.parametrize(
    ("field", "value"),
    [("tensor_parallel", 2), ("nodes", 2)],
)
def test_llamacpp_refuses_tensor_parallel_and_multi_node(field: str, value: int):
    """llama.cpp with tensor_parallel > 1 or nodes > 1 is refused, naming the field."""
    [problem] = problems_of(llamacpp_document(**{field: value}))
    assert problem.startswith(f"{field}:")


def test_vllm_gpu_count_must_match_tensor_parallel():
    """vLLM's gpu.count must equal tensor_parallel unless the profile says otherwise."""
    [problem] = problems_of(vllm_document(tensor_parallel=2))
    assert problem.startswith("gpu.count")
    explicit = make_vllm(
        tensor_parallel=2, gpu={"class": "h100", "count": 4, "allow_count_mismatch": True}
    )
    assert explicit.gpu is not None
    assert explicit.gpu.count == 4


def test_vllm_multi_node_is_accepted_by_the_schema():
    """nodes > 1 validates for vLLM (rendering refuses it separately)."""
    assert make_vllm(nodes=2).nodes == 2


@pytest.mark.parametrize(
    ("replicas", "needle"),
    [
        ({"min": 3, "max": 2}, "replicas.min (3) must be <= replicas.max (2)"),
        ({"min": 1, "max": 3, "initial": 4}, "replicas.initial (4)"),
        ({"min": 2, "max": 3, "initial": 1}, "replicas.initial (1)"),
        ({"min": 0, "max": 0}, "replicas.max"),
    ],
)
def test_replica_bounds(replicas: dict[str, int], needle: str):
    """replicas must satisfy min <= initial <= max and max >= 1."""
    [problem] = problems_of(vllm_document(replicas=replicas))
    assert needle in problem
    assert problem.startswith("replicas")


def test_min_zero_is_allowed_and_starts_at_one():
    """replicas.min may be 0; without `initial` the model starts with one replica."""
    profile = make_vllm(replicas={"min": 0, "max": 2})
    assert profile.replicas.start == 1
    assert make_vllm(replicas={"min": 0, "max": 2, "initial": 0}).replicas.start == 0


@pytest.mark.parametrize(
    "name",
    ["Qwen", "qwen_7b", "qwen.2", "-qwen", "qwen-", "a" * 41, "router"],
)
def test_name_must_be_dns_safe(name: str):
    """Names outside lowercase letters, digits and inner hyphens (<= 40) are refused."""
    [problem] = problems_of(vllm_document(name=name))
    assert problem.startswith("name:")


def test_unknown_keys_are_rejected_with_their_path():
    """A misspelt key is an error that names it, at any depth."""
    problems = problems_of(vllm_document(replicass=2, gpu={"class": "h100", "cuont": 1}))
    assert sorted(problems) == sorted(
        [
            "replicass: unknown field (check the spelling; see the profile reference)",
            "gpu.cuont: unknown field (check the spelling; see the profile reference)",
        ]
    )


def test_missing_required_fields_are_named():
    """Missing model and engine are reported by name."""
    problems = problems_of({"name": "x"})
    assert "model: required field is missing" in problems
    assert "engine: required field is missing" in problems


def test_cpu_and_cores_are_exclusive():
    """resources may give cpu_mhz or cores, not both (Nomad refuses both)."""
    [problem] = problems_of(vllm_document(resources={"cpu_mhz": 1000, "cores": 2}))
    assert problem.startswith("resources:")


def test_engine_args_may_not_repeat_managed_flags():
    """engine_args that set a flag caravan renders are refused, naming engine_args."""
    [problem] = problems_of(vllm_document(engine_args=["--port=9000"]))
    assert problem.startswith("engine_args: --port")
    [problem] = problems_of(llamacpp_document(engine_args=["-c", "2048"]))
    assert problem.startswith("engine_args: -c")


def test_env_names_are_checked():
    """env keys must be valid environment variable names."""
    [problem] = problems_of(vllm_document(env={"BAD-NAME": "1"}))
    assert problem.startswith("env:")


def test_autoscaling_needs_a_target_and_scale_to_zero_needs_min_zero():
    """The autoscaling block needs a target; scale_to_zero_after_s needs replicas.min 0."""
    [problem] = problems_of(vllm_document(autoscaling={}))
    assert problem.startswith("autoscaling:")
    [problem] = problems_of(
        vllm_document(autoscaling={"target_inflight": 4, "scale_to_zero_after_s": 60})
    )
    assert problem.startswith("autoscaling.scale_to_zero_after_s")
    ok = make_vllm(
        replicas={"min": 0, "max": 2},
        autoscaling={"target_inflight": 4, "scale_to_zero_after_s": 60},
    )
    assert ok.autoscaling is not None


def test_llamacpp_cannot_target_kv_cache():
    """llama-server has no KV-cache metric, so target_kv_cache is refused for it."""
    [problem] = problems_of(llamacpp_document(autoscaling={"target_kv_cache": 0.8}))
    assert problem.startswith("autoscaling.target_kv_cache")


def test_profile_is_frozen():
    """A validated profile cannot be changed in place."""
    profile = make_vllm()
    with pytest.raises(ValueError, match="frozen"):
        profile.name = "other"  # type: ignore[misc]


def test_yaml_syntax_error_names_the_line():
    """A YAML syntax error names the file and the line."""
    with pytest.raises(ProfileError) as caught:
        parse_profile_text("name: x\nengine: [vllm\nmodel: y\n", "bad.yaml")
    [problem] = caught.value.problems
    assert "YAML syntax error at line 3" in problem
    assert str(caught.value).startswith("bad.yaml: ")


def test_json_round_trip():
    """The canonical JSON form validates back to an equal profile."""
    profile = make_vllm(served_model_name="q", replicas={"min": 0, "max": 3, "initial": 2})
    assert parse_profile_text(profile_to_json(profile), "kv") == profile
