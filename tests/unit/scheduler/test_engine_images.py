"""A profile's `image` against the cluster's pinned engine images (issue 14 item 3)."""

from __future__ import annotations

from profile_builders import make_llamacpp

from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.profile_policy import ProfilePolicy, policy_problems


def test_profile_may_name_the_clusters_pinned_images_but_not_a_floating_tag():
    """The cluster's own pinned images pass the profile policy; the floating tag does not."""
    config = ClusterConfig()
    pinned = make_llamacpp(driver="docker", image=config.llamacpp.cuda_image)
    floating = make_llamacpp(driver="docker", image="ghcr.io/ggml-org/llama.cpp:server-cuda")
    images = config.engine_images
    assert [] == policy_problems(pinned, config.profile_policy, cluster_images=images)
    (problem,) = policy_problems(floating, config.profile_policy, cluster_images=images)
    assert problem.startswith("image: ghcr.io/ggml-org/llama.cpp:server-cuda is not one of")


def test_operator_can_allow_another_image():
    """`profile_policy.allowed_images` lets a profile run an image the cluster does not pin."""
    policy = ProfilePolicy(allowed_images=("registry.example/llama.cpp:server-cuda-b9999",))
    profile = make_llamacpp(driver="docker", image="registry.example/llama.cpp:server-cuda-b9999")
    assert [] == policy_problems(profile, policy, cluster_images=ClusterConfig().engine_images)


def test_overriding_a_default_image_changes_what_profiles_may_name():
    """A cluster config that pins another vLLM image makes that one the cluster's own."""
    config = ClusterConfig.model_validate({"vllm": {"image": "vllm/vllm-openai:v0.12.0"}})
    assert "vllm/vllm-openai:v0.12.0" in config.engine_images
    assert ClusterConfig().vllm.image not in config.engine_images
