"""Bad requests get Consul's status codes and messages; ACLs answer 403 as Consul does."""

from __future__ import annotations

import json
import logging
import uuid

import consul
import consul.aio
import pytest
from consul_helpers import REAL, Target, devcluster_config, raw_request

from caravan_llm.common.consul_api import ConsulClient, ConsulSettings
from caravan_llm.common.errors import HashiPermissionDenied
from caravan_llm.devcluster.consul.server import ConsulServer

REGISTER = "/v1/agent/service/register"
INTERVAL_ERROR = (
    "Invalid check: Interval must be > 0 for Script, HTTP, H2PING, TCP, UDP or OSService checks"
)

# (method, path, body, status, exact body)
EXACT = [
    ("PUT", REGISTER, {"Port": 1}, 400, "Missing service name"),
    ("PUT", REGISTER, {"Name": "x", "Address": "0.0.0.0"}, 400, "Invalid service address"),
    ("PUT", REGISTER, {"Name": "x", "Check": {"HTTP": "http://127.0.0.1/"}}, 400, INTERVAL_ERROR),
    (
        "PUT",
        REGISTER,
        {"Name": "x", "Check": {"Notes": "no kind"}},
        400,
        "Invalid check: TTL must be > 0 for TTL checks",
    ),
    (
        "PUT",
        REGISTER,
        {"Name": "x", "Check": {"TTL": "10s", "HTTP": "http://h/", "Interval": "10s"}},
        400,
        "Invalid check: Interval and TTL cannot both be specified",
    ),
    (
        "PUT",
        REGISTER,
        {"Name": "x", "Check": {"TTL": "10s", "FailuresBeforeWarning": 2}},
        400,
        "Invalid check: FailuresBeforeWarning can't be higher than FailuresBeforeCritical",
    ),
    (
        "PUT",
        REGISTER,
        {"Name": "x", "Check": {"TTL": "10s", "Status": "bogus"}},
        400,
        "Status for checks must 'passing', 'warning', 'critical'",
    ),
    (
        "PUT",
        REGISTER,
        {"Name": "x", "Bogus": 1},
        400,
        'Request decode failed: json: unknown field "Bogus"',
    ),
    ("PUT", "/v1/agent/check/register", {"TTL": "10s"}, 400, "Missing check name"),
    (
        "PUT",
        "/v1/agent/check/register",
        {"Name": "c", "TTL": "10s", "Status": "bogus"},
        400,
        "Bad check status",
    ),
    (
        "PUT",
        "/v1/agent/check/update/anything",
        {"Status": "bogus"},
        400,
        "Invalid check status: 'bogus'",
    ),
    ("GET", "/v1/health/service/consul?passing=nope", None, 400, "Invalid value for ?passing"),
    ("GET", "/v1/health/service/consul?index=abc", None, 400, "Invalid index"),
    ("GET", "/v1/health/service/consul?index=1&wait=abc", None, 400, "Invalid wait time"),
    ("PUT", "/v1/agent/service/maintenance/x", None, 400, "Missing value for enable"),
    (
        "PUT",
        "/v1/agent/service/maintenance/x?enable=maybe",
        None,
        400,
        'Invalid value for enable: "maybe"',
    ),
    ("PUT", "/v1/kv/k?cas=0&acquire=s", "v", 400, "Conflicting flags: acquire=s&cas=0\n"),
    ("GET", "/v1/kv/", None, 400, "Missing key name"),
    ("PUT", "/v1/session/create", {"Behavior": "bogus"}, 500, "Invalid Behavior setting 'bogus'"),
    (
        "PUT",
        "/v1/session/create",
        {"TTL": "abc"},
        500,
        "Session TTL 'abc' invalid: time: invalid duration \"abc\"",
    ),
    (
        "PUT",
        "/v1/session/create",
        {"Bogus": 1},
        400,
        'Request decode failed: json: unknown field "Bogus"',
    ),
    (
        "GET",
        "/v1/no/such/endpoint",
        None,
        404,
        "Invalid URL path: not a recognized HTTP API endpoint\n",
    ),
    ("GET", REGISTER, None, 405, "method GET not allowed"),
]


def _encode(body: object) -> str | None:
    if body is None or isinstance(body, str):
        return body
    return json.dumps(body)


@pytest.mark.parametrize("case", EXACT, ids=[f"{c[1]}-{c[3]}" for c in EXACT])
async def test_bad_requests_get_consuls_status_and_message(target: Target, case):
    """Each malformed request is refused with the status code and text a Consul agent sends."""
    method, path, body, status, text = case
    got_status, got_text, headers = await raw_request(target, method, path, body=_encode(body))
    assert (status, text) == (got_status, got_text)
    assert headers.get("Content-Type", "").startswith("text/plain")


