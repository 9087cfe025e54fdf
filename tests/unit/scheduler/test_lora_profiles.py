"""A profile's LoRA adapters and limits: validation, and how each engine renders them."""

from __future__ import annotations

from typing import Any

import pytest
from profile_builders import llamacpp_document, vllm_document

from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.model_service import SubmissionRejectedError, validate_submission
from caravan_llm.scheduler.profiles import ModelProfile, ProfileError, profile_from_mapping
from caravan_llm.scheduler.render import render
from caravan_llm.scheduler.weights import render_prefetch

SQL = {"name": "sql", "source": "/models/loras/sql", "rank": 8}
CHAT = {"name": "chat", "source": "acme/chat-lora"}


def sglang_document(**overrides: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": "qwen3",
        "model": "Qwen/Qwen3-8B",
        "engine": "sglang",
        "gpu": {"class": "h100", "count": 1},
    }
    document.update(overrides)
    return document


def problems_of(document: dict[str, Any]) -> list[str]:
    with pytest.raises(ProfileError) as caught:
        profile_from_mapping(document, "p.yaml")
    return caught.value.problems


def valid(document: dict[str, Any]) -> ModelProfile:
    return profile_from_mapping(document, "p.yaml")


def task_of(profile: ModelProfile) -> dict[str, Any]:
    task: dict[str, Any] = render(profile, 0)["Job"]["TaskGroups"][0]["Tasks"][0]
    return task


def test_adapters_turn_lora_on_with_the_default_limits():
    """Adapters without a `lora:` block get four adapters per replica and rank 16."""
    profile = valid(vllm_document(adapters=[SQL, CHAT]))
    limits = profile.lora_limits
    assert limits is not None
    assert (4, 16, None) == (limits.max_loras, limits.max_lora_rank, limits.max_cpu_loras)
    assert ("qwen", "sql", "chat") == profile.declared_names


def test_a_profile_without_adapters_or_lora_has_lora_off():
    """No adapters and no `lora:` block: no LoRA flags, no LoRA variable."""
    profile = valid(vllm_document())
    task = task_of(profile)
    assert profile.lora_limits is None
    assert not any("lora" in arg for arg in task["Config"]["args"])
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in task["Env"]


@pytest.mark.parametrize(
    ("adapters", "needle"),
    [
        (
            [{"name": "a/b", "source": "/m/a"}],
            "adapters[0].name: 'a/b' is not a valid adapter name",
        ),
        (
            [{"name": "x:y", "source": "/m/a"}],
            "adapters[0].name: 'x:y' is not a valid adapter name",
        ),
        (
            [{"name": "a", "source": "adapter-a"}],
            "neither an absolute folder path nor a Hugging Face",
        ),
        ([{"name": "a", "source": "/m/../etc"}], "must be a clean absolute folder path"),
        ([{"name": "a", "source": "/m/a", "rank": 0}], "adapters[0].rank"),
        ([{"name": "a", "source": "/m/a", "extra": 1}], "adapters[0].extra: unknown field"),
        ([{"name": "a"}], "adapters[0].source: required field is missing"),
    ],
)
def test_bad_adapter_fields_are_named(adapters: list[dict[str, Any]], needle: str):
    """Each malformed adapter field is refused with its index and field."""
    problems = problems_of(vllm_document(adapters=adapters))
    assert any(needle in p for p in problems), problems


def test_adapter_names_are_unique_within_the_profile():
    """An adapter named twice is refused at its second place."""
    problems = problems_of(vllm_document(adapters=[SQL, {**CHAT, "name": "sql"}]))
    assert ["adapters[1].name: 'sql' is declared twice"] == problems


def test_an_adapter_may_not_take_the_profiles_own_served_name():
    """An adapter named like the base model's served name is refused."""
    problems = problems_of(
        vllm_document(served_model_name="qwen-chat", adapters=[{**SQL, "name": "qwen-chat"}])
    )
    assert ["adapters[0].name: 'qwen-chat' is the profile's own served name"] == problems


def test_declared_rank_above_the_limit_is_refused():
    """A declared rank above lora.max_lora_rank is refused, naming both."""
    problems = problems_of(
        vllm_document(adapters=[{**SQL, "rank": 32}], lora={"max_lora_rank": 16})
    )
    assert [
        (
            "adapters[0].rank: 32 is above lora.max_lora_rank (16); raise the limit or use a "
            "smaller adapter"
        )
    ] == problems


def test_an_undeclared_rank_is_left_to_the_engine():
    """Without `rank`, only the engine can check the adapter (at load)."""
    profile = valid(vllm_document(adapters=[CHAT], lora={"max_lora_rank": 8}))
    assert profile.adapters[0].rank is None


def test_vllm_takes_only_its_own_rank_values():
    """vLLM's --max-lora-rank accepts a fixed list of values; another is refused."""
    problems = problems_of(vllm_document(adapters=[CHAT], lora={"max_lora_rank": 24}))
    assert [
        "lora.max_lora_rank: vLLM takes one of 1, 8, 16, 32, 64, 128, 256, 320, 512 (got 24)"
    ] == problems


def test_max_cpu_loras_must_hold_a_batch():
    """max_cpu_loras below max_loras is refused."""
    problems = problems_of(vllm_document(lora={"max_loras": 4, "max_cpu_loras": 2}))
    assert ["lora.max_cpu_loras (2) must be at least lora.max_loras (4)"] == problems


def test_llamacpp_refuses_adapters_naming_the_field():
    """llama.cpp cannot select an adapter by `model`: its profile is refused with the reason."""
    problems = problems_of(llamacpp_document(adapters=[SQL]))
    assert 1 == len(problems)
    assert problems[0].startswith("adapters: llama.cpp takes `--lora` adapters at start only")


