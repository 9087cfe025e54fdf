"""ACL policies and tokens: Consul's rule semantics, on every endpoint caravan uses.

Against devcluster by default (a server with a management token). With
CARAVAN_REAL_CONSUL=1 and CONSUL_HTTP_TOKEN set to a management token of an
agent with ACLs enabled (default policy deny), the same tests run against it.
Names carry a per-test suffix so a real agent's leftovers do not collide.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from consul_helpers import REAL, Target, devcluster_config, raw_request

from caravan_llm.devcluster.consul.server import ConsulServer

MANAGEMENT = os.environ.get("CONSUL_HTTP_TOKEN", "") if REAL else str(uuid.uuid4())


@pytest.fixture
async def acl_target() -> AsyncIterator[Target]:
    if REAL:
        if not MANAGEMENT:
            pytest.skip("set CONSUL_HTTP_TOKEN to a management token of an agent with ACLs on")
        address = os.environ.get("CONSUL_HTTP_ADDR", "127.0.0.1:8500").split("://")[-1]
        host, _, port = address.rpartition(":")
        yield Target(host, int(port), 8600, None, 10.0)
        return
    async with ConsulServer(devcluster_config(management_token=MANAGEMENT)) as server:
        yield Target(server.config.host, server.http_port, server.dns_port, server, 1.0)


async def call(
    target: Target, method: str, path: str, token: str | None, body: Any = None
) -> tuple[int, Any, dict[str, str]]:
    headers = {"X-Consul-Token": token} if token else {}
    raw = body if isinstance(body, (str, bytes)) or body is None else json.dumps(body)
    status, text, response_headers = await raw_request(
        target, method, path, body=raw, headers=headers
    )
    try:
        data: Any = json.loads(text) if text else None
    except json.JSONDecodeError:
        data = text
    return status, data, response_headers


async def make_token(target: Target, name: str, rules: str) -> dict[str, Any]:
    """A policy `name` with `rules` and a token that carries only it."""
    status, policy, _ = await call(
        target, "PUT", "/v1/acl/policy", MANAGEMENT, {"Name": name, "Rules": rules}
    )
    assert 200 == status, policy
    status, token, _ = await call(
        target,
        "PUT",
        "/v1/acl/token",
        MANAGEMENT,
        {"Description": name, "Policies": [{"Name": name}]},
    )
    assert 200 == status, token
    return dict(token)


def denied(token: dict[str, Any], permission: str, obj: str) -> str:
    return (
        f"Permission denied: token with AccessorID '{token['AccessorID']}' "
        f"lacks permission '{permission}' on \"{obj}\""
    )


async def test_policy_and_token_have_consuls_shapes(acl_target: Target, unique: str):
    rules = f'key_prefix "t-{unique}/" {{\n  policy = "read"\n}}\n'
    status, policy, _ = await call(
        acl_target,
        "PUT",
        "/v1/acl/policy",
        MANAGEMENT,
        {"Name": f"p-{unique}", "Description": "d", "Rules": rules},
    )
    assert 200 == status
    assert {"ID", "Name", "Description", "Rules", "Hash", "CreateIndex", "ModifyIndex"} <= set(
        policy
    )
    assert (f"p-{unique}", "d", rules) == (policy["Name"], policy["Description"], policy["Rules"])
    uuid.UUID(policy["ID"])
    secret = str(uuid.uuid4())
    status, token, _ = await call(
        acl_target,
        "PUT",
        "/v1/acl/token",
        MANAGEMENT,
        {"Policies": [{"Name": f"p-{unique}"}], "SecretID": secret},
    )
    assert 200 == status
    assert secret == token["SecretID"]
    uuid.UUID(token["AccessorID"])
    assert [{"ID": policy["ID"], "Name": f"p-{unique}"}] == token["Policies"]
    assert token["Local"] is False
    status, me, _ = await call(acl_target, "GET", "/v1/acl/token/self", secret)
    assert (200, token["AccessorID"]) == (status, me["AccessorID"])
    status, me, _ = await call(acl_target, "GET", "/v1/acl/token/self", MANAGEMENT)
    assert 200 == status
    assert "global-management" in [p["Name"] for p in me["Policies"]]


async def test_only_acl_write_may_create_policies_and_tokens(acl_target: Target, unique: str):
    token = await make_token(acl_target, f"kv-{unique}", 'key_prefix "" { policy = "write" }')
    status, text, _ = await call(
        acl_target, "PUT", "/v1/acl/policy", token["SecretID"], {"Name": f"x-{unique}"}
    )
    assert 403 == status
    assert f"token with AccessorID '{token['AccessorID']}' lacks permission 'acl:write'" in text
    status, _, _ = await call(acl_target, "PUT", "/v1/acl/token", None, {"Policies": []})
    assert 403 == status


async def test_bad_rules_and_unknown_policies_are_refused(acl_target: Target, unique: str):
    status, text, _ = await call(
        acl_target,
        "PUT",
        "/v1/acl/policy",
        MANAGEMENT,
        {"Name": f"bad-{unique}", "Rules": 'key_prefix "" { policy = "sometimes" }'},
    )
    assert 500 == status
    assert "sometimes" in text  # Consul names the bad rule (its wording varies by version)
    status, text, _ = await call(
        acl_target,
        "PUT",
        "/v1/acl/token",
        MANAGEMENT,
        {"Policies": [{"Name": f"missing-{unique}"}]},
    )
    assert 500 == status
    assert f"missing-{unique}" in text


async def test_key_rules_exact_beats_prefix_and_longest_prefix_wins(
    acl_target: Target, unique: str
):
    base = f"k-{unique}/"
    rules = f"""
