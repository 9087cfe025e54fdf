"""Hypothesis strategies for (desired, observation) pairs the scheduler's pure core judges.

The worlds are small (three profiles and a deleted model, four nodes, up to
three replica jobs a model) but reach every state `assess` distinguishes:
pending, running, lost, failed and given-up allocations, down and unknown
nodes, Consul silent or failing, blocked evaluations that a freed node would
or would not place, drain markers, and a prefetch in each of its states.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from profile_builders import make_llamacpp, make_vllm

from caravan_llm.common.contract import DrainRecord
from caravan_llm.common.nomad_api import Allocation, Evaluation, Node, TaskEvent
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.profiles import ModelProfile
from caravan_llm.scheduler.render import secret_templates, spec_hash
from caravan_llm.scheduler.weights import (
    ObservedPrefetch,
    PrefetchState,
    prefetch_job_id,
    render_prefetch,
)
from caravan_llm.scheduler.world import DesiredModel, Observation, ObservedReplica

NS = 1_000_000_000
NOW = 1_000_000.0
WEIGHTS = {"volume": {"type": "host", "source": "models"}, "path": "/models", "prefetch": {}}
PROFILES: dict[str, ModelProfile] = {
    "cpu": make_llamacpp(name="cpu"),
    "gpu": make_vllm(name="gpu"),
    "cached": make_vllm(name="cached", weights=WEIGHTS),
}
# Replicas of a model whose profile was deleted.
GONE = "gone"
NODE_IDS = ("n1", "n2", "n3", "n4")

FULL = {"engine": {"NodesEvaluated": 2, "DimensionExhausted": {"cpu": 2}}}
NO_GPU = {"engine": {"NodesEvaluated": 2, "ConstraintFiltered": {"missing devices": 2}}}


def _prefetch_hash(profile: ModelProfile) -> str:
    body = render_prefetch(profile, ClusterConfig(), secret_templates(profile))
    assert body is not None
    return str(body["Job"]["Meta"]["caravan_spec_hash"])


@st.composite
def allocations(draw: st.DrawFn, job_id: str, number: int) -> Allocation:
    # Weighted towards running, so that generated worlds have ready replicas too.
    client = draw(st.sampled_from(["running"] * 3 + ["pending", "complete", "failed", "lost"]))
    desired_status = "run" if client in {"pending", "running"} else "stop"
    if client in {"pending", "running"} and draw(st.integers(0, 4)) == 0:
        desired_status = "stop"
    at = NOW - draw(st.integers(0, 400))
    events: list[TaskEvent] = [TaskEvent("Started", "Task started by client", int(at * NS))]
    if client == "failed":
        events.append(TaskEvent("Terminated", "Exit Code: 1", int(at * NS) + 1))
        if draw(st.booleans()):
            events.append(TaskEvent("Not Restarting", "Exceeded attempts", int(at * NS) + 2))
    return Allocation(
        id=f"{job_id}-alloc-{number}",
        job_id=job_id,
        node_id=draw(st.sampled_from(NODE_IDS)),
        desired_status=desired_status,
        client_status=client,
        deployment_healthy=draw(st.sampled_from([None, True, False])),
        job_version=draw(st.integers(0, 1)),
        create_time_ns=int(at * NS),
        modify_time_ns=int(at * NS),
        task_events=tuple(events),
    )


@st.composite
def evaluations(draw: st.DrawFn, job_id: str) -> tuple[Evaluation, ...]:
    found = []
    for number in range(draw(st.integers(0, 2))):
        failed: Any = draw(st.sampled_from([None, FULL, NO_GPU]))
        found.append(
            Evaluation(
                id=f"{job_id}-eval-{number}",
                job_id=job_id,
                status=draw(st.sampled_from(["blocked", "complete"])),
                failed_tg_allocs=failed or {},
                create_index=10 + number,
            )
        )
    return tuple(found)


@st.composite
def worlds(draw: st.DrawFn) -> tuple[dict[str, DesiredModel], Observation]:
    """A desired state and an observation of it, both in the shapes the scheduler reads."""
    wanted = draw(st.sets(st.sampled_from(sorted(PROFILES))))
    desired = {name: DesiredModel(PROFILES[name], draw(st.integers(0, 3))) for name in wanted}
    down = draw(st.sets(st.sampled_from(NODE_IDS[:3]), max_size=1))
    # n4 is not in Nomad's node list: an allocation on it is on an unknown node.
    nodes = {n: Node(id=n, name=n, status="down" if n in down else "ready") for n in NODE_IDS[:3]}
    replicas: dict[str, ObservedReplica] = {}
    health: dict[str, str] = {}
    evals: dict[str, tuple[Evaluation, ...]] = {}
    draining: dict[str, DrainRecord] = {}
    for model in [*sorted(PROFILES), GONE]:
        for index in sorted(draw(st.sets(st.integers(0, 3), max_size=3))):
            job_id = f"caravan-{model}-{index}"
            profile = PROFILES.get(model)
            current = profile is not None and draw(st.booleans())
            allocs = tuple(
                draw(allocations(job_id, number)) for number in range(draw(st.integers(0, 2)))
            )
            for alloc in allocs:
                status = draw(st.sampled_from([None, "passing", "passing", "warning", "critical"]))
                if status is not None:
                    health[alloc.id] = status
            states = [health[a.id] == "passing" for a in allocs if a.live and a.id in health]
            replica = ObservedReplica(
                job_id=job_id,
                model=model,
                replica=index,
                spec_hash=spec_hash(profile, index) if current and profile else "old",
                job_status=draw(st.sampled_from(["pending", "running", "dead"])),
                stopped=index == 3 and draw(st.booleans()),
                submit_time_ns=int((NOW - draw(st.integers(0, 300))) * NS),
                allocs=allocs,
                passing=any(states) if states else None,
                inflight=draw(st.none() | st.integers(0, 8).map(float)),
                version=draw(st.integers(0, 1)),
            )
            replicas[job_id] = replica
            if not replica.stopped and not replica.live_allocs():
                evals[job_id] = draw(evaluations(job_id))
            if draw(st.integers(0, 4)) == 0:
                since = NOW - draw(st.integers(0, 60))
                draining[job_id] = DrainRecord(model=model, since=since, drain_s=30.0, reason="t")
    prefetch: dict[str, ObservedPrefetch] = {}
    if draw(st.booleans()):
        cached = PROFILES["cached"]
        state = draw(st.sampled_from(list(PrefetchState)))
        prefetch["cached"] = ObservedPrefetch(
            job_id=prefetch_job_id("cached"),
            model="cached",
            spec_hash=_prefetch_hash(cached) if draw(st.booleans()) else "old",
            state=state,
            submit_time_ns=int((NOW - 30) * NS),
            failure="Exit Code: 3" if state is PrefetchState.FAILED else None,
        )
    observation = Observation(
        replicas=replicas,
        nodes=nodes,
        draining=draining,
        taken_at=NOW,
        prefetch=prefetch,
        health=health,
        evaluations=evals,
    )
    return desired, observation
