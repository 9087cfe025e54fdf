"""Engines answer only to routers (issue 12 item 5) and secrets go by reference (issue 14 item 2).

End to end on devcluster: each replica's engine gets its model's key through
Nomad Variables and a `template`; a direct request without the key is 401
(simulated llama.cpp and vLLM, and the real llama-server when built), the
router's requests pass; the job spec, `caravan render` and the logs carry
only variable paths, never a key or a secret value.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from polling import eventually
from pydantic import ValidationError

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_profile, local_stack
from caravan_llm.common.contract import (
    ENGINE_KEY_ITEM,
    ENGINE_KEY_PREFIX,
    KVLayout,
    engine_key_path,
    model_service_name,
    replica_job_id,
    replica_key_path,
)
from caravan_llm.common.engine_scrape import ScrapeFailure
from caravan_llm.common.errors import HashiConflict
from caravan_llm.common.nomad_api import QueryResult, Variable, VariableMetadata
from caravan_llm.devcluster.engine.flags import parse_engine_args
from caravan_llm.devcluster.engine.server import run_engine
from caravan_llm.devcluster.llama_server_build import find_llama_server
from caravan_llm.devcluster.nomad.variables import workload_may_read
from caravan_llm.router.feeds.engine_keys import EngineKeys as RouterEngineKeys
from caravan_llm.router.settings import RouterSettings
from caravan_llm.scheduler.autoscale.scrape import ReplicaTarget, scrape_replicas
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.engine_keys import EngineKeys as SchedulerEngineKeys
from caravan_llm.scheduler.engines.llamacpp import LLAMACPP_METRIC_NAMES
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.profiles import ModelProfile, load_profile
from caravan_llm.scheduler.render import render
from caravan_llm.scheduler.status import StatusReader

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples/profiles/tiny-llamacpp-cpu.yaml"
QWEN = ROOT / "examples/profiles/qwen-vllm-h100.yaml"
HF_SECRET = "hf_s3cret_value_never_in_a_job"


def updated(profile: ModelProfile, **changes: Any) -> ModelProfile:
    """The profile with `changes`, validated again."""
    document = profile.model_dump(mode="json", exclude_none=True)
    document.update(changes)
    return ModelProfile.model_validate(document)


def stack_options(tmp_path: Path, *, real: bool) -> StackOptions:
    return StackOptions(
        prefer_real_llama_server=real,
        cpu_nodes=2,
        gpu_nodes=1,
        autoscale=False,
        work_dir=tmp_path,
        resync_s=2.0,
        router=RouterSettings(port=0, scrape_interval_s=0.5, log_level="warning"),
    )


async def passing_entry(stack: LocalStack, model: str) -> Any:
    consul = stack.scheduler.consul

    async def probe() -> Any:
        _, entries = await consul.health_service(model_service_name(model), passing=True)
        return entries[0] if entries else None

    return await eventually(probe, 90, f"a passing replica of {model}")


async def status_of(
    session: aiohttp.ClientSession, url: str, body: Any, headers: Mapping[str, str] | None = None
) -> int:
    async with session.post(url, json=body, headers=dict(headers or {})) as response:
        await response.read()
        return response.status


async def job_spec_json(stack: LocalStack, job_id: str) -> str:
    """The job as Nomad stores it (`GET /v1/job/:id`), as text (caravan's client reads only
    job stubs)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{stack.nomad_addr}/v1/job/{job_id}") as response,
    ):
        assert 200 == response.status
        return await response.text()


