"""The router's prompt token ids equal the real vLLM's, for the tiny model's tokenizer and template.

One real vLLM (the CPU build, `make vllm`) serves the tiny model; the router's
tokenizer (`caravan_llm.router.tokens`) loads the same model directory. Each
request is sent to vLLM's /tokenize (as `messages` and as `prompt`) and, for
chats, to /v1/chat/completions, whose usage.prompt_tokens counts what the
engine really ran.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from standalone import real_vllm_server

from caravan_llm.common.contract import EngineRoute
from caravan_llm.devcluster.vllm_build import find_vllm, missing_build_message
from caravan_llm.router.tokens.model_tokenizer import load_model_tokenizer
from caravan_llm.router.tokens.prompt import prompt_token_ids

SYSTEM = "You are a terse assistant. " * 12
CHATS: dict[str, dict[str, Any]] = {
    "system_user": {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "def add(a, b):\n    return a + b\n# explain?"},
        ]
    },
    "multi_turn": {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "first answer, with  two spaces"},
            {"role": "user", "content": "second question <|im_end|> with a marker"},
        ]
    },
    "text_parts": {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    },
    "developer": {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "developer", "content": "d"},
            {"role": "user", "content": "u"},
        ]
    },
    "continued": {
        "messages": [
            {"role": "user", "content": "count to three"},
            {"role": "assistant", "content": "one, two,"},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
}
PROMPTS = {
    "code": "import os\n\nfor name in os.listdir('.'):\n    print(name)  \n",
    "unicode": "naïve café — ünïcode\ttabs\r\nand <|im_start|> markers",
}


@dataclass(frozen=True, slots=True)
class Seen:
    tokenize_messages: dict[str, list[int]]
    usage_prompt_tokens: dict[str, int]
    tokenize_prompt: dict[str, list[int]]
    completion_prompt_tokens: dict[str, int]


async def _observe() -> tuple[Seen, Any]:
    build = find_vllm()
    if build is None:
        pytest.fail(missing_build_message())
    seen = Seen({}, {}, {}, {})
    async with (
        real_vllm_server(build) as url,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
    ):
        for name, chat in CHATS.items():
            async with http.post(url + "/tokenize", json={"model": "tiny", **chat}) as response:
                assert 200 == response.status, await response.text()
                seen.tokenize_messages[name] = (await response.json())["tokens"]
            body = {"model": "tiny", "max_tokens": 1, **chat}
            async with http.post(url + "/v1/chat/completions", json=body) as response:
                assert 200 == response.status, await response.text()
                seen.usage_prompt_tokens[name] = (await response.json())["usage"]["prompt_tokens"]
        for name, prompt in PROMPTS.items():
            body = {"model": "tiny", "prompt": prompt}
            async with http.post(url + "/tokenize", json=body) as response:
                assert 200 == response.status, await response.text()
                seen.tokenize_prompt[name] = (await response.json())["tokens"]
            async with http.post(
                url + "/v1/completions", json={**body, "max_tokens": 1}
            ) as response:
                assert 200 == response.status, await response.text()
                seen.completion_prompt_tokens[name] = (await response.json())["usage"][
                    "prompt_tokens"
                ]
    return seen, load_model_tokenizer(build.model)


@pytest.fixture(scope="module")
def observed() -> tuple[Seen, Any]:
    return asyncio.run(_observe())


def test_chat_ids_equal_vllm_tokenize_messages(observed: tuple[Seen, Any]) -> None:
    """For every chat, the router's ids are vLLM's /tokenize ids for the same messages."""
    seen, tokenizer = observed
    ours = {
        name: list(prompt_token_ids(tokenizer, EngineRoute.CHAT_COMPLETIONS, chat) or ())
        for name, chat in CHATS.items()
    }
    assert seen.tokenize_messages == ours


def test_chat_ids_count_the_prompt_tokens_vllm_ran(observed: tuple[Seen, Any]) -> None:
    """For every chat, the router's id count is the usage.prompt_tokens vLLM reports."""
    seen, tokenizer = observed
    ours = {
        name: len(prompt_token_ids(tokenizer, EngineRoute.CHAT_COMPLETIONS, chat) or ())
        for name, chat in CHATS.items()
    }
    assert seen.usage_prompt_tokens == ours


def test_completion_ids_equal_vllm_tokenize_prompt(observed: tuple[Seen, Any]) -> None:
    """For every text prompt, the router's ids are vLLM's /tokenize ids and its usage count."""
    seen, tokenizer = observed
    ours = {
        name: list(prompt_token_ids(tokenizer, EngineRoute.COMPLETIONS, {"prompt": p}) or ())
        for name, p in PROMPTS.items()
    }
    assert seen.tokenize_prompt == ours
    assert seen.completion_prompt_tokens == {name: len(ids) for name, ids in ours.items()}
