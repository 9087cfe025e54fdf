"""Builders and a closed-loop load model for the autoscaler's tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from caravan_llm.scheduler.autoscale.memory import Memory
from caravan_llm.scheduler.autoscale.policy import ScaleDecision, decide
from caravan_llm.scheduler.autoscale.signals import ModelSignals, ReplicaLoad
from caravan_llm.scheduler.profiles import Autoscaling, Replicas

# Wall-clock seconds, as the loop passes them.
T0 = 1_700_000_000.0


def make_policy(**overrides: Any) -> Autoscaling:
    fields: dict[str, Any] = {
        "target_inflight": 8.0,
        "tolerance": 0.1,
        "scale_up_window_s": 0,
        "scale_down_window_s": 0,
        "evaluation_interval_s": 5,
    }
    fields.update(overrides)
    return Autoscaling.model_validate(fields)


def make_replicas(**overrides: Any) -> Replicas:
    fields: dict[str, Any] = {"min": 1, "max": 10}
    fields.update(overrides)
    return Replicas.model_validate(fields)


def load(
    replica_id: str = "0",
    running: float | None = 0.0,
    waiting: float | None = 0.0,
    kv: float | None = None,
    at: float | None = T0,
) -> ReplicaLoad:
    return ReplicaLoad(
        replica_id=replica_id, running=running, waiting=waiting, kv_cache_usage=kv, scraped_at=at
    )


def failed(replica_id: str = "0") -> ReplicaLoad:
    """A replica whose scrape failed: nothing known."""
    return ReplicaLoad(
        replica_id=replica_id, running=None, waiting=None, kv_cache_usage=None, scraped_at=None
    )


def make_signals(
    *loads: ReplicaLoad,
    ready: int | None = None,
    queue: float | None = 0.0,
    wait: float | None = None,
    demand: bool = False,
    last_request_at: float | None = None,
) -> ModelSignals:
    return ModelSignals(
        replicas=tuple(loads),
        ready_replicas=len(loads) if ready is None else ready,
        router_queue_depth=queue,
        router_queue_wait_s=wait,
        demand_pending=demand,
        last_request_at=last_request_at,
    )


def even_load(
    total_inflight: float, replicas: int, now: float, total_kv: float | None = None
) -> ModelSignals:
    """The closed-loop load model: a total load shared evenly by the replicas in place."""
    if replicas == 0:
        return make_signals(queue=0.0, demand=total_inflight > 0)
    loads = [
        load(
            str(index),
            running=total_inflight / replicas,
            waiting=0.0,
            kv=None if total_kv is None else total_kv / replicas,
            at=now,
        )
        for index in range(replicas)
    ]
    return make_signals(*loads, last_request_at=now if total_inflight > 0 else None)


@dataclass(frozen=True)
class Tick:
    at: float
    count_before: int
    decision: ScaleDecision


def simulate(
    policy: Autoscaling,
    replicas: Replicas,
    *,
    start: int,
    total_load: Callable[[float], float],
    ticks: int,
    memory: Memory | None = None,
    t0: float = T0,
    total_kv: Callable[[float], float] | None = None,
) -> tuple[list[Tick], Memory]:
    """Run `ticks` evaluations, one per evaluation interval, applying each decision at once."""
    count = start
    mem = Memory() if memory is None else memory
    history: list[Tick] = []
    for index in range(ticks):
        now = t0 + index * policy.evaluation_interval_s
        kv = None if total_kv is None else total_kv(now)
        signals = even_load(total_load(now), count, now, kv)
        decision, mem = decide(signals, count, policy, replicas, mem, now)
        history.append(Tick(now, count, decision))
        count = decision.target
    return history, mem


def counts(history: list[Tick]) -> list[int]:
    return [tick.decision.target for tick in history]