async def test_undecodable_durations_and_bodies_are_400(target: Target):
    """Bodies that are not JSON, or durations that do not parse, fail decoding with 400."""
    bad_json = await raw_request(target, "PUT", REGISTER, body="{not json")
    bad_duration = await raw_request(
        target, "PUT", REGISTER, body=json.dumps({"Name": "x", "Check": {"Interval": "ten"}})
    )
    assert 400 == bad_json[0]
    assert bad_json[1].startswith("Request decode failed: ")
    assert 400 == bad_duration[0]
    assert bad_duration[1].startswith("Request decode failed: ")
    assert '"ten"' in bad_duration[1]


async def test_session_ttl_outside_the_allowed_range_is_500(target: Target):
    """A session TTL below session_ttl_min is refused with Consul's range message."""
    status, text, _ = await raw_request(
        target, "PUT", "/v1/session/create", body=json.dumps({"TTL": "1ms"})
    )
    assert 500 == status
    assert text.startswith("Invalid Session TTL '1000000', must be between [")
    assert text.endswith("=24h0m0s]")


async def test_acquire_with_an_unknown_session_is_500(target: Target):
    """Locking with a session id that does not exist is 500 `invalid session`."""
    session_id = str(uuid.uuid4())
    status, text, _ = await raw_request(target, "PUT", f"/v1/kv/k?acquire={session_id}", body="v")
    assert (500, f'invalid session "{session_id}"') == (status, text)


async def test_renewing_an_unknown_session_is_404(target: Target):
    """Renewing a session id that does not exist is 404 naming it."""
    session_id = str(uuid.uuid4())
    status, text, _ = await raw_request(target, "PUT", f"/v1/session/renew/{session_id}")
    assert (404, f"Session id '{session_id}' not found") == (status, text)


TOKEN = "devcluster-test-management-token"


@pytest.fixture
async def acl_target():
    if REAL:
        pytest.skip("needs an agent with ACLs enabled; the ACL tests run against devcluster only")
    async with ConsulServer(devcluster_config(management_token=TOKEN)) as server:
        yield Target(server.config.host, server.http_port, server.dns_port, server, 1.0)


async def test_acl_denies_requests_without_a_valid_token(acl_target: Target):
    """With a management token configured, anonymous writes and key reads are 403."""
    write = await raw_request(acl_target, "PUT", "/v1/kv/secret", body="v")
    read = await raw_request(acl_target, "GET", "/v1/kv/secret")
    agent_self = await raw_request(acl_target, "GET", "/v1/agent/self")
    unknown = await raw_request(
        acl_target, "GET", "/v1/kv/secret", headers={"X-Consul-Token": "not-a-token"}
    )
    assert 403 == write[0]
    assert write[1].startswith("Permission denied")
    assert "key:write" in write[1]
    assert 403 == read[0]
    assert 403 == agent_self[0]
    assert (403, "ACL not found") == unknown[:2]
    assert "deny" == write[2]["X-Consul-Default-ACL-Policy"]


async def test_acl_filters_anonymous_list_reads(acl_target: Target):
    """Anonymous list reads are filtered to nothing instead of refused, as in Consul."""
    status, body, _ = await raw_request(acl_target, "GET", "/v1/health/service/consul")
    services = await raw_request(acl_target, "GET", "/v1/catalog/services")
    assert (200, []) == (status, json.loads(body))
    assert {} == json.loads(services[1])


@pytest.mark.parametrize(
    ("headers", "query"),
    [
        ({"X-Consul-Token": TOKEN}, ""),
        ({"Authorization": f"Bearer {TOKEN}"}, ""),
        ({}, f"?token={TOKEN}"),
    ],
    ids=["x-consul-token", "bearer", "query"],
)
async def test_acl_accepts_the_management_token_three_ways(acl_target: Target, headers, query):
    """The token may come as X-Consul-Token, Authorization: Bearer, or ?token=."""
    status, body, _ = await raw_request(
        acl_target, "PUT", f"/v1/kv/ok{query}", body="v", headers=headers
    )
    assert (200, "true\n") == (status, body)


async def test_acl_with_py_consul_and_caravan_clients(acl_target: Target, caplog):
    """py-consul raises ACLPermissionDenied and caravan HashiPermissionDenied; no token in logs."""
    caplog.set_level(logging.DEBUG)
    anonymous = consul.aio.Consul(host=acl_target.host, port=acl_target.port)
    anonymous.token = None
    with_token = consul.aio.Consul(host=acl_target.host, port=acl_target.port, token=TOKEN)
    with_token.token = TOKEN
    try:
        with pytest.raises(consul.ACLPermissionDenied):
            await anonymous.kv.put("k", "v")
        assert await with_token.kv.put("k", "v") is True
    finally:
        await anonymous.close()
        await with_token.close()
    settings = ConsulSettings(host=acl_target.host, port=acl_target.port)
    async with ConsulClient(settings) as client:
        with pytest.raises(HashiPermissionDenied) as denied:
            await client.kv_put("k", b"v")
    assert 403 == denied.value.status
    assert TOKEN not in caplog.text
    assert TOKEN not in str(denied.value)
