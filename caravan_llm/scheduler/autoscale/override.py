"""What the autoscaler may not change (pure): a manual override, a model that failed for good.

`decide` says what the load asks for; `constrain` then applies the two rules
that outrank it, in this order:

1. **Override.** `caravan scale NAME N` on an autoscaled model writes a
   `ScaleOverride` (KV `override/<name>`) with the desired count. While it is
   in force (`now < until`) the count stays where it is, whatever the load
   says; the decision records what the autoscaler would have done, so
   `caravan status` shows both. The memory's history still takes the
   recommendation, so the windows are up to date when the override ends.
2. **Failure.** When every replica of the model has failed in a way that
   needs a change (KV `failed/<name>`, written by the reconcile loop), a
   scale-up is held: more replicas of the same spec would fail the same way,
   and a cold start for every waiting request would retry it in a loop.
   Scaling down stays allowed.

Both take `now` as a parameter; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import time
from dataclasses import replace

from caravan_llm.common.contract import ModelFailure, ScaleOverride
from caravan_llm.scheduler.autoscale.memory import DecisionRecord, Direction, Memory
from caravan_llm.scheduler.autoscale.policy import ScaleDecision


def utc_words(at: float) -> str:
    """A wall-clock time as operators read it: 2025-01-31 14:05:00 UTC."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def override_in_force(override: ScaleOverride | None, now: float) -> ScaleOverride | None:
    """The override when it still holds at `now`, else None."""
    return override if override is not None and override.in_force(now) else None


def _hold(
    decision: ScaleDecision,
    before: Memory,
    after: Memory,
    *,
    current: int,
    reason: str,
    now: float,
) -> tuple[ScaleDecision, Memory]:
    record = DecisionRecord(direction=Direction.NONE, target=current, reason=reason, at=now)
    # The recommendation stays in the history (the windows keep running), but
    # the decision that was not carried out is not recorded as a scaling.
    memory = replace(after, last_decision=record, last_scale=before.last_scale)
    return ScaleDecision(Direction.NONE, current, reason, decision.signals_used), memory


def constrain(
    decision: ScaleDecision,
    before: Memory,
    after: Memory,
    *,
    current: int,
    override: ScaleOverride | None,
    failure: ModelFailure | None,
    now: float,
) -> tuple[ScaleDecision, Memory]:
    """`decide`'s result with the override and failure rules applied (see the module doc).

    `before` is the memory `decide` was given, `after` the one it returned.
    """
    would = f"{decision.direction.value} to {decision.target}: {decision.reason}"
    held = override_in_force(override, now)
    if held is not None:
        reason = (
            f"overridden: `caravan scale` holds {current} until {utc_words(held.until)} "
            f"(the load alone says {would})"
        )
        return _hold(decision, before, after, current=current, reason=reason, now=now)
    if failure is not None and decision.direction is Direction.UP:
        reason = (
            f"holding {current}: every replica failed ({failure.reason}) since "
            f"{utc_words(failure.since)}; more replicas of this spec would fail the same "
            f"way, so no scale-up until a change (new profile, `caravan scale`, a passing "
            f"replica) (the load alone says {would})"
        )
        return _hold(decision, before, after, current=current, reason=reason, now=now)
    return decision, after
