"""The simulated llama.cpp engine answers like the real llama-server, field by field.

Both are started from the same rendered command line and sent the same
requests; their bodies must have the same structure (keys, nesting, kinds of
values) and agree on every value that does not depend on the model's text or
tokenizer. Needs the real server (scripts/build-llama-server.sh).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from engine_test_support import (
    LLAMA_SERVER_MISSING,
    StartEngine,
    exposition_types,
    free_port,
    json_shape,
    llama_server_process,
    parse_sse,
    rendered_llama_server_command,
    wait_healthy,
)

from caravan_llm.common.engine_metrics import parse_engine_load
from caravan_llm.devcluster.llama_server_build import find_llama_server
from caravan_llm.scheduler.engines.llamacpp import LLAMACPP_METRIC_NAMES

pytestmark = [pytest.mark.llamacpp]

BUILD = find_llama_server()
if BUILD is None:
    pytest.skip(LLAMA_SERVER_MISSING, allow_module_level=True)

MESSAGES = [{"role": "user", "content": "hi there"}]
# Every generation is greedy and ignores EOS, so its length is max_tokens on both
# sides. llama-server's /v1/messages route drops ignore_eos; sampled at its default
# temperature, the tiny model ended 4 answers in 60 on an end-of-generation token.
DETERMINISTIC = {"ignore_eos": True, "temperature": 0}


@dataclass(frozen=True)
class Pair:
    real: str
    sim: str


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=60)
    ) as client:
        yield client


@pytest.fixture
async def pair(sim_engine: StartEngine, session: aiohttp.ClientSession) -> AsyncIterator[Pair]:
    """The real server and the simulator, both from the rendered job's command line."""
    assert BUILD is not None
    port = free_port()
    command = rendered_llama_server_command(BUILD.binary, BUILD.model, port=port)
    sim_args = [
        arg for arg in command[1:] if arg not in {"--host", "--port", "127.0.0.1", str(port)}
    ]
    sim = await sim_engine("llamacpp", *sim_args)
    async with llama_server_process(command):
        real = f"http://127.0.0.1:{port}"
        await wait_healthy(session, real)
        yield Pair(real=real, sim=sim.base_url)


async def both(
    session: aiohttp.ClientSession, pair: Pair, method: str, path: str, body: Any = None
) -> tuple[tuple[int, Any], tuple[int, Any]]:
    """(status, decoded body) from the real server and from the simulator."""
    answers = []
    for base in (pair.real, pair.sim):
        kwargs: dict[str, Any] = {}
        if isinstance(body, bytes):
            kwargs = {"data": body, "headers": {"Content-Type": "application/json"}}
        elif body is not None:
            kwargs = {"json": body}
        async with session.request(method, base + path, **kwargs) as response:
            text = await response.text()
            if response.content_type == "text/event-stream":
                answers.append((response.status, parse_sse(text)))
            elif response.content_type == "application/json":
                answers.append((response.status, await response.json()))
            else:
                answers.append((response.status, text))
    return answers[0], answers[1]


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/slots"])
async def test_plain_endpoints_have_the_same_structure(
    path: str, pair: Pair, session: aiohttp.ClientSession
) -> None:
    """/health, /v1/models and /slots have llama-server's structure and key values."""
    (real_status, real), (sim_status, sim) = await both(session, pair, "GET", path)

    assert real_status == sim_status
    assert json_shape(real) == json_shape(sim)
    if path == "/v1/models":
        assert (real["data"][0]["id"], real["data"][0]["aliases"]) == (
            sim["data"][0]["id"],
            sim["data"][0]["aliases"],
        )
        assert real["data"][0]["meta"]["n_ctx"] == sim["data"][0]["meta"]["n_ctx"]
    if path == "/slots":
        assert real == sim


async def test_props_have_the_same_top_level_fields_and_slot_facts(
    pair: Pair, session: aiohttp.ClientSession
) -> None:
    """/props has llama-server's fields, the same slot count, alias and context."""
    (_, real), (_, sim) = await both(session, pair, "GET", "/props")

    assert sorted(real) == sorted(sim)
    assert (
        real["total_slots"],
        real["model_alias"],
        real["default_generation_settings"]["n_ctx"],
        real["endpoint_metrics"],
        real["endpoint_slots"],
    ) == (
        sim["total_slots"],
        sim["model_alias"],
        sim["default_generation_settings"]["n_ctx"],
        sim["endpoint_metrics"],
        sim["endpoint_slots"],
    )


