"""The decision: target value, windows, holds on unknown data, cold start and scale to zero."""

from __future__ import annotations

import pytest
from autoscale_builders import (
    T0,
    counts,
    even_load,
    failed,
    load,
    make_policy,
    make_replicas,
    make_signals,
    simulate,
)

from caravan_llm.scheduler.autoscale.memory import (
    Direction,
    Memory,
    memory_from_json,
    memory_to_json,
)
from caravan_llm.scheduler.autoscale.policy import CheckResult, decide, preempt, target_value

UP, NONE, DOWN = Direction.UP, Direction.NONE, Direction.DOWN


class TestTargetValue:
    def test_overload_scales_up_with_a_readable_reason(self) -> None:
        """14.2 in flight per replica against a target of 8 takes 2 replicas to 4."""
        signals = make_signals(load("a", running=12.2, waiting=2), load("b", running=14.2))

        decision, _ = decide(signals, 2, make_policy(), make_replicas(), Memory(), T0)

        assert UP == decision.direction
        assert 4 == decision.target
        assert decision.reason.startswith(
            "in-flight per replica 14.2 > target 8 (tolerance 10%): 2 -> 4"
        )
        assert 14.2 == pytest.approx(decision.signals_used["inflight_per_replica"])

    def test_inside_tolerance_keeps_the_count(self) -> None:
        """A load within 10% of the target changes nothing."""
        signals = make_signals(load("a", running=8.7), load("b", running=7.4))

        decision, _ = decide(signals, 2, make_policy(), make_replicas(), Memory(), T0)

        assert NONE == decision.direction
        assert 2 == decision.target
        assert "within target 8" in decision.reason

    def test_underload_scales_down_to_what_the_load_needs(self) -> None:
        """Four replicas carrying 9 in total against a target of 8 need two."""
        signals = even_load(9, 4, T0)

        decision, _ = decide(signals, 4, make_policy(), make_replicas(), Memory(), T0)

        assert (DOWN, 2) == (decision.direction, decision.target)

    def test_idle_never_recommends_zero_without_the_idle_rule(self) -> None:
        """An idle model goes to one replica, not zero, when scale to zero is off."""
        decision, _ = decide(
            even_load(0, 3, T0), 3, make_policy(), make_replicas(min=0), Memory(), T0
        )

        assert 1 == decision.target

    def test_replicas_still_starting_are_not_multiplied(self) -> None:
        """Two measured replicas at 12 need 3; with 4 in place (2 starting) nothing is added."""
        signals = make_signals(load("a", running=12), load("b", running=12))

        decision, _ = decide(signals, 4, make_policy(), make_replicas(), Memory(), T0)

        assert (NONE, 4) == (decision.direction, decision.target)
        assert "cover the measured load (needs 3)" in decision.reason

    def test_float_noise_does_not_add_a_replica(self) -> None:
        """Exactly enough load for 29 replicas recommends 29, not 30."""
        # 7 * (29 / 7) is 29.000000000000004 in floating point.
        vote = target_value(
            label="x", value=29 / 7, target=1.0, tolerance=0.1, measured_replicas=7, current=7
        )

        assert 29 == vote.count

    def test_kv_target_scales_up_while_inflight_is_fine(self) -> None:
        """One check saying up wins over another saying keep."""
        policy = make_policy(target_kv_cache=0.8)
        signals = make_signals(load("a", running=8, kv=0.95), load("b", running=8, kv=0.97))

        decision, _ = decide(signals, 2, policy, make_replicas(), Memory(), T0)

        assert (UP, 3) == (decision.direction, decision.target)
        assert "KV-cache use per replica 0.96 > target 0.8" in decision.reason

    def test_kv_unknown_blocks_an_inflight_scale_down(self) -> None:
        """A check with no data votes keep, and keep beats down."""
        policy = make_policy(target_kv_cache=0.8)
        signals = make_signals(load("a", running=1, kv=None), load("b", running=1, kv=None))

        decision, _ = decide(signals, 2, policy, make_replicas(), Memory(), T0)

        assert (NONE, 2) == (decision.direction, decision.target)
        assert "KV-cache use per replica unknown" in decision.reason


