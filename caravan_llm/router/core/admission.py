"""Admission control: admit, queue with a deadline, or reject, as plain data.

`decide_admission` turns a pick result into one decision. `AdmissionQueues`
holds the requests that wait, per model, bounded, ordered by (priority,
arrival): a lower priority number goes first (vLLM's convention), and equal
priorities go first come, first served. Each ticket has a deadline; a request
for a model with no endpoint at all (a cold start) is held longer, for the
first replica to boot, and so is one for a declared model whose every replica
is out (`rebuild_hold`): the scheduler rebuilds it, which takes Nomad's down
detection plus a reschedule and a model load, far longer than a capacity wait.

No asyncio here: the I/O layer pairs each ticket with a future, pops tickets
when capacity frees up (a request finishes, a snapshot brings an endpoint),
and fails the futures of the tickets `expire` returns. On one event loop that
drain runs before any new arrival is looked at, so queued requests keep their
place.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, assert_never

from caravan_llm.router.core.balancer import NoEndpointReason, NotPicked, Picked, PickResult
from caravan_llm.router.core.errors import (
    NoHealthyEndpoint,
    QueueFull,
    QueueTimeout,
    RebuildTimeout,
    RouterError,
)

if TYPE_CHECKING:
    from caravan_llm.router.core.endpoints import Endpoint


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """Bounds and deadlines; built once from the router's settings."""

    max_queue_per_model: int = 256
    # How long a request may wait for capacity (GIE's default request TTL is 30 s).
    queue_timeout_s: float = 30.0
    # How long a request may wait for a model's first replica to become ready;
    # engines load weights for minutes, so this is much longer.
    cold_start_hold_s: float = 300.0
    retry_after_s: int = 1
    cold_start_retry_after_s: int = 10
    # How long a request may wait for the rebuild of a declared model's replicas
    # when every one is out (dead, breaker open, critical): the expected rebuild
    # time, bounded. None: cold_start_hold_s (a rebuild is a down detection of
    # 10-30 s with Nomad's defaults, then a cold start).
    rebuild_hold_s: float | None = None
    # Hold requests for a rebuild at all (False: a breaker-open model queues
    # for queue_timeout_s like a full one, and a retry whose last replica died
    # ends with 503 at once).
    hold_for_rebuild: bool = True

    def __post_init__(self) -> None:
        if self.max_queue_per_model < 0:
            raise ValueError(f"max_queue_per_model must be >= 0, got {self.max_queue_per_model}")
        if self.queue_timeout_s <= 0 or self.cold_start_hold_s <= 0:
            raise ValueError("queue_timeout_s and cold_start_hold_s must be > 0")
        if self.rebuild_hold_s is not None and self.rebuild_hold_s <= 0:
            raise ValueError(f"rebuild_hold_s must be > 0, got {self.rebuild_hold_s}")
        if self.retry_after_s < 1 or self.cold_start_retry_after_s < 1:
            raise ValueError("retry_after_s and cold_start_retry_after_s must be >= 1")

    @property
    def rebuild_bound_s(self) -> float:
        """How long a request is held for a rebuild at most."""
        return self.cold_start_hold_s if self.rebuild_hold_s is None else self.rebuild_hold_s


@dataclass(frozen=True, slots=True)
class Admit:
    endpoint: Endpoint


@dataclass(frozen=True, slots=True)
class Queue:
    deadline: float
    # Waiting for a first replica (longer deadline; the scheduler gets a demand signal).
    cold_start: bool
    # Waiting for the rebuild of a replica that is out (breaker open), not for capacity.
    rebuild: bool = False


@dataclass(frozen=True, slots=True)
class Reject:
    status: int  # 429 or 503
    retry_after_s: int
    reason: NoEndpointReason
    queue_full: bool

    def error(self, model: str) -> RouterError:
        """The error to answer the client with."""
        if self.queue_full and self.status == 429:
            return QueueFull(model, self.retry_after_s)
        return NoHealthyEndpoint(model, self.reason.value, self.retry_after_s)


@dataclass(frozen=True, slots=True)
class UnknownModel:
    """No endpoint serves the model and no profile declares it: 404."""


Decision = Admit | Queue | Reject | UnknownModel


