"""Whose fault an engine's refusal is (router/core/input_fault.py, edge/engine_answers.py)."""

from __future__ import annotations

import json

import pytest

from caravan_llm.router.core.breaker import BreakerPolicy
from caravan_llm.router.core.input_fault import client_fault_status, input_at_fault, vouched
from caravan_llm.router.core.live_state import (
    EndpointLiveState,
    Lease,
    Outcome,
    blame,
    finish_request,
    start_request,
)
from caravan_llm.router.edge.engine_answers import MAX_MESSAGE_CHARS, engine_message, rejection

POLICY = BreakerPolicy(failure_threshold=2, cool_down_s=10.0)
WINDOW_S = 60.0


def served_at(now: float) -> dict[str, EndpointLiveState]:
    """The live state of endpoint `a` after one request there succeeded at `now`."""
    live: dict[str, EndpointLiveState] = {}
    lease = start_request(live, "a", POLICY, now)
    finish_request(live, lease, Outcome.SUCCESS, POLICY, now)
    return live


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, True),
        (404, True),
        (413, True),
        (422, True),
        (401, False),
        (408, False),
        (429, False),
        (200, False),
        (500, False),
        (501, False),
    ],
)
def test_only_4xx_about_the_input_are_the_clients(status: int, expected: bool) -> None:
    """An engine's 4xx is the client's fault, except its key (401), timeout (408) and load (429)."""
    assert expected == client_fault_status(status)


def test_a_replica_that_served_lately_is_vouched_for() -> None:
    """A success within the window vouches for the replica; an older one does not."""
    live = served_at(100.0)

    assert (True, True, False) == (
        vouched(live["a"], 100.0, WINDOW_S),
        vouched(live["a"], 160.0, WINDOW_S),
        vouched(live["a"], 160.5, WINDOW_S),
    )


def test_a_replica_that_never_served_or_failed_since_is_not_vouched_for() -> None:
    """No success at all, or a failure after the last success, gives no vouching."""
    live = served_at(100.0)
    lease = start_request(live, "a", POLICY, 101.0)
    finish_request(live, lease, Outcome.FAILURE, POLICY, 101.0)

    assert (False, False, False) == (
        vouched(None, 101.0, WINDOW_S),
        vouched(EndpointLiveState(), 101.0, WINDOW_S),
        vouched(live["a"], 101.0, WINDOW_S),
    )


def test_blame_counts_a_suspected_500_against_its_replica() -> None:
    """A suspicion proved right counts as a failure: two of them open the breaker."""
    live = served_at(100.0)
    for now in (101.0, 102.0):
        lease = start_request(live, "a", POLICY, now)
        finish_request(live, lease, Outcome.NO_VERDICT, POLICY, now)
        blame(live, "a", POLICY, now)

    assert ("open", 0) == (live["a"].breaker.phase.value, live["a"].in_flight)


def test_blame_of_a_vanished_endpoint_is_ignored() -> None:
    """Blaming an endpoint the live state no longer holds changes nothing."""
    live: dict[str, EndpointLiveState] = {}
    blame(live, "gone", POLICY, 1.0)
    finish_request(live, Lease("gone", probe=False), Outcome.FAILURE, POLICY, 1.0)

    assert {} == live


@pytest.mark.parametrize(
    ("suspects", "can_retry", "expected"),
    [
        ((), True, False),
        ((), False, False),
        (("a",), True, False),
        (("a",), False, True),
        (("a", "b"), True, True),
    ],
)
def test_the_input_is_blamed_when_two_replicas_agree_or_none_is_left(
    suspects: tuple[str, ...], can_retry: bool, expected: bool
) -> None:
    """Two suspected 500s, or one with no other attempt possible, blame the input."""
    assert expected == input_at_fault(suspects, can_retry=can_retry)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {"error": {"message": "too long", "param": "messages", "code": 400}},
            ("too long", "messages"),
        ),
        ({"error": "Unauthorized"}, ("Unauthorized", None)),
        ({"detail": "Not Found"}, ("Not Found", None)),
        (
            {
                "detail": [
                    {
                        "loc": ["body", "messages", 0, "content"],
                        "msg": "Field required",
                        "input": "secret prompt",
                    },
                    {"loc": ["body", "top_logprobs"], "msg": "must be <= 20"},
                ]
            },
            (
                "messages[0].content: Field required; top_logprobs: must be <= 20",
                "messages[0].content",
            ),
        ),
        ({"message": "bad\nthing\t here"}, ("bad thing here", None)),
        ({"error": {"message": "   "}}, (None, None)),
        ([1, 2], (None, None)),
        ({"detail": 5}, (None, None)),
    ],
)
def test_engine_messages_are_read_from_every_shape(
    body: object, expected: tuple[str | None, str | None]
) -> None:
    """OpenAI's, bare, FastAPI's and validation-list errors give their message and field."""
    assert expected == engine_message(json.dumps(body).encode())


def test_engine_messages_are_bounded_and_text_bodies_are_not_copied() -> None:
    """A long message is cut; a body that is not JSON gives no message."""
    long = engine_message(json.dumps({"error": {"message": "x" * 5000}}).encode())[0]

    assert (MAX_MESSAGE_CHARS, (None, None), (None, None)) == (
        len(long or ""),
        engine_message(b"<html>502 Bad Gateway</html>"),
        engine_message(b"\xff\xfe"),
    )


def test_a_rejection_keeps_the_engine_status_and_is_openai_shaped() -> None:
    """A FastAPI 422 becomes an OpenAI error with the engine's status, message and field."""
    error = rejection(422, json.dumps({"detail": [{"loc": ["body", "n"], "msg": "bad"}]}).encode())
    text_error = rejection(413, b"Request Entity Too Large")

    assert (422, "invalid_request_error", "rejected_by_engine", "n: bad", "n") == (
        error.status,
        error.error_type,
        error.code,
        error.message,
        error.param,
    )
    assert (413, "The model's engine refused the request (HTTP 413).") == (
        text_error.status,
        text_error.message,
    )
