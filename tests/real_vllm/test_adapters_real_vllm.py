"""LoRA adapters as models of their own, on the real vLLM (issue 25's acceptance, CPU build).

One stack for the module: devcluster with real vLLM replicas, a scheduler and a
router; one model of two real replicas with LoRA on (`max_loras: 2`, so four
adapter slots). Its adapters are tiny peft-format adapters made by
`caravan_llm.devcluster.tiny_lora` in the module's folder (host paths, which
the real engine reads as a node would). The tests run in order on it:

1. three adapters and a bad one (missing path): each good one is loaded
   somewhere, `caravan status` says where, each answers through the official
   `openai` client with text other than the base model's at temperature 0,
   the bad one is reported with vLLM's reason and answers an OpenAI-shaped 503;
2. one removed from the profile is unloaded from every replica by one reconcile;
3. five adapters for four slots: the plan places one per replica and leaves the
   other slot to routers, so some are held nowhere, and a request for one is
   answered (the router loads it on demand) with the load time in the request log;
4. a simulated vLLM with the same LoRA flags answers the adapter routes, model
   cards and `vllm:lora_requests_info` as a real replica does.

Timings are CPU timings on a loaded 2-core machine: nothing here asserts a speed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from polling import eventually
from standalone import simulated_vllm_server

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_stack
from caravan_llm.common.contract import KVLayout, model_service_name
from caravan_llm.devcluster.tiny_lora import TinyLora, write_adapter
from caravan_llm.devcluster.vllm_build import VllmBuild
from caravan_llm.router.settings import RouterSettings
from caravan_llm.scheduler.engine_keys import EngineKeys
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.profiles import ModelProfile

pytestmark = pytest.mark.asyncio(loop_scope="module")

NAME = "tiny-lora"
READY_S = 300
# Loads, unloads and plan passes on real engines (each load reads the adapter from disk).
SETTLE_S = 90
GOOD = ("sql", "chat", "poet")
LATER = ("d-four", "e-five", "f-six")
BAD = "broken"
MESSAGES = [{"role": "user", "content": "Say hello to the caravan."}]


def vllm_profile(adapters: list[dict[str, Any]]) -> ModelProfile:
    return ModelProfile.model_validate(
        {
            "name": NAME,
            # A hub id, as a user's profile names one; devcluster runs the tiny model in its place.
            "model": "caravan-tests/tiny-chat",
            "served_model_name": NAME,
            "engine": "vllm",
            "gpu": {"class": "h100", "count": 1},
            "replicas": {"min": 2, "max": 2, "initial": 2},
            "resources": {"cpu_mhz": 1000, "memory_mb": 4096},
            "max_concurrency": 4,
            "context_length": 2048,
            "startup_timeout_s": READY_S,
            "drain_s": 1,
            "adapters": adapters,
            "lora": {"max_loras": 2, "max_lora_rank": 8},
        }
    )


@dataclass(slots=True)
class Fleet:
    stack: LocalStack
    folder: Path
    lines: list[dict[str, Any]] = field(default_factory=list)

    def adapter(self, name: str) -> dict[str, Any]:
        return {"name": name, "source": str(self.folder / name), "rank": 8}

    async def submit(self, names: tuple[str, ...], *, bad: bool) -> None:
        adapters = [self.adapter(n) for n in names]
        if bad:
            adapters.append({"name": BAD, "source": str(self.folder / "missing")})
        store = ModelStore(self.stack.scheduler.consul, KVLayout())
        await store.submit([vllm_profile(adapters)])

    @property
    def client(self) -> openai.AsyncOpenAI:
        router = self.stack.router
        assert router is not None
        return openai.AsyncOpenAI(
            base_url=f"{router.base_url}/v1", api_key=router.api_key, max_retries=0
        )

    async def answer(self, model: str) -> str:
        """The text the model answers at temperature 0, through the router."""
        async with self.client as client:
            reply = await client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=8, temperature=0
            )
        assert model == reply.model
        return reply.choices[0].message.content or ""

    async def status(self) -> dict[str, Any]:
        """`caravan status NAME --json`, as an operator runs it."""
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "caravan_llm.cli", "status", NAME, "--json",
            env=dict(self.stack.env),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), 120)
        assert 0 == process.returncode, err.decode()[-2000:]
        document: dict[str, Any] = json.loads(out)
        return document

    async def engines(self) -> list[str]:
        """Base URLs of the model's passing replicas."""
        _, entries = await self.stack.scheduler.consul.health_service(
            model_service_name(NAME), passing=True
        )
        return [f"http://{e.service_address or e.node_address}:{e.port}" for e in entries]

    async def listed(self) -> list[set[str]]:
        """The adapters each replica's vLLM lists in /v1/models (entries with a parent)."""
        key = await EngineKeys(self.stack.scheduler.nomad).model_key(NAME)
        held = []
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            for url in await self.engines():
                async with http.get(f"{url}/v1/models") as response:
                    cards = (await response.json())["data"]
                assert {NAME} == {c["parent"] for c in cards if c["parent"] is not None} | {NAME}
                held.append({c["id"] for c in cards if c["parent"] is not None})
        return held


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet(
    vllm_build: VllmBuild, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Fleet]:
    assert vllm_build.python.is_file()
    work = tmp_path_factory.mktemp("real-vllm-adapters")
    folder = work / "loras"
    for seed, name in enumerate((*GOOD, *LATER), start=1):
        write_adapter(folder / name, TinyLora(seed=seed))
    lines: list[dict[str, Any]] = []
    (work / "stack").mkdir()
    options = StackOptions(
        cpu_nodes=1,
        gpu_nodes=2,
        gpus_per_node=1,
        vllm_engine="real",
        prefer_real_llama_server=False,
        autoscale=False,
        resync_s=1.0,
        work_dir=work / "stack",
        # The router reports no adapter demand while the module runs: demand moves copies
        # between replicas, and a request routed to a copy the scheduler is unloading gets
        # the engine's 404 (a known race, not what these tests are about).
        router=RouterSettings(
            port=0, scrape_interval_s=0.5, log_level="warning", adapter_demand_interval_s=3600
        ),
        request_log=lines.append,
    )
    # The router writes its canonical line per request (request_log) at info.
    proxy_log = logging.getLogger("router.proxy")
    level = proxy_log.level
    proxy_log.setLevel(logging.INFO)
    try:
        async with local_stack(options) as stack:
            found = Fleet(stack=stack, folder=folder, lines=lines)
            await found.submit(GOOD, bad=True)
            yield found
    finally:
        proxy_log.setLevel(level)