REQUESTS = {
    "chat": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
    "chat-stream": (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 4, "stream": True},
    ),
    "chat-stream-usage": (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "completion": ("/v1/completions", {"prompt": "hi there", "max_tokens": 3}),
    "completion-stream": (
        "/v1/completions",
        {"prompt": "hi there", "max_tokens": 3, "stream": True},
    ),
}


def facts(answer: Any) -> Any:
    """What must agree between the two whatever the model: objects, finish reasons, counts."""
    if isinstance(answer, list):
        return [facts(event) for event in answer]
    if not isinstance(answer, dict):
        return answer
    return {
        "object": answer.get("object"),
        "model": answer.get("model"),
        "id_prefix": answer.get("id", "")[:9],
        "finish": [c.get("finish_reason") for c in answer.get("choices", [])],
        "roles": [c.get("delta", c.get("message", {})).get("role") for c in answer["choices"]],
        "completion_tokens": (answer.get("usage") or {}).get("completion_tokens"),
        "predicted_n": (answer.get("timings") or {}).get("predicted_n"),
    }


@pytest.mark.parametrize("case", sorted(REQUESTS))
async def test_generation_answers_have_the_same_structure_and_facts(
    case: str, pair: Pair, session: aiohttp.ClientSession
) -> None:
    """Chat and completion answers, streamed or not: same keys, kinds, and model-free values."""
    path, body = REQUESTS[case]
    request = {**body, **DETERMINISTIC}

    (real_status, real), (sim_status, sim) = await both(session, pair, "POST", path, request)

    assert 200 == real_status == sim_status
    assert json_shape(real) == json_shape(sim)
    assert facts(real) == facts(sim)


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_continued_assistant_message_is_echoed_as_llama_server_does(
    explicit: bool, stream: bool, pair: Pair, session: aiohttp.ClientSession
) -> None:
    """Continuations repeat the partial text exactly when the real server does."""
    partial = "Partial answer"
    request: dict[str, Any] = {
        "messages": [*MESSAGES, {"role": "assistant", "content": partial}],
        "max_tokens": 3,
        "stream": stream,
        **DETERMINISTIC,
    }
    if explicit:
        request |= {"continue_final_message": True, "add_generation_prompt": False}

    (_, real), (_, sim) = await both(session, pair, "POST", "/v1/chat/completions", request)

    def echoed(answer: Any) -> bool:
        if isinstance(answer, list):
            first = next(
                e["choices"][0]["delta"]["content"]
                for e in answer
                if isinstance(e, dict) and e["choices"] and e["choices"][0]["delta"].get("content")
            )
            return bool(first.startswith(partial))
        return bool(answer["choices"][0]["message"]["content"].startswith(partial))

    assert echoed(real) == echoed(sim)
    assert json_shape(real) == json_shape(sim)


ERRORS = {
    "bad-json": (b"{not json", ("status", "type")),
    "messages-not-array": ({"messages": "x"}, ("status", "type", "message")),
    "continue-and-generation-prompt": (
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": "a"}],
            "continue_final_message": True,
        },
        ("status", "type", "message"),
    ),
    "context-exceeded": (
        {"messages": [{"role": "user", "content": "hi " * 3000}]},
        ("status", "type", "keys", "n_ctx"),
    ),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
async def test_errors_have_the_same_status_type_and_message(
    case: str, pair: Pair, session: aiohttp.ClientSession
) -> None:
    """Bad requests fail with llama-server's status, error type and (where fixed) message."""
    body, compared = ERRORS[case]

    answers = await both(session, pair, "POST", "/v1/chat/completions", body)

    def view(answer: tuple[int, Any]) -> dict[str, Any]:
        status, payload = answer
        error = payload["error"]
        every = {
            "status": status,
            "type": error["type"],
            "message": error["message"],
            "keys": sorted(error),
            "n_ctx": error.get("n_ctx"),
        }
        return {name: every[name] for name in compared}

    assert view(answers[0]) == view(answers[1])


