"""The in-flight view the controller reads: bounded, pruned, and None (never 0) when unknown."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from profile_builders import make_llamacpp
from prometheus_client import CollectorRegistry
from world_builders import alloc, replica

from caravan_llm.common.consul_api import HealthEntry
from caravan_llm.common.contract import model_service_name
from caravan_llm.scheduler.autoscale.inflight import InflightView
from caravan_llm.scheduler.autoscale.loop import (
    INFLIGHT_MAX_AGE_TICKS,
    Autoscaler,
    AutoscalerSettings,
)
from caravan_llm.scheduler.metrics import SchedulerMetrics
from caravan_llm.scheduler.model_store import DesiredState
from caravan_llm.scheduler.profiles import ModelProfile

T0 = 1_700_000_000.0


@dataclass
class Clock:
    now: float = T0

    def __call__(self) -> float:
        return self.now


class TestInflightView:
    def test_a_replica_reads_its_live_allocations_reading(self) -> None:
        profile = make_llamacpp()
        live, stopped = alloc("n1"), alloc("n2", "complete")
        view = InflightView(max_age_s=15, clock=Clock())

        view.replace_model(profile.name, {live.id: 3.0, stopped.id: 9.0}, at=T0)

        assert 3.0 == view.of(replica(profile, 0, stopped, live))
        assert view.of(replica(profile, 1, stopped)) is None

    def test_an_idle_replica_reads_zero_and_an_unmeasured_one_none(self) -> None:
        profile = make_llamacpp()
        idle, unmeasured = alloc("n1"), alloc("n2")
        view = InflightView(max_age_s=15, clock=Clock())

        view.replace_model(profile.name, {idle.id: 0.0, unmeasured.id: None}, at=T0)

        assert 0.0 == view.of(replica(profile, 0, idle))
        assert view.of(replica(profile, 1, unmeasured)) is None
        assert 1 == len(view)

    def test_each_scrape_of_a_model_replaces_its_readings(self) -> None:
        """An allocation missing from the latest scrape (gone from Consul) is dropped."""
        view = InflightView(max_age_s=15, clock=Clock())
        view.replace_model("m", {"a1": 1.0, "a2": 2.0}, at=T0)

        view.replace_model("m", {"a2": 5.0, "a3": 0.0}, at=T0)

        assert [None, 5.0, 0.0] == [view.of_alloc("m", a) for a in ("a1", "a2", "a3")]
        assert 2 == len(view)

    def test_a_scrape_with_no_reading_empties_the_model(self) -> None:
        view = InflightView(max_age_s=15, clock=Clock())
        view.replace_model("m", {"a1": 1.0}, at=T0)

        view.replace_model("m", {}, at=T0)

        assert view.of_alloc("m", "a1") is None
        assert 0 == len(view)

    def test_models_no_longer_in_the_profiles_are_dropped(self) -> None:
        view = InflightView(max_age_s=15, clock=Clock())
        view.replace_model("kept", {"a1": 1.0}, at=T0)
        view.replace_model("deleted", {"a2": 2.0}, at=T0)

        view.retain_models({"kept", "never-scraped"})

        assert (1.0, None) == (view.of_alloc("kept", "a1"), view.of_alloc("deleted", "a2"))
        assert 1 == len(view)

    def test_a_reading_older_than_max_age_is_none(self) -> None:
        clock = Clock()
        view = InflightView(max_age_s=15, clock=clock)
        view.replace_model("m", {"a1": 4.0}, at=T0)

        clock.now = T0 + 15
        at_limit = view.of_alloc("m", "a1")
        clock.now = T0 + 15.001

        assert (4.0, None) == (at_limit, view.of_alloc("m", "a1"))

    def test_readings_are_per_model(self) -> None:
        view = InflightView(max_age_s=15, clock=Clock())
        view.replace_model("a", {"alloc-1": 4.0}, at=T0)

        assert view.of_alloc("b", "alloc-1") is None

    def test_max_age_must_be_positive(self) -> None:
        with pytest.raises(ValueError, match="max_age_s must be > 0, got 0"):
            InflightView(max_age_s=0)


# The autoscaler fills the view from its scrapes, and prunes it as replicas and models go.

LLAMACPP_TEXT = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n"


@dataclass
class FakeHealth:
    """Consul's passing instances per service, as the test sets them."""

    entries: dict[str, list[HealthEntry]] = field(default_factory=dict)

    async def health_service(
        self,
        name: str,
        *,
        passing: bool = False,
        tags: tuple[str, ...] = (),
        filter_expr: str | None = None,
        index: int = 0,
        wait_s: float | None = None,
    ) -> tuple[int, tuple[HealthEntry, ...]]:
        del passing, tags, filter_expr, index, wait_s
        return 1, tuple(self.entries.get(name, ()))


