"""Properties of the decision over generated policies, signals and memories."""

from __future__ import annotations

import itertools
import math
from typing import Any

from autoscale_builders import T0, counts, even_load, failed, load, make_signals, simulate
from hypothesis import given, settings
from hypothesis import strategies as st

from caravan_llm.scheduler.autoscale.memory import (
    DecisionRecord,
    Direction,
    Memory,
    RecommendationSample,
    memory_from_json,
    memory_to_json,
)
from caravan_llm.scheduler.autoscale.policy import CheckResult, decide, preempt
from caravan_llm.scheduler.autoscale.signals import ReplicaLoad
from caravan_llm.scheduler.profiles import Autoscaling, Replicas

intervals = st.sampled_from([1.0, 2.0, 5.0, 10.0])
windows = st.sampled_from([0.0, 5.0, 15.0, 30.0, 60.0, 120.0])
steps = st.none() | st.integers(1, 4)
gauge = st.floats(0, 200, allow_nan=False)


@st.composite
def replica_bounds(draw: st.DrawFn) -> Replicas:
    low = draw(st.integers(0, 4))
    high = draw(st.integers(max(low, 1), 12))
    return Replicas(min=low, max=high)


@st.composite
def policies(draw: st.DrawFn, replicas: Replicas, *, kv: bool = True) -> Autoscaling:
    target_inflight = draw(st.none() | st.floats(1, 64)) if kv else draw(st.floats(1, 64))
    target_kv = draw(st.none() | st.floats(0.1, 1)) if kv else None
    if target_inflight is None and target_kv is None:
        target_inflight = 8.0
    fields: dict[str, Any] = {
        "target_inflight": target_inflight,
        "target_kv_cache": target_kv,
        "tolerance": draw(st.floats(0, 0.5)),
        "scale_up_window_s": draw(windows),
        "scale_down_window_s": draw(windows),
        "max_step_up": draw(steps),
        "max_step_down": draw(steps),
        "evaluation_interval_s": draw(intervals),
    }
    if replicas.min == 0:
        fields["scale_to_zero_after_s"] = draw(st.none() | st.floats(10, 600))
    return Autoscaling.model_validate(fields)


@st.composite
def known_loads(draw: st.DrawFn, replica_id: str) -> ReplicaLoad:
    return load(
        replica_id,
        running=draw(gauge),
        waiting=draw(st.none() | gauge),
        kv=draw(st.none() | st.floats(0, 1)),
        at=T0 - draw(st.floats(0, 2)),
    )


@st.composite
def unknown_loads(draw: st.DrawFn, replica_id: str) -> ReplicaLoad:
    """A replica whose scrape failed, or whose last reading is long stale."""
    if draw(st.booleans()):
        return failed(replica_id)
    return load(replica_id, running=draw(gauge), kv=draw(st.floats(0, 1)), at=T0 - 5000)


@st.composite
def memories(draw: st.DrawFn) -> Memory:
    offsets = sorted(draw(st.lists(st.floats(-3000, 0), max_size=8)))
    history = tuple(
        RecommendationSample(at=T0 + offset, count=draw(st.integers(0, 20))) for offset in offsets
    )
    last_busy = draw(st.none() | st.floats(-5000, 0).map(lambda offset: T0 + offset))
    return Memory(history=history, last_busy_at=last_busy)


@st.composite
def any_signals(draw: st.DrawFn) -> Any:
    entries = [
        draw(known_loads(str(index)) | unknown_loads(str(index)))
        for index in range(draw(st.integers(0, 6)))
    ]
    return make_signals(
        *entries,
        ready=len(entries) + draw(st.integers(0, 2)),
        queue=draw(st.none() | st.floats(0, 50)),
        wait=draw(st.none() | st.floats(0, 30)),
        demand=draw(st.booleans()),
        last_request_at=draw(st.none() | st.floats(-5000, 0).map(lambda offset: T0 + offset)),
    )


@given(data=st.data())
@settings(max_examples=200)
def test_target_always_within_min_and_max(data: st.DataObject) -> None:
    """Whatever the signals, memory or current count, an enabled policy targets [min, max]."""
    replicas = data.draw(replica_bounds())
    policy = data.draw(policies(replicas))
    current = data.draw(st.integers(0, 20))

    decision, _ = decide(
        data.draw(any_signals()), current, policy, replicas, data.draw(memories()), T0
    )

    assert replicas.min <= decision.target <= replicas.max


