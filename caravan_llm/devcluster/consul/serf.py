"""How long Consul's LAN gossip (serf on memberlist) takes to declare a dead agent failed.

Pure: `detection_delay_s` plays memberlist's failure detector for one agent
that stopped answering, with hashicorp/memberlist's LAN defaults
(`DefaultLANConfig`, which Consul's `gossip_lan` keeps):

* every live member probes one member per `ProbeInterval` (1 s), walking a
  shuffled list of the other members, so the dead one comes up at a random
  round of a random phase;
* a probe that gets no ack within `ProbeTimeout` (500 ms) goes indirect and
  fails at the end of its probe interval: the prober marks the node suspect;
* the suspicion timeout (`suspicion.go`): `min = SuspicionMult * max(1,
  log10(n)) * ProbeInterval` (`util.go` `suspicionTimeout`), `max =
  SuspicionMaxTimeoutMult * min`; it expects `k = SuspicionMult - 2`
  independent confirmations (0 when `n - 2 < k`, and then the timeout is
  `min`), and each confirmation lowers it to
  `max - log(c + 1) / log(k + 1) * (max - min)`, never below `min`;
* once dead, serf reports the member failed and Consul's leader sets the
  node's `serfHealth` critical at once (its reconcile loop).

Gossip propagation (milliseconds on a LAN) and the awareness multiplier
(healthy members) are left out.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SerfTiming:
    """memberlist's LAN failure-detection settings (Consul's `gossip_lan` block)."""

    probe_interval_s: float = 1.0
    probe_timeout_s: float = 0.5
    suspicion_mult: int = 4
    suspicion_max_timeout_mult: int = 6

    def __post_init__(self) -> None:
        if self.probe_interval_s <= 0:
            raise ValueError(f"probe_interval_s must be > 0, got {self.probe_interval_s}")
        if not 0 < self.probe_timeout_s <= self.probe_interval_s:
            raise ValueError(
                f"probe_timeout_s must be in (0, probe_interval_s], got {self.probe_timeout_s}"
            )
        if self.suspicion_mult < 1 or self.suspicion_max_timeout_mult < 1:
            raise ValueError("suspicion_mult and suspicion_max_timeout_mult must be >= 1")


def suspicion_bounds_s(timing: SerfTiming, members: int) -> tuple[float, float]:
    """(min, max) suspicion timeout for a cluster of `members` agents."""
    node_scale = max(1.0, math.log10(max(1.0, float(members))))
    low = timing.suspicion_mult * math.floor(node_scale * 1000) / 1000 * timing.probe_interval_s
    return low, timing.suspicion_max_timeout_mult * low


def expected_confirmations(timing: SerfTiming, members: int) -> int:
    k = timing.suspicion_mult - 2
    return 0 if members - 2 < k else k


def remaining_timeout_s(confirmations: int, k: int, low: float, high: float) -> float:
    """The whole suspicion timeout after `confirmations` (memberlist's formula, ms floor)."""
    if k < 1:
        return low
    fraction = math.log(confirmations + 1.0) / math.log(k + 1.0)
    raw = math.floor(1000 * (high - fraction * (high - low))) / 1000
    return max(raw, low)


def detection_delay_s(
    timing: SerfTiming, *, members: int, live_probers: int, rng: random.Random
) -> float:
    """Seconds from an agent's death to serf declaring it failed.

    `members` is the size of the LAN pool (the dead agent included);
    `live_probers` the members still probing (at least the server).
    """
    interval = timing.probe_interval_s
    others = max(members - 1, 1)
    # When each live member's failed probe of the dead one ends.
    failures = sorted(
        rng.uniform(0, interval) + rng.randrange(others) * interval + interval
        for _ in range(max(live_probers, 1))
    )
    suspected_at = failures[0]
    low, high = suspicion_bounds_s(timing, members)
    k = expected_confirmations(timing, members)
    timeout = high if k >= 1 else low
    confirmations = 0
    for confirmed_at in failures[1:]:
        if confirmations >= k or suspected_at + timeout <= confirmed_at:
            break
        confirmations += 1
        timeout = remaining_timeout_s(confirmations, k, low, high)
    return suspected_at + max(timeout, confirmed_floor(failures, confirmations, suspected_at))


def confirmed_floor(failures: list[float], confirmations: int, suspected_at: float) -> float:
    """The timeout cannot end before the confirmation that shortened it arrived."""
    if confirmations == 0:
        return 0.0
    return failures[confirmations] - suspected_at
