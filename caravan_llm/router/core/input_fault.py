"""Whose fault an engine's refusal is: the client's input, or the replica.

An engine's 4xx (other than 401, 408 and 429, which are about the router's
key, the connection and the engine's load) is the engine refusing what the
client sent: it goes back to that client as a 4xx, counts nothing against
the replica's breaker and is not retried elsewhere (`client_fault_status`).

An engine's HTTP 500 is ambiguous: a broken replica answers it, and so does
an engine whose handler threw on a malformed field it does not check (the
real llama-server answers `"reasoning_format": 5` with 500
`[json.exception.type_error.302] ...`). Counting such answers against
replicas would let any client trip breakers with malformed bodies, so the
rule is:

1. A 500 from a replica that was serving just before (`vouched`: its
   breaker closed with no failure since its last success, and that success
   at most `within_s` ago) is a *suspicion*: it counts nothing yet, and the
   request is tried on another replica as before.
2. Another replica answering the same request (2xx, or the start of a
   stream) clears the input: every suspicion of that request becomes a
   failure of its replica (`caravan_llm.router.core.live_state.blame`).
3. A second vouched replica answering 500 as well, or no other attempt
   being possible (one replica, attempts used up, nothing else admitted),
   blames the input (`input_at_fault`): the client gets a 400 with the
   engine's message, and no replica is counted against.
4. A 500 from a replica that was not serving lately (it failed since its
   last success, or has none within `within_s`) is the replica's failure at
   once, as before: a fleet broken from the start, or for longer than
   `within_s`, still opens breakers and answers 502.

So a replica that breaks while others serve is caught by rule 2, a fleet
that breaks all at once answers 400 with the engines' message for at most
`within_s` before rule 4 takes over, and malformed bodies mixed with any
valid traffic never count. The price: a flood of malformed bodies on a
fleet that served nothing else for `within_s` counts as failures (rule 4),
until the first valid request closes the breaker again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from caravan_llm.router.core.breaker import BreakerPhase

if TYPE_CHECKING:
    from collections.abc import Collection

    from caravan_llm.router.core.live_state import EndpointLiveState

# The engine status that may be the input's fault (rules 1-4 above).
AMBIGUOUS_STATUS = 500
# 4xx statuses that are not about the client's input: the router's engine key
# (401, a router-side failure), the engine's own read timeout (408) and load (429).
NOT_INPUT_4XX = frozenset({401, 408, 429})


def client_fault_status(status: int) -> bool:
    """Whether an engine's status says the client's input was refused."""
    return 400 <= status < 500 and status not in NOT_INPUT_4XX


def vouched(state: EndpointLiveState | None, now: float, within_s: float) -> bool:
    """Whether the endpoint was serving just before now (rule 1): a 500 from it is a suspicion."""
    if state is None or state.last_success_at is None:
        return False
    breaker = state.breaker
    return (
        breaker.phase is BreakerPhase.CLOSED
        and breaker.consecutive_failures == 0
        and now - state.last_success_at <= within_s
    )


def input_at_fault(suspects: Collection[str], *, can_retry: bool) -> bool:
    """Whether a request's suspicions blame its input (rule 3): two replicas agree, or no more."""
    return len(suspects) >= 2 or (bool(suspects) and not can_retry)