@given(data=st.data())
@settings(max_examples=200)
def test_unknown_data_never_scales_down(data: st.DataObject) -> None:
    """With at least one ready replica unread or stale, the count never goes down."""
    replicas = data.draw(replica_bounds())
    policy = data.draw(policies(replicas))
    current = data.draw(st.integers(max(replicas.min, 1), replicas.max))
    known = data.draw(st.lists(st.integers(0, 99).map(str), max_size=4))
    entries = [data.draw(known_loads(f"k{name}")) for name in known]
    entries += [
        data.draw(unknown_loads(f"u{index}")) for index in range(data.draw(st.integers(1, 3)))
    ]
    signals = make_signals(
        *entries,
        queue=data.draw(st.none() | st.floats(0, 50)),
        last_request_at=data.draw(st.none() | st.just(T0 - 10_000)),
    )

    decision, _ = decide(signals, current, policy, replicas, data.draw(memories()), T0)

    assert Direction.DOWN != decision.direction


@given(data=st.data())
@settings(max_examples=150)
def test_stable_signal_inside_tolerance_never_changes_the_count(data: st.DataObject) -> None:
    """A per-replica load held inside the tolerance band keeps the count, tick after tick."""
    replicas = data.draw(replica_bounds())
    policy = data.draw(policies(replicas, kv=False))
    assert policy.target_inflight is not None
    current = data.draw(st.integers(max(replicas.min, 1), replicas.max))
    # Strictly inside the band, clear of float noise at its edges.
    position = data.draw(st.floats(-0.999, 0.999))
    per_replica = policy.target_inflight * (1 + position * policy.tolerance)
    mem = data.draw(memories())

    for tick in range(40):
        now = T0 + tick * policy.evaluation_interval_s
        signals = even_load(per_replica * current, current, now)
        decision, mem = decide(signals, current, policy, replicas, mem, now)
        assert (Direction.NONE, current) == (decision.direction, decision.target)


def _ticks_to_settle(policy: Autoscaling, replicas: Replicas) -> int:
    longest = max(policy.scale_up_window_s, policy.scale_down_window_s)
    return int(longest / policy.evaluation_interval_s) + replicas.max + 10


