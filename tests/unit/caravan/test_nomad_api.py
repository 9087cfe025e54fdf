"""caravan's async Nomad client: settings, requests, error mapping, blocking reads, events."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from tls_material import TlsMaterial

from caravan_llm.common.errors import (
    HashiBadRequest,
    HashiConflict,
    HashiNotFound,
    HashiPermissionDenied,
    HashiUnavailable,
    JobModifyIndexConflict,
)
from caravan_llm.common.nomad_api import Allocation, JobStub, Node, NomadClient, NomadSettings

TOKEN = "s3cret-token"


# -- settings ------------------------------------------------------------------


def test_settings_default_to_the_local_agent() -> None:
    """With no variables the client talks to http://127.0.0.1:4646 without a token."""
    settings = NomadSettings.from_env({})
    assert ("http://127.0.0.1:4646", None, None) == (
        settings.address,
        settings.token,
        settings.namespace,
    )


def test_settings_read_the_nomad_cli_variables(tls_material: TlsMaterial) -> None:
    """NOMAD_ADDR, _TOKEN, _NAMESPACE, _REGION and the TLS variables."""
    ca = str(tls_material.cert)
    settings = NomadSettings.from_env(
        {
            "NOMAD_ADDR": "nomad.service.consul:4646",
            "NOMAD_TOKEN": TOKEN,
            "NOMAD_NAMESPACE": "llm",
            "NOMAD_REGION": "eu",
            "NOMAD_CACERT": ca,
            "NOMAD_CLIENT_CERT": str(tls_material.cert),
            "NOMAD_CLIENT_KEY": str(tls_material.key),
            "NOMAD_SKIP_VERIFY": "true",
        }
    )
    assert settings.token is not None
    assert (
        "http://nomad.service.consul:4646",
        TOKEN,
        "llm",
        "eu",
        ca,
        True,
    ) == (
        settings.address,
        settings.token.get_secret_value(),
        settings.namespace,
        settings.region,
        settings.ca_cert,
        settings.skip_verify,
    )
    assert TOKEN not in repr(settings)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"NOMAD_SKIP_VERIFY": "maybe"}, "NOMAD_SKIP_VERIFY must be a boolean"),
        ({"NOMAD_CLIENT_CERT": "/c.pem"}, "must be set together"),
        ({"NOMAD_ADDR": "ftp://x:1"}, "NOMAD_ADDR must be http(s)://host[:port]"),
        ({"NOMAD_ADDR": "http://x:notaport"}, "invalid port"),
    ],
)
def test_bad_settings_name_the_variable(environ: dict[str, str], message: str) -> None:
    """A bad variable is a ValueError that says which one."""
    with pytest.raises(ValueError, match=re.escape(message)):
        NomadSettings.from_env(environ)


# -- a fake Nomad --------------------------------------------------------------


@dataclass
class FakeNomad:
    """Canned answers per (method, path); every request is recorded."""

    answers: dict[tuple[str, str], Callable[[web.Request], web.StreamResponse]] = field(
        default_factory=dict
    )
    requests: list[web.Request] = field(default_factory=list)
    bodies: list[Any] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request)
        raw = await request.read()
        self.bodies.append(json.loads(raw) if raw else None)
        answer = self.answers.get((request.method, request.path))
        if answer is None:
            return web.Response(status=404, text="Invalid URL path")
        response = answer(request)
        if isinstance(response, web.Response):
            return response
        await response.prepare(request)
        return response


def json_answer(
    body: Any, *, index: int = 7, status: int = 200
) -> Callable[[web.Request], web.Response]:
    def answer(_request: web.Request) -> web.Response:
        return web.Response(
            text=json.dumps(body),
            status=status,
            content_type="application/json",
            headers={"X-Nomad-Index": str(index)},
        )

    return answer


def text_answer(text: str, status: int) -> Callable[[web.Request], web.Response]:
    def answer(_request: web.Request) -> web.Response:
        return web.Response(text=text, status=status, content_type="text/plain")

    return answer


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeNomad, TestServer]]:
    nomad = FakeNomad()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", nomad.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield nomad, server
    await server.close()


def client_for(server: TestServer, **settings: Any) -> NomadClient:
    address = f"http://127.0.0.1:{server.port}"
    return NomadClient(NomadSettings(address=address, **settings))


# -- requests -------------------------------------------------------------------


async def test_register_wraps_the_job_and_enforces_the_index(
    fake: tuple[FakeNomad, TestServer],
) -> None:
    """A bare job is sent as {"Job": ...} with EnforceIndex and the token header."""
    nomad, server = fake
    nomad.answers[("PUT", "/v1/jobs")] = json_answer(
        {"EvalID": "e1", "EvalCreateIndex": 9, "JobModifyIndex": 9, "Warnings": "", "Index": 9}
    )
    async with client_for(server, token=TOKEN, namespace="llm") as client:
        result = await client.register_job({"ID": "caravan-q-0"}, enforce_index=5)
    assert ("e1", 9, 9) == (result.eval_id, result.eval_create_index, result.job_modify_index)
    assert {"Job": {"ID": "caravan-q-0"}, "EnforceIndex": True, "JobModifyIndex": 5} == (
        nomad.bodies[0]
    )
    request = nomad.requests[0]
    assert (TOKEN, "llm") == (request.headers["X-Nomad-Token"], request.query["namespace"])