class TestPreempt:
    @pytest.mark.parametrize(
        ("first", "second", "winner"),
        [
            (CheckResult(UP, 3, "a"), CheckResult(NONE, 2, "b"), "a"),
            (CheckResult(NONE, 2, "a"), CheckResult(UP, 3, "b"), "b"),
            (CheckResult(NONE, 2, "a"), CheckResult(DOWN, 1, "b"), "a"),
            (CheckResult(DOWN, 1, "a"), CheckResult(UP, 9, "b"), "b"),
            (CheckResult(UP, 3, "a"), CheckResult(UP, 5, "b"), "b"),
            (CheckResult(DOWN, 1, "a"), CheckResult(DOWN, 2, "b"), "b"),
            (CheckResult(UP, 4, "a"), CheckResult(UP, 4, "b"), "a"),
        ],
    )
    def test_up_beats_none_beats_down_then_higher_count(
        self, first: CheckResult, second: CheckResult, winner: str
    ) -> None:
        """nomad-autoscaler's preemption order, with the first kept on a full tie."""
        assert winner == preempt(first, second).reason


class TestWindows:
    def test_scale_up_waits_for_the_up_window(self) -> None:
        """A step in load scales up only once it has lasted the whole up window."""
        policy = make_policy(scale_up_window_s=15)

        history, _ = simulate(
            policy,
            make_replicas(),
            start=1,
            total_load=lambda t: 0 if t < T0 + 10 else 32,
            ticks=8,
        )

        # The load appears at T0+10; the window is satisfied at T0+25 (tick 5).
        assert [1, 1, 1, 1, 1, 4, 4, 4] == counts(history)
        assert "scale-up waits for the up window (15s)" in history[3].decision.reason

    def test_brief_dip_never_scales_down(self) -> None:
        """A 20-second lull inside a 300-second down window keeps every replica."""
        policy = make_policy(scale_down_window_s=300)

        history, _ = simulate(
            policy,
            make_replicas(),
            start=4,
            total_load=lambda t: 2 if T0 + 100 <= t < T0 + 120 else 32,
            ticks=120,
        )

        assert all(4 == count for count in counts(history))

    def test_scale_down_after_the_down_window(self) -> None:
        """Once load has stayed low for the whole down window the count follows it."""
        policy = make_policy(scale_down_window_s=60)

        history, _ = simulate(
            policy,
            make_replicas(),
            start=4,
            total_load=lambda t: 32 if t < T0 + 50 else 8,
            ticks=30,
        )

        down_at = [tick.at for tick in history if tick.decision.direction is DOWN]
        assert [T0 + 110] == down_at
        assert 1 == counts(history)[-1]
        assert "scale-down waits for the down window (60s)" in history[15].decision.reason

    def test_partial_scale_up_to_what_was_recommended_throughout(self) -> None:
        """After 4 then 8 were recommended, only 4 has lasted the window."""
        policy = make_policy(scale_up_window_s=10, max_step_up=None)
        mem = Memory()
        _, mem = decide(even_load(32, 1, T0), 1, policy, make_replicas(), mem, T0)
        _, mem = decide(even_load(64, 1, T0 + 5), 1, policy, make_replicas(), mem, T0 + 5)

        decision, _ = decide(even_load(64, 1, T0 + 10), 1, policy, make_replicas(), mem, T0 + 10)

        assert (UP, 4) == (decision.direction, decision.target)
        assert "4 recommended throughout it, 8 not yet" in decision.reason


class TestNeverDownOnUnknown:
    def test_failed_replica_holds_the_count(self) -> None:
        """A low load on the known replicas never shrinks while one replica is unknown."""
        signals = make_signals(load("a", running=1), load("b", running=0), failed("c"))

        decision, _ = decide(signals, 3, make_policy(), make_replicas(), Memory(), T0)

        assert (NONE, 3) == (decision.direction, decision.target)
        assert "holding 3: 1 of 3 ready replicas have no fresh metrics" in decision.reason

    def test_unknown_data_still_allows_scale_up(self) -> None:
        """The measured replicas are overloaded whatever the unknown one does."""
        signals = make_signals(load("a", running=20), load("b", running=20), failed("c"))

        decision, _ = decide(signals, 3, make_policy(), make_replicas(), Memory(), T0)

        assert (UP, 5) == (decision.direction, decision.target)

    def test_no_ready_replica_holds_the_count(self) -> None:
        """Replicas that are all still starting are never scaled down for lack of load."""
        decision, _ = decide(make_signals(ready=0), 2, make_policy(), make_replicas(), Memory(), T0)

        assert (NONE, 2) == (decision.direction, decision.target)
        assert "no replica is ready" in decision.reason

    def test_router_queue_blocks_scale_down(self) -> None:
        """Queued requests at the routers hold the count, even when replicas look quiet."""
        signals = make_signals(
            load("a", running=1), load("b", running=1), load("c", running=0), queue=2
        )

        decision, _ = decide(signals, 3, make_policy(), make_replicas(), Memory(), T0)

        assert (NONE, 3) == (decision.direction, decision.target)
        assert "the routers hold 2 queued requests" in decision.reason

    def test_unknown_router_queue_does_not_block_scale_down(self) -> None:
        """Unknown router data neither blocks a scale-down forever nor causes one."""
        signals = make_signals(load("a", running=1), load("b", running=1), queue=None)

        decision, _ = decide(signals, 2, make_policy(), make_replicas(), Memory(), T0)

        assert (DOWN, 1) == (decision.direction, decision.target)

    def test_fresh_memory_does_not_scale_down_at_once(self) -> None:
        """A scheduler that lost its memory waits a full down window before shrinking."""
        policy = make_policy(scale_down_window_s=300)

        decision, _ = decide(even_load(1, 4, T0), 4, policy, make_replicas(), Memory(), T0)

        assert (NONE, 4) == (decision.direction, decision.target)


