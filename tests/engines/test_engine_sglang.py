"""The simulated SGLang server (`--flavor sglang`): SGLang's flags, auth, metrics and models.

The OpenAI request/response behaviour is the shared simulation's (vLLM's dialect,
which SGLang follows); these tests cover what is SGLang's own.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from engine_test_support import StartEngine, post_json

from caravan_llm.common.engine_metrics import parse_engine_load
from caravan_llm.devcluster.engine.flags import FlagError, parse_engine_args
from caravan_llm.scheduler.engines.sglang import SGLANG_METRIC_NAMES
from caravan_llm.scheduler.profiles import load_profile
from caravan_llm.scheduler.render import render

EXAMPLE_PROFILES = Path(__file__).resolve().parents[2] / "examples" / "profiles"
CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def _status(
    http: aiohttp.ClientSession, method: str, url: str, headers: dict[str, str] | None = None
) -> int:
    body = CHAT if method == "POST" else None
    async with http.request(method, url, json=body, headers=headers or {}) as response:
        await response.read()
        return response.status


def test_the_rendered_command_line_runs_unchanged() -> None:
    """What caravan renders for SGLang (after Nomad interpolates the key) parses as SGLang's."""
    profile = load_profile(EXAMPLE_PROFILES / "qwen3-sglang-h100.yaml")
    config = render(profile, 0)["Job"]["TaskGroups"][0]["Tasks"][0]["Config"]
    args = [arg.replace("${CARAVAN_ENGINE_API_KEY}", "k-1") for arg in config["args"]]

    settings = parse_engine_args(["--flavor", "sglang", *args], env={})

    assert ("qwen3-8b",) == settings.served_model_names
    assert 64 == settings.perf.max_num_seqs
    assert 8192 == settings.max_model_len
    assert settings.metrics_enabled
    assert ("k-1",) == settings.api_keys


def test_module_invocation_prefix_and_missing_model() -> None:
    settings = parse_engine_args(
        ["--flavor", "sglang", "-m", "sglang.launch_server", "--model-path", "m", "--tp", "2"],
        env={},
    )
    assert ("m",) == settings.served_model_names
    assert 30000 == settings.port
    assert "127.0.0.1" == settings.host
    with pytest.raises(FlagError, match="--model-path is required"):
        parse_engine_args(["--flavor", "sglang", "--tp", "2"], env={})


def test_no_environment_fallback_for_the_key() -> None:
    """SGLang reads its key from --api-key only."""
    settings = parse_engine_args(
        ["--flavor", "sglang", "--model-path", "m"],
        env={"SGLANG_API_KEY": "k", "VLLM_API_KEY": "k"},
    )
    assert () == settings.api_keys


async def test_guards_all_but_health_and_metrics(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    engine = await sim_engine(
        "sglang", "--model-path", "qwen", "--enable-metrics", "--api-key", "k-1"
    )
    base = engine.base_url
    async with http.post(f"{base}/v1/chat/completions", json=CHAT) as response:
        assert (401, {"error": "Unauthorized"}) == (response.status, await response.json())
    assert 401 == await _status(http, "GET", f"{base}/v1/models")
    assert 401 == await _status(http, "GET", f"{base}/v1/models", {"Authorization": "Bearer k-2"})
    assert 200 == await _status(http, "GET", f"{base}/health")
    assert 200 == await _status(http, "GET", f"{base}/health_generate")
    assert 200 == await _status(http, "GET", f"{base}/metrics")
    good = {"Authorization": "Bearer k-1"}
    assert 200 == await _status(http, "POST", f"{base}/v1/chat/completions", good)


async def test_metrics_need_enable_metrics_and_use_sglang_names(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    without = await sim_engine("sglang", "--model-path", "qwen")
    assert 404 == await _status(http, "GET", f"{without.base_url}/metrics")

    engine = await sim_engine("sglang", "--model-path", "qwen", "--enable-metrics")
    async with http.get(f"{engine.base_url}/metrics") as response:
        text = await response.text()
    load = parse_engine_load(text, SGLANG_METRIC_NAMES)
    assert (0.0, 0.0, 0.0) == (load.running, load.waiting, load.kv_cache_usage)
    assert 'sglang:num_running_reqs{engine_type="unified",model_name="qwen"' in text


async def test_models_and_the_completions_default_limit(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """`owned_by: sglang`; a completion without max_tokens stops at 16 (its published trait)."""
    engine = await sim_engine(
        "sglang", "--model-path", "Qwen/Qwen3-8B", "--served-model-name", "qwen"
    )
    async with http.get(f"{engine.base_url}/v1/models") as response:
        cards = (await response.json())["data"]
    assert [("qwen", "sglang")] == [(card["id"], card["owned_by"]) for card in cards]

    status, body = await post_json(
        http, f"{engine.base_url}/v1/completions", {"model": "qwen", "prompt": "Once"}
    )
    assert 200 == status
    # The simulated reply is longer than 16 tokens (at least half of --sim-output-tokens 64).
    assert 16 == body["usage"]["completion_tokens"]
    assert "length" == body["choices"][0]["finish_reason"]