async def test_job_stubs_are_decoded_with_their_meta(fake: tuple[FakeNomad, TestServer]) -> None:
    """`GET /v1/jobs?meta=true` stubs become JobStub values with what the scheduler reads."""
    nomad, server = fake
    stub = {
        "ID": "caravan-q-0",
        "Version": 3,
        "Status": "running",
        "Stop": False,
        "SubmitTime": 1_700_000_000_000_000_000,
        "Meta": {"k": "v"},
        "JobModifyIndex": 11,
        "ModifyIndex": 12,
    }
    nomad.answers[("GET", "/v1/jobs")] = json_answer([stub])
    async with client_for(server) as client:
        (job,) = (await client.list_jobs("caravan-", meta=True)).value
    assert JobStub(
        id="caravan-q-0",
        version=3,
        status="running",
        submit_time_ns=1_700_000_000_000_000_000,
        meta={"k": "v"},
        job_modify_index=11,
        modify_index=12,
    ) == replace(job, meta=dict(job.meta))
    assert {"prefix": "caravan-", "meta": "true"} == dict(nomad.requests[0].query)


async def test_blocking_read_sends_index_and_wait(fake: tuple[FakeNomad, TestServer]) -> None:
    """`index` and `wait` go out as query parameters; the answer's X-Nomad-Index comes back."""
    nomad, server = fake
    stub = {
        "ID": "a1",
        "Name": "j.g[0]",
        "ClientStatus": "running",
        "DesiredStatus": "run",
        "JobVersion": 2,
    }
    nomad.answers[("GET", "/v1/allocations")] = json_answer([stub], index=42)
    async with client_for(server) as client:
        result = await client.list_allocations(index=41, wait_s=30)
    (alloc,) = result.value
    assert (42, "a1", 2, None) == (result.index, alloc.id, alloc.job_version, alloc.ports)
    assert ("41", "30000ms") == (nomad.requests[0].query["index"], nomad.requests[0].query["wait"])


async def test_allocation_with_resources_has_ports_and_task_events(
    fake: tuple[FakeNomad, TestServer],
) -> None:
    """`AllocatedResources.Shared.Ports` become typed ports; every task's events come
    oldest first, in Nomad's display words."""
    nomad, server = fake
    body = {
        "ID": "a1",
        "JobID": "j",
        "DesiredStatus": "run",
        "ClientStatus": "running",
        "CreateTime": 5,
        "ModifyTime": 9,
        "AllocatedResources": {
            "Shared": {
                "Ports": [{"Label": "http", "Value": 23456, "To": 8000, "HostIP": "10.0.0.2"}]
            }
        },
        "DeploymentStatus": {"Healthy": True},
        "TaskStates": {
            "engine": {
                "Events": [
                    {"Type": "Started", "Time": 8, "DisplayMessage": "Task started by client"},
                    {"Type": "Received", "Time": 6, "Message": "queued"},
                    {
                        "Type": "Task hook failed",
                        "Time": 9,
                        "DisplayMessage": "volume missing",
                        "FailsTask": True,
                    },
                ]
            },
            "sidecar": None,
        },
    }
    nomad.answers[("GET", "/v1/allocations")] = json_answer([body])
    async with client_for(server) as client:
        (alloc,) = (await client.list_allocations(resources=True)).value
    assert alloc.ports is not None
    assert (("http", 23456, 8000, "10.0.0.2"), True, 5, 9, True) == (
        (alloc.ports[0].label, alloc.ports[0].value, alloc.ports[0].to, alloc.ports[0].host_ip),
        alloc.deployment_healthy,
        alloc.create_time_ns,
        alloc.modify_time_ns,
        alloc.live,
    )
    assert [
        ("Received: queued", False),
        ("Started: Task started by client", False),
        ("Task hook failed: volume missing", True),
    ] == [(event.words, event.fails_task) for event in alloc.task_events]
    assert "true" == nomad.requests[0].query["resources"]


@pytest.mark.parametrize(
    ("desired", "client", "live"),
    [
        ("run", "pending", True),
        ("run", "running", True),
        ("run", "unknown", False),
        ("run", "failed", False),
        ("run", "lost", False),
        ("run", "complete", False),
        ("stop", "running", False),
        ("evict", "running", False),
    ],
)
def test_one_definition_of_a_live_allocation(desired: str, client: str, live: bool) -> None:
    """Live: Nomad wants it running and it is pending or running; nothing else."""
    alloc = Allocation.from_api({"ID": "a", "DesiredStatus": desired, "ClientStatus": client})
    assert live == alloc.live