async def test_three_adapters_load_answer_with_their_own_text_and_a_bad_one_is_reported(
    fleet: Fleet,
) -> None:
    """Each good adapter is loaded somewhere and `caravan status` says where; each answers
    through the openai client with text unlike the base model's at temperature 0; the bad one
    is in the status with vLLM's reason, and a request for it gets an OpenAI-shaped 503."""

    async def settled() -> dict[str, Any] | None:
        status = await fleet.status()
        replicas = [r for r in status["replicas"] if r["state"] == "ready"]
        failed = (status.get("adapters") or {}).get("failed") or []
        loaded = [set(r.get("adapters_loaded") or ()) for r in replicas]
        if len(replicas) != 2 or not failed or set().union(*loaded) != set(GOOD):
            return None
        return status

    status = await eventually(settled, READY_S + SETTLE_S, "three adapters loaded, one failed")
    where = {
        name: sorted(r["replica"] for r in status["replicas"] if name in r["adapters_loaded"])
        for name in GOOD
    }
    assert all(where.values()), where
    assert all(len(r["adapters_loaded"]) <= 2 for r in status["replicas"])
    assert [(BAD, str(fleet.folder / "missing"))] == [
        (f["adapter"], f["source"]) for f in status["adapters"]["failed"]
    ]
    assert status["adapters"]["failed"][0]["reason"].startswith(
        f"HTTP 404: Loading lora {BAD} failed: No adapter found for "
    )
    engines_hold = await fleet.listed()
    assert set(GOOD) == set().union(*engines_hold)

    base = await fleet.answer(NAME)
    texts = {name: await fleet.answer(name) for name in GOOD}
    assert [] == [name for name, text in texts.items() if text == base], (base, texts)
    assert texts == {name: await fleet.answer(name) for name in GOOD}

    with pytest.raises(openai.APIStatusError) as refused:
        await fleet.answer(BAD)
    error = refused.value.body
    assert isinstance(error, dict)
    assert (503, "adapter_unavailable") == (refused.value.status_code, error.get("code"))
    assert f"'{BAD}'" in str(error.get("message"))
    assert "No adapter found" in str(error.get("message"))
    assert texts == {name: await fleet.answer(name) for name in GOOD}


async def test_the_models_list_names_each_adapter_with_its_parent(fleet: Fleet) -> None:
    """The router's /v1/models lists the profile's adapters with the base model as parent."""
    async with fleet.client as client:
        cards = {m.id: m.model_dump() for m in (await client.models.list()).data}
    assert dict.fromkeys((*GOOD, BAD), NAME) == {n: cards[n].get("parent") for n in (*GOOD, BAD)}


async def test_an_adapter_removed_from_the_profile_is_unloaded_everywhere_in_one_pass(
    fleet: Fleet,
) -> None:
    """After the profile drops an adapter, one reconcile pass unloads it from every replica."""
    dropped = GOOD[-1]
    await fleet.submit(GOOD[:-1], bad=False)
    await fleet.stack.scheduler.controller.reconcile_once()

    held = await fleet.listed()
    assert [] == [names for names in held if dropped in names]
    assert set(GOOD[:-1]) <= set().union(*held)