async def check_engine_refuses_direct_requests(
    stack: LocalStack, profile: ModelProfile, caplog: pytest.LogCaptureFixture
) -> str:
    """The shared scenario; returns the model's key for further checks."""
    assert stack.router is not None
    entry = await passing_entry(stack, profile.name)
    nomad = stack.scheduler.nomad
    variable = await nomad.get_variable(engine_key_path(profile.name))
    assert variable is not None
    key = variable.items[ENGINE_KEY_ITEM]
    copy = await nomad.get_variable(replica_key_path(replica_job_id(profile.name, 0)))
    assert copy is not None
    assert key == copy.items[ENGINE_KEY_ITEM]
    body = {
        "model": profile.served_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    }
    direct = f"http://{entry.address}:{entry.port}/v1/chat/completions"
    routed = f"{stack.router.base_url}/v1/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        assert 401 == await status_of(session, direct, body)
        assert 401 == await status_of(session, direct, body, {"Authorization": "Bearer guess"})

        # The client presents the router's key (the stack's routers require one);
        # the engine accepts only its own, so a 200 shows the router swapped them.
        client = stack.router.headers

        async def routed_ok() -> bool:
            # The router may still be loading the key the scheduler just created.
            return await status_of(session, routed, body, client) == 200

        await eventually(routed_ok, 20, "a request through the router to succeed")
        for _ in range(3):
            assert 200 == await status_of(session, routed, body, client)
        assert 200 == await status_of(session, direct, body, {"Authorization": f"Bearer {key}"})
    assert key not in await job_spec_json(stack, replica_job_id(profile.name, 0))
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert key not in logged
    return key


@pytest.mark.slow
async def test_simulated_llamacpp_answers_only_with_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Simulated llama.cpp: direct requests without the key are 401, routed ones pass."""
    caplog.set_level(logging.DEBUG)
    async with local_stack(stack_options(tmp_path, real=False)) as stack:
        profile = updated(
            local_profile(load_profile(TINY), stack.engine),
            replicas={"min": 1, "max": 1, "initial": 1},
        )
        await ModelStore(stack.scheduler.consul, KVLayout()).submit([profile])
        await check_engine_refuses_direct_requests(stack, profile, caplog)


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.skipif(find_llama_server() is None, reason="the real llama-server is not built")
async def test_real_llama_server_answers_only_with_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The real llama-server, started by devcluster from the rendered job, refuses direct
    requests without the key and serves the router."""
    caplog.set_level(logging.DEBUG)
    async with local_stack(stack_options(tmp_path, real=True)) as stack:
        assert stack.engine.real
        profile = updated(
            local_profile(load_profile(TINY), stack.engine),
            replicas={"min": 1, "max": 1, "initial": 1},
        )
        await ModelStore(stack.scheduler.consul, KVLayout()).submit([profile])
        await check_engine_refuses_direct_requests(stack, profile, caplog)