@pytest.mark.parametrize(
    ("status", "eligibility", "drain", "ready"),
    [
        ("ready", "eligible", False, True),
        ("ready", "ineligible", True, True),  # draining: its allocations still run
        ("initializing", "eligible", False, False),
        ("down", "eligible", False, False),
        ("disconnected", "eligible", False, False),
    ],
)
def test_one_definition_of_node_readiness(
    status: str, eligibility: str, drain: bool, ready: bool
) -> None:
    """Ready is Nomad's node status `ready`; eligibility and drain do not change it."""
    node = Node.from_api(
        {"ID": "n", "Status": status, "SchedulingEligibility": eligibility, "Drain": drain}
    )
    assert ready == node.ready


async def test_nodes_with_resources_and_devices(fake: tuple[FakeNomad, TestServer]) -> None:
    """Node stubs with `resources=true` carry CPU, memory and GPUs."""
    nomad, server = fake
    stub = {
        "ID": "n1",
        "Name": "node-1",
        "Address": "10.0.0.2",
        "Status": "ready",
        "SchedulingEligibility": "eligible",
        "Drain": False,
        "NodeResources": {
            "Cpu": {"CpuShares": 9600},
            "Memory": {"MemoryMB": 16384},
            "Devices": [
                {
                    "Vendor": "nvidia",
                    "Type": "gpu",
                    "Name": "NVIDIA H100 80GB HBM3",
                    "Instances": [
                        {"ID": "GPU-1", "Healthy": True},
                        {"ID": "GPU-2", "Healthy": False},
                    ],
                    "Attributes": {"memory": {"Int": 81559, "Unit": "MiB"}},
                }
            ],
        },
    }
    nomad.answers[("GET", "/v1/nodes")] = json_answer([stub])
    async with client_for(server) as client:
        (node,) = (await client.list_nodes()).value
    assert node.devices is not None
    assert (True, 9600, 16384, 1, 81559) == (
        node.ready,
        node.cpu_mhz,
        node.memory_mb,
        node.devices[0].healthy_instances,
        node.devices[0].memory_mib,
    )
    assert "true" == nomad.requests[0].query["resources"]


@pytest.mark.parametrize(
    ("status", "text", "error"),
    [
        (403, "Permission denied", HashiPermissionDenied),
        (400, "json: cannot unmarshal string into Go struct field", HashiBadRequest),
        (
            500,
            "1 error occurred:\n\t* Task group engine validation failed: ...",
            HashiBadRequest,
        ),
        (
            500,
            "Enforcing job modify index 5: job exists with conflicting job modify index: 9",
            JobModifyIndexConflict,
        ),
        (409, "Conflict", HashiConflict),
        (500, "rpc error: No cluster leader", HashiUnavailable),
        (503, "unavailable", HashiUnavailable),
    ],
)
async def test_errors_map_to_caravan_errors(
    fake: tuple[FakeNomad, TestServer], status: int, text: str, error: type[Exception]
) -> None:
    """Each failure maps to its typed error, carrying Nomad's message and never the token."""
    nomad, server = fake
    nomad.answers[("PUT", "/v1/jobs")] = text_answer(text, status)
    async with client_for(server, token=TOKEN) as client:
        with pytest.raises(error) as caught:
            await client.register_job({"ID": "j"})
    assert text.splitlines()[0] in str(caught.value)
    assert TOKEN not in str(caught.value)


async def test_validation_500_is_not_retryable_but_an_outage_is(
    fake: tuple[FakeNomad, TestServer],
) -> None:
    """A validation failure must not be retried; an rpc error may be."""
    nomad, server = fake
    async with client_for(server) as client:
        nomad.answers[("PUT", "/v1/jobs")] = text_answer("2 errors occurred:\n\t* a\n\t* b", 500)
        with pytest.raises(HashiBadRequest) as bad:
            await client.register_job({"ID": "j"})
        nomad.answers[("PUT", "/v1/jobs")] = text_answer("rpc error: No cluster leader", 500)
        with pytest.raises(HashiUnavailable) as down:
            await client.register_job({"ID": "j"})
    assert (False, True) == (bad.value.retryable, down.value.retryable)


async def test_unreachable_server_is_unavailable() -> None:
    """A refused connection is HashiUnavailable, naming the address but not the token."""
    settings = NomadSettings(address="http://127.0.0.1:1", token=TOKEN, request_timeout_s=2)
    async with NomadClient(settings) as client:
        with pytest.raises(HashiUnavailable) as caught:
            await client.list_jobs()
    assert "127.0.0.1:1" in str(caught.value)
    assert TOKEN not in str(caught.value)


async def test_read_of_missing_list_endpoint_raises_not_found(
    fake: tuple[FakeNomad, TestServer],
) -> None:
    """A 404 where a list was expected is HashiNotFound."""
    _, server = fake
    async with client_for(server) as client:
        with pytest.raises(HashiNotFound):
            await client.list_allocations()
