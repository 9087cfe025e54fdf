"""The simulated vLLM given a model directory with tokenizer.json tokenizes as the router does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from engine_test_support import StartEngine, post_json

from caravan_llm.common.contract import EngineRoute
from caravan_llm.router.tokens.model_tokenizer import ModelTokenizer, load_model_tokenizer
from caravan_llm.router.tokens.prompt import prompt_token_ids

CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "def add(a, b):\n    return a + b  # explain <|im_end|>"},
]
PROMPT = "import os\nprint(os.getcwd())  \n"


@pytest.fixture(scope="module")
def router_tokenizer(tiny_tokenizer_dir: Path) -> ModelTokenizer:
    return load_model_tokenizer(tiny_tokenizer_dir)


async def test_tokenize_equals_the_routers_ids(
    sim_engine: StartEngine,
    http: aiohttp.ClientSession,
    tiny_tokenizer_dir: Path,
    router_tokenizer: ModelTokenizer,
) -> None:
    """/tokenize with messages and with a prompt gives the router's ids for the same request."""
    engine = await sim_engine(
        "vllm", "--model", str(tiny_tokenizer_dir), "--served-model-name", "m"
    )
    _, chat = await post_json(http, engine.base_url + "/tokenize", {"model": "m", "messages": CHAT})
    _, plain = await post_json(
        http, engine.base_url + "/tokenize", {"model": "m", "prompt": PROMPT}
    )
    expected_chat = prompt_token_ids(
        router_tokenizer, EngineRoute.CHAT_COMPLETIONS, {"messages": CHAT}
    )
    expected_plain = prompt_token_ids(router_tokenizer, EngineRoute.COMPLETIONS, {"prompt": PROMPT})
    assert expected_chat is not None
    assert (list(expected_chat), list(expected_plain or ())) == (chat["tokens"], plain["tokens"])


async def test_usage_counts_the_models_tokens(
    sim_engine: StartEngine,
    http: aiohttp.ClientSession,
    tiny_tokenizer_dir: Path,
    router_tokenizer: ModelTokenizer,
) -> None:
    """A chat's usage.prompt_tokens is the number of ids the router computes for it."""
    engine = await sim_engine(
        "vllm",
        "--model",
        "tiny",
        "--tokenizer",
        str(tiny_tokenizer_dir),
        "--served-model-name",
        "m",
    )
    body = {"model": "m", "messages": CHAT, "max_tokens": 2}
    status, answer = await post_json(http, engine.base_url + "/v1/chat/completions", body)
    expected = prompt_token_ids(router_tokenizer, EngineRoute.CHAT_COMPLETIONS, body)
    assert 200 == status, answer
    assert len(expected or ()) == answer["usage"]["prompt_tokens"]


async def test_directory_without_tokenizer_keeps_the_regex_tokenizer(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """A --model directory without tokenizer.json tokenizes with the simulator's own tokens."""
    engine = await sim_engine("vllm", "--model", str(tmp_path), "--served-model-name", "m")
    _, answer = await post_json(
        http, engine.base_url + "/tokenize", {"model": "m", "prompt": "a b"}
    )
    assert 2 == answer["count"]
