"""Engine load from a replica's Prometheus `/metrics` text, engine-agnostically.

Both the router (to score endpoints) and the scheduler's autoscaler (to decide
scale) read the same three numbers from an engine: requests running, requests
waiting, and KV-cache usage. Engines name them differently, so each replica
states its metric names (Consul service Meta, contract 4) and this module
turns exposition text plus those names into an `EngineLoad`.

Missing is not zero: a metric the text does not contain, or a name that is not
configured, reads as `None`, so that an idle engine and an unknown one never
look the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


class EngineMetricsParseError(ValueError):
    """The text is not valid Prometheus exposition format."""


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Which sample names carry running, waiting and KV-cache usage (None = not exposed)."""

    running: str | None
    waiting: str | None
    kv_cache_usage: str | None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of an engine; each field is None when the engine did not report it."""

    running: float | None
    waiting: float | None
    # Fraction of KV-cache blocks in use, 0..1 (vLLM's `_perc` gauge is a fraction too).
    kv_cache_usage: float | None


def resolve_metric_names(
    defaults: MetricNames,
    running: str | None = None,
    waiting: str | None = None,
    kv_cache_usage: str | None = None,
) -> MetricNames:
    """Apply a (possibly partial) metric mapping to an engine's own names; blank means absent.

    `defaults` are the names of the replica's engine (each engine module in the
    scheduler owns its own). The rule:

    1. A mapping that names nothing means the engine's names.
    2. A mapping that names its own running metric is a complete statement: the
       fields it leaves blank stay None (guessing a name the engine may not
       expose would only ever read as "missing").
    3. A mapping that names some metrics but not running keeps what it names and
       takes the engine's names for the blanks (running is the one every engine
       has, so leaving it out says "I only override a detail").
    """
    running = running or None
    waiting = waiting or None
    kv_cache_usage = kv_cache_usage or None
    if running is not None:
        return MetricNames(running=running, waiting=waiting, kv_cache_usage=kv_cache_usage)
    return MetricNames(
        running=defaults.running,
        waiting=waiting if waiting is not None else defaults.waiting,
        kv_cache_usage=kv_cache_usage if kv_cache_usage is not None else defaults.kv_cache_usage,
    )


def metric_names_as_published(
    running: str | None, waiting: str | None, kv_cache_usage: str | None
) -> MetricNames:
    """The names a replica publishes (service Meta), read as written: blank is not exposed.

    The scheduler resolves a profile's mapping against its engine's names once,
    when it renders the job, so readers never fill blanks themselves.
    """
    return MetricNames(
        running=running or None, waiting=waiting or None, kv_cache_usage=kv_cache_usage or None
    )


def parse_engine_load(text: str, names: MetricNames) -> EngineLoad:
    """Read running, waiting and KV-cache usage from exposition text.

    Samples are matched by their full name (colons included). vLLM labels its
    gauges by `model_name` and, with several engine cores (data parallel), by
    `engine`: request counts are summed across label sets, while the KV-cache
    usage, a fraction per engine core, is averaged (a sum would read 1.4 for two
    cores at 70%). NaN and infinite samples are unknowns and are skipped (a
    `+Inf` and a `-Inf` would otherwise sum to NaN); a name with no usable
    sample reads as None.

    Raises EngineMetricsParseError when the text is not exposition format.
    """
    wanted = {name for name in (names.running, names.waiting, names.kv_cache_usage) if name}
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted and math.isfinite(sample.value):
                    totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
                    counts[sample.name] = counts.get(sample.name, 0) + 1
    # The parser signals bad input with ValueError mostly, but a truncated line can
    # surface as an IndexError or KeyError from inside it.
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise EngineMetricsParseError(f"malformed Prometheus exposition text: {exc}") from exc

    def total(name: str | None) -> float | None:
        return totals.get(name) if name else None

    def mean(name: str | None) -> float | None:
        if not name or name not in totals:
            return None
        return totals[name] / counts[name]

    return EngineLoad(
        running=total(names.running),
        waiting=total(names.waiting),
        kv_cache_usage=mean(names.kv_cache_usage),
    )
