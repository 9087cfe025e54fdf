"""An empty Nomad job list is suspected, unless caravan itself scaled every model to zero."""

from __future__ import annotations

from profile_builders import make_llamacpp
from prometheus_client import CollectorRegistry
from test_enforce_index import DictKV, EnforcingNomad, NoHealth

from caravan_llm.common.contract import KVLayout
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.controller import Controller
from caravan_llm.scheduler.metrics import SchedulerMetrics
from caravan_llm.scheduler.model_store import DesiredState, ModelStore

PROFILE = make_llamacpp(
    name="tiny", replicas={"min": 0, "max": 1, "initial": 1}, autoscaling={"target_inflight": 2}
)


class CountStore(ModelStore):
    """One profile whose desired count the test sets."""

    count = 1

    async def read(self, *, index: int = 0, wait_s: float | None = None) -> DesiredState:
        return DesiredState(
            profiles={PROFILE.name: PROFILE},
            invalid={},
            stored_counts={PROFILE.name: self.count},
            draining={},
            demand={},
        )


def controller(nomad: EnforcingNomad, store: CountStore, clock: list[float]) -> Controller:
    return Controller(
        store=store,
        nomad=nomad,
        health=NoHealth(),
        config=ClusterConfig(),
        metrics=SchedulerMetrics.create(CollectorRegistry()),
        clock=lambda: clock[0],
    )


async def test_a_cold_start_after_scale_to_zero_registers_at_once() -> None:
    """Jobs gone because every count was zero: the next count of one registers on that pass."""
    nomad, store, clock = EnforcingNomad(), CountStore(DictKV(), KVLayout()), [1_000_000.0]
    c = controller(nomad, store, clock)
    await c.reconcile_once()
    clock[0] += 1
    await c.reconcile_once()  # the controller has now seen the job in Nomad's list
    assert ["caravan-tiny-0"] == [job for job, _ in nomad.registers]

    store.count = 0
    nomad.jobs.clear()  # what the scale to zero left behind
    clock[0] += 1
    await c.reconcile_once()

    store.count = 1
    clock[0] += 1
    result = await c.reconcile_once()

    assert result.skipped is None
    assert ["caravan-tiny-0", "caravan-tiny-0"] == [job for job, _ in nomad.registers]


async def test_jobs_vanishing_while_counts_are_up_are_suspected_first() -> None:
    """Jobs gone while a model still wants a replica (a wrong namespace, a restored Nomad):
    nothing is registered until the empty list has lasted the confirmation window."""
    nomad, store, clock = EnforcingNomad(), CountStore(DictKV(), KVLayout()), [1_000_000.0]
    c = controller(nomad, store, clock)
    await c.reconcile_once()
    clock[0] += 1
    await c.reconcile_once()  # the controller has now seen the job in Nomad's list

    nomad.jobs.clear()
    clock[0] += 1
    suspected = await c.reconcile_once()
    clock[0] += c.settings.empty_list_confirm_s + 1
    confirmed = await c.reconcile_once()

    assert suspected.skipped is not None
    assert confirmed.skipped is None
    assert 2 == len(nomad.registers)