class TestZero:
    def test_cold_start_on_demand(self) -> None:
        """A request waiting for a model at zero starts one replica at once."""
        policy = make_policy(scale_up_window_s=60, scale_to_zero_after_s=300)

        decision, mem = decide(
            make_signals(demand=True), 0, policy, make_replicas(min=0), Memory(), T0
        )

        assert (UP, 1) == (decision.direction, decision.target)
        assert decision.reason.startswith("cold start: request waiting")
        assert T0 == mem.last_busy_at

    def test_cold_start_on_router_queue(self) -> None:
        """Requests queued at a router for a model at zero are demand too."""
        decision, _ = decide(
            make_signals(queue=3), 0, make_policy(), make_replicas(min=0), Memory(), T0
        )

        assert (UP, 1) == (decision.direction, decision.target)

    def test_cold_start_goes_to_min(self) -> None:
        """A model below its minimum comes back at the minimum."""
        decision, _ = decide(
            make_signals(demand=True), 0, make_policy(), make_replicas(min=2), Memory(), T0
        )

        assert 2 == decision.target

    def test_zero_without_demand_stays_at_zero(self) -> None:
        """Nothing waiting, nothing started."""
        decision, _ = decide(make_signals(), 0, make_policy(), make_replicas(min=0), Memory(), T0)

        assert (NONE, 0) == (decision.direction, decision.target)

    def test_scale_to_zero_after_the_idle_period(self) -> None:
        """With no request for scale_to_zero_after_s, an idle model goes to zero."""
        policy = make_policy(scale_to_zero_after_s=60)
        signals = make_signals(load("a", running=0), last_request_at=T0 - 61)

        decision, _ = decide(
            signals, 1, policy, make_replicas(min=0), Memory(last_busy_at=T0 - 100), T0
        )

        assert (DOWN, 0) == (decision.direction, decision.target)
        assert "idle for 61s >= scale_to_zero_after_s 60s" in decision.reason

    def test_recent_request_keeps_the_replica(self) -> None:
        """A request within the idle period keeps the model up even if nothing runs now."""
        policy = make_policy(scale_to_zero_after_s=60)
        signals = make_signals(load("a", running=0), last_request_at=T0 - 30)

        decision, _ = decide(
            signals, 1, policy, make_replicas(min=0), Memory(last_busy_at=T0 - 100), T0
        )

        assert (NONE, 1) == (decision.direction, decision.target)

    def test_idle_timer_without_request_times_runs_from_last_work(self) -> None:
        """Without last_request_at the idle period counts from the last in-flight work seen."""
        policy = make_policy(scale_to_zero_after_s=30)

        history, _ = simulate(
            policy,
            make_replicas(min=0),
            start=1,
            total_load=lambda t: 4 if t < T0 + 20 else 0,
            ticks=12,
        )

        # Last busy at T0+15; idle for 30 s at T0+45 (tick 9).
        assert [1] * 9 + [0, 0, 0] == counts(history)

    def test_unknown_load_never_scales_to_zero(self) -> None:
        """A replica that cannot be read may be busy."""
        policy = make_policy(scale_to_zero_after_s=10)
        mem = Memory(last_busy_at=T0 - 1000)

        decision, mem = decide(make_signals(failed("a")), 1, policy, make_replicas(min=0), mem, T0)

        assert (NONE, 1) == (decision.direction, decision.target)
        assert T0 == mem.last_busy_at

    def test_back_from_zero_on_demand_then_to_zero_again(self) -> None:
        """Idle -> zero -> a request -> one replica -> idle again -> zero."""
        policy = make_policy(scale_to_zero_after_s=20)

        history, _ = simulate(
            policy,
            make_replicas(min=0),
            start=1,
            total_load=lambda t: 4 if T0 + 50 <= t < T0 + 60 else 0,
            ticks=20,
        )

        assert [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0] == counts(history)
        assert history[10].decision.reason.startswith("cold start")