@given(data=st.data())
@settings(max_examples=150)
def test_constant_load_settles_without_oscillating(data: st.DataObject) -> None:
    """Under a constant load the count moves one way only, and settles at the right size."""
    replicas = data.draw(replica_bounds())
    policy = data.draw(policies(replicas))
    start = data.draw(st.integers(max(replicas.min, 1), replicas.max))
    total = data.draw(st.integers(1, 200).map(float))
    total_kv = data.draw(st.floats(0.05, 6))
    ticks = 2 * _ticks_to_settle(policy, replicas)

    history, _ = simulate(
        policy,
        replicas,
        start=start,
        total_load=lambda _: total,
        total_kv=lambda _: total_kv,
        ticks=ticks,
    )

    seen = [start, *counts(history)]
    changes = [after - before for before, after in itertools.pairwise(seen) if after != before]
    assert all(change > 0 for change in changes) or all(change < 0 for change in changes)
    if policy.max_step_up is None and policy.max_step_down is None:
        assert len(changes) <= 1
    # Settled: nothing changes in the second half.
    assert len(set(seen[len(seen) // 2 :])) == 1


@given(data=st.data())
@settings(max_examples=150)
def test_step_to_four_times_capacity_is_met_within_the_up_window(data: st.DataObject) -> None:
    """From one idle replica, a load of four replicas' target gets enough replicas in time."""
    up_window = data.draw(windows)
    step_up = data.draw(steps)
    interval = data.draw(intervals)
    policy = Autoscaling(
        target_inflight=data.draw(st.floats(1, 32)),
        tolerance=data.draw(st.floats(0, 0.5)),
        scale_up_window_s=up_window,
        scale_down_window_s=data.draw(windows),
        max_step_up=step_up,
        evaluation_interval_s=interval,
    )
    replicas = Replicas(min=1, max=data.draw(st.integers(4, 12)))
    step_at = T0 + data.draw(st.floats(0, 60))
    assert policy.target_inflight is not None
    capacity = policy.target_inflight

    history, _ = simulate(
        policy,
        replicas,
        start=1,
        total_load=lambda t: 4 * capacity if t >= step_at else 0.0,
        ticks=int((60 + up_window) / interval) + 12,
    )

    first_load = min(tick.at for tick in history if tick.at >= step_at)
    extra_steps = 0 if step_up is None else math.ceil(3 / step_up) - 1
    deadline = first_load + up_window + extra_steps * interval
    assert all(tick.decision.target == 1 for tick in history if tick.at < first_load + up_window)
    for tick in history:
        if tick.at >= deadline:
            # Enough: the load per replica is no longer above the tolerance band.
            assert 4 / tick.decision.target <= 1 + policy.tolerance + 1e-9
            assert tick.decision.target <= 4
            if step_up is None:
                assert 4 == tick.decision.target


@given(data=st.data())
@settings(max_examples=150)
def test_count_returns_to_min_only_after_the_down_window(data: st.DataObject) -> None:
    """When the load stops, no replica goes before the down window, and all spare ones after."""
    down_window = data.draw(windows)
    interval = data.draw(intervals)
    policy = Autoscaling(
        target_inflight=8,
        tolerance=data.draw(st.floats(0, 0.5)),
        scale_up_window_s=data.draw(windows),
        scale_down_window_s=down_window,
        evaluation_interval_s=interval,
    )
    replicas = Replicas(min=data.draw(st.integers(0, 2)), max=12)
    settled = max(replicas.min, 1)
    stop_at = T0 + 200

    history, _ = simulate(
        policy,
        replicas,
        start=4,
        total_load=lambda t: 40.0 if t < stop_at else 0.0,
        ticks=int((200 + down_window) / interval) + 5,
    )

    first_idle = min(tick.at for tick in history if tick.at >= stop_at)
    # The busy load (40 at a target of 8) kept four or five replicas, so there is
    # something to scale down.
    assert history[-1].decision.target < min(
        tick.decision.target for tick in history if tick.at < first_idle
    )
    for tick in history:
        if first_idle <= tick.at < first_idle + down_window:
            assert tick.decision.target >= tick.count_before
        if tick.at >= first_idle + down_window:
            assert settled == tick.decision.target


@given(data=st.data())
@settings(max_examples=100)
def test_scale_to_zero_after_idle_and_back_on_demand(data: st.DataObject) -> None:
    """An idle model goes to zero after its idle period and comes back at the next request."""
    after_s = data.draw(st.sampled_from([10.0, 30.0, 60.0]))
    interval = data.draw(intervals)
    policy = Autoscaling(
        target_inflight=8,
        scale_up_window_s=data.draw(windows),
        scale_down_window_s=data.draw(windows),
        scale_to_zero_after_s=after_s,
        evaluation_interval_s=interval,
    )
    replicas = Replicas(min=0, max=4)
    busy_until = T0 + 20
    demand_at = T0 + 20 + after_s + data.draw(st.floats(interval, 60))

    history, _ = simulate(
        policy,
        replicas,
        start=1,
        total_load=lambda t: 4.0 if t < busy_until or t >= demand_at else 0.0,
        ticks=int((demand_at - T0) / interval) + 3,
    )

    last_busy = max(tick.at for tick in history if tick.at < busy_until)
    for tick in history:
        if tick.at < last_busy + after_s:
            assert 1 == tick.decision.target
        elif tick.at < demand_at:
            assert 0 == tick.decision.target
        elif tick.count_before == 0:
            assert (Direction.UP, 1) == (tick.decision.direction, tick.decision.target)
            assert tick.decision.reason.startswith("cold start: request waiting")


times = st.floats(0, 4e9, allow_nan=False)
records = st.builds(
    DecisionRecord,
    direction=st.sampled_from(Direction),
    target=st.integers(0, 1000),
    reason=st.text(max_size=80),
    at=times,
)


@given(
    history=st.lists(st.builds(RecommendationSample, at=times, count=st.integers(0, 1000))),
    last_decision=st.none() | records,
    last_scale=st.none() | records,
    last_busy_at=st.none() | times,
)
def test_memory_json_round_trips(
    history: list[RecommendationSample],
    last_decision: DecisionRecord | None,
    last_scale: DecisionRecord | None,
    last_busy_at: float | None,
) -> None:
    """Any memory the policy can produce reads back equal from its JSON."""
    memory = Memory(
        history=tuple(sorted(history, key=lambda sample: sample.at)[:512]),
        last_decision=last_decision,
        last_scale=last_scale,
        last_busy_at=last_busy_at,
    )

    assert memory == memory_from_json(memory_to_json(memory))


check_results = st.builds(
    CheckResult,
    direction=st.sampled_from(Direction),
    count=st.integers(0, 20),
    reason=st.just(""),
)
RANK = {Direction.UP: 2, Direction.NONE: 1, Direction.DOWN: 0}


@given(first=check_results, second=check_results, third=check_results)
def test_preempt_prefers_up_then_none_then_the_higher_count(
    first: CheckResult, second: CheckResult, third: CheckResult
) -> None:
    """The winner has the strongest direction and, within it, the highest count, in any order."""
    votes = [first, second, third]
    best_rank = max(RANK[vote.direction] for vote in votes)
    best_count = max(vote.count for vote in votes if RANK[vote.direction] == best_rank)

    for ordering in ([first, second, third], [third, first, second], [second, third, first]):
        winner = preempt(preempt(ordering[0], ordering[1]), ordering[2])
        assert (best_rank, best_count) == (RANK[winner.direction], winner.count)
