"""Issue 12, item 9, exercised: caravan runs on exactly the least-privilege Consul policies.

The local stack runs devcluster's Consul with ACLs on (default deny) and gives
the scheduler, the router and the operator's CLI each a token that carries
exactly the rendered policy of terraform/policies/ and nothing else. A model
is submitted with the CLI's direct path (the operator's token), serves a
streamed completion through the router, is scaled and deleted, and Consul
refused nothing: devcluster logs every answer with the AccessorID of the
token it resolved, and no answer to any of the three tokens is a 403. Then the
router's token is shown to be unable to write a model or register a service.

As in production, the router runs with register_service=false: under Nomad
its service block registers `caravan-router` (docs/operations.md), so the
router's policy has no service:write at all; a last test shows what a
router that registers itself (outside Nomad) needs on top: write on its own
`caravan-router` service, as docs/security.md says. devcluster's Nomad registers
the replicas' services with the management token, as a Nomad agent does with
its own token.

Nomad's side is the same story: devcluster's Nomad runs with ACLs on and the
scheduler and the router each hold a Nomad token carrying exactly their
rendered policy (terraform/policies/caravan-*.nomad.hcl.tftpl); devcluster
logs every Nomad answer with the AccessorID of the token it resolved, and
Nomad refuses neither token anything while the model goes through its life.
Then the router's token is shown unable to register a job or read a node, and
the scheduler's unable to read or write the control plane's own Variables.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from polling import eventually

from caravan_llm.cli.local_stack import (
    ConsulAcl,
    LocalStack,
    NomadAcl,
    StackOptions,
    local_stack,
    running_router,
)
from caravan_llm.common.consul_api import ConsulClient, ConsulSettings
from caravan_llm.common.contract import KVLayout
from caravan_llm.common.errors import HashiPermissionDenied
from caravan_llm.devcluster.consul.server import ConsulConfig, ConsulServer
from caravan_llm.devcluster.nomad.server import NomadServer
from caravan_llm.router.settings import RouterSettings

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ROOT / "terraform" / "policies"
MODEL = "tiny-chat"


def rendered_policy(component: str) -> str:
    """A Consul policy template rendered with the Terraform module's defaults."""
    text = (POLICIES / f"caravan-{component}.consul.hcl.tftpl").read_text(encoding="utf-8")
    text = text.replace("${kv_prefix}", KVLayout().prefix).replace("${namespace}", "default")
    text = text.replace("${kv_history_prefix}", KVLayout().history)
    assert "${" not in text, component
    return text


def rendered_nomad_policy(component: str) -> str:
    """A Nomad policy template rendered with the Terraform module's defaults."""
    text = (POLICIES / f"caravan-{component}.nomad.hcl.tftpl").read_text(encoding="utf-8")
    text = text.replace("${namespace}", "default")
    assert "${" not in text, component
    return text


async def caravan(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.cli",
        *args,
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 150)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def write_profile(stack: LocalStack, folder: Path) -> Path:
    profile = yaml.safe_load((ROOT / "examples/profiles/tiny-llamacpp-cpu.yaml").read_text())
    profile["model"] = str(stack.engine.model)
    profile["replicas"] = {"min": 1, "max": 3, "initial": 1}
    profile.pop("autoscaling", None)  # manual scaling only: nothing else may change the count
    profile["env"] = {"CARAVAN_SIM_STEP_SECONDS": "0.002", "CARAVAN_SIM_OUTPUT_TOKENS": "4"}
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(profile), encoding="utf-8")
    return path


async def streamed_completion(session: aiohttp.ClientSession, url: str) -> str | None:
    """The text of one streamed chat completion, or None if the router refused it."""
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello"}],
    }
    async with session.post(url, json=body) as response:
        if response.status != 200:
            return None
        text, done = "", False
        async for raw in response.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                for choice in chunk.get("choices", []):
                    text += (choice.get("delta") or {}).get("content") or ""
        return text if done else None