@dataclass
class FakeStore:
    profiles: dict[str, ModelProfile] = field(default_factory=dict)

    async def read(self) -> DesiredState:
        return DesiredState(
            profiles=dict(self.profiles), invalid={}, stored_counts={}, draining={}, demand={}
        )


def passing_entry(service: str, alloc_id: str, port: int) -> HealthEntry:
    raw: dict[str, Any] = {
        "Node": {"Node": "client-1", "Address": "127.0.0.1"},
        "Service": {
            "ID": f"_nomad-task-{alloc_id}-engine",
            "Service": service,
            "Address": "127.0.0.1",
            "Port": port,
            "Meta": {
                "alloc_id": alloc_id,
                "metrics_path": "/metrics",
                "metric_running": "llamacpp:requests_processing",
                "metric_waiting": "llamacpp:requests_deferred",
            },
        },
        "Checks": [{"Status": "passing"}],
    }
    return HealthEntry.from_api(raw)


@pytest.fixture
async def engine_port() -> AsyncIterator[int]:
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=LLAMACPP_TEXT)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def test_the_autoscaler_prunes_what_is_gone(engine_port: int) -> None:
    profile = make_llamacpp()
    service = model_service_name(profile.name)
    first, second = alloc("n1"), alloc("n2")
    health = FakeHealth(
        {service: [passing_entry(service, a.id, engine_port) for a in (first, second)]}
    )
    store = FakeStore({profile.name: profile})
    clock = Clock()
    autoscaler = Autoscaler(
        store=store,  # type: ignore[arg-type]
        health=health,
        metrics=SchedulerMetrics.create(CollectorRegistry()),
        is_leader=lambda: True,
        settings=AutoscalerSettings(tick_s=5.0),
        clock=clock,
    )
    async with aiohttp.ClientSession() as session:
        await autoscaler.tick(session)
        both = [
            autoscaler.inflight.of(replica(profile, i, a)) for i, a in enumerate((first, second))
        ]

        health.entries[service] = [passing_entry(service, second.id, engine_port)]
        await autoscaler.tick(session)
        after_stop = (autoscaler.inflight.of(replica(profile, 0, first)), len(autoscaler.inflight))

        store.profiles.clear()
        await autoscaler.tick(session)

    assert [3.0, 3.0] == both
    assert (None, 1) == after_stop
    assert 0 == len(autoscaler.inflight)


async def test_the_autoscalers_readings_age_out_when_it_stops_ticking(engine_port: int) -> None:
    """A scheduler that lost the lead stops scraping; its last readings must not stand forever."""
    profile = make_llamacpp()
    service = model_service_name(profile.name)
    live = alloc("n1")
    clock = Clock()
    autoscaler = Autoscaler(
        store=FakeStore({profile.name: profile}),  # type: ignore[arg-type]
        health=FakeHealth({service: [passing_entry(service, live.id, engine_port)]}),
        metrics=SchedulerMetrics.create(CollectorRegistry()),
        is_leader=lambda: True,
        settings=AutoscalerSettings(tick_s=5.0),
        clock=clock,
    )
    async with aiohttp.ClientSession() as session:
        await autoscaler.tick(session)
    fresh = autoscaler.inflight.of(replica(profile, 0, live))

    clock.now = T0 + INFLIGHT_MAX_AGE_TICKS * 5.0 + 1

    assert 3.0 == fresh
    assert autoscaler.inflight.of(replica(profile, 0, live)) is None
