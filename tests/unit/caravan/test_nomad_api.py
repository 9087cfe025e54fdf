"""caravan's async Nomad client: settings, requests, error mapping, blocking reads, events."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from tls_material import TlsMaterial

from caravan.errors import (
    HashiBadRequest,
    HashiConflict,
    HashiNotFound,
    HashiPermissionDenied,
    HashiUnavailable,
    JobModifyIndexConflict,
)
from caravan.nomad_api import NomadClient, NomadSettings

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


async def test_get_job_is_none_when_nomad_has_no_such_job(
    fake: tuple[FakeNomad, TestServer],
) -> None:
    """404 `job not found` on a read of one job is None, not an error."""
    nomad, server = fake
    nomad.answers[("GET", "/v1/job/x")] = text_answer("job not found", 404)
    async with client_for(server) as client:
        assert await client.get_job("x") is None


async def test_job_reads_typed_with_raw_json(fake: tuple[FakeNomad, TestServer]) -> None:
    """The typed job keeps Nomad's JSON next to the fields caravan reads."""
    nomad, server = fake
    raw = {"ID": "j", "Version": 3, "Status": "running", "Meta": {"k": "v"}, "JobModifyIndex": 11}
    nomad.answers[("GET", "/v1/job/j")] = json_answer(raw)
    async with client_for(server) as client:
        job = await client.get_job("j")
    assert job is not None
    assert (3, "running", {"k": "v"}, 11, raw) == (
        job.version,
        job.status,
        dict(job.meta),
        job.job_modify_index,
        dict(job.raw),
    )


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
    nomad.answers[("GET", "/v1/job/j/allocations")] = json_answer([stub], index=42)
    async with client_for(server) as client:
        result = await client.job_allocations("j", index=41, wait_s=30)
    (alloc,) = result.value
    assert (42, "a1", 2, None) == (result.index, alloc.id, alloc.job_version, alloc.ports)
    assert ("41", "30000ms") == (nomad.requests[0].query["index"], nomad.requests[0].query["wait"])


async def test_full_allocation_has_ports(fake: tuple[FakeNomad, TestServer]) -> None:
    """`AllocatedResources.Shared.Ports` become typed ports."""
    nomad, server = fake
    body = {
        "ID": "a1",
        "AllocatedResources": {
            "Shared": {
                "Ports": [{"Label": "http", "Value": 23456, "To": 8000, "HostIP": "10.0.0.2"}]
            }
        },
        "DeploymentStatus": {"Healthy": True},
    }
    nomad.answers[("GET", "/v1/allocation/a1")] = json_answer(body)
    async with client_for(server) as client:
        alloc = await client.allocation("a1")
    assert alloc is not None
    assert alloc.ports is not None
    assert (("http", 23456, 8000, "10.0.0.2"), True) == (
        (alloc.ports[0].label, alloc.ports[0].value, alloc.ports[0].to, alloc.ports[0].host_ip),
        alloc.deployment_healthy,
    )


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


# -- events ---------------------------------------------------------------------


async def test_event_stream_skips_heartbeats_and_reconnects_after_the_last_index(
    fake: tuple[FakeNomad, TestServer],
) -> None:
    """Frames come in order without `{}`; after a break the stream resumes at last index + 1."""
    nomad, server = fake
    streams = [
        [
            {},
            {
                "Index": 5,
                "Events": [
                    {
                        "Topic": "Allocation",
                        "Type": "PlanResult",
                        "Key": "a1",
                        "Index": 5,
                        "Payload": {},
                    }
                ],
            },
        ],
        [
            {},
            {
                "Index": 6,
                "Events": [
                    {
                        "Topic": "Allocation",
                        "Type": "AllocationUpdated",
                        "Key": "a1",
                        "Index": 6,
                        "Payload": {},
                    }
                ],
            },
        ],
    ]

    def answer(_request: web.Request) -> web.StreamResponse:
        lines = streams.pop(0) if streams else [{}]
        body = "".join(json.dumps(line) + "\n" for line in lines)
        return web.Response(text=body, content_type="application/json")

    nomad.answers[("GET", "/v1/event/stream")] = answer
    frames = []
    async with client_for(server) as client:
        async for frame in client.events(["Allocation:job-1"], index=3):
            frames.append(frame)
            if len(frames) == 2:
                break
    assert [(5, "PlanResult"), (6, "AllocationUpdated")] == [
        (frame.index, frame.events[0].type) for frame in frames
    ]
    starts = [request.query["index"] for request in nomad.requests]
    assert ["3", "6"] == starts[:2]
    assert ["Allocation:job-1"] == nomad.requests[0].query.getall("topic")


async def test_event_stream_refusal_raises(fake: tuple[FakeNomad, TestServer]) -> None:
    """A 400 (bad topic) is raised, not retried forever."""
    nomad, server = fake
    nomad.answers[("GET", "/v1/event/stream")] = text_answer("Invalid topic query: x", 400)
    async with client_for(server) as client:
        with pytest.raises(HashiBadRequest):
            async for _ in client.events(["Job:a:b"]):
                pass
