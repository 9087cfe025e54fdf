"""The simulated vLLM's LoRA adapters: the flags, the runtime routes, models, requests, metric.

What vLLM 0.32 does (vllm/entrypoints/openai/models/serving.py and
serve/lora/api_router.py; docs at devcluster/engine/lora.py), the simulator does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import aiohttp
import polling
import pytest
from engine_test_support import StartEngine, post_json

from caravan_llm.devcluster.engine.flags import FlagError, parse_engine_args
from caravan_llm.scheduler.engines.vllm import VLLM_ADAPTERS
from caravan_llm.scheduler.lora.apply import AdapterApiError, AdapterTarget, HttpAdapterApi

RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
LORA = ("--model", "base", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")


def make_adapter(folder: Path, rank: int = 8) -> str:
    """A folder with a peft adapter_config.json, as vLLM reads it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    return str(folder)


async def load(http: aiohttp.ClientSession, base: str, name: str, path: str) -> tuple[int, Any]:
    async with http.post(
        f"{base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
    ) as response:
        return response.status, await response.text()


async def unload(http: aiohttp.ClientSession, base: str, name: str) -> tuple[int, Any]:
    async with http.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": name}) as response:
        return response.status, await response.text()


async def models(http: aiohttp.ClientSession, base: str) -> list[tuple[str, Any, Any]]:
    async with http.get(f"{base}/v1/models") as response:
        document = await response.json()
    return [(m["id"], m["parent"], m["root"]) for m in document["data"]]


async def completion(http: aiohttp.ClientSession, base: str, model: str) -> tuple[int, Any]:
    body = {"model": model, "prompt": "hello there", "max_tokens": 8, "temperature": 0}
    return await post_json(http, f"{base}/v1/completions", body)


