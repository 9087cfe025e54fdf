"""Weights cache end to end on devcluster (issue 14 item 1).

Two extra CPU nodes declare the host volume `models`, both backed by one
folder (the shared-storage setup docs/deploy.md requires for a prefetch);
the stack's other nodes have no volume. A llama.cpp model whose GGUF lives
on the volume lands only on those nodes and the real llama-server loads it
from there; a failing prefetch is shown in `caravan status` and holds the
replicas; a succeeding one fills the volume once and is not run again by
later reconcile passes, a replica's replacement or the death of the node it ran on.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import eventually, store_of

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_stack
from caravan_llm.common.contract import KVLayout, ModelFailure, model_service_name
from caravan_llm.common.nomad_api import Allocation, JobStub
from caravan_llm.devcluster.llama_server_build import find_llama_server
from caravan_llm.devcluster.nomad.settings import NodeSpec
from caravan_llm.scheduler.profile_policy import ProfilePolicy
from caravan_llm.scheduler.profiles import ModelProfile
from caravan_llm.scheduler.status import StatusReader
from caravan_llm.scheduler.weights import prefetch_job_id

pytestmark = [
    pytest.mark.slow,
    pytest.mark.llamacpp,
    pytest.mark.skipif(find_llama_server() is None, reason="the real llama-server is not built"),
]

GGUF = "tiny-llama.gguf"


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[LocalStack]:
    """The scheduler tests' stack, with prefetch commands allowed (the copy below is one)."""
    options = StackOptions(
        prefer_real_llama_server=False,
        gpus_per_node=4,
        autoscale=False,
        work_dir=tmp_path,
        resync_s=2.0,
        replace_lost_after_s=15.0,
        heartbeat_grace_s=1.0,
        min_heartbeat_ttl_s=1.0,
        profile_policy=ProfilePolicy(allow_prefetch_commands=True),
    )
    async with local_stack(options) as running:
        yield running


async def _volume_nodes(stack: LocalStack, folder: Path) -> set[str]:
    folder.mkdir(parents=True, exist_ok=True)
    spec = NodeSpec(
        cpu_cores=4,
        cpu_mhz_per_core=2400,
        memory_mb=16384,
        host_volumes={"models": {"path": str(folder)}},
    )
    added = [await stack.cluster.nomad.add_node(spec) for _ in range(2)]
    return {node.id for node in added}


def _profile(name: str, replicas: int, weights: dict[str, Any]) -> ModelProfile:
    return ModelProfile.model_validate(
        {
            "name": name,
            "engine": "llamacpp",
            "driver": "docker",
            "model": f"/models/{GGUF}",
            "replicas": {"min": replicas, "max": replicas, "initial": replicas},
            "resources": {"cores": 1, "memory_mb": 512},
            "max_concurrency": 2,
            "context_length": 256,
            "startup_timeout_s": 60,
            "weights": {
                "volume": {"type": "host", "source": "models"},
                "path": "/models",
                **weights,
            },
        }
    )


async def _passing_allocs(stack: LocalStack, model: str) -> set[str]:
    _, entries = await stack.scheduler.consul.health_service(
        model_service_name(model), passing=True
    )
    return {e.meta.get("alloc_id", "") for e in entries}


async def _running_replicas(stack: LocalStack, model: str, count: int) -> list[Any] | None:
    """The model's running replica allocations once `count` of them pass their checks."""
    passing = await _passing_allocs(stack, model)
    allocs = [
        a
        for a in (await stack.scheduler.nomad.list_allocations()).value
        if a.job_id.startswith(f"caravan-{model}-")
        and a.job_id != prefetch_job_id(model)
        and a.client_status == "running"
        and a.id in passing
    ]
    return allocs if len(allocs) >= count else None


def _passes(stack: LocalStack) -> float:
    value = stack.scheduler.registry.get_sample_value(
        "caravan_scheduler_reconcile_passes_total", {"outcome": "ok"}
    )
    return value or 0.0


def _status(stack: LocalStack) -> StatusReader:
    return StatusReader(
        store=store_of(stack),
        nomad=stack.scheduler.nomad,
        health=stack.scheduler.consul,
        config=stack.config,
    )


async def _job_stub(stack: LocalStack, job_id: str) -> JobStub | None:
    jobs = (await stack.scheduler.nomad.list_jobs(job_id)).value
    return next((job for job in jobs if job.id == job_id), None)


async def _allocs_of(stack: LocalStack, job_id: str) -> list[Allocation]:
    return [a for a in (await stack.scheduler.nomad.list_allocations()).value if a.job_id == job_id]


