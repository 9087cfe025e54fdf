"""The KV relay's Prometheus metrics, against an injected registry.

Counts and sizes only: no token id, digest, hash or key is ever a label or a value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from caravan_llm.kvrelay.state import RelayCounters

_PREFIX = "caravan_kv_relay"


class RelayMetrics:
    """Every metric of one relay process."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Counter(
            f"{_PREFIX}_batches_total", "Engine KV-event batches applied", registry=registry
        )
        self.events = Counter(
            f"{_PREFIX}_events_total", "Engine KV events applied", registry=registry
        )
        self.skipped_events = Counter(
            f"{_PREFIX}_skipped_events_total",
            "Engine KV events not applied, by reason (unknown_type, medium, group)",
            ["reason"],
            registry=registry,
        )
        self.decode_errors = Counter(
            f"{_PREFIX}_decode_errors_total",
            "Frames from the engine that did not decode (each counted once)",
            registry=registry,
        )
        self.resyncs = Counter(
            f"{_PREFIX}_resyncs_total",
            "Times the relay forgot its state and started a new epoch, by reason "
            "(gap, restart, engine_lost)",
            ["reason"],
            registry=registry,
        )
        self.replays = Counter(
            f"{_PREFIX}_replays_total",
            "Gaps the relay asked the engine's replay socket to fill, by outcome (filled, failed)",
            ["outcome"],
            registry=registry,
        )
        self.skipped_blocks = Counter(
            f"{_PREFIX}_skipped_blocks_total",
            "Engine blocks the relay could not name, by reason (unchained, opaque, foreign, "
            "malformed_events, unknown_removals, evicted)",
            ["reason"],
            registry=registry,
        )
        self.digests = Gauge(
            f"{_PREFIX}_digests", "Block digests the relay holds now", registry=registry
        )
        self.subscribers = Gauge(
            f"{_PREFIX}_subscribers", "Routers reading the digest stream now", registry=registry
        )
        self.subscriber_overflows = Counter(
            f"{_PREFIX}_subscriber_overflows_total",
            "Routers disconnected for falling too far behind the stream",
            registry=registry,
        )
        self.unauthorized = Counter(
            f"{_PREFIX}_unauthorized_total",
            "Stream requests refused for a missing or wrong engine key",
            registry=registry,
        )
        self.engine_connected = Gauge(
            f"{_PREFIX}_engine_connected",
            "1 while the engine's KV-event publisher is connected",
            registry=registry,
        )

    def count_state(self, before: RelayCounters, after: RelayCounters) -> None:
        """Add what one `RelayState.apply` did (the difference of its counters)."""
        self.batches.inc(after.batches - before.batches)
        self.events.inc(after.events - before.events)
        for reason, field in (
            ("unchained", "unchained_blocks"),
            ("opaque", "opaque_blocks"),
            ("foreign", "foreign_blocks"),
            ("malformed_events", "malformed_events"),
            ("unknown_removals", "unknown_removals"),
            ("evicted", "evicted_blocks"),
        ):
            grown = getattr(after, field) - getattr(before, field)
            if grown:
                self.skipped_blocks.labels(reason).inc(grown)
