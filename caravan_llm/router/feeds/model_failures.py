"""Models that failed for good, as the scheduler recorded them in KV `failed/<name>`.

The scheduler observes Nomad; when every replica of a model has failed in a
way that needs a change, it writes a `ModelFailure` (caravan_llm/common/contract.py).
One blocking watch on the `failed/` prefix keeps `ModelFailures` current;
the admission gate answers held and new requests of such a model with a 503
naming the reason instead of holding them for a cold start that cannot
succeed. A record the router cannot read is logged and left out: the model
is then served (or held) as before, never refused for a reason nobody wrote.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Protocol

from caravan_llm.common.consul_api import KVEntry
from caravan_llm.common.contract import ContractDecodeError, KVLayout, ModelFailure
from caravan_llm.common.watch import BlockingWatch

# Named as before the router's sub-packages: the logger is a field of every log line.
log = logging.getLogger("router.model_failures")


class FailureKV(Protocol):
    async def kv_get_recurse(
        self, prefix: str, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, tuple[KVEntry, ...]]: ...


def failures_from_kv(
    entries: Iterable[KVEntry], prefix: str
) -> tuple[dict[str, ModelFailure], list[str]]:
    """The failures by profile name, and one problem line per record left out (pure)."""
    found: dict[str, ModelFailure] = {}
    problems: list[str] = []
    for entry in entries:
        name = entry.key[len(prefix) :] if entry.key.startswith(prefix) else ""
        if not name or "/" in name:
            continue
        try:
            found[name] = ModelFailure.decode(entry.value)
        except ContractDecodeError as exc:
            problems.append(f"{entry.key}: {exc}")
    return found, problems


class ModelFailures:
    """The current failures, swapped whole; listeners run after every change."""

    def __init__(self) -> None:
        self._by_model: Mapping[str, ModelFailure] = MappingProxyType({})
        self._listeners: list[Callable[[], None]] = []

    def get(self, name: str) -> ModelFailure | None:
        return self._by_model.get(name)

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def update(self, failures: Mapping[str, ModelFailure]) -> None:
        if dict(failures) == dict(self._by_model):
            return
        self._by_model = MappingProxyType(dict(failures))
        for listener in self._listeners:
            listener()


async def watch_failures(
    consul: FailureKV,
    layout: KVLayout,
    failures: ModelFailures,
    *,
    wait_s: float = 60.0,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Keep `failures` equal to KV `<prefix>failed/`, until cancelled."""
    prefix = layout.failures

    async def fetch(index: int, wait: float) -> tuple[int, tuple[KVEntry, ...]]:
        return await consul.kv_get_recurse(prefix, index=index, wait_s=wait)

    last_problems: list[str] = []

    async def deliver(entries: tuple[KVEntry, ...]) -> None:
        nonlocal last_problems
        found, problems = failures_from_kv(entries, prefix)
        if problems != last_problems:
            for problem in problems:
                log.warning("model_failure_ignored", extra={"problem": problem})
            last_problems = problems
        failures.update(found)

    await BlockingWatch(f"kv {prefix}", fetch, wait_s=wait_s, clock=clock).run(deliver)
