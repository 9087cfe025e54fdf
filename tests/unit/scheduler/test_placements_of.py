"""What the scheduler publishes as placed: live allocations of its replica jobs, with their port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from caravan_llm.common.consul_api import KVEntry
from caravan_llm.common.contract import (
    KVLayout,
    PlacedAllocation,
    Placements,
    decode_placements,
    encode_placements,
)
from caravan_llm.common.errors import HashiUnavailable
from caravan_llm.common.nomad_api import AllocatedPort, Allocation
from caravan_llm.scheduler.metrics import SchedulerMetrics
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.observe import alloc_engine
from caravan_llm.scheduler.publish import Publisher, placements_of
from caravan_llm.scheduler.world import AllocEngine, ObservedReplica

RUNNING = "00000000-0000-4000-8000-000000000001"
PENDING = "00000000-0000-4000-8000-000000000002"
STOPPED = "00000000-0000-4000-8000-000000000003"
NO_PORT = "00000000-0000-4000-8000-000000000004"


def alloc(alloc_id: str, client: str = "running", desired: str = "run") -> Allocation:
    return Allocation(alloc_id, node_id="node-1", client_status=client, desired_status=desired)


def replica(job_id: str, model: str, *allocs: Allocation) -> ObservedReplica:
    return ObservedReplica(
        job_id=job_id,
        model=model,
        replica=int(job_id.rsplit("-", 1)[1]),
        spec_hash="h",
        job_status="running",
        stopped=False,
        submit_time_ns=0,
        allocs=allocs,
    )


def port(value: int) -> AllocEngine:
    return AllocEngine(AllocatedPort(label="http", value=value, to=0, host_ip="10.0.0.7"), "n1")


def test_live_allocations_with_a_port_are_placed_and_nothing_else() -> None:
    """Running and pending allocations count; stopped, portless or malformed ones do not."""
    replicas = {
        "caravan-a-0": replica(
            "caravan-a-0",
            "a",
            alloc(RUNNING),
            alloc(STOPPED, client="complete", desired="stop"),
        ),
        "caravan-a-1": replica("caravan-a-1", "a", alloc(PENDING, client="pending")),
        "caravan-b-0": replica("caravan-b-0", "b", alloc(NO_PORT)),
        "caravan-x-0": replica("caravan-x-0", "Not A Model!", alloc("not-a-uuid")),
        "caravan-c-0": replica("caravan-c-0", "c", alloc("not-a-uuid")),
    }
    ports = {
        RUNNING: port(2001),
        PENDING: port(2002),
        STOPPED: port(2003),
        "not-a-uuid": port(2004),
    }

    assert {
        "a": Placements(
            model="a",
            allocations=(
                PlacedAllocation(
                    alloc_id=RUNNING, job_id="caravan-a-0", address="10.0.0.7", port=2001, node="n1"
                ),
                PlacedAllocation(
                    alloc_id=PENDING, job_id="caravan-a-1", address="10.0.0.7", port=2002, node="n1"
                ),
            ),
        ),
        "b": Placements(model="b", allocations=()),
        "c": Placements(model="c", allocations=()),
    } == placements_of(replicas, ports)


def allocation_with(*ports: AllocatedPort) -> Allocation:
    return Allocation(RUNNING, node_name="n1", ports=ports)


def test_the_kv_relays_port_is_placed_with_the_engines() -> None:
    """An allocation's `kv` port at the engine's address is published as its kv_port."""
    http = AllocatedPort(label="http", value=2001, to=8000, host_ip="10.0.0.7")
    kv = AllocatedPort(label="kv", value=2002, to=8101, host_ip="10.0.0.7")
    engine = alloc_engine(allocation_with(http, kv))
    assert AllocEngine(http, "n1", 2002) == engine
    replicas = {"caravan-a-0": replica("caravan-a-0", "a", alloc(RUNNING))}
    assert (
        PlacedAllocation(
            alloc_id=RUNNING,
            job_id="caravan-a-0",
            address="10.0.0.7",
            port=2001,
            node="n1",
            kv_port=2002,
        ),
    ) == placements_of(replicas, {RUNNING: engine})["a"].allocations


def test_a_kv_port_elsewhere_than_the_engine_is_not_believed() -> None:
    """Routers trust a relay only at the engine's address: a kv port on another IP is left out."""
    http = AllocatedPort(label="http", value=2001, to=8000, host_ip="10.0.0.7")
    kv = AllocatedPort(label="kv", value=2002, to=8101, host_ip="10.0.0.8")
    assert AllocEngine(http, "n1", None) == alloc_engine(allocation_with(http, kv))
    assert alloc_engine(allocation_with(kv)) is None


