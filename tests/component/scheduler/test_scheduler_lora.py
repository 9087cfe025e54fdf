"""LoRA adapters on devcluster: the scheduler loads them as planned on simulated vLLMs,
reports a bad one with the engine's reason, and unloads a removed one in one pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
from conftest import eventually, example, store_of, submit

from caravan_llm.cli.local_stack import LocalStack
from caravan_llm.common.contract import model_service_name
from caravan_llm.scheduler.engine_keys import EngineKeys
from caravan_llm.scheduler.profiles import ModelProfile
from caravan_llm.scheduler.status import StatusReader

MODEL = "qwen2-5-7b"
GOOD = ("sql", "chat", "code")


def adapter_folder(root: Path, name: str) -> str:
    folder = root / "loras" / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    return str(folder)


def lora_profile(root: Path, names: tuple[str, ...], *, bad: bool) -> ModelProfile:
    adapters: list[dict[str, Any]] = [
        {"name": n, "source": str(root / "loras" / n), "rank": 8} for n in names
    ]
    if bad:
        adapters.append({"name": "broken", "source": str(root / "loras" / "missing")})
    return example(
        "qwen-vllm-h100.yaml",
        drain_s=1,
        autoscaling=None,
        adapters=adapters,
        lora={"max_loras": 2, "max_lora_rank": 8},
    )


async def engines(stack: LocalStack) -> list[str]:
    """Base URLs of the model's passing replicas."""
    _, entries = await stack.scheduler.consul.health_service(
        model_service_name(MODEL), passing=True
    )
    return [f"http://{e.address}:{e.port}" for e in entries]


async def listed(http: aiohttp.ClientSession, url: str, key: str) -> set[str]:
    """The adapters an engine lists (entries with a parent), asked with the engine key."""
    headers = {"Authorization": f"Bearer {key}"}
    async with http.get(f"{url}/v1/models", headers=headers) as response:
        document = await response.json()
    return {m["id"] for m in document["data"] if m["parent"] is not None}


async def test_adapters_are_loaded_as_planned_a_bad_one_is_reported_and_removal_unloads(
    stack: LocalStack, tmp_path: Path
) -> None:
    """Three adapters are loaded on two replicas of two slots (each somewhere, none over the
    limit), a missing path is reported with vLLM's reason while the others answer, and an
    adapter removed from the profile is unloaded everywhere by one reconcile pass."""
    for name in GOOD:
        adapter_folder(tmp_path, name)
    await submit(stack, lora_profile(tmp_path, GOOD, bad=True))
    reader = StatusReader(
        store=store_of(stack), nomad=stack.scheduler.nomad, health=stack.scheduler.consul
    )

    async def planned() -> Any:
        status = await reader.model(MODEL)
        replicas = [r for r in status.replicas if r.state == "ready"]
        if len(replicas) != 2 or status.adapters is None or not status.adapters["failed"]:
            return None
        loaded = [set(r.adapters_loaded or ()) for r in replicas]
        if set().union(*loaded) != set(GOOD) or any(
            set(r.adapters_loaded or ()) != set(r.adapters_desired or ()) for r in replicas
        ):
            return None
        return status

    status = await eventually(planned, timeout_s=90)
    assert all(len(r.adapters_loaded or ()) <= 2 for r in status.replicas)
    failure = status.adapters["failed"][0]
    assert ("broken", str(tmp_path / "loras" / "missing")) == (
        failure["adapter"],
        failure["source"],
    )
    assert failure["reason"] == (
        # vLLM masks paths in its error messages; the source is in the failure's own field.
        "HTTP 404: Loading lora broken failed: No adapter found for <path>"
    )

    key = await EngineKeys(stack.scheduler.nomad).model_key(MODEL)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        holders = {url: await listed(http, url, key) for url in await engines(stack)}
        for adapter in GOOD:
            url = next(u for u, held in holders.items() if adapter in held)
            body = {"model": adapter, "prompt": "hello", "max_tokens": 4}
            async with http.post(f"{url}/v1/completions", json=body, headers=headers) as answer:
                assert (200, adapter) == (answer.status, (await answer.json())["model"])
        async with http.post(
            f"{next(iter(holders))}/v1/completions",
            json={"model": "broken", "prompt": "hello", "max_tokens": 4},
            headers=headers,
        ) as answer:
            assert 404 == answer.status

        await submit(stack, lora_profile(tmp_path, GOOD[:2], bad=False))
        await stack.scheduler.controller.reconcile_once()
        after = [await listed(http, url, key) for url in await engines(stack)]
    assert all("code" not in held for held in after)
    assert set(GOOD[:2]) == set().union(*after)


async def test_the_lora_example_runs_as_it_is(stack: LocalStack) -> None:
    """The example profile's adapter folders exist on devcluster's nodes: all three load."""
    await submit(stack, example("qwen-vllm-h100-lora.yaml"))
    reader = StatusReader(
        store=store_of(stack), nomad=stack.scheduler.nomad, health=stack.scheduler.consul
    )

    async def all_loaded() -> set[str] | None:
        status = await reader.model("qwen-lora")
        loaded = {a for r in status.replicas for a in r.adapters_loaded or ()}
        return loaded if len(loaded) == 3 else None

    assert {"qwen-sql", "qwen-support", "qwen-poet"} == await eventually(all_loaded, timeout_s=90)
