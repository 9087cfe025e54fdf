"""When has a model failed for good, and in what words (pure), and publishing it (I/O).

A replica has failed for good when Nomad gave up restarting its engine: the
latest failed allocation of the job's current version carries a
`Not Restarting` task event (the restart policy's attempts are used up, or
the driver said the error is unrecoverable), and no allocation of the job is
running and passing. Nomad's reschedule policy still places new attempts
with a growing delay, but the same spec fails the same way: it takes a
change to recover.

A replica also has failed for good when it cannot be placed and no freed
capacity would change that: it has no allocation, and every failed
placement of its latest evaluation was filtered out by constraints (no node
with its GPU class, its driver, its volume...) rather than by resources in
use (`DimensionExhausted`), which Nomad places as soon as they free up.
It takes a change to recover: a new node, or a new profile.

A model has failed when every one of its replica jobs (at least one) has,
or when its weights prefetch failed for this weights version and no replica
is ready: replicas wait for the prefetch, and only a change brings it back.
`scheduler/assess.py` applies these rules to each pass's observation; the
reconcile loop publishes the result as a `ModelFailure` at KV `failed/<name>`
(routers answer the model's requests with a 503 naming the reason; the
autoscaler stops scaling it up) and deletes it when it no longer holds:

- a new profile version: the jobs are registered again with a new version,
  whose allocations have not failed;
- `caravan scale`: it deletes the record in its transaction, and new
  replicas make "every replica" false;
- a replica passing its check.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from caravan_llm.common.contract import MAX_FAILURE_REASON_CHARS, ModelFailure
from caravan_llm.common.errors import HashiError
from caravan_llm.scheduler.placement_explain import ReplicaAsk, explain_failed_placement
from caravan_llm.scheduler.world import ObservedReplica, engine_events

log = logging.getLogger(__name__)

NOT_RESTARTING = "Not Restarting"
# Events that say what the task died of, newest first wins.
_CAUSE_EVENTS = frozenset({"Terminated", "Driver Failure", "Setup Failure", "Killed"})


def replica_failure(replica: ObservedReplica, health: Mapping[str, str]) -> str | None:
    """Why this replica failed for good, in `caravan status`'s words; None when it has not.

    `health` is Consul's check status by allocation id.
    """
    allocs = replica.allocs
    if any(a.client_status == "running" and health.get(a.id) == "passing" for a in allocs):
        return None
    current = [a for a in allocs if a.job_version == replica.version]
    failed = [a for a in current if a.client_status == "failed"]
    if not failed:
        return None
    latest = max(failed, key=lambda a: (a.modify_time_ns, a.id))
    events = engine_events(latest)
    given_up = [e for e in events if e.type == NOT_RESTARTING]
    if not given_up:
        return None
    causes = [e for e in events if e.type in _CAUSE_EVENTS]
    words = f"the engine failed and Nomad stopped restarting it ({given_up[-1].words})"
    if causes:
        words += f"; last: {causes[-1].words}"
    return words


def impossible_placement(failed_tg_allocs: Mapping[str, Any] | None, ask: ReplicaAsk) -> str | None:
    """Why a replica can never be placed as it is, in `caravan status`'s words; else None.

    None when nothing failed, or when some node was only short of resources
    in use (Nomad places the replica when they free up).
    """
    if not failed_tg_allocs:
        return None
    metrics = [metric for _, metric in sorted(failed_tg_allocs.items())]
    if any((metric or {}).get("DimensionExhausted") for metric in metrics):
        return None
    if any((metric or {}).get("QuotaExhausted") for metric in metrics):
        return None
    sentence = "; ".join(explain_failed_placement(metric or {}, ask) for metric in metrics)
    return f"cannot be placed: {sentence}"


def model_failure(replicas: Sequence[tuple[int, str | None]]) -> str | None:
    """The model's reason when every replica (index, failed-for-good reason) failed; else None."""
    if not replicas or any(reason is None for _, reason in replicas):
        return None
    index, reason = min(replicas, key=lambda item: item[0])
    more = f" (and the other {len(replicas) - 1})" if len(replicas) > 1 else ""
    return f"replica {index}{more}: {reason}"


@dataclass(frozen=True, slots=True)
class FailureUpdate:
    """One KV change: publish `failure` for `model`, or delete its record (None)."""

    model: str
    failure: ModelFailure | None


def failure_updates(
    found: Mapping[str, str], stored: Mapping[str, ModelFailure], now: float
) -> list[FailureUpdate]:
    """The writes that make KV say `found` (pure); an unchanged reason keeps its `since`."""
    updates = [
        FailureUpdate(model, ModelFailure(reason=reason, since=now))
        for model, reason in sorted(found.items())
        if model not in stored or stored[model].reason != reason[:MAX_FAILURE_REASON_CHARS]
    ]
    updates += [FailureUpdate(model, None) for model in sorted(set(stored) - set(found))]
    return updates


class FailureStore(Protocol):
    async def record_failure(self, name: str, failure: ModelFailure | None) -> None: ...


async def publish_failures(store: FailureStore, updates: Sequence[FailureUpdate]) -> None:
    """Write the updates; a failed write is logged and tried again on the next pass."""
    for update in updates:
        try:
            await store.record_failure(update.model, update.failure)
        except HashiError as exc:
            log.warning(
                "model_failure_not_written", extra={"model": update.model, "error": str(exc)}
            )
            continue
        if update.failure is None:
            log.info("model_failure_cleared", extra={"model": update.model})
        else:
            log.error(
                "model_failed", extra={"model": update.model, "reason": update.failure.reason}
            )
