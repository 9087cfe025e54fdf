"""The simulated engines mount the routes their real servers mount, with the real shapes."""

from __future__ import annotations

import aiohttp
import pytest
from engine_test_support import StartEngine, post_json

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/score", "/v1/rerank", "/rerank"])
async def test_vllm_generate_model_has_no_pooling_routes(
    path: str, sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """vLLM mounts embeddings, score and rerank for pooling models only: FastAPI's 404."""
    engine = await sim_engine("vllm", "--model", "m", "--served-model-name", "tiny")

    status, body = await post_json(http, engine.base_url + path, {"model": "tiny", "input": "x"})

    assert (404, {"detail": "Not Found"}) == (status, body)


@pytest.mark.parametrize("flavor", ["vllm", "llamacpp", "sglang"])
async def test_every_engine_answers_responses(
    flavor: str, sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """/v1/responses answers a `response` whose text has the asked number of tokens."""
    args = {
        "vllm": ("--model", "m", "--served-model-name", "tiny"),
        "llamacpp": ("-m", "/m/t.gguf", "-a", "tiny"),
        "sglang": ("--model-path", "m", "--served-model-name", "tiny"),
    }[flavor]
    engine = await sim_engine(flavor, *args)
    body = {"model": "tiny", "input": "hello", "max_output_tokens": 3, "ignore_eos": True}

    status, answer = await post_json(http, engine.base_url + "/v1/responses", body)

    assert (200, "response", 3) == (status, answer["object"], answer["usage"]["output_tokens"])


async def test_sglang_has_no_anthropic_messages(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """SGLang serves no /v1/messages (its own not-found, not an OpenAI error)."""
    engine = await sim_engine("sglang", "--model-path", "m", "--served-model-name", "tiny")
    body = {"model": "tiny", "max_tokens": 2, "messages": CHAT}

    status, answer = await post_json(http, engine.base_url + "/v1/messages", body)

    assert (404, {"detail": "Not Found"}) == (status, answer)


async def test_llamacpp_embeddings_need_the_flag(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """Without --embeddings llama-server answers 501; with it, one unit vector per input."""
    plain = await sim_engine("llamacpp", "-m", "/m/t.gguf", "-a", "tiny")
    flagged = await sim_engine("llamacpp", "-m", "/m/t.gguf", "-a", "tiny", "--embeddings")
    body = {"model": "tiny", "input": ["a", "b"]}

    refused, error = await post_json(http, plain.base_url + "/v1/embeddings", body)
    served, vectors = await post_json(http, flagged.base_url + "/v1/embeddings", body)

    norm = sum(value * value for value in vectors["data"][0]["embedding"])
    assert (501, "not_supported_error") == (refused, error["error"]["type"])
    assert (200, 2) == (served, len(vectors["data"]))
    assert abs(norm - 1.0) < 1e-3
