"""SGLang, the third engine, end to end on devcluster: profile -> rendered job -> simulated
SGLang server (`--flavor sglang`) -> Consul -> router -> client.

The router knows no engine by name: it routes on the Meta the rendered job
publishes (served name, capacity, metric names, stream traits).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from polling import eventually

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_stack
from caravan_llm.common.contract import (
    ENGINE_KEY_ITEM,
    KVLayout,
    ServiceMetaKey,
    decode_stream_traits,
    engine_key_path,
    model_service_name,
    replica_job_id,
)
from caravan_llm.common.engine_metrics import metric_names_as_published, parse_engine_load
from caravan_llm.router.settings import RouterSettings
from caravan_llm.scheduler.engine_logs import EngineLogReader
from caravan_llm.scheduler.engines.registry import Engine, adapter_for
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.profiles import ModelProfile, load_profile
from caravan_llm.scheduler.world import engine_events

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/profiles/qwen3-sglang-h100.yaml"


def sglang_profile() -> ModelProfile:
    """The example profile, one replica, a fast simulated load, no autoscaler."""
    document = load_profile(EXAMPLE).model_dump(mode="json", by_alias=True, exclude_none=True)
    document.pop("autoscaling")
    document.update(
        replicas={"min": 1, "max": 1, "initial": 1},
        env={**document["env"], "CARAVAN_SIM_LOAD_SECONDS": "0.5"},
        startup_timeout_s=60,
    )
    return ModelProfile.model_validate(document)


async def status_and_json(
    session: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str]
) -> tuple[int, Any]:
    async with session.post(url, json=body, headers=headers) as response:
        raw = await response.read()
        return response.status, json.loads(raw) if raw else None


@pytest.mark.slow
async def test_sglang_serves_through_the_router(tmp_path: Path) -> None:
    options = StackOptions(
        prefer_real_llama_server=False,
        cpu_nodes=1,
        gpu_nodes=1,
        gpus_per_node=4,
        autoscale=False,
        work_dir=tmp_path,
        resync_s=2.0,
        router=RouterSettings(port=0, scrape_interval_s=0.5, log_level="warning"),
    )
    profile = sglang_profile()
    async with local_stack(options) as stack:
        await ModelStore(stack.scheduler.consul, KVLayout()).submit([profile])
        entry = await passing_entry(stack, profile)

        # The job published what the router and autoscaler need, from the SGLang adapter.
        meta = entry.meta
        assert "sglang" == meta[ServiceMetaKey.ENGINE]
        assert "64" == meta[ServiceMetaKey.CAPACITY]
        assert adapter_for(Engine.SGLANG).facts.stream_traits == decode_stream_traits(meta)
        names = metric_names_as_published(
            meta.get(ServiceMetaKey.METRIC_RUNNING),
            meta.get(ServiceMetaKey.METRIC_WAITING),
            meta.get(ServiceMetaKey.METRIC_KV_CACHE),
        )
        assert "sglang:num_running_reqs" == names.running

        assert stack.router is not None
        routed = f"{stack.router.base_url}/v1/chat/completions"
        direct = f"http://{entry.address}:{entry.port}"
        chat = {
            "model": profile.served_name,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 6,
        }
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            client = stack.router.headers

            async def routed_ok() -> Any:
                # The router may still be loading the engine key the scheduler created.
                status, body = await status_and_json(session, routed, chat, client)
                return body if status == 200 else None

            body = await eventually(routed_ok, 30, "a chat completion through the router")
            assert profile.served_name == body["model"]
            assert body["choices"][0]["message"]["content"]

            # A streamed legacy completion through the router ends with [DONE].
            completion = {
                "model": profile.served_name,
                "prompt": "Once",
                "max_tokens": 4,
                "stream": True,
            }
            async with session.post(
                f"{stack.router.base_url}/v1/completions", json=completion, headers=client
            ) as response:
                assert 200 == response.status
                text = (await response.read()).decode()
            assert text.rstrip().endswith("data: [DONE]")
            assert text.count('"text_completion"') >= 1

            # The engine got its key through the template and `--api-key ${...}`:
            # it refuses a direct request without it and takes one with it.
            key = await engine_key(stack, profile)
            url = f"{direct}/v1/chat/completions"
            assert 401 == (await status_and_json(session, url, chat, {}))[0]
            with_key = {"Authorization": f"Bearer {key}"}
            assert 200 == (await status_and_json(session, url, chat, with_key))[0]

            # SGLang's /metrics (public, as in SGLang) carries the names the Meta publishes.
            async with session.get(f"{direct}{meta[ServiceMetaKey.METRICS_PATH]}") as response:
                assert 200 == response.status
                load = parse_engine_load(await response.text(), names)
            assert load.running is not None
            assert load.waiting is not None
            assert load.kv_cache_usage is not None

        # The job as Nomad stores it (caravan's client reads job stubs only).
        job_url = f"{stack.nomad_addr}/v1/job/{replica_job_id(profile.name, 0)}"
        async with aiohttp.ClientSession() as http, http.get(job_url) as response:
            assert 200 == response.status
            assert key not in await response.text()

        # What the failure report above reads, read here too, so that it works when needed.
        ends = await task_ends(stack, replica_job_id(profile.name, 0))
        assert ends
        assert all(end["events"] for end in ends)


async def passing_entry(stack: LocalStack, profile: ModelProfile) -> Any:
    consul = stack.scheduler.consul

    async def probe() -> Any:
        _, entries = await consul.health_service(model_service_name(profile.name), passing=True)
        return entries[0] if entries else None

    try:
        return await eventually(probe, 90, f"a passing replica of {profile.name}")
    except pytest.fail.Exception as exc:
        # Say why, so that a failure in CI explains itself: the failure record
        # the scheduler wrote, and what Nomad's latest evaluation said.
        _, record = await consul.kv_get(KVLayout().failure_key(profile.name))
        job = replica_job_id(profile.name, 0)
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{stack.nomad_addr}/v1/job/{job}/evaluations") as response,
        ):
            evaluations = await response.json()
        latest = max(evaluations, key=lambda e: e.get("CreateIndex", 0), default={})
        detail = {
            "failure": record.value.decode() if record is not None else None,
            "latest evaluation": {
                key: latest.get(key) for key in ("Status", "TriggeredBy", "FailedTGAllocs")
            },
        }
        try:
            detail["tasks"] = await task_ends(stack, job)
        except Exception as error:  # the report must not hide the failure it reports
            detail["tasks"] = f"not read: {type(error).__name__}: {error}"
        pytest.fail(f"{exc}; {json.dumps(detail)[:6000]}")


async def task_ends(stack: LocalStack, job: str) -> list[dict[str, Any]]:
    """Per allocation of the job: its engine's last events and the end of its stderr, as
    `caravan status` reads them (an engine that exited says why there: argparse's usage
    line, a traceback)."""
    nomad = stack.scheduler.nomad
    reader = EngineLogReader(nomad, reader="the test's Nomad token")
    ends = []
    for alloc in (await nomad.list_allocations()).value:
        if alloc.job_id != job:
            continue
        tail = await reader.tail(alloc)
        ends.append(
            {
                "allocation": alloc.id[:8],
                "events": [[e.type, e.exit_code, e.message] for e in engine_events(alloc)[-4:]],
                "stderr": tail.unavailable or list(tail.lines),
            }
        )
    return ends


async def engine_key(stack: LocalStack, profile: ModelProfile) -> str:
    variable = await stack.scheduler.nomad.get_variable(engine_key_path(profile.name))
    assert variable is not None
    return str(variable.items[ENGINE_KEY_ITEM])
