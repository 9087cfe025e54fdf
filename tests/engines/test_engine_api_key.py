"""The simulated engines honour `--api-key` and the env var the way the real engines do.

vLLM (`--api-key` or VLLM_API_KEY) guards only paths under `/v1` and wants
`Authorization: Bearer <key>`; llama-server (`--api-key`, comma-separated,
or LLAMA_API_KEY) guards everything but `/health` and `/v1/health`, and also
takes `X-Api-Key` (measured on the real build: tests/engines/test_llama_server_real.py).
"""

from __future__ import annotations

import aiohttp
import pytest
from engine_test_support import StartEngine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def _status(
    http: aiohttp.ClientSession, method: str, url: str, headers: dict[str, str] | None = None
) -> int:
    body = CHAT if method == "POST" else None
    async with http.request(method, url, json=body, headers=headers or {}) as response:
        await response.read()
        return response.status


@pytest.mark.parametrize("source", ["flag", "env"])
async def test_vllm_guards_v1_only(
    sim_engine: StartEngine, http: aiohttp.ClientSession, source: str
) -> None:
    """Without the key /v1/* is 401 {"error": "Unauthorized"}; /health and /metrics stay open."""
    args = ("--model", "m", "--api-key", "k-1") if source == "flag" else ("--model", "m")
    env = {"VLLM_API_KEY": "k-1"} if source == "env" else None
    engine = await sim_engine("vllm", *args, env=env)
    base = engine.base_url
    async with http.post(f"{base}/v1/chat/completions", json=CHAT) as response:
        assert (401, {"error": "Unauthorized"}) == (response.status, await response.json())
    assert 401 == await _status(http, "GET", f"{base}/v1/models")
    wrong = {"Authorization": "Bearer k-2"}
    assert 401 == await _status(http, "POST", f"{base}/v1/chat/completions", wrong)
    assert 401 == await _status(http, "GET", f"{base}/v1/models", {"X-Api-Key": "k-1"})
    good = {"Authorization": "Bearer k-1"}
    assert 200 == await _status(http, "POST", f"{base}/v1/chat/completions", good)
    assert 200 == await _status(http, "GET", f"{base}/health")
    assert 200 == await _status(http, "GET", f"{base}/metrics")


@pytest.mark.parametrize("source", ["flag", "env"])
async def test_llamacpp_guards_all_but_health(
    sim_engine: StartEngine, http: aiohttp.ClientSession, source: str
) -> None:
    """Without the key everything but /health is 401 with llama-server's body."""
    args = ("-m", "m.gguf", "--metrics")
    args += ("--api-key", "other,k-1") if source == "flag" else ()
    env = {"LLAMA_API_KEY": "k-1"} if source == "env" else None
    engine = await sim_engine("llamacpp", *args, env=env)
    base = engine.base_url
    async with http.post(f"{base}/v1/chat/completions", json=CHAT) as response:
        body = await response.json()
    assert 401 == response.status
    assert {"message": "Invalid API Key", "type": "authentication_error", "code": 401} == (
        body["error"]
    )
    for path in ("/metrics", "/v1/models", "/models", "/slots", "/props"):
        assert 401 == await _status(http, "GET", f"{base}{path}"), path
    assert 200 == await _status(http, "GET", f"{base}/health")
    assert 200 == await _status(http, "GET", f"{base}/v1/health")
    for headers in ({"Authorization": "Bearer k-1"}, {"X-Api-Key": "k-1"}):
        assert 200 == await _status(http, "POST", f"{base}/v1/chat/completions", headers)
        assert 200 == await _status(http, "GET", f"{base}/metrics", headers)


async def test_no_key_means_open(sim_engine: StartEngine, http: aiohttp.ClientSession) -> None:
    """Without a key (flag or env) both engines answer as before."""
    engine = await sim_engine("llamacpp", "-m", "m.gguf", "--metrics")
    assert 200 == await _status(http, "POST", f"{engine.base_url}/v1/chat/completions")
    assert 200 == await _status(http, "GET", f"{engine.base_url}/metrics")