async def _job_spec(stack: LocalStack, job_id: str) -> dict[str, Any]:
    """The job as Nomad stores it (caravan's client reads job stubs only)."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{stack.nomad_addr}/v1/job/{job_id}") as response,
    ):
        assert 200 == response.status
        document: dict[str, Any] = await response.json()
        return document


async def test_cached_model_lands_only_where_the_volume_is_and_loads_from_it(
    stack: LocalStack, tmp_path: Path
) -> None:
    build = find_llama_server()
    assert build is not None
    volume = tmp_path / "shared-models"
    with_volume = await _volume_nodes(stack, volume)
    shutil.copy(build.model, volume / GGUF)
    await store_of(stack).submit([_profile("cached", 2, {"read_only": True})])

    allocs = await eventually(lambda: _running_replicas(stack, "cached", 2), timeout_s=120)
    assert {a.node_id for a in allocs} == with_volume  # one on each, none elsewhere
    job = await _job_spec(stack, allocs[0].job_id)
    group = job["TaskGroups"][0]
    assert group["Volumes"]["weights"]["Source"] == "models"
    assert group["Tasks"][0]["VolumeMounts"][0]["ReadOnly"] is True


async def test_failed_prefetch_is_shown_and_a_good_one_runs_once(
    stack: LocalStack, tmp_path: Path
) -> None:
    build = find_llama_server()
    assert build is not None
    volume = tmp_path / "shared-models"
    with_volume = await _volume_nodes(stack, volume)
    failing = {
        "driver": "exec",
        "command": [sys.executable, "-c", "import sys; sys.exit(1)"],
    }
    copying = {
        "driver": "exec",
        "command": [
            sys.executable,
            "-c",
            "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])",
            str(build.model),
            f"/models/{GGUF}",
        ],
    }
    await store_of(stack).submit(
        [
            _profile("badfetch", 1, {"prefetch": failing}),
            _profile("goodfetch", 2, {"prefetch": copying}),
        ]
    )

    async def failed() -> Any:
        status = await _status(stack).model("badfetch")
        return status if status.status == "prefetch failed" else None

    shown = await eventually(failed, timeout_s=90)
    assert shown.prefetch is not None
    assert shown.prefetch.startswith("failed: Terminated: Exit Code: 1"), shown.prefetch
    assert shown.problem is not None
    assert prefetch_job_id("badfetch") in shown.problem
    assert () == shown.replicas

    # Routers fail fast on it: the scheduler records the failure with its reason.
    async def recorded() -> Any:
        _, entry = await stack.scheduler.consul.kv_get(KVLayout().failure_key("badfetch"))
        return entry

    record = ModelFailure.decode((await eventually(recorded, timeout_s=30)).value)
    assert prefetch_job_id("badfetch") in record.reason

    allocs = await eventually(lambda: _running_replicas(stack, "goodfetch", 2), timeout_s=120)
    assert {a.node_id for a in allocs} <= with_volume
    assert (volume / GGUF).stat().st_size == build.model.stat().st_size
    status = await _status(stack).model("goodfetch")
    assert "complete" == status.prefetch

    registry = stack.scheduler.registry
    gauge = "caravan_scheduler_prefetch_failed"

    async def gauges() -> bool:
        # The controller's pass may come a moment after what status read from Nomad.
        return (
            registry.get_sample_value(gauge, {"model": "badfetch"}),
            registry.get_sample_value(gauge, {"model": "goodfetch"}),
        ) == (1.0, 0.0)

    await eventually(gauges, timeout_s=30)
    # The planner never registered a replica of the failed model.
    jobs = (await stack.scheduler.nomad.list_jobs("caravan-badfetch-")).value
    assert [prefetch_job_id("badfetch")] == [j.id for j in jobs]

    prefetch = await _job_stub(stack, prefetch_job_id("goodfetch"))
    assert prefetch is not None
    # A replica is replaced (its allocation stopped): Nomad places a new one.
    async with (
        aiohttp.ClientSession() as http,
        http.put(f"{stack.nomad_addr}/v1/allocation/{allocs[0].id}/stop") as response,
    ):
        assert 200 == response.status, await response.text()
    old = {a.id for a in allocs}

    async def replaced() -> list[Any] | None:
        now = await _running_replicas(stack, "goodfetch", 2)
        return now if now is not None and {a.id for a in now} - old else None

    allocs = await eventually(replaced, timeout_s=120)
    # The node the prefetch ran on dies: its replicas are replaced on the other
    # volume node, and the completed prefetch is not run again.
    (fetched,) = await _allocs_of(stack, prefetch_job_id("goodfetch"))
    await stack.cluster.nomad.kill_node(fetched.node_id)
    survivor = with_volume - {fetched.node_id}

    async def moved() -> list[Any] | None:
        now = await _running_replicas(stack, "goodfetch", 2)
        return now if now is not None and {a.node_id for a in now} == survivor else None

    await eventually(moved, timeout_s=120)
    # Several reconcile passes later (resync every 2 s) the prefetch is the same job
    # version with its one allocation.
    passes = _passes(stack)

    async def more_passes() -> bool:
        return _passes(stack) >= passes + 3

    await eventually(more_passes, timeout_s=60)
    after = await _job_stub(stack, prefetch_job_id("goodfetch"))
    assert after is not None
    assert (prefetch.version, prefetch.job_modify_index) == (after.version, after.job_modify_index)
    runs = await _allocs_of(stack, prefetch_job_id("goodfetch"))
    assert ["complete"] == [a.client_status for a in runs]

    # New weights settings are a new weights version: the prefetch runs once more.
    changed = {**copying, "memory_mb": 1024}
    await store_of(stack).submit([_profile("goodfetch", 2, {"prefetch": changed})])

    async def ran_again() -> list[Any] | None:
        runs = await _allocs_of(stack, prefetch_job_id("goodfetch"))
        done = [a for a in runs if a.client_status == "complete"]
        return runs if len(done) == 2 else None

    runs = await eventually(ran_again, timeout_s=60)
    assert 2 == len(runs)
    status = await _status(stack).model("goodfetch")
    assert "complete" == status.prefetch

    # Deleting the failed model removes its prefetch job too.
    await store_of(stack).delete("badfetch")

    async def purged() -> bool:
        return await _job_stub(stack, prefetch_job_id("badfetch")) is None

    await eventually(purged, timeout_s=60)
    assert registry.get_sample_value(gauge, {"model": "badfetch"}) is None
