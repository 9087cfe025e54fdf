"""The simulated engines' HTTP API: health, models, chat and completions, errors, faults."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from engine_test_support import StartEngine, chat_text, eventually, parse_sse, post_json

CHAT = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 5}


async def test_vllm_refuses_connections_while_loading_then_answers_health_200(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """vLLM binds its port but does not listen until loaded, then /health is 200 and empty."""
    engine = await sim_engine("vllm", "--model", "m", "--sim-load-seconds", "0.5", wait_ready=False)

    with pytest.raises(aiohttp.ClientConnectorError):
        await http.get(engine.base_url + "/health")
    await asyncio.wait_for(engine.engine.ready.wait(), timeout=5)
    async with http.get(engine.base_url + "/health") as response:
        assert (200, "") == (response.status, await response.text())


async def test_llamacpp_answers_503_loading_model_then_200_ok(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """llama.cpp listens at once and answers 503 "Loading model" until loaded, then 200."""
    engine = await sim_engine(
        "llamacpp", "-m", "/m/tiny.gguf", "--sim-load-seconds", "0.5", wait_ready=False
    )

    async with http.get(engine.base_url + "/health") as response:
        loading = (response.status, await response.json())
    await asyncio.wait_for(engine.engine.ready.wait(), timeout=5)
    async with http.get(engine.base_url + "/health") as response:
        ready = (response.status, await response.json())

    assert (
        503,
        {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}},
    ) == loading
    assert (200, {"status": "ok"}) == ready


async def test_vllm_lists_every_served_model_name(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """/v1/models has one card per --served-model-name, rooted at --model."""
    engine = await sim_engine(
        "vllm", "--model", "org/model", "--served-model-name", "a", "b", "--max-model-len", "4096"
    )

    async with http.get(engine.base_url + "/v1/models") as response:
        cards = (await response.json())["data"]

    assert [("a", "org/model", 4096, "vllm"), ("b", "org/model", 4096, "vllm")] == [
        (c["id"], c["root"], c["max_model_len"], c["owned_by"]) for c in cards
    ]


async def test_vllm_chat_completion_fields(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """A non-streamed vLLM chat reply has vLLM's fields, usage and the served name asked for."""
    engine = await sim_engine("vllm", "--model", "m", "--served-model-name", "a", "b")

    status, body = await post_json(
        http, engine.base_url + "/v1/chat/completions", {**CHAT, "model": "b"}
    )

    assert 200 == status
    assert body["id"].startswith("chatcmpl-")
    assert ("chat.completion", "b") == (body["object"], body["model"])
    choice = body["choices"][0]
    assert ("assistant", "length", None) == (
        choice["message"]["role"],
        choice["finish_reason"],
        choice["stop_reason"],
    )
    assert 5 == body["usage"]["completion_tokens"]
    assert body["usage"]["prompt_tokens"] + 5 == body["usage"]["total_tokens"]


async def test_vllm_stream_has_role_chunk_tokens_finish_usage_and_done(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """vLLM streams a role chunk, a chunk per token (the last with finish_reason), usage, [DONE]."""
    engine = await sim_engine("vllm", "--model", "m")
    request = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}

    status, events = await post_json(http, engine.base_url + "/v1/chat/completions", request)
    _, whole = await post_json(http, engine.base_url + "/v1/chat/completions", CHAT)

    assert 200 == status
    assert "[DONE]" == events[-1]
    assert {"role": "assistant", "content": ""} == events[0]["choices"][0]["delta"]
    token_chunks = events[1:-2]
    assert 5 == len(token_chunks)
    assert [None] * 4 + ["length"] == [c["choices"][0]["finish_reason"] for c in token_chunks]
    assert ([], 5) == (events[-2]["choices"], events[-2]["usage"]["completion_tokens"])
    assert whole["choices"][0]["message"]["content"] == chat_text(events)


