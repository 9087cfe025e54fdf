"""The engine-reported in-flight requests of each live allocation, for the planner.

When a model scales down, the planner drains the replica with the fewest
requests in flight (`plan.py`). The autoscaler scrapes every model's passing
replicas each tick and records here what it read; the controller reads it
back per replica through `InflightView.of`.

The view is bounded and pruned, so that it never answers for what is gone:

- a model's readings are replaced as a whole by each scrape of the model, so
  an allocation that no longer passes in Consul (stopped, replaced, failed)
  drops out at the next tick;
- `retain_models` drops every model that is no longer in the profiles;
- a reading older than `max_age_s` reads as None (the autoscaler stopped
  ticking, e.g. this process lost the leadership).

Missing is None, never 0: a replica with no fresh reading sorts after every
measured one (`plan.py` reads None as "infinitely busy").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from caravan_llm.scheduler.world import ObservedReplica


@dataclass(frozen=True, slots=True)
class InflightReading:
    """Running + waiting requests of one allocation's engine, and when they were read."""

    value: float
    at: float


class InflightView:
    """Last in-flight reading per allocation, grouped by model; stale or missing is None."""

    def __init__(self, *, max_age_s: float, clock: Callable[[], float] = time.time) -> None:
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self._max_age_s = max_age_s
        self._clock = clock
        self._by_model: dict[str, Mapping[str, InflightReading]] = {}

    def replace_model(self, model: str, readings: Mapping[str, float | None], at: float) -> None:
        """Record one scrape of a model: its allocations' readings replace all earlier ones.

        `readings` maps allocation ID to running + waiting requests; None (not
        measured) and blank allocation IDs are not kept.
        """
        kept = {
            alloc_id: InflightReading(value=value, at=at)
            for alloc_id, value in readings.items()
            if alloc_id and value is not None
        }
        if kept:
            self._by_model[model] = MappingProxyType(kept)
        else:
            self._by_model.pop(model, None)

    def retain_models(self, models: Collection[str]) -> None:
        """Forget every model not in `models` (a profile that was deleted)."""
        for model in [m for m in self._by_model if m not in models]:
            del self._by_model[model]

    def of_alloc(self, model: str, alloc_id: str) -> float | None:
        """The fresh reading of one of a model's allocations, or None."""
        reading = self._by_model.get(model, {}).get(alloc_id)
        if reading is None or self._clock() - reading.at > self._max_age_s:
            return None
        return reading.value

    def of(self, replica: ObservedReplica) -> float | None:
        """The fresh in-flight reading of a replica's live allocation, or None."""
        for alloc in replica.live_allocs():
            value = self.of_alloc(replica.model, alloc.id)
            if value is not None:
                return value
        return None

    def __len__(self) -> int:
        """How many allocations have a reading kept (fresh or not)."""
        return sum(len(readings) for readings in self._by_model.values())
