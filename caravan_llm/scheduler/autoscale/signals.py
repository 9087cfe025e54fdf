"""What the autoscaler knows about one model's load, and how it is summed up (pure).

The loop collects, per model, one `ReplicaLoad` per ready replica (scraped from
the engine's `/metrics` by `scrape.py`) and the routers' queue for the model,
and builds a `ModelSignals`. `aggregate` turns that into per-replica figures
for the policy.

Unknown is never zero here. A replica whose scrape failed, or whose last
successful scrape is older than `max_age_s`, contributes nothing to the
averages and is counted in `unknown_replicas`; the averages are taken over the
replicas that were measured. The policy may scale up on such partial data
(the measured replicas are overloaded whatever the others do) but never down.

All times are seconds on the same clock as the `now` passed in; the loop uses
wall-clock time (see `policy.decide`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's engine load from its last scrape; None = not known.

    `scraped_at` is set only when the scrape succeeded; the figures of a
    failed scrape are all None.
    """

    replica_id: str
    running: float | None
    waiting: float | None
    # Fraction of the KV cache in use, 0..1.
    kv_cache_usage: float | None
    scraped_at: float | None


@dataclass(frozen=True, slots=True)
class ModelSignals:
    """Everything the policy reads about one model at one evaluation."""

    # One entry per ready replica the loop tried to scrape.
    replicas: tuple[ReplicaLoad, ...]
    # How many replicas Consul lists as ready (passing checks). A ready replica
    # with no entry in `replicas` counts as unknown.
    ready_replicas: int
    # Requests held by the routers for this model, summed over routers (see
    # `router_queue`); None = not known.
    router_queue_depth: float | None
    # The longest mean queue wait among routers; informational only.
    router_queue_wait_s: float | None
    # A router has recorded that a request arrived while no replica was ready
    # (KV `caravan/demand/<name>`).
    demand_pending: bool
    # When the routers last saw a request for this model; None = not known.
    last_request_at: float | None


@dataclass(frozen=True, slots=True)
class Aggregate:
    """Per-replica load of one model, over the replicas measured recently.

    In-flight per replica is the estimated total demand divided by the
    replicas whose in-flight count is known:

        (sum of running + waiting over measured replicas + router queue depth)
        / measured replicas

    The routers' queued requests are demand that the measured replicas would
    have to absorb, so they are spread evenly over them. A replica that was not
    measured adds nothing to the sum (the estimate errs low, so it never causes
    extra scale-up) and makes the data incomplete (so it never allows a
    scale-down). An unknown router queue adds nothing.

    `waiting` is added when the engine reports it; an engine whose metric
    mapping names no waiting gauge still has a known in-flight count (its
    queue then shows up in the routers' queue). A replica without a `running`
    value has an unknown in-flight count.
    """

    ready_replicas: int
    # Ready replicas with no fresh value for a metric the policy needs.
    unknown_replicas: int
    inflight_known_replicas: int
    # Sum of running + waiting over the measured replicas, router queue excluded.
    inflight_total: float | None
    inflight_per_replica: float | None
    kv_cache_known_replicas: int
    # Mean KV-cache use over the replicas that report it.
    kv_cache_per_replica: float | None
    # Every ready replica (at least one) has a fresh in-flight count.
    inflight_complete: bool
    # Every ready replica (at least one) has a fresh KV-cache value.
    kv_cache_complete: bool
    # Every ready replica has a fresh value for every metric the policy needs.
    complete: bool


def _plausible(value: float | None) -> float | None:
    """A gauge reading, or None when it cannot be a real reading (NaN, inf, negative)."""
    if value is None or not math.isfinite(value) or value < 0:
        return None
    return value


def _is_fresh(load: ReplicaLoad, now: float, max_age_s: float) -> bool:
    # A sample stamped slightly in the future (two hosts' clocks) is fresh.
    return load.scraped_at is not None and now - load.scraped_at <= max_age_s


def _inflight(load: ReplicaLoad) -> float | None:
    running = _plausible(load.running)
    if running is None:
        return None
    waiting = _plausible(load.waiting)
    return running + (waiting if waiting is not None else 0.0)


