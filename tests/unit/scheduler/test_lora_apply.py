"""The LoRA step of a pass against a fake engine API: loads, failures, removal, documents."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from profile_builders import make_vllm
from world_builders import NOW, alloc, desired, replica, world

from caravan_llm.common.contract import (
    ContractError,
    ModelAdapters,
    decode_model_adapters,
    encode_model_adapters,
)
from caravan_llm.common.errors import HashiUnavailable
from caravan_llm.common.nomad_api import AllocatedPort
from caravan_llm.scheduler.assess import assess
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.engines.base import RuntimeAdapterApi
from caravan_llm.scheduler.lora.apply import (
    AdapterApiError,
    AdapterTarget,
    HttpAdapterApi,
    LoraApplier,
)
from caravan_llm.scheduler.world import AllocEngine, Observation

SQL = {"name": "sql", "source": "/m/sql"}
CHAT = {"name": "chat", "source": "/m/chat"}
BAD = {"name": "bad", "source": "/m/missing"}
A0, A1 = (f"0000000{i}-0000-0000-0000-000000000000" for i in range(2))


@dataclass
class FakeEngines:
    """Engines by allocation id: what each holds (name -> source); `/m/missing` does not load."""

    held: dict[str, dict[str, str]] = field(default_factory=dict)
    keys: list[str | None] = field(default_factory=list)

    async def loaded(self, target: AdapterTarget) -> dict[str, str]:
        self.keys.append(target.api_key)
        return dict(self.held.setdefault(target.alloc_id, {}))

    async def load(self, target: AdapterTarget, name: str, source: str) -> None:
        if source == "/m/missing":
            raise AdapterApiError(f"HTTP 404: Loading lora {name} failed: No adapter found")
        self.held[target.alloc_id][name] = source

    async def unload(self, target: AdapterTarget, name: str) -> None:
        del self.held[target.alloc_id][name]


def two_ready_replicas(profile: Any) -> Observation:
    ids = (A0, A1)
    replicas = [replica(profile, i, replace(alloc(f"n{i + 1}"), id=ids[i])) for i in range(2)]
    seen = world(*replicas)
    engines = {
        ids[i]: AllocEngine(AllocatedPort("http", 20000 + i, 8000, "10.0.0.1"), f"n{i + 1}")
        for i in range(2)
    }
    return replace(seen, engines=engines, health={A0: "passing", A1: "passing"})


async def run(applier: LoraApplier, profile: Any, seen: Observation) -> ModelAdapters:
    models = desired((profile, 2))
    documents = await applier.reconcile(models, seen, assess(models, seen, ClusterConfig(), NOW))
    return documents[profile.name]


def applier_with(engines: FakeEngines, clock: list[float]) -> LoraApplier:
    async def key(model: str) -> str:
        return f"key-of-{model}"

    def factory(session: aiohttp.ClientSession) -> FakeEngines:
        del session
        return engines

    return LoraApplier(engine_key=key, api_factory=factory, clock=lambda: clock[0])


async def test_adapters_are_loaded_as_planned_with_the_engine_key() -> None:
    """Each adapter lands on a replica, none over max_loras, asked with the model's key."""
    profile = make_vllm(adapters=[SQL, CHAT], lora={"max_loras": 1})
    engines, clock = FakeEngines(), [NOW]
    document = await run(applier_with(engines, clock), profile, two_ready_replicas(profile))
    assert {A0: {"chat": "/m/chat"}, A1: {"sql": "/m/sql"}} == engines.held
    assert [(A0, ("chat",), ("chat",)), (A1, ("sql",), ("sql",))] == [
        (r.alloc_id, r.loaded, r.desired) for r in document.replicas
    ]
    assert {"key-of-qwen"} == set(engines.keys)


async def test_a_failed_load_is_recorded_and_its_slot_serves_the_others() -> None:
    """A refused load is in the document with the engine's answer; the next pass leaves it
    out, so its slot holds another adapter; after the retry time it is tried again."""
    profile = make_vllm(adapters=[BAD, SQL], lora={"max_loras": 1})
    engines, clock = FakeEngines(), [NOW]
    applier = applier_with(engines, clock)
    seen = two_ready_replicas(profile)
    first = await run(applier, profile, seen)
    assert [("bad", "HTTP 404: Loading lora bad failed: No adapter found", NOW)] == [
        (f.adapter, f.reason, f.since) for f in first.failed
    ]
    second = await run(applier, profile, seen)
    assert [("sql",), ("sql",)] == [r.loaded for r in second.replicas]
    clock[0] = NOW + 61
    third = await run(applier, profile, seen)
    assert [NOW] == [f.since for f in third.failed]