async def test_an_adapter_held_nowhere_is_loaded_on_demand_with_the_time_logged(
    fleet: Fleet,
) -> None:
    """Five adapters for four slots leave some held nowhere (the plan keeps a slot per
    replica for routers' loads); a request for one is answered with no error, and its line
    in the request log carries the load time."""
    names = (*GOOD[:-1], *LATER)
    await fleet.submit(names, bad=False)

    async def held_nowhere() -> str | None:
        status = await fleet.status()
        replicas = [r for r in status["replicas"] if r["state"] == "ready"]
        loaded = [set(r.get("adapters_loaded") or ()) for r in replicas]
        desired = [set(r.get("adapters_desired") or ()) for r in replicas]
        applied = all(want <= held for want, held in zip(desired, loaded, strict=True))
        if len(replicas) != 2 or not applied:
            return None
        nowhere = sorted(set(names) - set().union(*loaded) - set().union(*await fleet.listed()))
        return nowhere[0] if nowhere else None

    async def loaded_on_demand() -> tuple[str, dict[str, Any]] | None:
        """Ask for an adapter held nowhere: every answer must be a success; the first whose
        adapter the router loaded itself is the proof (under load the scheduler's next pass
        may place the adapter between the look and the request: then ask again)."""
        unplaced = await held_nowhere()
        if unplaced is None:
            return None
        assert await fleet.answer(unplaced)
        line = [entry for entry in fleet.lines if entry.get("model") == unplaced][-1]
        assert 200 == line.get("status")
        return (unplaced, line) if line.get("adapter_load_s") is not None else None

    unplaced, line = await eventually(loaded_on_demand, SETTLE_S, "an adapter loaded on demand")

    assert (unplaced, True) == (line["model"], line["adapter_load_s"] > 0)


async def probe_adapter_routes(
    base_url: str, key: str, held: str, source: str, missing: str
) -> dict[str, Any]:
    """What an engine answers on the adapter routes, for probes that change nothing it holds:
    status, content type and JSON body of each, its adapter cards' fields, the LoRA metric."""
    answers: dict[str, Any] = {}
    probes = {
        "load held": ("/v1/load_lora_adapter", {"lora_name": held, "lora_path": source}),
        "load missing": ("/v1/load_lora_adapter", {"lora_name": "nope", "lora_path": missing}),
        "load no path": ("/v1/load_lora_adapter", {"lora_name": "nope"}),
        "unload unknown": ("/v1/unload_lora_adapter", {"lora_name": "nope"}),
        "unload no name": ("/v1/unload_lora_adapter", {}),
    }
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
        for name, (path, body) in probes.items():
            async with http.post(base_url + path, json=body) as response:
                answers[name] = (response.status, response.content_type, await response.json())
        async with http.get(f"{base_url}/v1/models") as response:
            cards = (await response.json())["data"]
        (card,) = [c for c in cards if c["id"] == held]
        answers["card"] = (sorted(card), card["root"], card["parent"] is not None)
        async with http.get(f"{base_url}/metrics") as response:
            metrics = await response.text()
    info = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
    labels = {tuple(sorted(p.split("=")[0] for p in line.split("{")[1].split("}")[0].split(",")))
              for line in info}  # fmt: skip
    answers["lora_requests_info labels"] = labels
    answers["max_lora"] = {line.split('max_lora="')[1].split('"')[0] for line in info}
    return answers


async def test_the_simulated_vllm_answers_the_adapter_routes_as_the_real_one(
    fleet: Fleet, vllm_build: VllmBuild
) -> None:
    """A simulated vLLM with the replicas' LoRA flags and key answers the same statuses,
    content types, bodies, model cards and LoRA metric labels as a real replica."""
    key = await EngineKeys(fleet.stack.scheduler.nomad).model_key(NAME)
    url = (await fleet.engines())[0]
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http,
        http.get(f"{url}/v1/models") as response,
    ):
        held = min(c["id"] for c in (await response.json())["data"] if c["parent"] is not None)
    source = str(fleet.folder / held)
    missing = str(fleet.folder / "missing")
    real = await probe_adapter_routes(url, key, held, source, missing)
    flags = ["--api-key", key, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    async with simulated_vllm_server(vllm_build, extra_args=flags, env=env) as sim_url:
        async with (
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http,
            http.post(
                f"{sim_url}/v1/load_lora_adapter", json={"lora_name": held, "lora_path": source}
            ) as loaded,
        ):
            assert 200 == loaded.status
        simulated = await probe_adapter_routes(sim_url, key, held, source, missing)

    assert real == simulated