class MemoryKV:
    """Consul KV in a dict, counting writes; `fail` makes every call raise HashiUnavailable."""

    def __init__(self, data: dict[str, bytes] | None = None) -> None:
        self.data = dict(data or {})
        self.writes = 0
        self.fail = False

    def _check(self) -> None:
        if self.fail:
            raise HashiUnavailable("consul down")

    async def kv_get_recurse(
        self, prefix: str, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, tuple[KVEntry, ...]]:
        self._check()
        entries = tuple(
            KVEntry(key, value, 0, None, 0, 1, 1)
            for key, value in sorted(self.data.items())
            if key.startswith(prefix)
        )
        return 1, entries

    async def kv_get(
        self, key: str, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, KVEntry | None]:
        self._check()
        value = self.data.get(key)
        return 1, None if value is None else KVEntry(key, value, 0, None, 0, 1, 1)

    async def kv_put(self, key: str, value: bytes | str, **_: object) -> bool:
        self._check()
        self.writes += 1
        self.data[key] = value.encode() if isinstance(value, str) else value
        return True

    async def kv_delete(self, key: str, **_: object) -> bool:
        self._check()
        self.writes += 1
        self.data.pop(key, None)
        return True


def controller_on(kv: MemoryKV) -> Publisher:
    """What a reconcile pass publishes with (scheduler/publish.py)."""
    return Publisher(
        store=ModelStore(kv, KVLayout()), metrics=SchedulerMetrics.create(CollectorRegistry())
    )


def placed(model: str, *alloc_ids: str) -> Placements:
    return Placements(
        model=model,
        allocations=tuple(
            PlacedAllocation(alloc_id=a, job_id=f"caravan-{model}-0", address="10.0.0.7", port=2001)
            for a in alloc_ids
        ),
    )


async def test_publish_writes_changes_only_and_clears_models_that_are_gone() -> None:
    """Unchanged placements are not rewritten; a stale document of a gone model is deleted."""
    stale = encode_placements(placed("gone", RUNNING)).encode()
    kv = MemoryKV({"caravan/placements/gone": stale})
    controller = controller_on(kv)

    await controller.publish_placements({"a": placed("a", RUNNING)})
    after_first = dict(kv.data)
    writes = kv.writes
    await controller.publish_placements({"a": placed("a", RUNNING)})
    unchanged_writes = kv.writes - writes
    await controller.publish_placements({"a": placed("a", RUNNING, PENDING)})

    assert {"caravan/placements/a": encode_placements(placed("a", RUNNING)).encode()} == after_first
    assert 0 == unchanged_writes
    assert placed("a", RUNNING, PENDING) == decode_placements(
        kv.data["caravan/placements/a"], key="k", model="a"
    )


async def test_a_failed_write_is_retried_on_the_next_pass() -> None:
    """Consul down: nothing is remembered as written, so the next pass writes it."""
    kv = MemoryKV()
    controller = controller_on(kv)
    kv.fail = True
    await controller.publish_placements({"a": placed("a", RUNNING)})
    kv.fail = False
    await controller.publish_placements({"a": placed("a", RUNNING)})

    assert "caravan/placements/a" in kv.data