def test_llamacpp_refuses_a_lora_block_naming_it():
    """A `lora:` block alone is refused on llama.cpp too, naming `lora`."""
    problems = problems_of(llamacpp_document(lora={"max_loras": 2}))
    assert problems[0].startswith("lora: llama.cpp")


def test_a_path_adapter_must_be_on_the_weights_volume():
    """With a weights volume, an adapter folder outside its mount path is refused."""
    weights = {"volume": {"type": "host", "source": "models"}, "path": "/models"}
    problems = problems_of(
        vllm_document(weights=weights, adapters=[{"name": "a", "source": "/opt/a"}])
    )
    assert [
        (
            "adapters[0].source: '/opt/a' is not on the weights volume the replicas mount at "
            "/models/ (weights.path)"
        )
    ] == problems


def test_lora_flags_are_managed():
    """engine_args may not set the LoRA limits the profile's `lora:` block renders."""
    problems = problems_of(vllm_document(engine_args=["--max-loras", "8"]))
    assert "adapters, lora" in problems[0]


def test_vllm_renders_lora_on_and_runtime_loading_but_no_adapter():
    """vLLM gets --enable-lora and its limits, and the variable that opens the load routes;
    the adapters themselves are loaded at run time, so they are not in the job."""
    profile = valid(vllm_document(adapters=[SQL, CHAT], lora={"max_loras": 2, "max_cpu_loras": 6}))
    task = task_of(profile)
    args = task["Config"]["args"]
    start = args.index("--enable-lora")
    assert [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--max-cpu-loras",
        "6",
    ] == args[start : start + 7]
    assert "1" == task["Env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    assert not any(a.startswith("sql") or "/models/loras" in a for a in args)


def test_changing_vllm_adapters_keeps_the_spec():
    """Adding an adapter to a vLLM profile changes no job (no replica restarts)."""
    one = valid(vllm_document(adapters=[SQL]))
    two = valid(vllm_document(adapters=[SQL, CHAT]))
    assert render(one, 0) == render(two, 0)


def test_sglang_names_every_adapter_at_start():
    """SGLang gets --enable-lora, its per-batch limit and every adapter as name=source."""
    profile = valid(sglang_document(adapters=[SQL, CHAT], lora={"max_loras": 3}))
    args = task_of(profile)["Config"]["args"]
    start = args.index("--enable-lora")
    assert [
        "--enable-lora",
        "--max-loras-per-batch",
        "3",
        "--max-lora-rank",
        "16",
        "--lora-paths",
        "sql=/models/loras/sql",
        "chat=acme/chat-lora",
    ] == args[start : start + 8]


def test_the_default_prefetch_brings_hub_adapters():
    """With the default download, each adapter named by a hub id gets its own download task."""
    weights = {
        "volume": {"type": "host", "source": "models"},
        "path": "/models",
        "prefetch": {},
    }
    profile = valid(
        vllm_document(weights=weights, adapters=[{**SQL, "source": "/models/sql"}, CHAT])
    )
    job = render_prefetch(profile, ClusterConfig(), [])
    assert job is not None
    tasks = job["Job"]["TaskGroups"][0]["Tasks"]
    assert [
        ("prefetch", ["download", "Qwen/Qwen2.5-7B-Instruct"]),
        ("adapter-1", ["download", "acme/chat-lora"]),
    ] == [(t["Name"], t["Config"]["args"]) for t in tasks]


def test_a_prefetch_command_of_its_own_brings_the_adapters_itself():
    """A prefetch with its own command gets no adapter tasks."""
    weights = {
        "volume": {"type": "host", "source": "models"},
        "path": "/models",
        "prefetch": {"command": ["fetch-all"]},
    }
    profile = valid(vllm_document(weights=weights, adapters=[CHAT]))
    job = render_prefetch(profile, ClusterConfig(), [])
    assert job is not None
    assert ["prefetch"] == [t["Name"] for t in job["Job"]["TaskGroups"][0]["Tasks"]]


def _submit(
    *documents: tuple[str, dict[str, Any]], stored: dict[str, ModelProfile] | None = None
) -> list[str]:
    import json  # noqa: PLC0415 - local to the helper

    texts = [(source, json.dumps(document)) for source, document in documents]
    with pytest.raises(SubmissionRejectedError) as refused:
        validate_submission(texts, ClusterConfig(), stored)
    return [str(p) for p in refused.value.problems]


def test_an_adapter_name_may_not_be_another_models_served_name():
    """Submitting an adapter named like a stored model's served name is refused, naming it."""
    stored = {"sql": valid(vllm_document(name="sql"))}
    problems = _submit(("q.yaml", vllm_document(adapters=[SQL])), stored=stored)
    assert [
        (
            "q.yaml: adapters[0].name: 'sql' is already served by model 'sql'; choose another "
            "adapter name or delete sql first"
        )
    ] == problems


def test_a_served_name_may_not_be_another_models_adapter():
    """A stored model's adapter name is taken for every other profile's served name."""
    stored = {"qwen": valid(vllm_document(adapters=[SQL]))}
    problems = _submit(("s.yaml", vllm_document(name="sql")), stored=stored)
    assert [
        (
            "s.yaml: served_model_name: 'sql' is already served by model 'qwen'; choose another "
            "served_model_name or delete qwen first"
        )
    ] == problems


def test_two_profiles_of_one_submission_may_not_share_an_adapter_name():
    """Within one submission, the second profile declaring an adapter name is refused."""
    problems = _submit(
        ("a.yaml", vllm_document(name="a", adapters=[SQL])),
        ("b.yaml", vllm_document(name="b", adapters=[SQL])),
    )
    assert ["b.yaml: adapters[0].name: 'sql' is also served by model 'a' in a.yaml"] == problems