@pytest.mark.slow
async def test_vllm_replica_gets_its_key_and_profile_secret_by_reference(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Simulated vLLM from the example profile: its HF_TOKEN secret and engine key reach the
    task through templates; the job spec holds neither value."""
    caplog.set_level(logging.DEBUG)
    async with local_stack(stack_options(tmp_path, real=False)) as stack:
        profile = updated(
            load_profile(QWEN),
            replicas={"min": 1, "max": 1, "initial": 1},
            env={"CARAVAN_SIM_LOAD_SECONDS": "0.5"},
            startup_timeout_s=60,
        ).model_copy(update={"autoscaling": None})
        await stack.scheduler.nomad.put_variable("caravan/secrets/hf", {"HF_TOKEN": HF_SECRET})
        await ModelStore(stack.scheduler.consul, KVLayout()).submit([profile])
        await check_engine_refuses_direct_requests(stack, profile, caplog)
        job_id = replica_job_id(profile.name, 0)
        spec = await job_spec_json(stack, job_id)
        assert HF_SECRET not in spec
        assert "caravan/secrets/hf" in spec
        allocs = [
            a for a in (await stack.scheduler.nomad.list_allocations()).value if a.job_id == job_id
        ]
        running = [a for a in allocs if a.client_status == "running"]
        server = stack.cluster.nomad
        node = server.state.nodes[running[0].node_id]
        rendered = (
            server.data_dir
            / node.name
            / "alloc"
            / running[0].id
            / "engine"
            / "secrets"
            / "profile-secrets-0.env"
        ).read_text()
        assert f"HF_TOKEN={HF_SECRET}\n" in rendered
        logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
        assert HF_SECRET not in logged


# -- rendering and the CLI ---------------------------------------------------------


def test_rendered_job_carries_references_only() -> None:
    """The job has templates that name variable paths; the engine args carry no key."""
    profile = load_profile(QWEN)
    task = render(profile, 1)["Job"]["TaskGroups"][0]["Tasks"][0]
    templates = {t["DestPath"]: t for t in task["Templates"]}
    key_template = templates["secrets/engine-key.env"]
    assert '{{ with nomadVar "nomad/jobs/caravan-qwen2-5-7b-1" }}' in key_template["EmbeddedTmpl"]
    assert "VLLM_API_KEY={{ .api_key }}" in key_template["EmbeddedTmpl"]
    assert key_template["Envvars"] is True
    secret = templates["secrets/profile-secrets-0.env"]["EmbeddedTmpl"]
    assert 'nomadVar "caravan/secrets/hf"' in secret
    assert "HF_TOKEN={{ .HF_TOKEN }}" in secret
    assert not any("api-key" in arg for arg in task["Config"]["args"])
    assert "HF_TOKEN" not in task["Env"]


def test_keys_off_renders_no_template() -> None:
    """`engine_api_keys: false` (setups without Variables) renders the job as before."""
    profile = load_profile(TINY)
    task = render(profile, 0, config=ClusterConfig(engine_api_keys=False))["Job"]
    assert "Templates" not in task["TaskGroups"][0]["Tasks"][0]


def test_caravan_render_prints_the_reference_not_the_value() -> None:
    """`caravan render` of the example with a secret shows its path, and no value can leak:
    rendering never reads Nomad."""
    result = subprocess.run(
        [sys.executable, "-m", "caravan_llm.cli", "render", str(QWEN)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert 0 == result.returncode, result.stderr
    assert "caravan/secrets/hf" in result.stdout
    assert "nomad/jobs/caravan-qwen2-5-7b-0" in result.stdout
    assert HF_SECRET not in result.stdout


@pytest.mark.parametrize(
    ("secrets", "message"),
    [
        ({"VLLM_API_KEY": "caravan/k"}, "engine's API key"),
        ({"HF_TOKEN": "bad path!"}, "not a Nomad Variables path"),
        ({"HF_TOKEN": "nomad/other/x"}, "only nomad/jobs"),
        ({"HF_TOKEN": "nomad/jobsx/y"}, "only nomad/jobs"),
        ({"K": "nomad/jobs/caravan-scheduler#nomad_token"}, "caravan's own"),
        ({"K": "nomad/jobs/caravan-other-0#api_key"}, "caravan's own"),
        ({"K": "nomad/jobs/caravan-engine-keys/models/other/key#api_key"}, "caravan's own"),
        ({"HF_TOKEN": "caravan/x#not-ident"}, "item 'not-ident'"),
        ({"1BAD": "caravan/x"}, "not a valid environment variable name"),
        ({"HF_HOME": "caravan/x"}, "env and secrets both set HF_HOME"),
    ],
)
def test_bad_secret_references_are_refused(secrets: dict[str, str], message: str) -> None:
    """Secret references are validated with an error naming the variable."""
    document = load_profile(QWEN).model_dump(mode="json", exclude_none=True)
    document["secrets"] = secrets
    with pytest.raises(ValidationError, match=message):
        ModelProfile.model_validate(document)


def test_forward_authorization_is_retired() -> None:
    """Forwarding the client's Authorization to engines can no longer be turned on."""
    with pytest.raises(ValidationError, match="forward_authorization is retired"):
        RouterSettings(forward_authorization=True)


# -- the key stores ------------------------------------------------------------------


class FakeVariables:
    """An in-memory Variables store with Nomad's CAS rule."""

    def __init__(self) -> None:
        self.vars: dict[str, Variable] = {}
        self.index = 10
        self.puts = 0

    def _meta(self, path: str) -> VariableMetadata:
        return VariableMetadata("default", path, self.index, self.index)

    async def get_variable(self, path: str) -> Variable | None:
        return self.vars.get(path)

    async def put_variable(
        self, path: str, items: Mapping[str, str], *, cas: int | None = None
    ) -> VariableMetadata:
        current = self.vars.get(path)
        if cas is not None and cas != (0 if current is None else current.meta.modify_index):
            raise HashiConflict("cas")
        self.index += 1
        self.puts += 1
        self.vars[path] = Variable(self._meta(path), dict(items))
        return self.vars[path].meta

    async def delete_variable(self, path: str, *, cas: int | None = None) -> None:
        del cas
        self.vars.pop(path, None)

    async def list_variables(
        self, prefix: str = "", *, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[VariableMetadata]]:
        del index, wait_s
        metas = [v.meta for p, v in sorted(self.vars.items()) if p.startswith(prefix)]
        return QueryResult(self.index, metas)


async def test_scheduler_creates_a_key_once_per_model_and_copies_it_per_replica() -> None:
    """One key per model (different across models), copied into each replica's own path."""
    store = FakeVariables()
    keys = SchedulerEngineKeys(store)
    await keys.ensure_replica_key("alpha", "caravan-alpha-0")
    await keys.ensure_replica_key("alpha", "caravan-alpha-1")
    await keys.ensure_replica_key("beta", "caravan-beta-0")
    alpha = store.vars[engine_key_path("alpha")].items["api_key"]
    beta = store.vars[engine_key_path("beta")].items["api_key"]
    assert alpha != beta
    assert alpha == store.vars["nomad/jobs/caravan-alpha-1"].items["api_key"]
    assert beta == store.vars["nomad/jobs/caravan-beta-0"].items["api_key"]
    puts = store.puts
    await SchedulerEngineKeys(store).ensure_replica_key("alpha", "caravan-alpha-0")
    assert puts == store.puts  # an existing key is kept, an equal copy not rewritten
    # An operator's rotation (a new per-model key) reaches the next replica registered.
    await store.put_variable(engine_key_path("alpha"), {"api_key": "rotated"})
    await keys.ensure_replica_key("alpha", "caravan-alpha-0")
    assert "rotated" == store.vars["nomad/jobs/caravan-alpha-0"].items["api_key"]
    await keys.remove_replica_key("caravan-alpha-1")
    assert "nomad/jobs/caravan-alpha-1" not in store.vars


async def test_scrape_key_cache_is_bounded_in_time() -> None:
    """The autoscaler's cached key is read again once CACHE_S has passed."""
    store = FakeVariables()
    now = [0.0]
    keys = SchedulerEngineKeys(store, clock=lambda: now[0])
    first = await keys.cached_model_key("alpha")
    await store.put_variable(engine_key_path("alpha"), {"api_key": "rotated"})
    assert first == await keys.cached_model_key("alpha")
    now[0] = 31.0
    assert "rotated" == await keys.cached_model_key("alpha")


async def test_router_follows_the_keys_by_service_name() -> None:
    """The router maps each model's key variable to `caravan-<model>`; changes show up."""
    store = FakeVariables()
    await store.put_variable(engine_key_path("alpha"), {"api_key": "ka"})
    await store.put_variable(f"{ENGINE_KEY_PREFIX}alpha/other", {"api_key": "kx"})
    await store.put_variable(f"{ENGINE_KEY_PREFIX}Bad_Name/key", {"api_key": "kx"})
    keys = RouterEngineKeys(store)
    await keys.refresh()
    assert ("ka", None) == (keys.key_for("caravan-alpha"), keys.key_for("caravan-beta"))
    assert frozenset({"caravan-alpha"}) == keys.models
    await store.put_variable(engine_key_path("alpha"), {"api_key": "ka2"})
    await store.put_variable(engine_key_path("beta"), {"api_key": "kb"})
    await keys.refresh()
    assert ("ka2", "kb") == (keys.key_for("caravan-alpha"), keys.key_for("caravan-beta"))
    await store.delete_variable(engine_key_path("beta"))
    await keys.refresh()
    assert keys.key_for("caravan-beta") is None


def test_model_keys_are_below_every_implicit_workload_path() -> None:
    """No job can read a model's key by choosing its own name: the path is deeper than
    `nomad/jobs/<job>/<group>/<task>`; a replica reads only its own copy."""
    path = engine_key_path("alpha")
    parts = path.split("/")
    assert len(parts) > 5
    assert not workload_may_read(path, job_id=parts[2], group=parts[3], task=parts[4])
    copy = replica_key_path("caravan-alpha-0")
    assert workload_may_read(copy, job_id="caravan-alpha-0", group="engine", task="engine")
    assert not workload_may_read(copy, job_id="caravan-alpha-1", group="engine", task="engine")


async def test_autoscaler_scrape_sends_the_engine_key() -> None:
    """llama-server guards /metrics: the autoscaler's scrape reads it with the key only."""
    argv = ["--flavor", "llamacpp", "-m", "m.gguf", "--metrics", "--host", "127.0.0.1"]
    argv += ["--port", "0", "--sim-load-seconds", "0", "--api-key", "scrape-key"]
    settings = parse_engine_args(argv, env={})
    async with run_engine(settings) as running, aiohttp.ClientSession() as session:
        await asyncio.wait_for(running.engine.ready.wait(), timeout=10)
        target = ReplicaTarget(
            replica_id="r0",
            base_url=running.base_url,
            metrics_path="/metrics",
            metric_names=LLAMACPP_METRIC_NAMES,
        )
        keyed = replace(target, api_key="scrape-key")
        assert "scrape-key" not in repr(keyed)
        without, with_key = await scrape_replicas(session, [target, keyed])
    assert (ScrapeFailure.HTTP_STATUS, "HTTP 401") == (without.failure, without.detail)
    assert with_key.failure is None
    assert 0 == with_key.load.running


@pytest.mark.slow
async def test_missing_secret_holds_the_replica_and_status_names_the_path(tmp_path: Path) -> None:
    """Before its variable exists a replica waits, and `caravan status` says which path
    it waits for (the reference, never a value); once written, the replica comes up."""
    options = replace(stack_options(tmp_path, real=False), variables={}, router=None)
    async with local_stack(options) as stack:
        profile = updated(
            load_profile(QWEN),
            replicas={"min": 1, "max": 1, "initial": 1},
            env={"CARAVAN_SIM_LOAD_SECONDS": "0.5"},
            startup_timeout_s=60,
        ).model_copy(update={"autoscaling": None})
        store = ModelStore(stack.scheduler.consul, KVLayout())
        await store.submit([profile])
        reader = StatusReader(
            store=store,
            nomad=stack.scheduler.nomad,
            health=stack.scheduler.consul,
            config=stack.config,
        )

        async def waiting_reason() -> str | None:
            status = await reader.model(profile.name)
            events = [r.last_event or "" for r in status.replicas]
            return next((e for e in events if "Missing: nomad.var.block(" in e), None)

        reason = await eventually(waiting_reason, 60, "status to name the missing variable")
        assert "caravan/secrets/hf" in reason
        await stack.scheduler.nomad.put_variable("caravan/secrets/hf", {"HF_TOKEN": HF_SECRET})
        await passing_entry(stack, profile.name)
        status = json.dumps((await reader.model(profile.name)).to_json())
        assert HF_SECRET not in status