async def test_an_unknown_route_is_the_same_404(pair: Pair, session: aiohttp.ClientSession) -> None:
    """An unknown path answers llama-server's own 404 body."""
    (real_status, real), (sim_status, sim) = await both(session, pair, "GET", "/no/such/path")

    assert (real_status, real) == (sim_status, sim)


async def test_metrics_have_the_same_names_types_and_order_and_parse_alike(
    pair: Pair, session: aiohttp.ClientSession
) -> None:
    """After the same traffic, /metrics lists the same metrics, and caravan reads both."""
    await both(
        session, pair, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}
    )
    texts = []
    for base in (pair.real, pair.sim):
        async with session.get(base + "/metrics") as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            texts.append(await response.text())

    assert list(exposition_types(texts[0]).items()) == list(exposition_types(texts[1]).items())
    real_load = parse_engine_load(texts[0], LLAMACPP_METRIC_NAMES)
    sim_load = parse_engine_load(texts[1], LLAMACPP_METRIC_NAMES)
    assert real_load == sim_load


TYPED_REQUESTS = {
    "responses": ("/v1/responses", {"input": "hi there", "max_output_tokens": 3}),
    "responses-stream": (
        "/v1/responses",
        {"input": "hi there", "max_output_tokens": 3, "stream": True},
    ),
    "messages": ("/v1/messages", {"messages": MESSAGES, "max_tokens": 3}),
    "messages-stream": ("/v1/messages", {"messages": MESSAGES, "max_tokens": 3, "stream": True}),
    "messages-count-tokens": ("/v1/messages/count_tokens", {"messages": MESSAGES}),
    "tokenize": ("/tokenize", {"content": "hello world"}),
    "tokenize-pieces": ("/tokenize", {"content": "hello world", "with_pieces": True}),
    "detokenize": ("/detokenize", {"tokens": [1, 2]}),
    "embeddings-without-flag": ("/v1/embeddings", {"input": "hi"}),
    "rerank-without-flag": ("/v1/rerank", {"query": "a", "documents": ["b", "c"]}),
    "no-such-route": ("/v1/score", {"text_1": "a", "text_2": "b"}),
}


def typed_facts(answer: Any) -> Any:
    """What must agree on the other routes: object kinds, statuses, event types, error types."""
    if isinstance(answer, list):
        return [typed_facts(event) for event in answer]
    if not isinstance(answer, dict):
        return answer
    error = answer.get("error")
    return {
        "object": answer.get("object"),
        "type": answer.get("type"),
        "status": answer.get("status"),
        "stop_reason": answer.get("stop_reason"),
        "error": (error.get("type"), error.get("code")) if isinstance(error, dict) else None,
    }


@pytest.mark.parametrize("case", sorted(TYPED_REQUESTS))
async def test_other_routes_have_the_same_structure_and_facts(
    case: str, pair: Pair, session: aiohttp.ClientSession
) -> None:
    """Responses, Anthropic messages, tokenize and the 501/404 answers match llama-server's."""
    path, body = TYPED_REQUESTS[case]
    request = {"model": "tiny", **body, **DETERMINISTIC}

    (real_status, real), (sim_status, sim) = await both(session, pair, "POST", path, request)

    def shapes(answer: Any) -> Any:
        # Every kind of event of a stream in order, not only the first (a run of
        # deltas is one: how many tokens come depends on the model).
        if not isinstance(answer, list):
            return json_shape(answer)
        kinds = [json_shape(event) for event in answer]
        return [kind for i, kind in enumerate(kinds) if i == 0 or kind != kinds[i - 1]]

    def event_types(events: list[Any]) -> list[Any]:
        # Stream events: the same types in the same order, a run of deltas as one.
        kinds = [event.get("type") for event in events if isinstance(event, dict)]
        return [kind for i, kind in enumerate(kinds) if i == 0 or kind != kinds[i - 1]]

    assert real_status == sim_status
    assert shapes(real) == shapes(sim)
    if isinstance(real, list):
        assert event_types(real) == event_types(sim)
    else:
        assert typed_facts(real) == typed_facts(sim)