async def test_an_adapter_removed_from_the_profile_is_unloaded_everywhere() -> None:
    """One pass after the profile drops an adapter, no replica holds it."""
    engines, clock = FakeEngines(), [NOW]
    applier = applier_with(engines, clock)
    both = make_vllm(adapters=[SQL, CHAT], lora={"max_loras": 2})
    await run(applier, both, two_ready_replicas(both))
    assert all("chat" in held for held in engines.held.values())
    only_sql = make_vllm(adapters=[SQL], lora={"max_loras": 2})
    await run(applier, only_sql, two_ready_replicas(only_sql))
    assert [{"sql": "/m/sql"}, {"sql": "/m/sql"}] == list(engines.held.values())


async def test_an_adapter_loaded_from_another_source_is_loaded_again() -> None:
    """When the profile moves an adapter to another folder, replicas reload it from there."""
    engines, clock = FakeEngines(held={A0: {"sql": "/old/sql"}, A1: {}}), [NOW]
    profile = make_vllm(adapters=[SQL], lora={"max_loras": 1})
    await run(applier_with(engines, clock), profile, two_ready_replicas(profile))
    assert {A0: {"sql": "/m/sql"}, A1: {"sql": "/m/sql"}} == engines.held


async def test_a_profile_without_lora_gets_no_document() -> None:
    """Models with LoRA off are not asked anything."""
    engines, clock = FakeEngines(), [NOW]
    profile = make_vllm()
    models = desired((profile, 2))
    seen = two_ready_replicas(profile)
    documents = await applier_with(engines, clock).reconcile(
        models, seen, assess(models, seen, ClusterConfig(), NOW)
    )
    assert ({}, []) == (documents, engines.keys)


def test_the_adapters_document_round_trips_sorted() -> None:
    """The codec writes one canonical form (sorted) and reads back what it wrote."""
    document = ModelAdapters.model_validate(
        {
            "model": "qwen",
            "replicas": [
                {
                    "alloc_id": "bbbbbbbb-0000-0000-0000-000000000000",
                    "job_id": "caravan-qwen-1",
                    "loaded": ["b", "a"],
                    "desired": ["b", "a"],
                },
                {
                    "alloc_id": "aaaaaaaa-0000-0000-0000-000000000000",
                    "job_id": "caravan-qwen-0",
                    "loaded": ["c"],
                },
            ],
            "unplaced": ["z", "y"],
        }
    )
    raw = encode_model_adapters(document)
    decoded = decode_model_adapters(raw, key="caravan/adapters/qwen", model="qwen")
    assert [("caravan-qwen-0", ("c",)), ("caravan-qwen-1", ("a", "b"))] == [
        (r.job_id, r.loaded) for r in decoded.replicas
    ]
    assert ("y", "z") == decoded.unplaced
    assert ("aaaaaaaa-0000-0000-0000-000000000000",) == decoded.holders("c")
    assert raw == encode_model_adapters(decoded)


def test_a_document_under_another_models_key_is_refused() -> None:
    """The codec names the key when the document's model does not match it."""
    raw = encode_model_adapters(ModelAdapters(model="other"))
    with pytest.raises(ContractError) as refused:
        decode_model_adapters(raw, key="caravan/adapters/qwen", model="qwen")
    assert "caravan/adapters/qwen: model 'other' does not match its key" == str(refused.value)


async def test_an_unreadable_engine_key_keeps_the_last_document() -> None:
    """When Nomad Variables cannot be read, the model's last document is said again."""
    engines, clock = FakeEngines(), [NOW]
    failing = [False]

    async def key(model: str) -> str:
        if failing[0]:
            raise HashiUnavailable("nomad variables: connection refused")
        return f"key-of-{model}"

    def factory(session: aiohttp.ClientSession) -> FakeEngines:
        del session
        return engines

    applier = LoraApplier(engine_key=key, api_factory=factory, clock=lambda: clock[0])
    profile = make_vllm(adapters=[SQL], lora={"max_loras": 1})
    seen = two_ready_replicas(profile)
    first = await run(applier, profile, seen)
    failing[0] = True
    assert first == await run(applier, profile, seen)


