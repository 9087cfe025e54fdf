"""The autoscaler's decision for one model (pure): signals, policy and memory in; count out.

`decide` is a plain function of its arguments: no clock reads, no I/O, and the
state it needs between evaluations comes in as `Memory` and goes out as the
next `Memory`. The loop that calls it scrapes the signals, stores the memory
and writes the desired count; see README.md beside this file.

One evaluation, in order:

1. Disabled policy: nothing to decide.
2. At zero replicas: a request waiting (router demand or queue) starts one
   replica at once, with no window ("cold start").
3. Each target (`target_inflight`, `target_kv_cache`) votes with the
   nomad-autoscaler target-value rule: factor = per-replica value / target; no
   change inside [1 - tolerance, 1 + tolerance]; else ceil(measured replicas x
   factor). The votes are combined with `preempt` (up > none > down, then the
   higher count). The result is never below 1: only the idle rule below goes
   to zero.
4. A recommendation below the current count is held at the current count
   when the data is incomplete or the routers hold queued requests.
5. Stabilisation windows (Kubernetes HPA / Knative): scale up to the lowest
   recommendation in force during the last `scale_up_window_s`, that is only
   as far as the recommendations have called for continuously; scale down to
   the highest recommendation in force during the last `scale_down_window_s`,
   so a brief dip never scales down and a constant load settles without
   oscillating.
6. Scale to zero after `scale_to_zero_after_s` of known idleness
   (`replicas.min` 0 only).
7. Limit the step by `max_step_up` / `max_step_down`, then cap to
   `[replicas.min, replicas.max]`.

Every step that changes or holds the count adds to the reason, so
`caravan status` can say why a model has the count it has.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from caravan_llm.scheduler.autoscale.memory import DecisionRecord, Direction, Memory
from caravan_llm.scheduler.autoscale.signals import Aggregate, ModelSignals, aggregate
from caravan_llm.scheduler.profiles import Autoscaling, Replicas

# A replica's metrics count as fresh for this many evaluation intervals: the
# loop scrapes once per evaluation, so an older value means scrapes have been
# failing.
STALE_AFTER_EVALUATIONS = 3


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """What the autoscaler wants for one model now, and why.

    `target` equals the current count when `direction` is none.
    """

    direction: Direction
    target: int
    reason: str
    # The figures the decision was made from, for logs and `caravan status`.
    signals_used: dict[str, float | None]


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One target's vote: where the count should go by this metric alone."""

    direction: Direction
    count: int
    reason: str


_PRECEDENCE = {Direction.UP: 2, Direction.NONE: 1, Direction.DOWN: 0}


def preempt(first: CheckResult, second: CheckResult) -> CheckResult:
    """The vote that wins when two checks disagree (nomad-autoscaler's rule).

    Up beats none beats down: one metric saying "overloaded" is enough to
    grow, and any metric saying "keep" blocks a shrink. Within one direction
    the higher count wins, the safer choice. On a full tie the first stays.
    """
    first_rank = _PRECEDENCE[first.direction]
    second_rank = _PRECEDENCE[second.direction]
    if first_rank != second_rank:
        return first if first_rank > second_rank else second
    return first if first.count >= second.count else second


def _ceil(value: float) -> int:
    # Rounding first keeps float noise from adding a replica: 7 * (29 / 7) is
    # 29.000000000000004, which must still mean 29.
    return math.ceil(round(value, 9))


def target_value(
    *,
    label: str,
    value: float | None,
    target: float,
    tolerance: float,
    measured_replicas: int,
    current: int,
    decimals: int = 1,
) -> CheckResult:
    """The target-value vote of one metric (nomad-autoscaler's target-value strategy).

    The count multiplied by the factor is the number of replicas that were
    measured, which is the current count in steady state. While replicas are
    still starting or cannot be read, this sizes the model for the load that
    was seen rather than inflating the current count (Kubernetes HPA treats
    such replicas as idle when it scales up). A vote never points against
    its metric: over target never votes below the current count, under
    target never above it.
    """
    if value is None or measured_replicas <= 0:
        return CheckResult(Direction.NONE, current, f"{label} unknown (no fresh metrics)")
    shown = f"{value:.{decimals}f}"
    band = f"target {target:g} (tolerance {tolerance:.0%})"
    factor = value / target
    if 1 - tolerance <= factor <= 1 + tolerance:
        return CheckResult(Direction.NONE, current, f"{label} {shown} within {band}")
    needed = max(_ceil(measured_replicas * factor), 1)
    if factor > 1:
        count = max(needed, current)
        if count == current:
            return CheckResult(
                Direction.NONE,
                current,
                f"{label} {shown} > {band}, but the {current} replicas in place "
                f"cover the measured load (needs {needed})",
            )
        return CheckResult(Direction.UP, count, f"{label} {shown} > {band}: {current} -> {count}")
    count = min(needed, current)
    direction = Direction.DOWN if count < current else Direction.NONE
    return CheckResult(direction, count, f"{label} {shown} < {band}: {current} -> {count}")