key_prefix "{base}" {{ policy = "write" }}
key_prefix "{base}ro/" {{ policy = "read" }}
key "{base}ro/open" {{ policy = "write" }}
key "{base}secret" {{ policy = "deny" }}
"""
    token = await make_token(acl_target, f"k-{unique}", rules)
    secret = token["SecretID"]
    for key, allowed in (
        (f"{base}a", True),
        (f"{base}ro/x", False),
        (f"{base}ro/open", True),
        (f"{base}secret", False),
        (f"other-{unique}", False),
    ):
        status, text, _ = await call(acl_target, "PUT", f"/v1/kv/{key}", secret, "v")
        if allowed:
            assert (200, True) == (status, text), key
        else:
            assert (403, denied(token, "key:write", key)) == (status, text), key
    status, _, _ = await call(acl_target, "PUT", f"/v1/kv/{base}ro/x", MANAGEMENT, "v")
    assert 200 == status
    status, entries, _ = await call(acl_target, "GET", f"/v1/kv/{base}ro/x", secret)
    assert (200, f"{base}ro/x") == (status, entries[0]["Key"])
    status, text, _ = await call(acl_target, "GET", f"/v1/kv/{base}secret", secret)
    assert (403, denied(token, "key:read", f"{base}secret")) == (status, text)


async def test_recursive_reads_are_filtered_and_say_so(acl_target: Target, unique: str):
    base = f"f-{unique}/"
    for key in ("a", "hidden/b", "c"):
        status, _, _ = await call(acl_target, "PUT", f"/v1/kv/{base}{key}", MANAGEMENT, "v")
        assert 200 == status
    token = await make_token(
        acl_target,
        f"f-{unique}",
        f'key_prefix "{base}" {{ policy = "read" }}\n'
        f'key_prefix "{base}hidden/" {{ policy = "deny" }}\n',
    )
    status, entries, headers = await call(
        acl_target, "GET", f"/v1/kv/{base}?recurse", token["SecretID"]
    )
    assert 200 == status
    assert [f"{base}a", f"{base}c"] == [e["Key"] for e in entries]
    assert "true" == headers.get("X-Consul-Results-Filtered-By-ACLs")
    status, keys, headers = await call(acl_target, "GET", f"/v1/kv/{base}?keys", token["SecretID"])
    assert [f"{base}a", f"{base}c"] == keys
    assert "true" == headers.get("X-Consul-Results-Filtered-By-ACLs")
    status, entries, headers = await call(acl_target, "GET", f"/v1/kv/{base}?recurse", MANAGEMENT)
    assert 3 == len(entries)
    assert "X-Consul-Results-Filtered-By-ACLs" not in headers


async def test_recursive_delete_needs_write_on_the_whole_tree(acl_target: Target, unique: str):
    base = f"d-{unique}/"
    token = await make_token(
        acl_target,
        f"d-{unique}",
        f'key_prefix "{base}" {{ policy = "write" }}\nkey "{base}keep" {{ policy = "read" }}\n',
    )
    status, text, _ = await call(acl_target, "DELETE", f"/v1/kv/{base}?recurse", token["SecretID"])
    assert (403, denied(token, "key:write", base)) == (status, text)
    status, text, _ = await call(
        acl_target, "DELETE", f"/v1/kv/{base}sub/?recurse", token["SecretID"]
    )
    assert (200, True) == (status, text)


async def test_policies_of_one_token_merge_and_deny_wins(acl_target: Target, unique: str):
    base = f"m-{unique}/"
    names = []
    for label, rules in (
        ("w", f'key_prefix "{base}" {{ policy = "write" }}'),
        (
            "d",
            (
                f'key_prefix "{base}" {{ policy = "deny" }}\n'
                f'key_prefix "{base}ok/" {{ policy = "write" }}'
            ),
        ),
    ):
        name = f"m{label}-{unique}"
        status, _, _ = await call(
            acl_target, "PUT", "/v1/acl/policy", MANAGEMENT, {"Name": name, "Rules": rules}
        )
        assert 200 == status
        names.append(name)
    status, token, _ = await call(
        acl_target,
        "PUT",
        "/v1/acl/token",
        MANAGEMENT,
        {"Policies": [{"Name": n} for n in names]},
    )
    assert 200 == status
    status, _, _ = await call(acl_target, "PUT", f"/v1/kv/{base}x", token["SecretID"], "v")
    assert 403 == status
    status, _, _ = await call(acl_target, "PUT", f"/v1/kv/{base}ok/x", token["SecretID"], "v")
    assert 200 == status


def _service(name: str, unique: str) -> dict[str, Any]:
    return {"Name": name, "ID": f"{name}-{unique}", "Port": 8080}


async def test_service_rules_on_register_catalog_and_health(acl_target: Target, unique: str):
    allowed, other = f"web-{unique}", f"db-{unique}"
    for name in (allowed, other):
        status, _, _ = await call(
            acl_target, "PUT", "/v1/agent/service/register", MANAGEMENT, _service(name, unique)
        )
        assert 200 == status
    token = await make_token(
        acl_target,
        f"s-{unique}",
        f'service_prefix "web-{unique}" {{ policy = "write" }}\n'
        'node_prefix "" { policy = "read" }\n',
    )
    secret = token["SecretID"]
    status, text, _ = await call(
        acl_target, "PUT", "/v1/agent/service/register", secret, _service(other, unique)
    )
    assert (403, denied(token, "service:write", other)) == (status, text)
    status, services, headers = await call(acl_target, "GET", "/v1/catalog/services", secret)
    assert 200 == status
    assert allowed in services
    assert other not in services
    assert "true" == headers.get("X-Consul-Results-Filtered-By-ACLs")
    status, entries, _ = await call(acl_target, "GET", f"/v1/health/service/{allowed}", secret)
    assert [f"{allowed}-{unique}"] == [e["Service"]["ID"] for e in entries]
    status, entries, headers = await call(acl_target, "GET", f"/v1/health/service/{other}", secret)
    assert (200, []) == (status, entries)
    assert "true" == headers.get("X-Consul-Results-Filtered-By-ACLs")
    status, agent_services, headers = await call(acl_target, "GET", "/v1/agent/services", secret)
    assert "true" == headers.get("X-Consul-Results-Filtered-By-ACLs")
    assert {f"{allowed}-{unique}"} == {sid for sid in agent_services if sid.endswith(unique)}
    status, text, _ = await call(
        acl_target, "PUT", f"/v1/agent/service/deregister/{other}-{unique}", secret
    )
    assert (403, denied(token, "service:write", other)) == (status, text)
    status, _, _ = await call(
        acl_target, "PUT", f"/v1/agent/service/deregister/{allowed}-{unique}", secret
    )
    assert 200 == status
    await call(acl_target, "PUT", f"/v1/agent/service/deregister/{other}-{unique}", MANAGEMENT)


async def test_service_read_without_node_read_sees_no_instances(acl_target: Target, unique: str):
    """Service instances need node:read on their node as well (Consul's aclFilter)."""
    name = f"api-{unique}"
    await call(acl_target, "PUT", "/v1/agent/service/register", MANAGEMENT, _service(name, unique))
    token = await make_token(acl_target, f"n-{unique}", f'service "{name}" {{ policy = "read" }}')
    status, entries, _ = await call(
        acl_target, "GET", f"/v1/health/service/{name}", token["SecretID"]
    )
    assert (200, []) == (status, entries)
    status, services, _ = await call(acl_target, "GET", "/v1/catalog/services", token["SecretID"])
    assert [name] == list(services)
    await call(acl_target, "PUT", f"/v1/agent/service/deregister/{name}-{unique}", MANAGEMENT)


async def test_agent_and_session_rules(acl_target: Target, unique: str):
    status, agent, _ = await call(acl_target, "GET", "/v1/agent/self", MANAGEMENT)
    node = agent["Config"]["NodeName"]
    token = await make_token(
        acl_target,
        f"a-{unique}",
        'session_prefix "" { policy = "write" }\n'
        f'key_prefix "l-{unique}/" {{ policy = "write" }}\n',
    )
    secret = token["SecretID"]
    status, text, _ = await call(acl_target, "GET", "/v1/agent/self", secret)
    assert (403, denied(token, "agent:read", node)) == (status, text)
    status, session, _ = await call(acl_target, "PUT", "/v1/session/create", secret, {"TTL": "15s"})
    assert 200 == status
    status, acquired, _ = await call(
        acl_target, "PUT", f"/v1/kv/l-{unique}/leader?acquire={session['ID']}", secret, "me"
    )
    assert (200, True) == (status, acquired)
    status, _, _ = await call(acl_target, "PUT", f"/v1/session/destroy/{session['ID']}", secret)
    assert 200 == status
    reader = await make_token(acl_target, f"r-{unique}", 'key_prefix "" { policy = "read" }')
    status, text, _ = await call(
        acl_target, "PUT", "/v1/session/create", reader["SecretID"], {"TTL": "15s"}
    )
    assert (403, denied(reader, "session:write", node)) == (status, text)


def _b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()


async def test_txn_checks_each_operation_and_filters_gets(acl_target: Target, unique: str):
    base = f"x-{unique}/"
    await call(acl_target, "PUT", f"/v1/kv/{base}ro/a", MANAGEMENT, "v")
    await call(acl_target, "PUT", f"/v1/kv/{base}hidden", MANAGEMENT, "v")
    token = await make_token(
        acl_target,
        f"x-{unique}",
        f'key_prefix "{base}" {{ policy = "read" }}\n'
        f'key_prefix "{base}rw/" {{ policy = "write" }}\n'
        f'key "{base}hidden" {{ policy = "deny" }}\n',
    )
    ops = [
        {"KV": {"Verb": "set", "Key": f"{base}rw/a", "Value": _b64("1")}},
        {"KV": {"Verb": "set", "Key": f"{base}ro/b", "Value": _b64("2")}},
    ]
    status, body, _ = await call(acl_target, "PUT", "/v1/txn", token["SecretID"], ops)
    assert 409 == status
    assert [{"OpIndex": 1, "What": denied(token, "key:write", f"{base}ro/b")}] == body["Errors"]
    status, missing, _ = await call(acl_target, "GET", f"/v1/kv/{base}rw/a", MANAGEMENT)
    assert 404 == status, missing
    gets = [
        {"KV": {"Verb": "get", "Key": f"{base}ro/a"}},
        {"KV": {"Verb": "get", "Key": f"{base}hidden"}},
    ]
    status, body, _ = await call(acl_target, "PUT", "/v1/txn", token["SecretID"], gets)
    assert 200 == status
    assert [f"{base}ro/a"] == [r["KV"]["Key"] for r in body["Results"]]


@pytest.mark.parametrize(
    "path",
    ["/v1/kv/nothing-here/?recurse", "/v1/kv/nothing-here/?keys", "/v1/catalog/services"],
)
async def test_an_unknown_token_is_refused_even_where_nothing_would_be_filtered(
    acl_target: Target, path: str
):
    status, text, _ = await call(acl_target, "GET", path, str(uuid.uuid4()))
    assert (403, "ACL not found") == (status, text)
