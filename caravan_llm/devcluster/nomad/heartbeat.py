"""Client heartbeat TTLs as Nomad's servers compute them (`nomad/heartbeat.go`, facts N22).

On each heartbeat (and registration) the leader picks the TTL it hands back
to the client: `helper.RateScaledInterval(max_heartbeats_per_second,
min_heartbeat_ttl, nodes)`, that is `max(min_heartbeat_ttl, nodes / rate)`,
plus `helper.RandomStagger` of it (uniform in [0, ttl)). The client
heartbeats again after that TTL; the server marks the node `down` when no
heartbeat came within TTL + `heartbeat_grace`. Defaults are the server's
(`nomad/config.go`): 10 s, 50 per second and 10 s, so a node that dies is
marked down 10-30 s later on a small cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

# helper.minRate: once a day; at or below it the minimum TTL applies.
MIN_RATE_PER_S = 1.0 / 86400


@dataclass(frozen=True, slots=True)
class HeartbeatSettings:
    min_ttl_s: float = 10.0
    max_per_second: float = 50.0
    grace_s: float = 10.0


def rate_scaled_interval_s(rate: float, minimum_s: float, nodes: int) -> float:
    """`helper.RateScaledInterval`: spread `nodes` heartbeats so they total `rate` per second."""
    if rate <= MIN_RATE_PER_S:
        return minimum_s
    return max(nodes / rate, minimum_s)


def heartbeat_ttl_s(settings: HeartbeatSettings, nodes: int, stagger: float) -> float:
    """The TTL handed to a client; `stagger` in [0, 1) draws `RandomStagger`."""
    base = rate_scaled_interval_s(settings.max_per_second, settings.min_ttl_s, nodes)
    return base + stagger * base
