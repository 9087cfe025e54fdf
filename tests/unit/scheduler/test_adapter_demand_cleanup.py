"""Adapter-demand records of routers that went away are deleted, not kept forever."""

from __future__ import annotations

from test_placements_of import MemoryKV

from caravan_llm.common.contract import AdapterDemandRecord, KVLayout, encode_adapter_demand
from caravan_llm.scheduler.lora.plan import DEMAND_FORGET_AFTER_S, forgotten_demand
from caravan_llm.scheduler.model_store import ModelStore

NOW = 1_000_000.0


def record(at: float, router: str = "") -> bytes:
    return encode_adapter_demand(
        AdapterDemandRecord(at=at, router=router, requests_per_s={"sql": 1.0})
    ).encode()


async def test_a_record_older_than_the_forget_age_is_deleted_and_a_fresh_one_stays() -> None:
    """The key names the router (even when the record does not); only the old key goes."""
    layout = KVLayout()
    gone = layout.adapter_demand_key("qwen", "router-gone")
    alive = layout.adapter_demand_key("qwen", "router-alive")
    kv = MemoryKV({gone: record(NOW - DEMAND_FORGET_AFTER_S - 1), alive: record(NOW - 5)})
    store = ModelStore(kv, layout)  # type: ignore[arg-type]
    desired = await store.read()
    stale = forgotten_demand(desired.adapter_demand, NOW)
    assert [("qwen", "router-gone")] == stale
    for model, router in stale:
        await store.forget_adapter_demand(model, router)
    assert [alive] == sorted(kv.data)
