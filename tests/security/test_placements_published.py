"""The scheduler publishes what it placed: the proof routers check services against.

On the local stack (devcluster's Nomad and Consul, a scheduler): once a
model's replicas run, `caravan/placements/<model>` lists exactly the live
allocations of its replica jobs, at the address and port Nomad allocated, and
every service Nomad registered for them matches (Nomad's service ID, address,
port, node), so the router's verification accepts the real replicas. When the model
is deleted and its replicas are gone, the document goes too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from polling import eventually

from caravan_llm.cli.local_stack import StackOptions, local_profile, local_stack
from caravan_llm.common.contract import (
    JOB_PREFIX,
    KVLayout,
    Placements,
    decode_placements,
    model_service_name,
    nomad_service_id,
)
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.profiles import load_profile

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_placements_list_the_live_allocations_and_match_nomads_services(
    tmp_path: Path,
) -> None:
    """Placements equal Nomad's live allocations; Nomad's services match them; deletion clears."""
    options = StackOptions(
        prefer_real_llama_server=False, gpu_nodes=0, autoscale=False, work_dir=tmp_path
    )
    async with local_stack(options) as stack:
        consul, nomad = stack.scheduler.consul, stack.scheduler.nomad
        base = load_profile(ROOT / "examples/profiles/tiny-llamacpp-cpu.yaml")
        profile = base.model_copy(
            update={
                "replicas": base.replicas.model_copy(update={"initial": 2}),
                "drain_s": 0,
            }
        )
        store = ModelStore(consul, LAYOUT)
        await store.submit([local_profile(profile, stack.engine)])
        service = model_service_name(profile.name)
        key = LAYOUT.placements_key(profile.name)

        async def placements() -> Placements | None:
            _, entry = await consul.kv_get(key)
            if entry is None:
                return None
            return decode_placements(entry.value, key=key, model=profile.name)

        async def settled() -> bool:
            _, passing = await consul.health_service(service, passing=True)
            document = await placements()
            return len(passing) == 2 and document is not None and len(document.allocations) == 2

        await eventually(settled, 90, "2 passing replicas and their placements")
        document = await placements()
        assert document is not None
        live = {
            alloc.id: alloc
            for alloc in (await nomad.list_allocations(resources=True)).value
            if alloc.job_id.startswith(JOB_PREFIX) and alloc.live
        }
        _, entries = await consul.health_service(service, passing=True)

        assert set(live) == {placed.alloc_id for placed in document.allocations}
        for placed in document.allocations:
            assert (live[placed.alloc_id].job_id, live[placed.alloc_id].node_name) == (
                placed.job_id,
                placed.node,
            )
            (port,) = [p for p in live[placed.alloc_id].ports or () if p.label == "http"]
            assert (port.host_ip, port.value) == (placed.address, placed.port)
        assert {
            (
                nomad_service_id(placed.alloc_id, profile.name),
                placed.address,
                placed.port,
                placed.node,
            )
            for placed in document.allocations
        } == {
            (entry.service_id, entry.service_address, entry.port, entry.node) for entry in entries
        }

        await store.delete(profile.name)

        async def cleared() -> bool:
            return await placements() is None

        await eventually(cleared, 90, "the placements of the deleted model to go")