def aggregate(
    signals: ModelSignals,
    now: float,
    max_age_s: float,
    *,
    need_inflight: bool = True,
    need_kv_cache: bool = False,
) -> Aggregate:
    """Sum up the fresh replica loads of one model; see `Aggregate` for the formulas.

    `need_inflight` / `need_kv_cache` say which metrics the policy uses, so that
    `complete` and `unknown_replicas` are about those (llama.cpp reports no
    KV-cache use, which must not make its data incomplete forever).
    """
    if signals.ready_replicas < 0:
        raise ValueError(f"ready_replicas must be >= 0, got {signals.ready_replicas}")
    if max_age_s < 0:
        raise ValueError(f"max_age_s must be >= 0, got {max_age_s}")
    fresh = [load for load in signals.replicas if _is_fresh(load, now, max_age_s)]
    inflights = [value for load in fresh if (value := _inflight(load)) is not None]
    kv_values = [value for load in fresh if (value := _plausible(load.kv_cache_usage)) is not None]

    def has_needed(load: ReplicaLoad) -> bool:
        if need_inflight and _inflight(load) is None:
            return False
        return not (need_kv_cache and _plausible(load.kv_cache_usage) is None)

    fully_known = sum(1 for load in fresh if has_needed(load))
    ready = signals.ready_replicas
    queue = _plausible(signals.router_queue_depth)

    inflight_total = sum(inflights) if inflights else None
    inflight_per_replica = (sum(inflights) + (queue or 0.0)) / len(inflights) if inflights else None
    inflight_complete = ready >= 1 and len(inflights) >= ready
    kv_cache_complete = ready >= 1 and len(kv_values) >= ready
    return Aggregate(
        ready_replicas=ready,
        unknown_replicas=max(ready - fully_known, 0),
        inflight_known_replicas=len(inflights),
        inflight_total=inflight_total,
        inflight_per_replica=inflight_per_replica,
        kv_cache_known_replicas=len(kv_values),
        kv_cache_per_replica=sum(kv_values) / len(kv_values) if kv_values else None,
        inflight_complete=inflight_complete,
        kv_cache_complete=kv_cache_complete,
        complete=ready >= 1 and fully_known >= ready,
    )


@dataclass(frozen=True, slots=True)
class RouterQueueReport:
    """One router's queues, from one scrape of its `/metrics`.

    A mapping is None when the scrape failed or the router does not export
    that metric at all; a model missing from a mapping that exists has an
    empty queue at that router (it exports the family, with no series for the
    model yet).
    """

    router_id: str
    depth_by_model: Mapping[str, float] | None
    # Mean queue wait per model (histogram sum / count since the router started).
    mean_wait_s_by_model: Mapping[str, float] | None


@dataclass(frozen=True, slots=True)
class RouterQueue:
    """The routers' queue for one model, combined over all routers."""

    depth: float | None
    wait_s: float | None


def router_queue(reports: Iterable[RouterQueueReport], model: str) -> RouterQueue:
    """Combine every router's report for `model`: depth summed, wait the worst mean.

    1. No routers at all: nothing can be queued, depth 0.
    2. Every router known: the sum of their depths.
    3. Some routers unknown: the known depths are a lower bound. A positive
       lower bound is reported (it already proves a queue exists); a zero one
       proves nothing, so the depth is None.
    The wait is the largest mean wait among routers that report one, else None.
    """
    known_depths: list[float] = []
    any_unknown = False
    waits: list[float] = []
    for report in reports:
        if report.depth_by_model is None:
            any_unknown = True
        else:
            known_depths.append(report.depth_by_model.get(model, 0.0))
        if report.mean_wait_s_by_model is not None and model in report.mean_wait_s_by_model:
            waits.append(report.mean_wait_s_by_model[model])
    known_sum = sum(known_depths)
    depth: float | None = known_sum
    if any_unknown and known_sum <= 0:
        depth = None
    return RouterQueue(depth=depth, wait_s=max(waits) if waits else None)