async def test_a_loaded_adapter_is_a_model_with_its_parent(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Loading answers vLLM's success text; the adapter is listed with `parent` and its path."""
    engine = await sim_engine("vllm", *LORA, env=RUNTIME)
    path = make_adapter(tmp_path / "sql")
    assert (200, "Success: LoRA adapter 'sql' added successfully.") == await load(
        http, engine.base_url, "sql", path
    )
    assert [("base", None, "base"), ("sql", "base", path)] == await models(http, engine.base_url)


async def test_an_adapter_answers_with_text_of_its_own(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """`model=<adapter>` is served, echoes the adapter's name, and its text differs from the
    base model's, the same each time."""
    engine = await sim_engine("vllm", *LORA, env=RUNTIME)
    await load(http, engine.base_url, "sql", make_adapter(tmp_path / "sql"))
    status, base = await completion(http, engine.base_url, "base")
    status_a, first = await completion(http, engine.base_url, "sql")
    _, second = await completion(http, engine.base_url, "sql")
    assert (200, 200, "sql") == (status, status_a, first["model"])
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert base["choices"][0]["text"] != first["choices"][0]["text"]


async def test_a_missing_path_is_404_and_the_others_keep_serving(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """A path with no adapter answers vLLM's 404 NotFoundError, the path masked as vLLM 0.32
    masks paths in every error message (measured on the real build); a loaded adapter still
    serves."""
    engine = await sim_engine("vllm", *LORA, env=RUNTIME)
    await load(http, engine.base_url, "sql", make_adapter(tmp_path / "sql"))
    status, text = await load(http, engine.base_url, "bad", str(tmp_path / "missing"))
    assert 404 == status
    assert {
        "error": {
            "message": "Loading lora bad failed: No adapter found for <path>",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    } == json.loads(text)
    assert 200 == (await completion(http, engine.base_url, "sql"))[0]
    assert 404 == (await completion(http, engine.base_url, "bad"))[0]


async def test_a_second_load_of_a_name_is_400(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Loading a loaded name again is vLLM's 400 InvalidUserInput."""
    engine = await sim_engine("vllm", *LORA, env=RUNTIME)
    path = make_adapter(tmp_path / "sql")
    await load(http, engine.base_url, "sql", path)
    status, text = await load(http, engine.base_url, "sql", path)
    error = json.loads(text)["error"]
    assert (400, "InvalidUserInput") == (status, error["type"])
    assert error["message"].startswith("The lora adapter 'sql' has already been loaded.")


async def test_unload_removes_the_model_and_unknown_is_404(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Unloading answers vLLM's text; the adapter is gone; unloading it again is 404."""
    engine = await sim_engine("vllm", *LORA, env=RUNTIME)
    await load(http, engine.base_url, "sql", make_adapter(tmp_path / "sql"))
    assert (200, "Success: LoRA adapter 'sql' removed successfully.") == await unload(
        http, engine.base_url, "sql"
    )
    assert [("base", None, "base")] == await models(http, engine.base_url)
    status, text = await unload(http, engine.base_url, "sql")
    assert (404, "The lora adapter 'sql' cannot be found.") == (
        status,
        json.loads(text)["error"]["message"],
    )


async def test_loads_beyond_max_loras_succeed(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """vLLM keeps adapters beyond --max-loras in its CPU cache: the third load succeeds."""
    engine = await sim_engine("vllm", *LORA, env=RUNTIME)
    statuses = [
        (await load(http, engine.base_url, n, make_adapter(tmp_path / n)))[0]
        for n in ("a", "b", "c")
    ]
    assert [200, 200, 200] == statuses


async def test_a_rank_above_the_limit_is_refused(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """An adapter whose rank is above --max-lora-rank is refused with vLLM's message (the
    worker's, as the real build words it)."""
    engine = await sim_engine("vllm", *LORA, env=RUNTIME)
    status, text = await load(http, engine.base_url, "big", make_adapter(tmp_path / "b", 16))
    expected = (
        "Call to add_lora method failed: Worker failed with error 'LoRA rank 16 is greater "
        "than max_lora_rank 8.', please check the stack trace above for the root cause"
    )
    assert (500, expected) == (status, json.loads(text)["error"]["message"])


async def test_a_load_without_its_path_is_fastapis_400(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """A load body without `lora_path` is refused by request validation, as vLLM's FastAPI
    app words it (measured on the real build)."""
    engine = await sim_engine("vllm", *LORA, env=RUNTIME)
    async with http.post(
        f"{engine.base_url}/v1/load_lora_adapter", json={"lora_name": "x"}
    ) as response:
        status, error = response.status, (await response.json())["error"]
    assert (
        400,
        {
            "message": "1 validation error:\n  {'type': 'missing', 'loc': 'body.lora_path', "
            "'msg': 'Field required', 'input': '<dict of 1 items>'}",
            "type": "Bad Request",
            "param": "body.lora_path",
            "code": 400,
        },
    ) == (status, error)


async def test_a_successful_load_has_no_content_type(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """vLLM answers a load with a bare body, which a client reads as application/octet-stream."""
    engine = await sim_engine("vllm", *LORA, env=RUNTIME)
    body = {"lora_name": "sql", "lora_path": make_adapter(tmp_path / "sql")}
    async with http.post(f"{engine.base_url}/v1/load_lora_adapter", json=body) as response:
        assert (200, "application/octet-stream") == (response.status, response.content_type)


async def test_without_runtime_updating_the_routes_do_not_exist(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING the load route is FastAPI's 404."""
    engine = await sim_engine("vllm", *LORA)
    status, text = await load(http, engine.base_url, "sql", make_adapter(tmp_path / "sql"))
    assert (404, {"detail": "Not Found"}) == (status, json.loads(text))


async def test_lora_modules_are_loaded_at_start(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """`--lora-modules name=path` (and its JSON form) are listed and served from the start."""
    one, two = make_adapter(tmp_path / "one"), make_adapter(tmp_path / "two")
    engine = await sim_engine(
        "vllm",
        *LORA,
        "--lora-modules",
        f"one={one}",
        json.dumps({"name": "two", "path": two}),
    )
    assert [("base", None, "base"), ("one", "base", one), ("two", "base", two)] == await models(
        http, engine.base_url
    )


async def test_the_lora_metric_names_running_adapters(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """`vllm:lora_requests_info` carries max_lora and the adapters of running requests."""
    engine = await sim_engine("vllm", *LORA, "--sim-step-seconds", "0.05", env=RUNTIME)
    await load(http, engine.base_url, "sql", make_adapter(tmp_path / "sql"))
    running = (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""}'
    )
    body = {"model": "sql", "prompt": "hi", "max_tokens": 100, "ignore_eos": True}
    request = asyncio.create_task(post_json(http, f"{engine.base_url}/v1/completions", body))

    async def metric_names_it() -> bool:
        async with http.get(f"{engine.base_url}/metrics") as response:
            return running in await response.text()

    try:
        assert await polling.eventually(metric_names_it, 10, "the running adapter in /metrics")
    finally:
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request


def test_lora_modules_need_enable_lora() -> None:
    """--lora-modules without --enable-lora is refused, as vLLM refuses it."""
    with pytest.raises(FlagError, match="add --enable-lora"):
        parse_engine_args(["--flavor", "vllm", "--model", "m", "--lora-modules", "a=/x"], {})


def test_max_lora_rank_takes_vllms_values_only() -> None:
    """--max-lora-rank outside vLLM's list is an argparse error (exit 2)."""
    with pytest.raises(SystemExit):
        parse_engine_args(["--flavor", "vllm", "--model", "m", "--max-lora-rank", "12"], {})


async def test_the_schedulers_load_of_an_adapter_already_held_counts_as_loaded(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """A router loaded the adapter between the scheduler's list and its load: vLLM's 400
    "already been loaded" means it is held, so the scheduler records no failure; another
    refusal (a bad path) still raises with the engine's answer."""
    engine = await sim_engine("vllm", *LORA, env=RUNTIME)
    path = make_adapter(tmp_path / "sql")
    await load(http, engine.base_url, "sql", path)
    api = HttpAdapterApi(http)
    target = AdapterTarget(
        model="m", job_id="j", alloc_id="a", base_url=engine.base_url, api=VLLM_ADAPTERS.api
    )

    await api.load(target, "sql", path)
    with pytest.raises(AdapterApiError) as refused:
        await api.load(target, "bad", str(tmp_path / "missing"))

    assert {"sql": path} == await api.loaded(target)
    assert refused.value.reason.startswith("HTTP 404: Loading lora bad failed")
