"""What the scheduler publishes as placed: live allocations of its replica jobs, with their port."""

from __future__ import annotations

from caravan.contract import PlacedAllocation, Placements
from caravan.nomad_api import AllocatedPort
from scheduler.controller import placements_of
from scheduler.world import ObservedAlloc, ObservedReplica

RUNNING = "00000000-0000-4000-8000-000000000001"
PENDING = "00000000-0000-4000-8000-000000000002"
STOPPED = "00000000-0000-4000-8000-000000000003"
NO_PORT = "00000000-0000-4000-8000-000000000004"


def alloc(alloc_id: str, client: str = "running", desired: str = "run") -> ObservedAlloc:
    return ObservedAlloc(alloc_id, "node-1", client, desired, None, 0, 0)


def replica(job_id: str, model: str, *allocs: ObservedAlloc) -> ObservedReplica:
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


def port(value: int) -> AllocatedPort:
    return AllocatedPort(label="http", value=value, to=0, host_ip="10.0.0.7")


def test_live_allocations_with_a_port_are_placed_and_nothing_else() -> None:
    """Running and pending allocations count; stopped ones and ones without a port do not."""
    replicas = {
        "caravan-a-0": replica(
            "caravan-a-0",
            "a",
            alloc(RUNNING),
            alloc(STOPPED, client="complete", desired="stop"),
        ),
        "caravan-a-1": replica("caravan-a-1", "a", alloc(PENDING, client="pending")),
        "caravan-b-0": replica("caravan-b-0", "b", alloc(NO_PORT)),
    }
    ports = {RUNNING: port(2001), PENDING: port(2002), STOPPED: port(2003)}

    assert {
        "a": Placements(
            model="a",
            allocations=(
                PlacedAllocation(
                    alloc_id=RUNNING, job_id="caravan-a-0", address="10.0.0.7", port=2001
                ),
                PlacedAllocation(
                    alloc_id=PENDING, job_id="caravan-a-1", address="10.0.0.7", port=2002
                ),
            ),
        ),
        "b": Placements(model="b", allocations=()),
    } == placements_of(replicas, ports)
