"""What outranks the load (pure): a `caravan scale` override in force, a model that failed."""

from __future__ import annotations

from caravan_llm.common.contract import ModelFailure, ScaleOverride
from caravan_llm.scheduler.autoscale.memory import (
    DecisionRecord,
    Direction,
    Memory,
    RecommendationSample,
)
from caravan_llm.scheduler.autoscale.override import constrain, override_in_force
from caravan_llm.scheduler.autoscale.policy import ScaleDecision

NOW = 1_700_000_000.0
EARLIER = DecisionRecord(Direction.UP, 3, "earlier scale", NOW - 500)


def decision(direction: Direction, target: int) -> ScaleDecision:
    return ScaleDecision(direction, target, "inflight 0.0 < target 4", {"inflight": 0.0})


def memories() -> tuple[Memory, Memory]:
    before = Memory(last_scale=EARLIER)
    after = Memory(
        history=(RecommendationSample(at=NOW, count=1),),
        last_decision=DecisionRecord(Direction.DOWN, 1, "x", NOW),
        last_scale=DecisionRecord(Direction.DOWN, 1, "x", NOW),
    )
    return before, after


def test_override_in_force_holds_the_count_against_an_idle_scale_down():
    """Held at 3 until later: the decision is none at 3 and says what the load alone says."""
    before, after = memories()
    override = ScaleOverride(count=3, until=NOW + 60, set_at=NOW - 10)

    held, memory = constrain(
        decision(Direction.DOWN, 1),
        before,
        after,
        current=3,
        override=override,
        failure=None,
        now=NOW,
    )

    assert (Direction.NONE, 3) == (held.direction, held.target)
    assert held.reason.startswith("overridden: `caravan scale` holds 3 until 2023-11-14 22:14:20")
    assert "the load alone says down to 1" in held.reason
    assert EARLIER == memory.last_scale
    assert after.history == memory.history
    assert memory.last_decision is not None
    assert (Direction.NONE, 3, NOW) == (
        memory.last_decision.direction,
        memory.last_decision.target,
        memory.last_decision.at,
    )


def test_expired_override_lets_the_decision_through():
    """At `until` the override no longer holds: the autoscaler decides again."""
    before, after = memories()
    override = ScaleOverride(count=3, until=NOW, set_at=NOW - 3600)
    wanted = decision(Direction.DOWN, 1)

    result = constrain(wanted, before, after, current=3, override=override, failure=None, now=NOW)

    assert (wanted, after) == result
    assert override_in_force(override, NOW) is None
    assert override == override_in_force(override, NOW - 1)


def test_failed_model_is_not_scaled_up_but_may_scale_down():
    """A failure record holds a scale-up (it would fail the same way); a scale-down passes."""
    before, after = memories()
    failure = ModelFailure(reason="replica 0: bad model path", since=NOW - 30)

    up, _ = constrain(
        decision(Direction.UP, 1), before, after, current=0, override=None, failure=failure, now=NOW
    )
    down = decision(Direction.DOWN, 1)
    kept, _ = constrain(down, before, after, current=2, override=None, failure=failure, now=NOW)

    assert (Direction.NONE, 0) == (up.direction, up.target)
    assert "every replica failed (replica 0: bad model path)" in up.reason
    assert down == kept
