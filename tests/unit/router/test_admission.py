"""Admission decisions and the bounded per-model queue ordered by (priority, arrival)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from router_builders import endpoint_entry, snapshot_of

from caravan_llm.router.core.admission import (
    AdmissionPolicy,
    AdmissionQueues,
    Admit,
    Queue,
    Reject,
    UnknownModel,
    decide_admission,
)
from caravan_llm.router.core.balancer import NoEndpointReason, NotPicked, Picked
from caravan_llm.router.core.errors import NoHealthyEndpoint, QueueFull, QueueTimeout

POLICY = AdmissionPolicy(
    max_queue_per_model=2,
    queue_timeout_s=30.0,
    cold_start_hold_s=300.0,
    retry_after_s=1,
    cold_start_retry_after_s=10,
)
NOW = 1_000.0


def decide(
    reason: NoEndpointReason, *, depth: int = 0, declared: bool = True
) -> Admit | Queue | Reject | UnknownModel:
    return decide_admission(
        NotPicked(reason), queue_depth=depth, model_declared=declared, policy=POLICY, now=NOW
    )


class TestDecideAdmission:
    def test_picked_endpoint_is_admitted(self) -> None:
        """A request the balancer placed goes straight through."""
        endpoint = snapshot_of(endpoint_entry("a")).by_id["a"]

        decision = decide_admission(
            Picked(endpoint), queue_depth=0, model_declared=True, policy=POLICY, now=NOW
        )

        assert Admit(endpoint) == decision

    @pytest.mark.parametrize(
        "reason",
        [
            NoEndpointReason.AT_CAPACITY,
            NoEndpointReason.NONE_HEALTHY,
            NoEndpointReason.BREAKERS_OPEN,
        ],
    )
    def test_busy_or_unhealthy_model_queues_with_the_queue_deadline(
        self, reason: NoEndpointReason
    ) -> None:
        """Full, unhealthy or breaker-open endpoints make it wait, up to the queue timeout."""
        assert Queue(deadline=NOW + 30.0, cold_start=False) == decide(reason)

    def test_declared_model_with_no_endpoint_is_held_for_cold_start(self) -> None:
        """A declared model with zero replicas holds the request for the cold-start deadline."""
        assert Queue(deadline=NOW + 300.0, cold_start=True) == decide(NoEndpointReason.NO_ENDPOINTS)

    def test_undeclared_model_with_no_endpoint_is_unknown(self) -> None:
        """A model nobody declared and nothing serves is a 404, not a wait."""
        assert UnknownModel() == decide(NoEndpointReason.NO_ENDPOINTS, declared=False)

    def test_full_queue_at_capacity_rejects_with_429(self) -> None:
        """A busy model with a full queue answers 429 with Retry-After."""
        decision = decide(NoEndpointReason.AT_CAPACITY, depth=2)

        assert Reject(429, 1, NoEndpointReason.AT_CAPACITY, queue_full=True) == decision
        assert isinstance(decision, Reject)
        error = decision.error("qwen")
        assert (QueueFull, 429, 1) == (
            type(error),
            error.status,
            getattr(error, "retry_after_s", None),
        )

    @pytest.mark.parametrize(
        ("reason", "retry_after"),
        [(NoEndpointReason.NONE_HEALTHY, 1), (NoEndpointReason.NO_ENDPOINTS, 10)],
    )
    def test_full_queue_when_unavailable_rejects_with_503(
        self, reason: NoEndpointReason, retry_after: int
    ) -> None:
        """An unavailable model with a full queue answers 503; cold start asks for a longer wait."""
        decision = decide(reason, depth=2)

        assert Reject(503, retry_after, reason, queue_full=True) == decision
        assert isinstance(decision, Reject)
        assert isinstance(decision.error("qwen"), NoHealthyEndpoint)

    def test_every_endpoint_tried_rejects_without_queueing(self) -> None:
        """A request that already tried every endpoint ends with 503 rather than waiting."""
        decision = decide(NoEndpointReason.ALL_EXCLUDED)

        assert Reject(503, 1, NoEndpointReason.ALL_EXCLUDED, queue_full=False) == decision


class TestQueueOrdering:
    def test_lower_priority_number_first_then_arrival_order(self) -> None:
        """Tickets leave by priority (lower first), and first come first served within one."""
        queues = AdmissionQueues(max_per_model=10)
        names = {}
        for name, priority in [("late-normal", 0), ("urgent", -5), ("normal", 0), ("batch", 3)]:
            ticket = queues.enqueue("m", priority=priority, now=NOW, deadline=NOW + 60)
            names[ticket.seq] = name

        order = []
        while (popped := queues.pop_ready("m", NOW)) is not None:
            order.append(names[popped.seq])

        assert order == ["urgent", "late-normal", "normal", "batch"]

    def test_queues_are_per_model(self) -> None:
        """Each model has its own queue, depth and bound."""
        queues = AdmissionQueues(max_per_model=1)
        queues.enqueue("a", priority=0, now=NOW, deadline=NOW + 60)
        queues.enqueue("b", priority=0, now=NOW, deadline=NOW + 60)

        assert (queues.depths(), queues.pop_ready("c", NOW)) == ({"a": 1, "b": 1}, None)

    def test_bound_rejects_with_queue_full(self) -> None:
        """Enqueueing past the bound raises QueueFull carrying Retry-After."""
        queues = AdmissionQueues(max_per_model=2)
        for _ in range(2):
            queues.enqueue("m", priority=0, now=NOW, deadline=NOW + 60)

        with pytest.raises(QueueFull) as raised:
            queues.enqueue("m", priority=0, now=NOW, deadline=NOW + 60, retry_after_s=4)

        assert (raised.value.status, raised.value.retry_after_s, queues.depth("m")) == (429, 4, 2)

    def test_requeue_restores_the_ticket_to_its_place(self) -> None:
        """A ticket popped and put back (the pick failed) is still first in line."""
        queues = AdmissionQueues(max_per_model=2)
        first = queues.enqueue("m", priority=0, now=NOW, deadline=NOW + 60)
        queues.enqueue("m", priority=0, now=NOW + 1, deadline=NOW + 60)

        popped = queues.pop_ready("m", NOW + 2)
        assert first == popped
        queues.requeue(first)

        assert first == queues.pop_ready("m", NOW + 3)

    def test_cancel_removes_a_waiting_ticket(self) -> None:
        """A client that goes away frees its place; cancelling twice says so."""
        queues = AdmissionQueues(max_per_model=2)
        gone = queues.enqueue("m", priority=0, now=NOW, deadline=NOW + 60)
        stays = queues.enqueue("m", priority=0, now=NOW, deadline=NOW + 60)

        assert (queues.cancel(gone), queues.cancel(gone)) == (True, False)
        assert (1, stays) == (queues.depth("m"), queues.pop_ready("m", NOW))


class TestDeadlines:
    def test_expire_returns_late_tickets_and_keeps_the_rest(self) -> None:
        """Tickets past their deadline come back from expire, oldest first; others keep waiting."""
        queues = AdmissionQueues(max_per_model=10)
        short = queues.enqueue("a", priority=0, now=NOW, deadline=NOW + 5)
        cold = queues.enqueue("b", priority=0, now=NOW, deadline=NOW + 300, cold_start=True)
        shorter = queues.enqueue("b", priority=1, now=NOW, deadline=NOW + 2)

        assert queues.expire(NOW + 1) == []
        assert [short, shorter] == queues.expire(NOW + 5)
        assert queues.depths() == {"b": 1}
        assert [cold] == queues.expire(NOW + 300)
        assert queues.depths() == {}

    def test_pop_ready_never_hands_out_an_expired_ticket(self) -> None:
        """An expired ticket at the head is skipped by pop and reported by the next expire."""
        queues = AdmissionQueues(max_per_model=10)
        late = queues.enqueue("m", priority=-1, now=NOW, deadline=NOW + 1)
        in_time = queues.enqueue("m", priority=0, now=NOW, deadline=NOW + 60)

        assert in_time == queues.pop_ready("m", NOW + 2)
        assert [late] == queues.expire(NOW + 2)

    def test_timeout_error_names_what_was_awaited(self) -> None:
        """An expired ticket answers 503 with the Retry-After of its kind of wait."""
        queues = AdmissionQueues(max_per_model=10)
        cold = queues.enqueue("m", priority=0, now=NOW, deadline=NOW + 1, cold_start=True)

        error = cold.timeout_error(POLICY)

        assert (QueueTimeout, 503, 10, True) == (
            type(error),
            error.status,
            error.retry_after_s,
            error.cold_start,
        )
        assert "first replica" in error.message


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("enqueue"), st.integers(-2, 2), st.floats(0.5, 20)),
        st.tuples(st.just("pop"), st.just(0), st.just(0.0)),
        st.tuples(st.just("cancel"), st.integers(0, 50), st.just(0.0)),
        st.tuples(st.just("tick"), st.just(0), st.floats(0, 5)),
    ),
    max_size=80,
)


@settings(max_examples=100, deadline=None)
@given(OPS)
def test_every_ticket_leaves_exactly_once_and_in_order(ops: list[tuple[str, int, float]]) -> None:
    """Each ticket is popped, cancelled or expired exactly once; pops follow (priority, arrival)."""
    queues = AdmissionQueues(max_per_model=8)
    now = 0.0
    issued = []
    left: list[int] = []
    for op, number, amount in ops:
        if op == "enqueue" and queues.depth("m") < 8:
            issued.append(queues.enqueue("m", priority=number, now=now, deadline=now + amount))
        elif op == "pop":
            ticket = queues.pop_ready("m", now)
            if ticket is not None:
                assert now < ticket.deadline
                waiting = [t for t in issued if t.seq not in left and t.seq != ticket.seq]
                in_time = [t for t in waiting if now < t.deadline]
                assert all((ticket.priority, ticket.seq) < (t.priority, t.seq) for t in in_time)
                left.append(ticket.seq)
        elif op == "cancel" and issued:
            ticket = issued[number % len(issued)]
            if queues.cancel(ticket):
                left.append(ticket.seq)
        else:
            now += amount
            left.extend(ticket.seq for ticket in queues.expire(now))
        assert len(left) == len(set(left))
    left.extend(ticket.seq for ticket in queues.expire(now + 1_000))

    assert sorted(t.seq for t in issued) == sorted(left)