def answers(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, int]]:
    """(accessor, method path, status) of every Consul answer devcluster logged."""
    out = []
    for record in caplog.records:
        if record.name != "caravan_llm.devcluster.consul.http_api":
            continue
        if record.getMessage() not in ("consul_request", "consul_request_failed"):
            continue
        fields = record.__dict__
        out.append(
            (
                str(fields.get("accessor_id")),
                f"{fields['method']} {fields['path']}",
                int(fields["status"]),
            )
        )
    return out


def nomad_answers(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, int]]:
    """(accessor, method path, status) of every Nomad answer devcluster logged."""
    return [
        (
            str(record.__dict__.get("accessor_id")),
            f"{record.__dict__['method']} {record.__dict__['path']}",
            int(record.__dict__["status"]),
        )
        for record in caplog.records
        if record.name == "caravan_llm.devcluster.nomad.http_api"
        and record.getMessage() == "nomad_request"
    ]


def nomad_refusals(
    stack: LocalStack, caplog: pytest.LogCaptureFixture
) -> list[tuple[str, str, int]]:
    """Every 401/403 Nomad gave the scheduler's or the router's token."""
    accessors = {c: str(t["AccessorID"]) for c, t in stack.nomad_tokens.items()}
    return [
        (component, request, status)
        for accessor, request, status in nomad_answers(caplog)
        for component, known in accessors.items()
        if accessor == known and status in (401, 403)
    ]


def least_privilege_options(tmp_path: Path, **overrides: Any) -> StackOptions:
    """The local stack with Consul and Nomad ACLs on, each component on its rendered policies."""
    acl = ConsulAcl(
        management_token=str(uuid.uuid4()),
        scheduler_rules=rendered_policy("scheduler"),
        router_rules=rendered_policy("router"),
        operator_rules=rendered_policy("operator"),
    )
    values: dict[str, Any] = {
        "prefer_real_llama_server": False,
        "gpu_nodes": 0,
        "work_dir": tmp_path,
        "resync_s": 2.0,
        # As under Nomad, whose service block registers `caravan-router`.
        "router": RouterSettings(
            port=0, register_service=False, scrape_interval_s=0.5, log_level="warning"
        ),
        "consul_acl": acl,
        "nomad_acl": NomadAcl(
            management_token=str(uuid.uuid4()),
            scheduler_rules=rendered_nomad_policy("scheduler"),
            router_rules=rendered_nomad_policy("router"),
        ),
    }
    values.update(overrides)
    return StackOptions(**values)


def management_client(stack: LocalStack) -> ConsulClient:
    assert stack.cluster.config.consul.management_token is not None
    token = stack.cluster.config.consul.management_token
    return ConsulClient(ConsulSettings.from_env({**stack.env, "CONSUL_HTTP_TOKEN": token}))