async def test_vllm_unknown_model_is_404_not_found(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """vLLM answers 404 NotFoundError for a model it does not serve."""
    engine = await sim_engine("vllm", "--model", "m", "--served-model-name", "a")

    status, body = await post_json(
        http, engine.base_url + "/v1/chat/completions", {**CHAT, "model": "zzz"}
    )

    assert (404, "NotFoundError", "model") == (
        status,
        body["error"]["type"],
        body["error"]["param"],
    )
    assert "zzz" in body["error"]["message"]


async def test_bad_json_is_400_for_vllm_and_500_for_llamacpp(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """Unparseable JSON: vLLM answers 400, llama-server 500 server_error (as measured)."""
    vllm = await sim_engine("vllm", "--model", "m")
    llama = await sim_engine("llamacpp", "-m", "/m/tiny.gguf")

    results = []
    for engine in (vllm, llama):
        async with http.post(
            engine.base_url + "/v1/chat/completions",
            data=b"{not json",
            headers={"Content-Type": "application/json"},
        ) as response:
            results.append((response.status, (await response.json())["error"]["type"]))

    assert [(400, "BadRequestError"), (500, "server_error")] == results


async def test_llamacpp_n_above_one_is_refused_with_400(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """The simulated llama.cpp returns one choice per request and says so for n > 1."""
    engine = await sim_engine("llamacpp", "-m", "m")

    status, body = await post_json(http, engine.base_url + "/v1/chat/completions", {**CHAT, "n": 2})

    assert 400 == status
    assert "n=2" in body["error"]["message"]


async def test_vllm_n_above_one_returns_n_choices(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """Like real vLLM (tests/real_vllm/test_differential.py): n choices, usage over all of them."""
    engine = await sim_engine("vllm", "--model", "m")
    url = engine.base_url + "/v1/chat/completions"

    status, body = await post_json(http, url, {**CHAT, "n": 3, "max_tokens": 4, "ignore_eos": True})
    _, events = await post_json(
        http,
        url,
        {**CHAT, "n": 2, "max_tokens": 4, "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip

    assert 200 == status
    assert [0, 1, 2] == [choice["index"] for choice in body["choices"]]
    assert 12 == body["usage"]["completion_tokens"]
    finishes = [
        (event["choices"][0]["index"], event["choices"][0]["finish_reason"])
        for event in events[:-2]
        if event["choices"][0]["finish_reason"] is not None
    ]
    assert [(0, "length"), (1, "length")] == sorted(finishes)
    assert 8 == events[-2]["usage"]["completion_tokens"]
    assert "[DONE]" == events[-1]


async def test_vllm_context_overflow_is_400(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """A prompt plus max_tokens beyond --max-model-len is a 400 naming the limit.

    max_tokens stays under the limit by itself: above it, vLLM 0.32 answers
    "max_tokens=... cannot be greater than max_model_len=..." first.
    """
    engine = await sim_engine("vllm", "--model", "m", "--max-model-len", "64")

    status, body = await post_json(
        http, engine.base_url + "/v1/chat/completions", {**CHAT, "max_tokens": 60}
    )

    assert 400 == status
    assert "maximum context length is 64 tokens" in body["error"]["message"]


async def test_llamacpp_context_overflow_is_exceed_context_size_error(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """A prompt longer than a slot's context is llama-server's exceed_context_size_error."""
    engine = await sim_engine("llamacpp", "-m", "/m/t.gguf", "-c", "128", "-np", "2")
    long_chat = {"messages": [{"role": "user", "content": "hi " * 100}]}

    status, body = await post_json(http, engine.base_url + "/v1/chat/completions", long_chat)

    assert 400 == status
    assert ("exceed_context_size_error", 64) == (body["error"]["type"], body["error"]["n_ctx"])


async def test_vllm_completions_default_to_16_tokens(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """A completion without max_tokens stops at 16 tokens, the OpenAI default vLLM keeps."""
    engine = await sim_engine("vllm", "--model", "m", "--sim-output-tokens", "500")

    status, body = await post_json(http, engine.base_url + "/v1/completions", {"prompt": "x"})

    assert (200, "text_completion", 16, "length") == (
        status,
        body["object"],
        body["usage"]["completion_tokens"],
        body["choices"][0]["finish_reason"],
    )


async def test_llamacpp_reports_its_alias_whatever_model_is_asked(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """llama-server ignores the request's model and reports its (first, sorted) alias."""
    engine = await sim_engine("llamacpp", "-m", "/m/t.gguf", "-a", "zeta,alpha")

    status, body = await post_json(
        http, engine.base_url + "/v1/chat/completions", {**CHAT, "model": "nonsense"}
    )
    async with http.get(engine.base_url + "/v1/models") as response:
        models = await response.json()

    assert (200, "alpha") == (status, body["model"])
    assert ("alpha", ["alpha", "zeta"]) == (models["data"][0]["id"], models["data"][0]["aliases"])


async def test_llamacpp_chat_reply_has_usage_and_timings(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """A non-streamed llama.cpp reply carries usage with cached tokens and llama's timings."""
    engine = await sim_engine("llamacpp", "-m", "/m/t.gguf")

    _, body = await post_json(http, engine.base_url + "/v1/chat/completions", CHAT)

    assert {"cached_tokens": 0} == body["usage"]["prompt_tokens_details"]
    timings = body["timings"]
    assert (body["usage"]["prompt_tokens"], 5) == (timings["prompt_n"], timings["predicted_n"])
    assert timings["predicted_ms"] > 0


async def test_llamacpp_stream_ends_with_finish_chunk_usage_timings_and_done(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """llama.cpp streams role, tokens, an empty-delta finish chunk, usage with timings, [DONE]."""
    engine = await sim_engine("llamacpp", "-m", "/m/t.gguf")
    request = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}

    _, events = await post_json(http, engine.base_url + "/v1/chat/completions", request)

    assert {"role": "assistant", "content": None} == events[0]["choices"][0]["delta"]
    assert [None] * 5 == [e["choices"][0]["finish_reason"] for e in events[1:6]]
    assert ({}, "length") == (
        events[6]["choices"][0]["delta"],
        events[6]["choices"][0]["finish_reason"],
    )
    assert ([], 5) == (events[7]["choices"], events[7]["usage"]["completion_tokens"])
    assert "timings" in events[7]
    assert "[DONE]" == events[8]


async def test_llamacpp_metrics_need_the_metrics_flag(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """Without --metrics llama-server's /metrics is 501 not_supported_error."""
    engine = await sim_engine("llamacpp", "-m", "/m/t.gguf")

    async with http.get(engine.base_url + "/metrics") as response:
        status, body = response.status, await response.json()

    assert (501, "not_supported_error") == (status, body["error"]["type"])


async def test_llamacpp_slots_show_busy_slots_and_fail_on_no_slot(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """/slots marks busy slots; with every slot busy, ?fail_on_no_slot=1 is 503."""
    engine = await sim_engine(
        "llamacpp", "-m", "/m/t.gguf", "-np", "2", "--sim-step-seconds", "0.05"
    )
    url = engine.base_url
    async with http.get(url + "/slots?fail_on_no_slot=1") as response:
        idle_status = response.status

    long = {**CHAT, "max_tokens": 40}
    streams = [
        asyncio.create_task(post_json(http, url + "/v1/chat/completions", long)) for _ in range(3)
    ]

    async def both_slots_busy() -> list[dict[str, object]] | None:
        async with http.get(url + "/slots") as response:
            slots: list[dict[str, object]] = await response.json()
        return slots if all(slot["is_processing"] for slot in slots) else None

    slots = await eventually(both_slots_busy, timeout_s=10, what="both slots processing")
    async with http.get(url + "/slots?fail_on_no_slot=1") as response:
        busy_status, busy_body = response.status, await response.json()
    async with http.get(url + "/props") as response:
        props = await response.json()
    for stream in streams:
        stream.cancel()
    await asyncio.gather(*streams, return_exceptions=True)

    assert 200 == idle_status
    assert [True, True] == [slot["is_processing"] for slot in slots]
    assert (503, "no slot available") == (busy_status, busy_body["error"]["message"])
    assert 2 == props["total_slots"]


async def test_llamacpp_no_slots_flag_makes_slots_501(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """--no-slots turns /slots off like llama-server (501)."""
    engine = await sim_engine("llamacpp", "-m", "/m/t.gguf", "--no-slots")

    async with http.get(engine.base_url + "/slots") as response:
        assert 501 == response.status


async def test_unknown_routes_answer_like_each_engine(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """An unknown path: FastAPI's {"detail"} for vLLM, llama-server's File Not Found."""
    vllm = await sim_engine("vllm", "--model", "m")
    llama = await sim_engine("llamacpp", "-m", "m")

    async with http.get(vllm.base_url + "/nope") as response:
        vllm_answer = (response.status, await response.json())
    async with http.get(llama.base_url + "/nope") as response:
        llama_answer = (response.status, await response.json())

    assert (404, {"detail": "Not Found"}) == vllm_answer
    assert (404, "File Not Found") == (llama_answer[0], llama_answer[1]["error"]["message"])


async def test_stop_string_ends_the_reply_before_it(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """A stop string cuts the reply right before it, with finish_reason "stop"."""
    engine = await sim_engine("vllm", "--model", "m")
    _, whole = await post_json(http, engine.base_url + "/v1/chat/completions", CHAT)
    text = whole["choices"][0]["message"]["content"]
    stop = text.split()[2]

    _, cut = await post_json(
        http, engine.base_url + "/v1/chat/completions", {**CHAT, "stop": [stop]}
    )

    assert (text[: text.find(stop)], "stop") == (
        cut["choices"][0]["message"]["content"],
        cut["choices"][0]["finish_reason"],
    )


async def test_failure_rate_one_answers_500_before_any_byte(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """With --sim-failure-rate 1 every request is an HTTP 500 in the engine's error shape."""
    engine = await sim_engine("vllm", "--model", "m", "--sim-failure-rate", "1")

    status, body = await post_json(
        http, engine.base_url + "/v1/chat/completions", {**CHAT, "stream": True}
    )

    assert (500, "InternalServerError") == (status, body["error"]["type"])


async def test_disconnect_rate_one_drops_the_stream_before_done(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """With --sim-disconnect-rate 1 a stream breaks after some tokens and never sends [DONE]."""
    engine = await sim_engine("vllm", "--model", "m", "--sim-disconnect-rate", "1")
    received: list[bytes] = []

    async def read_stream() -> None:
        async with http.post(
            engine.base_url + "/v1/chat/completions", json={**CHAT, "stream": True}
        ) as response:
            async for line in response.content:
                # One by one: what arrived before the drop must survive the error.
                received.append(line)  # noqa: PERF401

    with pytest.raises(aiohttp.ClientPayloadError):
        await read_stream()

    events = parse_sse(b"".join(received).decode())
    assert len(events) >= 2
    assert "[DONE]" not in events


async def test_hang_rate_one_never_answers_and_the_engine_stays_healthy(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """With --sim-hang-rate 1 a request never answers; health and metrics still do."""
    engine = await sim_engine("vllm", "--model", "m", "--sim-hang-rate", "1")

    started = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(0.5):
            await post_json(http, engine.base_url + "/v1/chat/completions", CHAT)
    async with http.get(engine.base_url + "/health") as response:
        health = response.status

    assert time.monotonic() - started >= 0.5
    assert 200 == health


async def test_environment_knobs_configure_the_engine_without_flags(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """CARAVAN_SIM_* variables set the knobs a rendered job's args cannot."""
    engine = await sim_engine("vllm", "--model", "m", env={"CARAVAN_SIM_FAILURE_RATE": "1"})

    status, _ = await post_json(http, engine.base_url + "/v1/chat/completions", CHAT)

    assert 500 == status
