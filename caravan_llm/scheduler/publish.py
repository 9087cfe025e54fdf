"""After a pass: say what it found, on change only (metrics, logs, `placements/`, `failed/`,
`adapters/`).

Everything here reads the pass's observation, assessment and plan; nothing
decides. What the publisher keeps between passes is only what it last said
(the series it set, the documents it wrote), so that an unchanged world makes
no writes and a gone model leaves no series or document behind.

`placements/<model>` holds the live allocations of caravan's replica jobs and
where Nomad put their engine (one codec in `caravan_llm.common.contract`). Routers accept
a Consul service as an endpoint only if it is Nomad's registration of one of
these allocations (docs/security.md, "Endpoint verification").
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Mapping

from caravan_llm.common.consul_api import KVEntry
from caravan_llm.common.contract import (
    ALLOC_ID_PATTERN,
    MODEL_NAME_PATTERN,
    ModelAdapters,
    PlacedAllocation,
    Placements,
    PlacementsError,
    decode_placements,
    encode_model_adapters,
    encode_placements,
)
from caravan_llm.common.errors import HashiError
from caravan_llm.scheduler.assess import UNPLACED_NEWS_AFTER_S, Assessment
from caravan_llm.scheduler.metrics import SchedulerMetrics
from caravan_llm.scheduler.model_failure import failure_updates, publish_failures
from caravan_llm.scheduler.model_store import DesiredState, ModelStore
from caravan_llm.scheduler.nomad_time import NS_PER_S
from caravan_llm.scheduler.plan import Plan
from caravan_llm.scheduler.world import AllocEngine, Observation, ObservedReplica

log = logging.getLogger(__name__)


def placements_of(
    replicas: Mapping[str, ObservedReplica], engines: Mapping[str, AllocEngine]
) -> dict[str, Placements]:
    """Per model, the live allocations of its replica jobs and where their engine listens (pure).

    An allocation whose `http` port Nomad has not reported is left out (the
    next pass publishes it): routers must never be told an address that is not
    Nomad's. So is a job whose Meta names no valid model, or an allocation id
    that is not Nomad's UUID form (neither can be a replica caravan rendered).
    """
    placed: dict[str, list[PlacedAllocation]] = {}
    for job_id in sorted(replicas):
        replica = replicas[job_id]
        if not MODEL_NAME_PATTERN.match(replica.model):
            continue
        allocations = placed.setdefault(replica.model, [])
        for alloc in replica.live_allocs():
            engine = engines.get(alloc.id)
            if engine is None or not re.match(ALLOC_ID_PATTERN, alloc.id):
                continue
            allocations.append(
                PlacedAllocation(
                    alloc_id=alloc.id,
                    job_id=job_id,
                    address=engine.port.host_ip,
                    port=engine.port.value,
                    node=engine.node_name,
                    kv_port=engine.kv_port,
                )
            )
    return {
        model: Placements(model=model, allocations=tuple(allocations))
        for model, allocations in placed.items()
    }


def _stored_placements(entries: tuple[KVEntry, ...], prefix: str) -> dict[str, str]:
    """What is under placements/ now, by model, normalised; unreadable documents are rewritten."""
    stored: dict[str, str] = {}
    for entry in entries:
        model = entry.key[len(prefix) :]
        if not model or "/" in model:
            continue
        try:
            stored[model] = encode_placements(
                decode_placements(entry.value, key=entry.key, model=model)
            )
        except PlacementsError:
            stored[model] = ""
    return stored


class Publisher:
    """Writes what each pass found where it changed: gauges, logs, placements/, failed/."""

    def __init__(self, *, store: ModelStore, metrics: SchedulerMetrics) -> None:
        self.store = store
        self.metrics = metrics
        # What this process last wrote (or found) under placements/, by model;
        # None until read from KV, which a new leader does once.
        self._published: dict[str, str] | None = None
        # What the last pass said, so the next says only what changed.
        self._reported_models: set[str] = set()
        self._unplaced: set[str] = set()
        self._failure_gauges: set[str] = set()
        self._prefetch_failed: set[str] = set()
        # What this process last wrote under adapters/, by model; None until read.
        self._adapters: dict[str, str] | None = None

    def forget_placements(self) -> None:
        """Another leader may write placements meanwhile: read them again before writing."""
        self._published = None
        self._adapters = None

    def record_plan(self, result: Plan, observed: Observation) -> None:
        """The per-model gauges, and a log line for what newly went wrong."""
        reported = {report.model for report in result.reports}
        for gone in self._reported_models - reported:
            # A deleted model's series must not linger at their last values.
            for gauge in (
                self.metrics.replicas_desired,
                self.metrics.replicas_live,
                self.metrics.replicas_ready,
                self.metrics.replicas_unplaced,
            ):
                with contextlib.suppress(KeyError):
                    gauge.remove(gone)
        self._reported_models = reported
        # A job registered a moment ago has no allocation yet: not news.
        unplaced = {
            job
            for report in result.reports
            for job in report.unplaced
            if job in observed.replicas
            and observed.taken_at - observed.replicas[job].submit_time_ns / NS_PER_S
            > UNPLACED_NEWS_AFTER_S
        }
        for job_id in sorted(unplaced - self._unplaced):
            log.warning("replica_unplaced", extra={"job_id": job_id, "see": "caravan status"})
        self._unplaced = unplaced
        self._record_prefetch(result)
        for report in result.reports:
            self.metrics.replicas_desired.labels(model=report.model).set(report.desired)
            self.metrics.replicas_live.labels(model=report.model).set(report.live)
            self.metrics.replicas_ready.labels(model=report.model).set(report.ready)
            self.metrics.replicas_unplaced.labels(model=report.model).set(len(report.unplaced))
        for name, problem in result.errors.items():
            self.metrics.errors.labels(kind="render").inc()
            log.error("profile_unrenderable", extra={"model": name, "problem": problem})

    def _record_prefetch(self, result: Plan) -> None:
        """The prefetch gauge per model with a prefetch; one error log when one fails."""
        failed: set[str] = set()
        for report in result.reports:
            if report.prefetch is None:
                with contextlib.suppress(KeyError):
                    self.metrics.prefetch_failed.remove(report.model)
                continue
            self.metrics.prefetch_failed.labels(model=report.model).set(
                1 if report.prefetch_failed else 0
            )
            if report.prefetch_failed:
                failed.add(report.model)
        for model in sorted(self._prefetch_failed - {r.model for r in result.reports}):
            with contextlib.suppress(KeyError):
                self.metrics.prefetch_failed.remove(model)
        reports = {r.model: r for r in result.reports}
        for model in sorted(failed - self._prefetch_failed):
            log.error(
                "prefetch_failed",
                extra={"model": model, "reason": reports[model].prefetch, "see": "caravan status"},
            )
        self._prefetch_failed = failed

    async def publish_placements(self, placements: Mapping[str, Placements]) -> None:
        """Write each model's placements where they changed; delete those of models gone.

        Failures are logged and retried on the next pass (they only delay a
        new replica's first request, or keep a gone one listed a little longer).
        """
        kv = self.store.kv
        prefix = self.store.layout.placements
        try:
            if self._published is None:
                _, entries = await kv.kv_get_recurse(prefix)
                self._published = _stored_placements(entries, prefix)
            published = self._published
            wanted = {model: encode_placements(doc) for model, doc in placements.items()}
            for model in sorted(published.keys() - wanted.keys()):
                await kv.kv_delete(self.store.layout.placements_key(model))
                published.pop(model, None)
                log.info("placements_cleared", extra={"model": model})
            for model, document in sorted(wanted.items()):
                if published.get(model) == document:
                    continue
                await kv.kv_put(self.store.layout.placements_key(model), document)
                published[model] = document
                log.info(
                    "placements_published",
                    extra={"model": model, "allocations": len(placements[model].allocations)},
                )
        except HashiError as exc:
            self._published = None
            # Counted by class like every failed Nomad or Consul call (the alerts read these).
            self.metrics.errors.labels(kind=type(exc).__name__).inc()
            log.warning("placements_publish_failed", extra={"error": str(exc)})

    async def publish_adapters(self, documents: Mapping[str, ModelAdapters]) -> None:
        """Write each LoRA model's `adapters/<model>` where it changed; delete the others'.

        Failures are logged and retried on the next pass (routers then route on
        the last document a little longer).
        """
        kv = self.store.kv
        prefix = self.store.layout.adapters
        try:
            if self._adapters is None:
                _, entries = await kv.kv_get_recurse(prefix)
                self._adapters = {
                    entry.key[len(prefix) :]: entry.value.decode("utf-8", "replace")
                    for entry in entries
                    if entry.key[len(prefix) :] and "/" not in entry.key[len(prefix) :]
                }
            published = self._adapters
            wanted = {model: encode_model_adapters(doc) for model, doc in documents.items()}
            for model in sorted(published.keys() - wanted.keys()):
                await kv.kv_delete(self.store.layout.adapters_key(model))
                published.pop(model, None)
                log.info("adapters_cleared", extra={"model": model})
            for model, document in sorted(wanted.items()):
                if published.get(model) == document:
                    continue
                await kv.kv_put(self.store.layout.adapters_key(model), document)
                published[model] = document
                log.info("adapters_published", extra={"model": model})
        except HashiError as exc:
            self._adapters = None
            self.metrics.errors.labels(kind=type(exc).__name__).inc()
            log.warning("adapters_publish_failed", extra={"error": str(exc)})

    async def publish_failures(
        self, desired: DesiredState, assessment: Assessment, now: float
    ) -> None:
        """Publish which models failed for good (the assessment's word), on change only."""
        found = {
            name: model.failure
            for name, model in assessment.models.items()
            if model.failure is not None and name in desired.profiles
        }
        for name in desired.profiles:
            self.metrics.model_failed.labels(model=name).set(1 if name in found else 0)
        for gone in self._failure_gauges - set(desired.profiles):
            # A deleted model must not stay "failed" on a dashboard.
            with contextlib.suppress(KeyError):
                self.metrics.model_failed.remove(gone)
        self._failure_gauges = set(desired.profiles)
        await publish_failures(self.store, failure_updates(found, desired.failures, now))