def refusals(stack: LocalStack, caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, int]]:
    """Every 401/403 Consul gave a component's token: (component, request, status).

    Also fails on any warning or error the scheduler or router logged about a
    refusal (their side of the same story).
    """

    def about_a_refusal(record: logging.LogRecord) -> bool:
        texts = [record.getMessage(), *(v for v in record.__dict__.values() if isinstance(v, str))]
        if any(w in t.lower() for t in texts for w in ("permission denied", "acl not found")):
            return True
        return any(record.__dict__.get(k) in (401, 403) for k in ("status", "status_code"))

    complaints = [
        record.getMessage()
        for record in caplog.records
        if record.levelno >= logging.WARNING
        and record.name.startswith(("scheduler", "router", "caravan"))
        and about_a_refusal(record)
    ]
    assert complaints == []
    accessors = {c: str(t["AccessorID"]) for c, t in stack.consul_tokens.items()}
    return [
        (component, request, status)
        for accessor, request, status in answers(caplog)
        for component, known in accessors.items()
        if accessor == known and status in (401, 403)
    ]


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_components_work_on_exactly_their_least_privilege_policies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Submit (CLI), stream through the router, scale, delete: Consul and Nomad refuse nothing."""
    caplog.set_level(logging.DEBUG, logger="caravan_llm.devcluster.consul.http_api")
    caplog.set_level(logging.DEBUG, logger="caravan_llm.devcluster.nomad.http_api")
    options = least_privilege_options(tmp_path)
    async with local_stack(options) as stack:
        assert stack.router is not None
        accessors = {c: str(t["AccessorID"]) for c, t in stack.consul_tokens.items()}
        env = dict(stack.env)
        assert env["CONSUL_HTTP_TOKEN"] == stack.consul_tokens["operator"]["SecretID"]
        admin = management_client(stack)
        async with admin, aiohttp.ClientSession(headers=stack.router.headers) as session:

            async def passing(count: int) -> bool:
                _, entries = await admin.health_service(f"caravan-{MODEL}", passing=True)
                return len(entries) == count

            code, out, err = await caravan(
                env, "submit", str(write_profile(stack, tmp_path)), "--wait", "--timeout", "120"
            )
            assert (code, err) == (0, ""), (out, err)
            url = f"{stack.router.base_url}/v1/chat/completions"
            completions: list[str] = []

            async def serves() -> bool:
                text = await streamed_completion(session, url)
                if text:
                    completions.append(text)
                return bool(text)

            await eventually(serves, 60, "a streamed completion through the router")

            # The operator's CLI reads status and logs on its own Nomad policy alone.
            operator_env = {
                **env,
                "NOMAD_TOKEN": await nomad_token_for(
                    stack.nomad_addr,
                    options.nomad_acl.management_token,
                    "caravan-operator",
                    rendered_nomad_policy("operator"),
                ),
            }
            code, out, err = await caravan(operator_env, "status", MODEL)
            assert (code, err) == (0, ""), (out, err)
            assert "unavailable" not in out, out
            code, out, err = await caravan(
                operator_env, "logs", MODEL, "--replica", "0", "--stderr", "--tail", "-n", "5"
            )
            assert code == 0, (out, err)

            code, out, err = await caravan(env, "scale", MODEL, "2")
            assert (code, err) == (0, ""), (out, err)
            await eventually(lambda: passing(2), 120, "2 passing replicas after scaling")

            code, out, err = await caravan(env, "delete", MODEL)
            assert (code, err) == (0, ""), (out, err)

            async def gone() -> bool:
                _, model = await admin.kv_get(KVLayout().model_key(MODEL))
                return model is None and await passing(0)

            await eventually(gone, 120, "the model deleted and its replicas gone")
            seen = answers(caplog)

            # The three components did talk to Consul, each with its own token...
            for component in ("scheduler", "router", "operator"):
                assert any(a == accessors[component] for a, _, _ in seen), component
            # ...and Consul refused none of them anything.
            assert refusals(stack, caplog) == []

            # The router's token cannot write a model or register a service.
            router_token = stack.consul_tokens["router"]
            async with aiohttp.ClientSession(
                headers={"X-Consul-Token": str(router_token["SecretID"])}
            ) as raw:
                base = f"http://{stack.consul_addr}/v1"
                model_key = KVLayout().model_key("rogue")
                async with raw.put(f"{base}/kv/{model_key}", data=b"name: rogue") as response:
                    assert 403 == response.status
                    assert (
                        f"token with AccessorID '{accessors['router']}' lacks permission "
                        f"'key:write' on \"{model_key}\""
                    ) in await response.text()
                registration = {"Name": f"caravan-{MODEL}", "Port": 1, "Tags": ["caravan"]}
                async with raw.put(f"{base}/agent/service/register", json=registration) as response:
                    assert 403 == response.status
                    assert "lacks permission 'service:write'" in await response.text()
                # What it may write: its cold-start demand record.
                demand = KVLayout().demand_key(MODEL)
                async with raw.put(f"{base}/kv/{demand}", data=b"1") as response:
                    assert 200 == response.status
            _, rogue = await admin.kv_get(model_key)
            assert rogue is None
            # The log the check above relies on does record refusals, with the token's accessor.
            refused_now = [
                (request, status)
                for accessor, request, status in answers(caplog)
                if accessor == accessors["router"] and status == 403
            ]
            assert [
                (f"PUT /v1/kv/{model_key}", 403),
                ("PUT /v1/agent/service/register", 403),
            ] == refused_now
        assert completions
        await nomad_side_of_the_story(stack, caplog)


async def nomad_side_of_the_story(stack: LocalStack, caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler and router used Nomad with their own tokens, unrefused; then the limits."""
    nomad_accessors = {c: str(t["AccessorID"]) for c, t in stack.nomad_tokens.items()}
    seen = nomad_answers(caplog)
    scheduler_calls = {r for a, r, _ in seen if a == nomad_accessors["scheduler"]}
    # The scheduler registered, listed and deregistered jobs, read nodes, wrote engine keys.
    assert "PUT /v1/jobs" in scheduler_calls
    assert "GET /v1/nodes" in scheduler_calls
    assert f"DELETE /v1/job/caravan-{MODEL}-0" in scheduler_calls
    key = f"/v1/var/nomad/jobs/caravan-engine-keys/models/{MODEL}/key"
    assert f"PUT {key}" in scheduler_calls
    # The router read the engines' API keys from Variables with its own token.
    router_reads = [
        (r, status)
        for a, r, status in seen
        if a == nomad_accessors["router"] and r.startswith("GET /v1/var/")
    ]
    assert (f"GET {key}", 200) in router_reads
    assert nomad_refusals(stack, caplog) == []

    base = stack.nomad_addr
    router_token = str(stack.nomad_tokens["router"]["SecretID"])
    scheduler_token = str(stack.nomad_tokens["scheduler"]["SecretID"])
    job = {"Job": {"ID": "rogue", "Datacenters": ["dc1"], "TaskGroups": []}}
    async with aiohttp.ClientSession(headers={"X-Nomad-Token": router_token}) as raw:
        async with raw.put(f"{base}/v1/jobs", json=job) as response:
            assert (403, "Permission denied") == (response.status, await response.text())
        async with raw.get(f"{base}/v1/nodes") as response:
            assert (403, "Permission denied") == (response.status, await response.text())
        # Only the engine keys: not another job's Variables, not even a replica's own copy.
        async with raw.get(f"{base}/v1/var/nomad/jobs/caravan-{MODEL}-0") as response:
            assert (403, "Permission denied") == (response.status, await response.text())
    own = f"{base}/v1/var/nomad/jobs/caravan-scheduler"
    async with aiohttp.ClientSession(headers={"X-Nomad-Token": scheduler_token}) as raw:
        async with raw.get(own) as response:
            assert (403, "Permission denied") == (response.status, await response.text())
        async with raw.put(own, json={"Items": {"token": "stolen"}}) as response:
            assert 403 == response.status
    # The log the check above relies on does record these refusals, with each token's accessor.
    refused = nomad_refusals(stack, caplog)
    assert [
        ("router", "PUT /v1/jobs", 403),
        ("router", "GET /v1/nodes", 403),
        ("router", f"GET /v1/var/nomad/jobs/caravan-{MODEL}-0", 403),
        ("scheduler", "GET /v1/var/nomad/jobs/caravan-scheduler", 403),
        ("scheduler", "PUT /v1/var/nomad/jobs/caravan-scheduler", 403),
    ] == refused


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_cold_start_works_on_the_routers_and_schedulers_policies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Scale to zero, then a request: the router's demand record wakes the model up.

    The model goes in through the scheduler's HTTP API (the scheduler's token
    writes it); the router writes the cold-start demand record with its own
    token, and the scheduler's autoscaler scales the model back up.

    It is about tokens and policies, not placement or draining: one CPU node
    is enough for the one replica, and the replica drains for 1 s (not the
    default 10 s) on scale-to-zero and on delete.
    """
    caplog.set_level(logging.DEBUG, logger="caravan_llm.devcluster.consul.http_api")
    options = least_privilege_options(tmp_path, autoscale_tick_s=1.0, cpu_nodes=1)
    async with local_stack(options) as stack:
        assert stack.router is not None
        layout = KVLayout()
        profile = yaml.safe_load((ROOT / "examples/profiles/tiny-llamacpp-cpu.yaml").read_text())
        profile.update(
            {
                "name": "cold",
                "model": str(stack.engine.model),
                "replicas": {"min": 0, "max": 1, "initial": 1},
                "drain_s": 1,
                "env": {"CARAVAN_SIM_STEP_SECONDS": "0.002", "CARAVAN_SIM_OUTPUT_TOKENS": "4"},
                "autoscaling": {
                    "target_inflight": 2,
                    "scale_up_window_s": 0,
                    "scale_down_window_s": 3,
                    "scale_to_zero_after_s": 3,
                    "evaluation_interval_s": 1,
                },
            }
        )
        admin = management_client(stack)
        async with admin, aiohttp.ClientSession(headers=stack.scheduler_headers) as api:

            async def desired_is(count: int) -> bool:
                _, entry = await admin.kv_get(layout.desired_key("cold"))
                return entry is not None and entry.value == str(count).encode()

            async def passing(count: int) -> bool:
                _, entries = await admin.health_service("caravan-cold", passing=True)
                return len(entries) == count

            async with api.put(
                f"{stack.scheduler_url}/v1/models/cold", data=yaml.safe_dump(profile)
            ) as response:
                assert 200 == response.status, await response.text()
            await eventually(lambda: passing(1), 90, "the first replica")
            await eventually(lambda: desired_is(0), 60, "scale to zero")
            await eventually(lambda: passing(0), 60, "no replica left")

            body = {
                "model": "cold",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            }
            timeout = aiohttp.ClientTimeout(total=120)
            async with (
                aiohttp.ClientSession(headers=stack.router.headers, timeout=timeout) as client,
                client.post(f"{stack.router.base_url}/v1/chat/completions", json=body) as response,
            ):
                answer = await response.json()
            assert 200 == response.status, answer
            assert answer["choices"][0]["message"]["content"]

            router = str(stack.consul_tokens["router"]["AccessorID"])
            demand_writes = [
                status
                for accessor, request, status in answers(caplog)
                if accessor == router and request == f"PUT /v1/kv/{layout.demand_key('cold')}"
            ]
            assert demand_writes
            assert set(demand_writes) == {200}

            async with api.delete(f"{stack.scheduler_url}/v1/models/cold") as response:
                assert 200 == response.status, await response.text()
            await eventually(lambda: passing(0), 60, "the replica gone after delete")
            assert refusals(stack, caplog) == []
            assert nomad_refusals(stack, caplog) == []


def golden_job(name: str) -> dict[str, Any]:
    """A replica or prefetch job exactly as caravan renders it (tests/golden)."""
    document: dict[str, Any] = json.loads((ROOT / "tests" / "golden" / name).read_text())
    return document if "Job" in document else {"Job": document}


async def nomad_token_for(address: str, management: str, name: str, rules: str) -> str:
    """A Nomad client token carrying only a policy `name` with `rules`; its SecretID."""
    async with aiohttp.ClientSession(headers={"X-Nomad-Token": management}) as session:
        policy = {"Name": name, "Rules": rules}
        async with session.post(f"{address}/v1/acl/policy/{name}", json=policy) as response:
            assert 200 == response.status, await response.text()
        token = {"Name": name, "Type": "client", "Policies": [name]}
        async with session.post(f"{address}/v1/acl/token", json=token) as response:
            assert 200 == response.status, await response.text()
            return str((await response.json())["SecretID"])


async def test_the_schedulers_nomad_policy_registers_weights_cache_volumes() -> None:
    """Replicas and prefetch jobs that mount a weights cache (host or CSI volume) register.

    Nomad's Job.Register checks volume permissions on top of submit-job: a host
    volume needs host_volume mount-readonly/readwrite, a CSI volume plugin read
    and csi-mount-volume. The rendered jobs of the cached example profile are
    registered with the scheduler's token, and with a token lacking those
    grants (refused: the check is real).
    """
    management = str(uuid.uuid4())
    replica = golden_job("llama-vllm-h100-cached.job.json")
    prefetch = golden_job("llama-vllm-h100-cached.prefetch.job.json")
    csi = golden_job("llama-vllm-h100-cached.job.json")
    csi["Job"]["ID"] = csi["Job"]["Name"] = "caravan-csi-0"
    for group in csi["Job"]["TaskGroups"]:
        for volume in group["Volumes"].values():
            volume.update({"Type": "csi", "AccessMode": "multi-node-reader-only"})
            volume.update({"AttachmentMode": "file-system"})
    bare = 'namespace "default" {\n  capabilities = ["submit-job"]\n}\n'
    async with NomadServer(nodes=0, token=management) as nomad_server:
        address = nomad_server.address
        scheduler = await nomad_token_for(
            address, management, "scheduler", rendered_nomad_policy("scheduler")
        )
        without = await nomad_token_for(address, management, "bare", bare)
        async with aiohttp.ClientSession() as http:
            for job in (replica, prefetch, csi):
                for token, expected in ((without, 403), (scheduler, 200)):
                    async with http.put(
                        f"{address}/v1/jobs", json=job, headers={"X-Nomad-Token": token}
                    ) as response:
                        assert expected == response.status, (
                            job["Job"]["ID"],
                            await response.text(),
                        )


async def token_for(consul_addr: str, management: str, name: str, rules: str) -> str:
    """A token carrying only a policy `name` with `rules` (Consul's ACL API); its SecretID."""
    async with aiohttp.ClientSession(headers={"X-Consul-Token": management}) as session:
        policy = {"Name": name, "Rules": rules}
        async with session.put(f"http://{consul_addr}/v1/acl/policy", json=policy) as response:
            assert 200 == response.status, await response.text()
        token = {"Policies": [{"Name": name}]}
        async with session.put(f"http://{consul_addr}/v1/acl/token", json=token) as response:
            assert 200 == response.status, await response.text()
            return str((await response.json())["SecretID"])


async def test_a_self_registering_router_needs_exactly_write_on_its_own_service() -> None:
    """What docs/security.md says a router outside Nomad needs on top of its policy."""
    management = str(uuid.uuid4())
    async with ConsulServer(ConsulConfig(management_token=management)) as server:
        plain = await token_for(server.http_addr, management, "router", rendered_policy("router"))
        extra = 'service "caravan-router" {\n  policy = "write"\n}\n'
        registering = await token_for(
            server.http_addr, management, "router-registering", rendered_policy("router") + extra
        )
        settings = RouterSettings(port=0, host="127.0.0.1", log_level="warning")
        environ = {"CONSUL_HTTP_ADDR": server.http_addr}
        async with ConsulClient(
            ConsulSettings.from_env({**environ, "CONSUL_HTTP_TOKEN": plain})
        ) as consul:
            with pytest.raises(HashiPermissionDenied):
                async with running_router(settings, consul):
                    pass
        async with (
            ConsulClient(
                ConsulSettings.from_env({**environ, "CONSUL_HTTP_TOKEN": registering})
            ) as consul,
            running_router(settings, consul),
        ):
            _, entries = await consul.health_service("caravan-router")
            assert 1 == len(entries)
