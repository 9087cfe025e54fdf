"""A reply cut mid-stream and continued on another instance gives the uninterrupted text."""

from __future__ import annotations

import aiohttp
import pytest
from engine_test_support import StartEngine, chat_text, post_json

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about caravans."},
]


def tokens_of(events: list[object]) -> list[str]:
    """The content deltas of a chat stream, one per token chunk."""
    return [
        choice["delta"]["content"]
        for event in events
        if isinstance(event, dict)
        for choice in event["choices"]
        if choice["delta"].get("content")
    ]


@pytest.mark.parametrize("cut", [1, 7, 19])
async def test_vllm_continue_final_message_on_another_instance_completes_the_same_text(
    cut: int, sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """Cut after k tokens, continued elsewhere with continue_final_message: same full text."""
    first = await sim_engine("vllm", "--model", "m", "--sim-output-tokens", "100")
    second = await sim_engine("vllm", "--model", "m", "--sim-output-tokens", "100")
    request = {"messages": MESSAGES, "max_tokens": 30, "stream": True}

    _, events = await post_json(http, first.base_url + "/v1/chat/completions", request)
    tokens = tokens_of(events)
    partial = "".join(tokens[:cut])
    continued = {
        **request,
        "messages": [*MESSAGES, {"role": "assistant", "content": partial}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 30 - cut,
    }
    _, rest = await post_json(http, second.base_url + "/v1/chat/completions", continued)

    assert 30 == len(tokens)
    assert "".join(tokens) == partial + chat_text(rest)
    assert tokens[cut:] == tokens_of(rest)
    assert "length" == rest[-2]["choices"][0]["finish_reason"]


async def test_vllm_without_continue_flag_starts_a_new_turn(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """Without continue_final_message a trailing assistant message gets a fresh reply after it."""
    engine = await sim_engine("vllm", "--model", "m")
    request = {"messages": MESSAGES, "max_tokens": 12}
    _, whole = await post_json(http, engine.base_url + "/v1/chat/completions", request)
    text = whole["choices"][0]["message"]["content"]
    partial = text[: len(text) // 2]

    _, fresh = await post_json(
        http,
        engine.base_url + "/v1/chat/completions",
        {**request, "messages": [*MESSAGES, {"role": "assistant", "content": partial}]},
    )

    assert not (partial + fresh["choices"][0]["message"]["content"]).startswith(text)


async def test_llamacpp_explicit_continuation_streams_only_new_tokens(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """llama.cpp with continue_final_message streams just the rest of the reply."""
    first = await sim_engine("llamacpp", "-m", "/m/t.gguf")
    second = await sim_engine("llamacpp", "-m", "/m/t.gguf")
    request = {"messages": MESSAGES, "max_tokens": 20, "stream": True}
    _, events = await post_json(http, first.base_url + "/v1/chat/completions", request)
    tokens = tokens_of(events)
    partial = "".join(tokens[:6])

    _, rest = await post_json(
        http,
        second.base_url + "/v1/chat/completions",
        {
            **request,
            "messages": [*MESSAGES, {"role": "assistant", "content": partial}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 14,
        },
    )

    assert tokens[6:] == tokens_of(rest)


async def test_llamacpp_implicit_prefill_repeats_the_partial_text_first(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """A trailing assistant message without the flag: llama-server's first delta repeats it."""
    engine = await sim_engine("llamacpp", "-m", "/m/t.gguf")
    request = {"messages": MESSAGES, "max_tokens": 20, "stream": True}
    _, events = await post_json(http, engine.base_url + "/v1/chat/completions", request)
    tokens = tokens_of(events)
    partial = "".join(tokens[:6])
    prefilled = {
        **request,
        "messages": [*MESSAGES, {"role": "assistant", "content": partial}],
        "max_tokens": 14,
    }

    _, streamed = await post_json(http, engine.base_url + "/v1/chat/completions", prefilled)
    _, whole = await post_json(
        http, engine.base_url + "/v1/chat/completions", {**prefilled, "stream": False}
    )

    assert [partial + tokens[6], *tokens[7:]] == tokens_of(streamed)
    assert "".join(tokens) == whole["choices"][0]["message"]["content"]
    assert 14 == whole["usage"]["completion_tokens"]


async def test_llamacpp_refuses_two_trailing_assistant_messages(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """Like llama-server, a prefill after another assistant message is a 400."""
    engine = await sim_engine("llamacpp", "-m", "/m/t.gguf")
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]

    status, _ = await post_json(
        http, engine.base_url + "/v1/chat/completions", {"messages": messages}
    )

    assert 400 == status


@pytest.mark.parametrize("flavor", ["vllm", "llamacpp"])
async def test_continue_together_with_generation_prompt_is_400(
    flavor: str, sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """continue_final_message with add_generation_prompt left true is refused by both engines."""
    engine = await sim_engine(flavor, "--model" if flavor == "vllm" else "-m", "m")
    request = {
        "messages": [*MESSAGES, {"role": "assistant", "content": " the"}],
        "continue_final_message": True,
    }

    status, _ = await post_json(http, engine.base_url + "/v1/chat/completions", request)

    assert 400 == status


async def test_the_seed_changes_the_reply_and_instances_with_one_seed_agree(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """Two instances with the same --sim-seed answer alike; a request seed changes the reply."""
    one = await sim_engine("vllm", "--model", "m", "--sim-seed", "3")
    two = await sim_engine("vllm", "--model", "m", "--sim-seed", "3")
    request = {"messages": MESSAGES, "max_tokens": 10}

    _, a = await post_json(http, one.base_url + "/v1/chat/completions", request)
    _, b = await post_json(http, two.base_url + "/v1/chat/completions", request)
    _, c = await post_json(http, two.base_url + "/v1/chat/completions", {**request, "seed": 99})

    def text(body: dict[str, list[dict[str, dict[str, str]]]]) -> str:
        return body["choices"][0]["message"]["content"]

    assert text(a) == text(b)
    assert text(a) != text(c)
