"""`caravan router --workers N`: each worker writes its demand signals under its own key,
so that the scheduler's sum counts every worker's requests (not only the last writer's)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from caravan_llm.common.contract import KVLayout
from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.wiring.app import RUNTIME, create_app


class RegisteringConsul:
    """Takes the router's registration; nothing else is asked of it here."""

    async def agent_service_register(self, *_: Any, **__: Any) -> None:
        return None


async def test_each_worker_names_its_demand_keys_and_registering_keeps_them() -> None:
    """Worker 1 and worker 2 on one port write two adapter-demand keys and two cold-start
    demand ids, before and after they register in Consul (which sets the service id)."""
    names = []
    for index in (1, 2):
        settings = RouterSettings(port=8080, register_service=True)
        app = create_app(settings, consul=RegisteringConsul(), registry=CollectorRegistry())  # type: ignore[arg-type]
        runtime = app[RUNTIME]
        runtime.set_worker(index)
        await runtime.register(8080)
        names.append(
            (
                runtime.demand.router_id,
                KVLayout().adapter_demand_key("qwen", runtime.adapter_demand.router_id),
            )
        )
    service = names[0][0].removesuffix("-worker-1")
    assert [
        (f"{service}-worker-1", f"caravan/adapter-demand/qwen/{service}-worker-1"),
        (f"{service}-worker-2", f"caravan/adapter-demand/qwen/{service}-worker-2"),
    ] == names