def _signals_used(
    agg: Aggregate, signals: ModelSignals, idle_for_s: float | None
) -> dict[str, float | None]:
    used: dict[str, float | None] = {
        "inflight_per_replica": agg.inflight_per_replica,
        "kv_cache_per_replica": agg.kv_cache_per_replica,
        "ready_replicas": float(agg.ready_replicas),
        "unknown_replicas": float(agg.unknown_replicas),
        "router_queue_depth": signals.router_queue_depth,
        "router_queue_wait_s": signals.router_queue_wait_s,
    }
    if idle_for_s is not None:
        used["idle_for_s"] = idle_for_s
    return used


def _conclude(
    current: int,
    target: int,
    *,
    reasons: list[str],
    used: dict[str, float | None],
    memory: Memory,
    now: float,
) -> tuple[ScaleDecision, Memory]:
    if target > current:
        direction = Direction.UP
    elif target < current:
        direction = Direction.DOWN
    else:
        direction = Direction.NONE
    reason = "; ".join(reasons)
    record = DecisionRecord(direction=direction, target=target, reason=reason, at=now)
    memory = replace(
        memory,
        last_decision=record,
        last_scale=memory.last_scale if direction is Direction.NONE else record,
    )
    return ScaleDecision(direction, target, reason, used), memory


def _cap(desired: int, replicas: Replicas, reasons: list[str]) -> int:
    capped = min(max(desired, replicas.min), replicas.max)
    if capped != desired:
        reasons.append(
            f"capped from {desired} to {capped} (replicas.min {replicas.min}, "
            f"replicas.max {replicas.max})"
        )
    return capped


