"""Builders of observed worlds for planner tests, and a tiny simulated Nomad."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from caravan_llm.common.nomad_api import Allocation, Node
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.plan import (
    Action,
    ClearDrainMarker,
    Deregister,
    PlanSettings,
    Register,
    Replace,
    StartDrain,
    drain_record_for,
    plan,
)
from caravan_llm.scheduler.profiles import ModelProfile
from caravan_llm.scheduler.render import spec_hash
from caravan_llm.scheduler.world import (
    DesiredModel,
    DrainRecord,
    Observation,
    ObservedReplica,
    PlannerMemory,
)

NS = 1_000_000_000
NOW = 1_000_000.0


def nodes(*names: str, down: tuple[str, ...] = ()) -> dict[str, Node]:
    return {n: Node(id=n, name=n, status="down" if n in down else "ready") for n in names}


def alloc(
    node: str, status: str = "running", *, at: float = NOW - 100, healthy: bool | None = True
) -> Allocation:
    return Allocation(
        id=f"alloc-{node}-{at}",
        node_id=node,
        client_status=status,
        desired_status="run" if status in {"running", "pending"} else "stop",
        deployment_healthy=healthy,
        create_time_ns=int(at * NS),
        modify_time_ns=int(at * NS),
    )


def replica(
    profile: ModelProfile,
    index: int,
    *allocs: Allocation,
    outdated: bool = False,
    passing: bool | None = True,
    inflight: float | None = None,
    submitted: float = NOW - 200,
) -> ObservedReplica:
    return ObservedReplica(
        job_id=f"caravan-{profile.name}-{index}",
        model=profile.name,
        replica=index,
        spec_hash="old" if outdated else spec_hash(profile, index),
        job_status="running",
        stopped=False,
        submit_time_ns=int(submitted * NS),
        allocs=allocs,
        passing=passing,
        inflight=inflight,
    )


def world(
    *replicas: ObservedReplica,
    node_map: dict[str, Node] | None = None,
    draining: dict[str, DrainRecord] | None = None,
) -> Observation:
    return Observation(
        replicas={r.job_id: r for r in replicas},
        nodes=node_map if node_map is not None else nodes("n1", "n2", "n3"),
        draining=draining or {},
        taken_at=NOW,
    )


def desired(*pairs: tuple[ModelProfile, int]) -> dict[str, DesiredModel]:
    return {p.name: DesiredModel(profile=p, count=c) for p, c in pairs}


def run_plan(
    want: dict[str, DesiredModel],
    seen: Observation,
    memory: PlannerMemory | None = None,
    now: float = NOW,
    settings: PlanSettings | None = None,
):
    return plan(
        want,
        seen,
        memory or PlannerMemory(),
        config=ClusterConfig(),
        settings=settings or PlanSettings(),
        now=now,
    )


class SimulatedNomad:
    """Applies plan actions to an Observation the way Nomad + Consul would, instantly.

    New replicas land on the up node with the fewest caravan allocations that
    is not in the job's anti-affinity set when possible, and are at once
    running and passing.
    """

    def __init__(self, observation: Observation) -> None:
        self.observation = observation
        self._ids = itertools.count()

    def _place(self, body: dict[str, Any]) -> str:
        job = body["Job"]
        avoid: set[str] = set()
        for affinity in job.get("Affinities", []):
            avoid |= set(affinity["RTarget"].split(","))
        load = {n: 0 for n, v in self.observation.nodes.items() if v.ready}
        for r in self.observation.replicas.values():
            for a in r.live_allocs():
                if a.node_id in load:
                    load[a.node_id] += 1
        return min(load, key=lambda n: (n in avoid, load[n], n))

    def apply(self, actions: tuple[Action, ...], now: float) -> None:
        replicas = dict(self.observation.replicas)
        draining = dict(self.observation.draining)
        for action in actions:
            match action:
                case Register() | Replace():
                    job = action.body["Job"]
                    node = self._place(action.body)
                    replicas[action.job_id] = ObservedReplica(
                        job_id=action.job_id,
                        model=action.model,
                        replica=action.replica,
                        spec_hash=job["Meta"]["caravan_spec_hash"],
                        job_status="running",
                        stopped=False,
                        submit_time_ns=int(now * NS),
                        allocs=(replace(alloc(node, at=now), id=f"a{next(self._ids)}"),),
                        passing=True,
                    )
                    self.observation = replace(self.observation, replicas=replicas)
                case StartDrain():
                    draining[action.job_id] = drain_record_for(action, now)
                case Deregister():
                    replicas.pop(action.job_id, None)
                case ClearDrainMarker():
                    draining.pop(action.job_id, None)
        self.observation = replace(
            self.observation, replicas=replicas, draining=draining, taken_at=now
        )