async def test_with_more_adapters_than_slots_a_routers_copy_is_kept_and_none_go_over() -> None:
    """Five adapters on two replicas of two slots: the plan takes one slot each, a copy a
    router loaded into the other stays over the next pass, and no replica holds more than 2."""
    names = ("a", "b", "c", "d", "e")
    profile = make_vllm(
        adapters=[{"name": n, "source": f"/m/{n}"} for n in names], lora={"max_loras": 2}
    )
    engines, clock = FakeEngines(), [NOW]
    applier = applier_with(engines, clock)
    seen = two_ready_replicas(profile)
    first = await run(applier, profile, seen)
    assert [1, 1] == [len(r.desired) for r in first.replicas]
    assert 3 == len(first.unplaced)
    router_copy = first.unplaced[0]
    engines.held[A0][router_copy] = f"/m/{router_copy}"  # a router's on-demand load
    second = await run(applier, profile, seen)
    assert router_copy in engines.held[A0]
    assert first.replicas[0].desired == second.replicas[0].desired
    assert all(len(held) <= 2 for held in engines.held.values())


async def test_vllms_already_loaded_and_not_found_answers_count_as_done() -> None:
    """A load a router made since the pass read (400 "already been loaded") and an unload of
    one it unloaded since (404 "cannot be found") are successes; other refusals are not."""

    async def load(_: web.Request) -> web.Response:
        return web.json_response(
            {"error": {"message": "The lora adapter 'sql' has already been loaded."}}, status=400
        )

    async def unload(request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        message = f"The lora adapter '{name}' cannot be found."
        return web.json_response({"error": {"message": message}}, status=404 if name else 400)

    app = web.Application()
    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        api_routes = RuntimeAdapterApi(
            list_path="/v1/models",
            load_path="/v1/load_lora_adapter",
            unload_path="/v1/unload_lora_adapter",
        )
        target = AdapterTarget("qwen", "job", A0, str(server.make_url("")).rstrip("/"), api_routes)
        async with aiohttp.ClientSession() as session:
            api = HttpAdapterApi(session)
            await api.load(target, "sql", "/m/sql")
            await api.unload(target, "sql")
            with pytest.raises(AdapterApiError, match="HTTP 400"):
                await api.unload(target, "")
    finally:
        await server.close()


async def test_an_adapter_a_router_just_loaded_is_not_unloaded_under_its_request() -> None:
    """With every slot planned (max_loras 1, no slot left to routers), an adapter that
    appeared on a replica since the last pass stays for the grace time, and the planned
    one waits for its slot; after the grace the plan has its way, never above max_loras."""
    profile = make_vllm(adapters=[SQL, CHAT], lora={"max_loras": 1})
    engines, clock = FakeEngines(), [NOW]
    applier = applier_with(engines, clock)
    seen = two_ready_replicas(profile)
    await run(applier, profile, seen)
    assert {A0: {"chat": "/m/chat"}, A1: {"sql": "/m/sql"}} == engines.held
    # A router swaps A0's chat for sql (its on-demand load), just before this pass.
    engines.held[A0] = {"sql": "/m/sql"}
    clock[0] = NOW + 1
    await run(applier, profile, seen)
    assert {"sql": "/m/sql"} == engines.held[A0]
    assert {"sql": "/m/sql"} == engines.held[A1]
    clock[0] = NOW + 1 + applier.appeared_grace_s
    await run(applier, profile, seen)
    assert [1, 1] == [len(held) for held in engines.held.values()]
    assert {"chat", "sql"} == {name for held in engines.held.values() for name in held}


async def test_what_a_replica_held_when_first_read_gets_no_grace() -> None:
    """A scheduler that starts (or takes over) applies its plan at once: only adapters that
    appear between its own passes are recent."""
    profile = make_vllm(adapters=[SQL, CHAT], lora={"max_loras": 1})
    engines, clock = FakeEngines(held={A0: {"sql": "/m/sql"}, A1: {"sql": "/m/sql"}}), [NOW]
    await run(applier_with(engines, clock), profile, two_ready_replicas(profile))
    assert [1, 1] == [len(held) for held in engines.held.values()]
    assert {"chat", "sql"} == {name for held in engines.held.values() for name in held}