# The six inputs are the decision's whole world, passed positionally as
# nomad-autoscaler's strategies take theirs; a parameter object would only hide them.
def decide(  # noqa: PLR0917 - see above
    signals: ModelSignals,
    current: int,
    policy: Autoscaling,
    replicas: Replicas,
    memory: Memory,
    now: float,
    *,
    max_signal_age_s: float | None = None,
) -> tuple[ScaleDecision, Memory]:
    """Decide the replica count of one model; see the module docstring for the steps.

    `current` is the model's desired count as the scheduler holds it now.
    `now` must be wall-clock seconds (`time.time()`), on the same clock as
    `ReplicaLoad.scraped_at` and `ModelSignals.last_request_at`: the memory
    stamps its history with it, and that memory is stored in Consul KV and
    read back after a restart or by the next leader, where a monotonic clock
    would be meaningless. `max_signal_age_s` defaults to
    `STALE_AFTER_EVALUATIONS` evaluation intervals.
    """
    if current < 0:
        raise ValueError(f"current replica count must be >= 0, got {current}")
    if not policy.enabled:
        disabled = ["autoscaling is disabled for this model; the count is set by hand"]
        return _conclude(current, current, reasons=disabled, used={}, memory=memory, now=now)

    max_age_s = (
        max_signal_age_s
        if max_signal_age_s is not None
        else STALE_AFTER_EVALUATIONS * policy.evaluation_interval_s
    )
    agg = aggregate(
        signals,
        now,
        max_age_s,
        need_inflight=policy.target_inflight is not None,
        need_kv_cache=policy.target_kv_cache is not None,
    )
    queue = signals.router_queue_depth
    queued = queue is not None and queue > 0
    reasons: list[str] = []

    if current == 0:
        return _decide_at_zero(signals, agg, replicas, memory, now, queued=queued)

    # 3. Target-value votes.
    checks: list[CheckResult] = []
    if policy.target_inflight is not None:
        checks.append(
            target_value(
                label="in-flight per replica",
                value=agg.inflight_per_replica,
                target=policy.target_inflight,
                tolerance=policy.tolerance,
                measured_replicas=agg.inflight_known_replicas,
                current=current,
            )
        )
    if policy.target_kv_cache is not None:
        checks.append(
            target_value(
                label="KV-cache use per replica",
                value=agg.kv_cache_per_replica,
                target=policy.target_kv_cache,
                tolerance=policy.tolerance,
                measured_replicas=agg.kv_cache_known_replicas,
                current=current,
                decimals=2,
            )
        )
    if not checks:
        checks.append(CheckResult(Direction.NONE, current, "no target set"))
    combined = functools.reduce(preempt, checks)
    reasons.extend(check.reason for check in checks)
    recommended = max(combined.count, 1)

    # 4. Never shrink on what is not known, nor while requests queue.
    if not agg.complete:
        missing = (
            "no replica is ready"
            if agg.ready_replicas == 0
            else f"{agg.unknown_replicas} of {agg.ready_replicas} ready replicas "
            "have no fresh metrics"
        )
        if recommended < current:
            reasons.append(f"holding {current}: {missing} (never scale down on unknown data)")
            recommended = current
        else:
            reasons.append(f"data incomplete: {missing}")
    elif queued and recommended < current:
        reasons.append(f"holding {current}: the routers hold {queue:g} queued requests")
        recommended = current

    # 5. Stabilisation windows.
    up_window = policy.scale_up_window_s
    down_window = policy.scale_down_window_s
    memory = memory.with_recommendation(now, recommended, keep_s=max(up_window, down_window))
    up_limit = min(memory.in_force_since(now - up_window, before_history=current))
    down_limit = max(memory.in_force_since(now - down_window, before_history=current))
    desired = current
    if up_limit > current:
        desired = up_limit
    elif down_limit < current:
        desired = down_limit
    if recommended > desired:
        if desired == current:
            reasons.append(f"scale-up waits for the up window ({up_window:g}s)")
        else:
            reasons.append(
                f"up window ({up_window:g}s): {desired} recommended throughout it, "
                f"{recommended} not yet"
            )
    elif recommended < desired:
        reasons.append(
            f"scale-down waits for the down window ({down_window:g}s): "
            f"highest recommendation in it is {down_limit}"
        )

    # 6. Scale to zero after a known idle period.
    busy = signals.demand_pending or queued or not agg.inflight_complete or agg.inflight_total != 0
    last_busy_at = now if busy or memory.last_busy_at is None else memory.last_busy_at
    memory = replace(memory, last_busy_at=last_busy_at)
    idle_since = last_busy_at
    if signals.last_request_at is not None:
        idle_since = max(idle_since, signals.last_request_at)
    idle_for_s = max(now - idle_since, 0.0)
    after_s = policy.scale_to_zero_after_s
    if after_s is not None and replicas.min == 0 and not busy and idle_for_s >= after_s:
        reasons.append(f"idle for {idle_for_s:.0f}s >= scale_to_zero_after_s {after_s:g}s")
        desired = 0

    # 7. Step limits, then bounds.
    step_up = policy.max_step_up
    if step_up is not None and desired > current + step_up:
        reasons.append(f"limited by max_step_up {step_up}: {desired} -> {current + step_up}")
        desired = current + step_up
    step_down = policy.max_step_down
    if step_down is not None and desired < current - step_down:
        reasons.append(f"limited by max_step_down {step_down}: {desired} -> {current - step_down}")
        desired = current - step_down
    target = _cap(desired, replicas, reasons)
    used = _signals_used(agg, signals, idle_for_s if after_s is not None else None)
    return _conclude(current, target, reasons=reasons, used=used, memory=memory, now=now)


def _decide_at_zero(
    signals: ModelSignals,
    agg: Aggregate,
    replicas: Replicas,
    memory: Memory,
    now: float,
    *,
    queued: bool,
) -> tuple[ScaleDecision, Memory]:
    """At zero replicas there is nothing to measure; only waiting requests and bounds count."""
    reasons: list[str] = []
    if signals.demand_pending or queued:
        # No window: a client is waiting for the first replica, and every
        # second of window is a second of its time-to-first-token.
        desired = max(1, replicas.min)
        reasons.append(f"cold start: request waiting (0 -> {desired})")
        # The idle timer restarts, so the model is not sent back to zero
        # while its first replica loads.
        memory = replace(memory, last_busy_at=now)
    else:
        desired = 0
        reasons.append("at zero replicas and no request waiting")
    target = _cap(desired, replicas, reasons)
    used = _signals_used(agg, signals, None)
    return _conclude(0, target, reasons=reasons, used=used, memory=memory, now=now)
