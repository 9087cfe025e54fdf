"""Has a submitted revision rolled out, failed, or is it still on its way? (pure)

`caravan submit --wait` asks this of every model it submitted, from the
model's status as `caravan status --json` shows it (the same document
through Consul and Nomad directly or through the scheduler's API). The
answer is about the submitted revision only, never the previous one:

- A replica is of the submitted revision when it is `current`: its job's
  spec hash is the one the stored profile renders to. Right after a submit,
  before the scheduler has registered anything, every replica is still of
  the previous revision; what happened to them says nothing about this one.
- The model's `failure` record is the scheduler's, written a pass after it
  observed the failure and cleared a pass after a change: it may still be
  the previous revision's. It is believed only when no live replica exists
  to say otherwise (a current one that failed says so itself, below).
- A current replica that failed for good (Nomad stopped restarting it, or it
  can never be placed) fails the wait at once: it takes a change to recover,
  so waiting longer cannot make the revision ready.
- Ready: as many current replicas ready as desired, and none of the
  previous revision still live (a rolling update has finished).
- A replica whose engine exited non-zero carries the last lines of its
  stderr (`engine_stderr`, or `engine_stderr_unavailable` saying why not):
  its reasons end with them, so a failed or timed-out wait shows the
  engine's own error.
- `version`: when the submit said which version it wrote and the model now
  shows another, a later submission replaced this one: the wait ends,
  failed, saying so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Outcome(StrEnum):
    WAITING = "waiting"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Rollout:
    """Where one model's submitted revision stands."""

    name: str
    outcome: Outcome
    # Current replicas ready / desired, and live replicas of an earlier revision.
    ready: int
    desired: int
    outdated: int
    # Why it failed (FAILED), or what it waits for (WAITING), in plain words.
    reasons: tuple[str, ...] = ()

    def progress_line(self, replicas: Sequence[Mapping[str, Any]]) -> str:
        """`NAME: 1/2 ready (r0 ready, r1 starting)`, as `submit --wait` prints it."""
        states = ", ".join(
            f"r{r['replica']} {r['state']}" + ("" if r.get("current", True) else " (previous)")
            for r in replicas
        )
        return f"{self.name}: {self.ready}/{self.desired} ready ({states or 'no replicas'})"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "outcome": self.outcome.value,
            "ready": self.ready,
            "desired": self.desired,
            "outdated": self.outdated,
            "reasons": list(self.reasons),
        }


def engine_stderr_lines(replica: Mapping[str, Any]) -> list[str]:
    """`engine stderr (last lines):` and the lines, or why they are unavailable; none when the
    replica's engine has not exited non-zero (or nobody read its log)."""
    lines = [str(line) for line in replica.get("engine_stderr") or ()]
    if lines:
        return ["engine stderr (last lines):", *(f"  {line}" for line in lines)]
    why = replica.get("engine_stderr_unavailable")
    return [f"engine stderr unavailable: {why}"] if why else []


def _with_stderr(words: str, replica: Mapping[str, Any]) -> str:
    """A reason followed by the replica's engine stderr lines, one a line."""
    return "\n    ".join([words, *engine_stderr_lines(replica)])


def _live(replicas: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in replicas if not r.get("draining")]


def judge_rollout(model: Mapping[str, Any], version: int | None = None) -> Rollout:
    """Judge one model's status document for the revision that was submitted (pure)."""
    name = str(model["name"])
    desired = int(model["desired"])
    live = _live(model.get("replicas") or [])
    current = [r for r in live if r.get("current", True)]
    outdated = len(live) - len(current)
    ready = sum(1 for r in current if r.get("state") == "ready")

    def rollout(outcome: Outcome, reasons: Sequence[str] = ()) -> Rollout:
        return Rollout(name, outcome, ready, desired, outdated, tuple(reasons))

    shown = model.get("version")
    if version is not None and shown is not None and shown != version:
        return rollout(
            Outcome.FAILED,
            [f"version {version} was replaced by version {shown} before it was ready"],
        )
    failed = [r for r in current if r.get("failed")]
    if failed:
        return rollout(
            Outcome.FAILED,
            [_with_stderr(f"replica {r['replica']}: {r['failed']}", r) for r in failed],
        )
    failure = model.get("failure")
    if failure and not live:
        # No live replica, of this revision or another, to say otherwise.
        return rollout(Outcome.FAILED, [str(failure["reason"])])
    if model.get("status") == "prefetch failed":
        return rollout(Outcome.FAILED, [str(model.get("problem") or "the prefetch job failed")])
    if ready >= desired and not outdated:
        return rollout(Outcome.READY)
    return rollout(Outcome.WAITING, waiting_reasons(model, current, outdated))


def waiting_reasons(
    model: Mapping[str, Any], current: Sequence[Mapping[str, Any]], outdated: int
) -> list[str]:
    """What a model still waits for, one line each (what a timed-out wait prints)."""
    reasons: list[str] = []
    for replica in current:
        if replica.get("state") == "ready":
            continue
        words = f"replica {replica['replica']}: {replica.get('state')}"
        detail = replica.get("pending_reason") or replica.get("last_event")
        if detail:
            words += f" ({detail})"
        reasons.append(_with_stderr(words, replica))
    missing = int(model["desired"]) - len(current)
    if missing > 0:
        if not current and not outdated:
            reasons.append("no replica job exists yet; is `caravan scheduler` running?")
        else:
            reasons.append(f"{missing} replica(s) of this version not registered yet")
    if outdated:
        reasons.append(f"{outdated} replica(s) still run the previous version")
    if model.get("problem"):
        reasons.append(str(model["problem"]))
    return reasons
