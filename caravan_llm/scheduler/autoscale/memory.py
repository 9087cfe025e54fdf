"""What the autoscaler remembers about one model between evaluations, and its stored form.

`policy.decide` takes a `Memory` and returns the next one; nothing is hidden
in a client. The loop keeps it in Consul KV at `caravan/state/<name>`
(`KVLayout.state_key`), so that a scheduler restart or a leader change resumes
the stabilisation windows instead of forgetting them.

Every time in a `Memory` is wall-clock seconds (`time.time()`): the memory is
read back by another process, possibly on another host, where a monotonic
clock would mean nothing.

The history is a step function: each sample is the recommended count from its
time until the next sample, and only changes are stored, so under a steady
load it holds one entry. It is pruned to what the longest window can still
see.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# A hard bound on stored samples, for a load that flaps at every evaluation
# during a long window. Dropping the oldest only makes the windows act as if
# they began later, which delays scaling rather than hastening it.
MAX_HISTORY = 512

MEMORY_FORMAT_VERSION = 1


class Direction(StrEnum):
    UP = "up"
    DOWN = "down"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class RecommendationSample:
    """From `at` on, the policy recommended `count` replicas (before windows and caps)."""

    at: float
    count: int


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """A decision as shown by `caravan status`."""

    direction: Direction
    target: int
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class Memory:
    """The autoscaler's state for one model; a fresh `Memory()` is always safe.

    A fresh memory never scales down and never scales up before a full window
    has been observed, because the count in place is taken as the
    recommendation in force before the first sample.
    """

    history: tuple[RecommendationSample, ...] = ()
    # The latest evaluation, whatever it decided.
    last_decision: DecisionRecord | None = None
    # The latest evaluation that changed the count.
    last_scale: DecisionRecord | None = None
    # When the model last had work (in-flight, queued, demand) or its load was
    # unknown; the scale-to-zero timer runs from here.
    last_busy_at: float | None = None
    # Set by `memory_from_json` when the stored memory could not be read and a
    # fresh one was started instead; never stored.
    load_warning: str | None = None

    def with_recommendation(self, now: float, count: int, keep_s: float) -> Memory:
        """Add the recommendation made at `now`, and forget what `keep_s` no longer needs.

        A clock that steps backwards (the leader moved to a host whose clock is
        behind) never reorders the history: the sample is stamped no earlier
        than the last one, which only stretches the windows.
        """
        samples = list(self.history)
        if not samples or samples[-1].count != count:
            at = max(now, samples[-1].at) if samples else now
            samples.append(RecommendationSample(at=at, count=count))
        # Keep the newest sample at or before the horizon: it is the value in
        # force when the longest window begins.
        horizon = now - keep_s
        first = 0
        for index, sample in enumerate(samples):
            if sample.at <= horizon:
                first = index
        kept = samples[first:][-MAX_HISTORY:]
        return replace(self, history=tuple(kept))

    def in_force_since(self, since: float, before_history: int) -> tuple[int, ...]:
        """Every recommendation in force at some time from `since` to now.

        `before_history` stands for the time before the first sample (the
        count in place), so a window the history does not cover yet is never
        read as agreeing with the latest sample.
        """
        anchor = before_history
        later: list[int] = []
        for sample in self.history:
            if sample.at <= since:
                anchor = sample.count
            else:
                later.append(sample.count)
        return (anchor, *later)


# The stored form. Unknown keys are ignored, so a newer scheduler may add
# fields without breaking an older one during a rolling upgrade.
_TOLERANT = ConfigDict(frozen=True, extra="ignore")


class _StoredSample(BaseModel):
    model_config = _TOLERANT

    at: float = Field(allow_inf_nan=False)
    count: int = Field(ge=0)


class _StoredDecision(BaseModel):
    model_config = _TOLERANT

    direction: Direction
    target: int = Field(ge=0)
    reason: str
    at: float = Field(allow_inf_nan=False)


class _StoredMemory(BaseModel):
    model_config = _TOLERANT

    version: Literal[1]
    history: list[_StoredSample] = Field(default_factory=list)
    last_decision: _StoredDecision | None = None
    last_scale: _StoredDecision | None = None
    last_busy_at: float | None = Field(default=None, allow_inf_nan=False)


def _record_to_json(record: DecisionRecord | None) -> dict[str, object] | None:
    if record is None:
        return None
    return {
        "direction": record.direction.value,
        "target": record.target,
        "reason": record.reason,
        "at": record.at,
    }


def _record_from_stored(stored: _StoredDecision | None) -> DecisionRecord | None:
    if stored is None:
        return None
    return DecisionRecord(
        direction=stored.direction, target=stored.target, reason=stored.reason, at=stored.at
    )


def memory_to_json(memory: Memory) -> str:
    """The JSON stored in Consul KV (`load_warning` is not stored)."""
    document = {
        "version": MEMORY_FORMAT_VERSION,
        "history": [{"at": sample.at, "count": sample.count} for sample in memory.history],
        "last_decision": _record_to_json(memory.last_decision),
        "last_scale": _record_to_json(memory.last_scale),
        "last_busy_at": memory.last_busy_at,
    }
    return json.dumps(document, separators=(",", ":"), allow_nan=False)


def _fresh(problem: str) -> Memory:
    return Memory(load_warning=f"stored autoscaler memory ignored, starting fresh: {problem}")


def memory_from_json(text: str | bytes) -> Memory:
    """Read stored memory; anything unreadable gives a fresh `Memory` with `load_warning` set.

    A fresh memory is safe (it holds the count until the windows have been
    observed again), so a corrupt or foreign value in KV must never stop the
    autoscaler.
    """
    try:
        document = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        return _fresh(f"not JSON ({exc.__class__.__name__})")
    if not isinstance(document, dict):
        return _fresh(f"expected a JSON object, got {type(document).__name__}")
    version = document.get("version")
    if version != MEMORY_FORMAT_VERSION:
        return _fresh(f"unknown format version {version!r} (this scheduler reads 1)")
    try:
        stored = _StoredMemory.model_validate(document)
    except ValidationError as exc:
        fields = sorted({".".join(str(part) for part in error["loc"]) for error in exc.errors()})
        return _fresh(f"invalid fields: {', '.join(fields)}")
    samples = sorted(
        (RecommendationSample(at=sample.at, count=sample.count) for sample in stored.history),
        key=lambda sample: sample.at,
    )
    return Memory(
        history=tuple(samples[-MAX_HISTORY:]),
        last_decision=_record_from_stored(stored.last_decision),
        last_scale=_record_from_stored(stored.last_scale),
        last_busy_at=stored.last_busy_at,
    )