def decide_admission(
    result: PickResult,
    *,
    queue_depth: int,
    model_declared: bool,
    policy: AdmissionPolicy,
    now: float,
    replacement: bool = False,
    rebuild_expected: bool = False,
) -> Decision:
    """What to do with a request, given what the balancer found for it.

    `rebuild_expected`: the scheduler keeps the model's replicas up (a profile
    declares it, no failure record says they failed for good), so one that is
    out is rebuilt.

    1. An endpoint was picked: admit.
    2. No endpoint serves the model: hold it for a cold start if a profile
       declares the model, else 404.
    3. Endpoints exist but are full, unhealthy or breaker-open: queue, since
       capacity frees up or Nomad replaces the replica within seconds. When
       every one is breaker-open and a rebuild is expected, hold it like a
       cold start up to the rebuild bound: the replica is dead or failing,
       and its rebuild takes longer than a capacity wait.
    4. The request already tried every endpoint: 503, no queue (the proxy's
       retry loop ends there), unless it waits for the `replacement` of a
       replica that died (`caravan_llm.router.core.replacement`) and a profile declares the
       model: then it is held like a cold start, up to the rebuild bound.
    5. A full queue rejects: 429 when the model is at capacity (back off), 503
       when it is unavailable.
    """
    match result:
        case Picked(endpoint=endpoint):
            return Admit(endpoint)
        case NotPicked(reason=reason):
            pass
        case _:
            assert_never(result)
    cold_start = reason is NoEndpointReason.NO_ENDPOINTS
    if cold_start and not model_declared:
        return UnknownModel()
    replaced = reason is NoEndpointReason.ALL_EXCLUDED and replacement and model_declared
    rebuild = (
        reason is NoEndpointReason.BREAKERS_OPEN and rebuild_expected and policy.hold_for_rebuild
    )
    cold_start = cold_start or replaced or rebuild
    retry_after = policy.cold_start_retry_after_s if cold_start else policy.retry_after_s
    if reason is NoEndpointReason.ALL_EXCLUDED and not cold_start:
        return Reject(503, retry_after, reason, queue_full=False)
    if queue_depth >= policy.max_queue_per_model:
        status = 429 if reason is NoEndpointReason.AT_CAPACITY else 503
        return Reject(status, retry_after, reason, queue_full=True)
    if replaced or rebuild:
        return Queue(deadline=now + policy.rebuild_bound_s, cold_start=True, rebuild=rebuild)
    hold_s = policy.cold_start_hold_s if cold_start else policy.queue_timeout_s
    return Queue(deadline=now + hold_s, cold_start=cold_start)


# Every endpoint of the model is out: none merely full.
_OUT = frozenset(
    {NoEndpointReason.NO_ENDPOINTS, NoEndpointReason.NONE_HEALTHY, NoEndpointReason.BREAKERS_OPEN}
)


def rebuild_hold(
    ticket: Ticket, reason: NoEndpointReason, *, rebuild_expected: bool, policy: AdmissionPolicy
) -> Ticket | None:
    """The ticket held for a rebuild instead, when its model's replicas went out while it waited.

    A request that queued for capacity (or for breakers to cool down) keeps
    its place, and its deadline moves to the rebuild bound counted from its
    arrival; None: nothing changes (already held that long, the model has an
    endpoint that is merely full, or no rebuild is expected).
    """
    if ticket.rebuild or ticket.cold_start or not rebuild_expected or not policy.hold_for_rebuild:
        return None
    if reason not in _OUT:
        return None
    deadline = max(ticket.deadline, ticket.enqueued_at + policy.rebuild_bound_s)
    return replace(ticket, deadline=deadline, cold_start=True, rebuild=True)


@dataclass(frozen=True, slots=True)
class Ticket:
    """One waiting request; the I/O layer keys its future by the ticket."""

    seq: int  # arrival order, unique per AdmissionQueues
    model: str
    priority: int
    enqueued_at: float
    deadline: float
    cold_start: bool
    # Held for the rebuild of the model's replicas (`rebuild_hold`, or a breaker-open pick).
    rebuild: bool = False

    def timeout_error(self, policy: AdmissionPolicy) -> QueueTimeout:
        """The error for a ticket that expired."""
        retry_after = policy.cold_start_retry_after_s if self.cold_start else policy.retry_after_s
        if self.rebuild:
            waited_s = self.deadline - self.enqueued_at
            return RebuildTimeout(self.model, retry_after, waited_s=waited_s)
        return QueueTimeout(self.model, retry_after, cold_start=self.cold_start)