class TestLimitsAndBounds:
    def test_max_step_up_limits_each_change(self) -> None:
        """A jump from 1 to 8 goes in steps of two."""
        history, _ = simulate(
            make_policy(max_step_up=2), make_replicas(), start=1, total_load=lambda _: 64, ticks=5
        )

        assert [3, 5, 7, 8, 8] == counts(history)
        assert "limited by max_step_up 2: 8 -> 3" in history[0].decision.reason

    def test_max_step_down_limits_each_change(self) -> None:
        """A drop from 8 to 1 goes in steps of three."""
        history, _ = simulate(
            make_policy(max_step_down=3), make_replicas(), start=8, total_load=lambda _: 1, ticks=4
        )

        assert [5, 2, 1, 1] == counts(history)

    def test_recommendation_above_max_is_capped(self) -> None:
        """The reason says the count was capped, and from what."""
        decision, _ = decide(
            even_load(96, 2, T0), 2, make_policy(), make_replicas(max=8), Memory(), T0
        )

        assert 8 == decision.target
        assert "capped from 12 to 8" in decision.reason

    def test_count_below_min_is_raised(self) -> None:
        """A count under the minimum (a profile change) goes up to the minimum."""
        decision, _ = decide(
            even_load(8, 1, T0), 1, make_policy(), make_replicas(min=3), Memory(), T0
        )

        assert (UP, 3) == (decision.direction, decision.target)

    def test_disabled_policy_never_scales(self) -> None:
        """With autoscaling off the count is left alone, and the reason says so."""
        policy = make_policy(enabled=False)

        decision, _ = decide(even_load(100, 1, T0), 1, policy, make_replicas(), Memory(), T0)

        assert (NONE, 1) == (decision.direction, decision.target)
        assert "autoscaling is disabled" in decision.reason

    def test_negative_current_count_is_rejected(self) -> None:
        """A negative count is a caller bug, reported by name."""
        with pytest.raises(ValueError, match="current replica count"):
            decide(make_signals(), -1, make_policy(), make_replicas(), Memory(), T0)


class TestMemory:
    def test_decisions_are_recorded_for_status(self) -> None:
        """The memory keeps the latest decision and the latest change of count."""
        policy = make_policy()
        _, mem = decide(even_load(32, 1, T0), 1, policy, make_replicas(), Memory(), T0)
        _, mem = decide(even_load(32, 4, T0 + 5), 4, policy, make_replicas(), mem, T0 + 5)

        assert mem.last_scale is not None
        assert mem.last_decision is not None
        assert (UP, 4, T0) == (mem.last_scale.direction, mem.last_scale.target, mem.last_scale.at)
        assert (NONE, 4, T0 + 5) == (
            mem.last_decision.direction,
            mem.last_decision.target,
            mem.last_decision.at,
        )

    def test_restart_between_evaluations_changes_nothing(self) -> None:
        """Storing and reloading the memory at every tick gives the same decisions."""
        policy = make_policy(scale_up_window_s=15, scale_down_window_s=60)
        replicas = make_replicas()

        def total(t: float) -> float:
            return 40 if T0 + 20 <= t < T0 + 100 else 5

        straight, _ = simulate(policy, replicas, start=1, total_load=total, ticks=50)
        count, mem = 1, Memory()
        restarted = []
        for index in range(50):
            now = T0 + index * 5
            mem = memory_from_json(memory_to_json(mem))
            decision, mem = decide(
                even_load(total(now), count, now), count, policy, replicas, mem, now
            )
            restarted.append(decision.target)
            count = decision.target

        assert counts(straight) == restarted
        assert len(set(restarted)) > 1

    def test_restart_under_load_does_not_scale_down(self) -> None:
        """A new leader reading the memory keeps the high recommendation of the window."""
        policy = make_policy(scale_down_window_s=300)
        replicas = make_replicas()
        history, mem = simulate(policy, replicas, start=1, total_load=lambda _: 40, ticks=3)
        count = counts(history)[-1]

        reloaded = memory_from_json(memory_to_json(mem))
        decision, _ = decide(
            even_load(0, count, T0 + 20), count, policy, replicas, reloaded, T0 + 20
        )

        assert (NONE, 5) == (decision.direction, decision.target)

    def test_clock_stepping_back_keeps_history_ordered(self) -> None:
        """A leader whose clock is behind never reorders the stored history."""
        policy = make_policy(scale_up_window_s=10, scale_down_window_s=10)
        _, mem = decide(even_load(32, 1, T0), 1, policy, make_replicas(), Memory(), T0)

        _, mem = decide(even_load(8, 1, T0 - 50), 1, policy, make_replicas(), mem, T0 - 50)

        times = [sample.at for sample in mem.history]
        assert sorted(times) == times