@dataclass(slots=True)
class _ModelQueue:
    # (priority, seq) entries; a seq no longer in `waiting` is a tombstone left
    # by cancel or expire, skipped on pop and swept by compaction.
    heap: list[tuple[int, int]] = field(default_factory=list)
    waiting: dict[int, Ticket] = field(default_factory=dict)


class AdmissionQueues:
    """Bounded per-model queues of tickets, ordered by (priority, arrival)."""

    def __init__(self, max_per_model: int) -> None:
        if max_per_model < 0:
            raise ValueError(f"max_per_model must be >= 0, got {max_per_model}")
        self._max_per_model = max_per_model
        self._queues: dict[str, _ModelQueue] = {}
        self._seq = itertools.count()
        # Tickets found expired by pop_ready, handed out by the next expire().
        self._expired: list[Ticket] = []

    def depth(self, model: str) -> int:
        """Requests waiting for this model (exported to the autoscaler)."""
        queue = self._queues.get(model)
        return len(queue.waiting) if queue is not None else 0

    def depths(self) -> dict[str, int]:
        """Waiting requests of every model that has any."""
        return {model: len(queue.waiting) for model, queue in self._queues.items() if queue.waiting}

    def enqueue(
        self,
        model: str,
        *,
        priority: int,
        now: float,
        deadline: float,
        cold_start: bool = False,
        retry_after_s: int = 1,
        rebuild: bool = False,
    ) -> Ticket:
        """Add a waiting request. Raises QueueFull when the model's queue is at its bound."""
        queue = self._queues.setdefault(model, _ModelQueue())
        if len(queue.waiting) >= self._max_per_model:
            raise QueueFull(model, retry_after_s)
        ticket = Ticket(next(self._seq), model, priority, now, deadline, cold_start, rebuild)
        self._push(queue, ticket)
        return ticket

    def pop_ready(self, model: str, now: float) -> Ticket | None:
        """Remove and return the first waiting ticket of the model that is still in time."""
        queue = self._queues.get(model)
        if queue is None:
            return None
        while queue.heap:
            _, seq = heapq.heappop(queue.heap)
            ticket = queue.waiting.pop(seq, None)
            if ticket is None:
                continue
            if now >= ticket.deadline:
                self._expired.append(ticket)
                continue
            self._forget_if_empty(model, queue)
            return ticket
        self._forget_if_empty(model, queue)
        return None

    def requeue(self, ticket: Ticket) -> None:
        """Put a popped ticket back in its original place (the pick after the pop failed).

        The bound does not apply: the ticket was already counted when it queued.
        """
        self._push(self._queues.setdefault(ticket.model, _ModelQueue()), ticket)

    def update(self, ticket: Ticket) -> bool:
        """Replace a waiting ticket by a new version of itself (same seq and priority, so the
        same place); False if it was no longer waiting."""
        queue = self._queues.get(ticket.model)
        if queue is None or ticket.seq not in queue.waiting:
            return False
        queue.waiting[ticket.seq] = ticket
        return True

    def cancel(self, ticket: Ticket) -> bool:
        """Drop a ticket whose client went away; False if it was no longer waiting."""
        queue = self._queues.get(ticket.model)
        if queue is None or queue.waiting.pop(ticket.seq, None) is None:
            return False
        self._compact(queue)
        self._forget_if_empty(ticket.model, queue)
        return True

    def expire(self, now: float) -> list[Ticket]:
        """Remove and return every ticket whose deadline has passed, oldest first."""
        expired, self._expired = self._expired, []
        for model, queue in list(self._queues.items()):
            late = [seq for seq, ticket in queue.waiting.items() if now >= ticket.deadline]
            for seq in late:
                expired.append(queue.waiting.pop(seq))
            if late:
                self._compact(queue)
            self._forget_if_empty(model, queue)
        expired.sort(key=lambda ticket: ticket.seq)
        return expired

    def _push(self, queue: _ModelQueue, ticket: Ticket) -> None:
        queue.waiting[ticket.seq] = ticket
        heapq.heappush(queue.heap, (ticket.priority, ticket.seq))

    def _compact(self, queue: _ModelQueue) -> None:
        # Tombstones would otherwise pile up in a queue that is never popped.
        if len(queue.heap) > 2 * len(queue.waiting) + 16:
            queue.heap = [(t.priority, t.seq) for t in queue.waiting.values()]
            heapq.heapify(queue.heap)

    def _forget_if_empty(self, model: str, queue: _ModelQueue) -> None:
        if not queue.waiting:
            queue.heap.clear()
            self._queues.pop(model, None)
