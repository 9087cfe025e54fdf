"""Nomad's ACL system: policies, tokens, and what a token's capabilities let it do.

Against devcluster each test starts a Nomad with a management token (ACLs on).
With CARAVAN_REAL_NOMAD=1 they run against the agent at NOMAD_ADDR, which must
have ACLs enabled and bootstrapped: NOMAD_TOKEN is its management token.
Policy names carry a per-test suffix so a real agent's leftovers do not matter.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from nomad_contract_support import REAL, sleeper_job

from caravan_llm.common.preflight import PROBE_NAME
from caravan_llm.devcluster.nomad.server import NomadServer
from caravan_llm.scheduler.preflight import plan_probe_job


@dataclass(frozen=True)
class AclTarget:
    address: str
    management: str
    server: NomadServer | None


@pytest.fixture
async def acl_target() -> AsyncIterator[AclTarget]:
    if REAL:
        token = os.environ.get("NOMAD_TOKEN")
        if not token:
            pytest.skip("needs NOMAD_TOKEN: the management token of a bootstrapped agent")
        address = os.environ.get("NOMAD_ADDR", "http://127.0.0.1:4646")
        yield AclTarget(address=address, management=token, server=None)
        return
    management = str(uuid.uuid4())
    async with NomadServer(nodes=1, token=management) as server:
        yield AclTarget(address=server.address, management=management, server=server)


async def call(
    target: AclTarget,
    method: str,
    path: str,
    token: str | None,
    body: Any = None,
) -> tuple[int, Any]:
    """(status, JSON body or text) of one request presenting `token` (None: no token)."""
    headers = {} if token is None else {"X-Nomad-Token": token}
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, f"{target.address}{path}", json=body, headers=headers) as response,
    ):
        text = await response.text()
        if response.content_type == "application/json" and text:
            return response.status, await response.json()
        return response.status, text.strip()


async def token_with(target: AclTarget, rules: dict[str, str], unique: str) -> dict[str, Any]:
    """A client token carrying one policy per `rules` entry (name -> HCL); Nomad's reply."""
    names = []
    for name, text in rules.items():
        full = f"{name}-{unique}"
        policy = {"Name": full, "Description": "contract test", "Rules": text}
        status, answer = await call(
            target, "POST", f"/v1/acl/policy/{full}", target.management, policy
        )
        assert 200 == status, answer
        names.append(full)
    body = {"Name": f"t-{unique}", "Type": "client", "Policies": names}
    status, token = await call(target, "POST", "/v1/acl/token", target.management, body)
    assert 200 == status, token
    return dict(token)


async def test_a_token_may_do_exactly_what_its_capabilities_say(
    acl_target: AclTarget, unique: str
) -> None:
    """list-jobs and read-job: jobs are listed and read, never registered; nodes are not read."""
    rules = {"reader": 'namespace "default" {\n  capabilities = ["list-jobs", "read-job"]\n}\n'}
    token = (await token_with(acl_target, rules, unique))["SecretID"]
    job = sleeper_job(f"acl-{unique}")
    status, _ = await call(acl_target, "PUT", "/v1/jobs", acl_target.management, job)
    assert 200 == status

    assert 200 == (await call(acl_target, "GET", "/v1/jobs", token))[0]
    assert 200 == (await call(acl_target, "GET", f"/v1/job/acl-{unique}", token))[0]
    assert 200 == (await call(acl_target, "GET", f"/v1/job/acl-{unique}/evaluations", token))[0]
    assert (403, "Permission denied") == await call(acl_target, "PUT", "/v1/jobs", token, job)
    assert (403, "Permission denied") == await call(
        acl_target, "DELETE", f"/v1/job/acl-{unique}", token
    )
    assert (403, "Permission denied") == await call(acl_target, "GET", "/v1/nodes", token)
    assert (403, "Permission denied") == await call(acl_target, "GET", "/v1/var/x/y", token)
    await call(acl_target, "DELETE", f"/v1/job/acl-{unique}?purge=true", acl_target.management)


async def test_node_read_and_submit_job(acl_target: AclTarget, unique: str) -> None:
    """`node { policy = "read" }` reads nodes; submit-job registers and stops jobs."""
    rules = {
        "submitter": (
            'namespace "default" {\n  capabilities = ["submit-job"]\n}\n'
            'node {\n  policy = "read"\n}\n'
        )
    }
    token = (await token_with(acl_target, rules, unique))["SecretID"]
    status, nodes = await call(acl_target, "GET", "/v1/nodes", token)
    assert 200 == status
    assert nodes
    status, answer = await call(acl_target, "PUT", "/v1/jobs", token, sleeper_job(f"s-{unique}"))
    assert 200 == status, answer
    # The job's own namespace is checked, not only the request's.
    elsewhere = sleeper_job(f"e-{unique}")
    elsewhere["Job"]["Namespace"] = f"other-{unique}"
    assert 403 == (await call(acl_target, "PUT", "/v1/jobs", token, elsewhere))[0]
    assert 200 == (await call(acl_target, "DELETE", f"/v1/job/s-{unique}?purge=true", token))[0]
    # submit-job alone does not list jobs, and node read does not drain nodes.
    assert (403, "Permission denied") == await call(acl_target, "GET", "/v1/jobs", token)
    node_id = nodes[0]["ID"]
    drain = {"DrainSpec": {"Deadline": 0}}
    assert (403, "Permission denied") == await call(
        acl_target, "POST", f"/v1/node/{node_id}/drain", token, drain
    )


async def test_deny_wins_over_any_grant(acl_target: AclTarget, unique: str) -> None:
    """A namespace denied by one policy stays denied whatever another grants."""
    rules = {
        "writer": 'namespace "default" {\n  policy = "write"\n}\n',
        "denier": 'namespace "default" {\n  policy = "deny"\n}\n',
    }
    token = (await token_with(acl_target, rules, unique))["SecretID"]
    assert (403, "Permission denied") == await call(acl_target, "GET", "/v1/jobs", token)
    status, _ = await call(acl_target, "PUT", "/v1/jobs", token, sleeper_job(f"d-{unique}"))
    assert 403 == status


async def test_the_most_specific_variable_path_wins(acl_target: AclTarget, unique: str) -> None:
    """`app/*` read, `app/secret` deny, `app/sub/*` write: each path gets its closest rule."""
    base = f"acl{unique}"
    rules = {
        "vars": (
            'namespace "default" {\n  variables {\n'
            f'    path "{base}/*" {{\n      capabilities = ["read"]\n    }}\n'
            f'    path "{base}/secret" {{\n      capabilities = ["deny"]\n    }}\n'
            f'    path "{base}/sub/*" {{\n      capabilities = ["write", "read"]\n    }}\n'
            "  }\n}\n"
        )
    }
    token = (await token_with(acl_target, rules, unique))["SecretID"]
    for path in (f"{base}/open", f"{base}/secret", f"{base}/sub/one"):
        body = {"Items": {"k": "v"}}
        status, _ = await call(acl_target, "PUT", f"/v1/var/{path}", acl_target.management, body)
        assert 200 == status

    status, found = await call(acl_target, "GET", f"/v1/var/{base}/open", token)
    assert (200, {"k": "v"}) == (status, found["Items"])
    assert (403, "Permission denied") == await call(
        acl_target, "GET", f"/v1/var/{base}/secret", token
    )
    written = await call(acl_target, "PUT", f"/v1/var/{base}/sub/two", token, {"Items": {"a": "b"}})
    assert 200 == written[0]
    assert (403, "Permission denied") == await call(
        acl_target, "PUT", f"/v1/var/{base}/open", token, {"Items": {"a": "b"}}
    )
    # read implies list, write does not imply destroy.
    status, listed = await call(acl_target, "GET", f"/v1/vars?prefix={base}/", token)
    assert 200 == status
    assert [f"{base}/open", f"{base}/sub/one", f"{base}/sub/two"] == [v["Path"] for v in listed]
    assert (403, "Permission denied") == await call(
        acl_target, "DELETE", f"/v1/var/{base}/sub/two", token
    )
    for path in (f"{base}/open", f"{base}/secret", f"{base}/sub/one", f"{base}/sub/two"):
        await call(acl_target, "DELETE", f"/v1/var/{path}", acl_target.management)


async def test_token_self_and_anonymous(acl_target: AclTarget, unique: str) -> None:
    """token/self answers the caller's token; no token is the anonymous one, with no rights."""
    rules = {"self": 'namespace "default" {\n  capabilities = ["list-jobs"]\n}\n'}
    created = await token_with(acl_target, rules, unique)
    status, me = await call(acl_target, "GET", "/v1/acl/token/self", created["SecretID"])
    assert 200 == status
    assert (created["AccessorID"], "client", [f"self-{unique}"]) == (
        me["AccessorID"],
        me["Type"],
        me["Policies"],
    )
    status, management = await call(acl_target, "GET", "/v1/acl/token/self", acl_target.management)
    assert (200, "management") == (status, management["Type"])

    status, anonymous = await call(acl_target, "GET", "/v1/acl/token/self", None)
    assert (200, "anonymous", "Anonymous Token") == (
        status,
        anonymous["AccessorID"],
        anonymous["Name"],
    )
    assert (403, "Permission denied") == await call(acl_target, "GET", "/v1/jobs", None)
    # A well-formed secret nobody holds.
    assert (403, "Permission denied") == await call(
        acl_target, "GET", "/v1/jobs", str(uuid.uuid4())
    )


async def test_policy_writes_need_management_and_valid_rules(
    acl_target: AclTarget, unique: str
) -> None:
    """A client token may not write policies or tokens; bad rules are a 400; a policy is read
    back by management or by a token that holds it."""
    rules = {"holder": 'namespace "default" {\n  policy = "read"\n}\n'}
    token = (await token_with(acl_target, rules, unique))["SecretID"]
    name = f"other-{unique}"
    policy = {"Name": name, "Rules": 'namespace "default" {\n  policy = "write"\n}\n'}
    assert (403, "Permission denied") == await call(
        acl_target, "POST", f"/v1/acl/policy/{name}", token, policy
    )
    client = {"Type": "client", "Policies": [f"holder-{unique}"]}
    assert (403, "Permission denied") == await call(
        acl_target, "POST", "/v1/acl/token", token, client
    )
    status, text = await call(
        acl_target,
        "POST",
        f"/v1/acl/policy/{name}",
        acl_target.management,
        {"Name": name, "Rules": 'namespace "default" {\n  policy = "sideways"\n}\n'},
    )
    assert 400 == status
    assert "failed to parse rules" in text
    status, text = await call(
        acl_target, "POST", f"/v1/acl/policy/{name}", acl_target.management, {"Name": "x"}
    )
    assert (400, "ACL policy name does not match request path") == (status, text)
    status, text = await call(
        acl_target, "POST", "/v1/acl/token", acl_target.management, {"Type": "client"}
    )
    assert 400 == status
    assert "client token missing policies or roles" in text

    status, held = await call(acl_target, "GET", f"/v1/acl/policy/holder-{unique}", token)
    assert (200, f"holder-{unique}") == (status, held["Name"])
    assert "Rules" in held
    assert (
        200
        == (
            await call(acl_target, "POST", f"/v1/acl/policy/{name}", acl_target.management, policy)
        )[0]
    )
    assert (403, "Permission denied") == await call(
        acl_target, "GET", f"/v1/acl/policy/{name}", token
    )
    status, missing = await call(
        acl_target, "GET", f"/v1/acl/policy/none-{unique}", acl_target.management
    )
    assert (404, "ACL policy not found") == (status, missing)


async def test_devcluster_refuses_policy_blocks_it_does_not_implement(
    acl_target: AclTarget,
) -> None:
    """A `node_pool` block is refused with a 400 naming it, never silently ignored."""
    if acl_target.server is None:
        pytest.skip("devcluster-only: a real Nomad supports node_pool blocks")
    rules = 'node_pool "gpu" {\n  policy = "read"\n}\n'
    status, text = await call(
        acl_target,
        "POST",
        "/v1/acl/policy/pools",
        acl_target.management,
        {"Name": "pools", "Rules": rules},
    )
    assert 400 == status
    assert "node_pool" in text


async def test_acl_routes_say_acls_are_disabled_without_a_management_token() -> None:
    """devcluster without --nomad-token: ACLs off, as Nomad answers with acl.enabled=false."""
    if REAL:
        pytest.skip("devcluster-only: starts its own server with ACLs off")
    async with NomadServer(nodes=1) as server:
        target = AclTarget(address=server.address, management="", server=server)
        assert (400, "ACL support disabled") == await call(
            target, "GET", "/v1/acl/token/self", None
        )
        assert 200 == (await call(target, "GET", "/v1/jobs", None))[0]


async def test_the_schedulers_submit_job_probe_plans_and_registers_nothing(
    acl_target: AclTarget, unique: str
) -> None:
    """Planning the preflight's probe job: 403 without submit-job, 200 with it; no job appears."""
    job = {"Job": plan_probe_job(), "Diff": False}
    path = f"/v1/job/{PROBE_NAME}/plan"
    reader = {"reader": 'namespace "default" {\n  capabilities = ["list-jobs", "read-job"]\n}\n'}
    submitter = {"submitter": 'namespace "default" {\n  capabilities = ["submit-job"]\n}\n'}
    read_only = (await token_with(acl_target, reader, f"r-{unique}"))["SecretID"]
    may_submit = (await token_with(acl_target, submitter, f"s-{unique}"))["SecretID"]

    refused = await call(acl_target, "POST", path, read_only, job)
    status, plan = await call(acl_target, "POST", path, may_submit, job)
    after = await call(acl_target, "GET", f"/v1/job/{PROBE_NAME}", acl_target.management)

    assert (403, "Permission denied") == refused
    assert 200 == status, plan
    assert plan["FailedTGAllocs"] is None
    assert 404 == after[0]


async def test_namespaces_are_written_by_management_and_read_by_capabilities(
    acl_target: AclTarget, unique: str
) -> None:
    """Namespace writes need the management token; a token reads and lists only the
    namespaces where it holds a capability (a variables-only rule is not one)."""
    mine, other = f"mine-{unique}", f"other-{unique}"
    for name in (mine, other):
        status, answer = await call(
            acl_target, "PUT", f"/v1/namespace/{name}", acl_target.management, {"Name": name}
        )
        assert 200 == status, answer
    rules = {
        "ns-reader": f'namespace "{mine}" {{\n  capabilities = ["read-job"]\n}}\n',
        "ns-vars": (
            f'namespace "{other}" {{\n  variables {{\n    path "*" {{\n'
            '      capabilities = ["read"]\n    }\n  }\n}\n'
        ),
    }
    token = (await token_with(acl_target, rules, unique))["SecretID"]
    assert (403, "Permission denied") == await call(
        acl_target, "PUT", f"/v1/namespace/x-{unique}", token, {"Name": f"x-{unique}"}
    )
    assert (403, "Permission denied") == await call(
        acl_target, "DELETE", f"/v1/namespace/{mine}", token
    )
    status, found = await call(acl_target, "GET", f"/v1/namespace/{mine}", token)
    assert (200, mine) == (status, found["Name"])
    for refused in (other, "default"):
        assert (403, "Permission denied") == await call(
            acl_target, "GET", f"/v1/namespace/{refused}", token
        )
    status, listed = await call(acl_target, "GET", "/v1/namespaces", token)
    assert (200, [mine]) == (status, [ns["Name"] for ns in listed])
    for name in (mine, other):
        status, answer = await call(
            acl_target, "DELETE", f"/v1/namespace/{name}", acl_target.management
        )
        assert 200 == status, answer


async def test_a_job_write_is_checked_in_the_namespace_it_goes_to(
    acl_target: AclTarget, unique: str
) -> None:
    """submit-job in the job's namespace registers it there, with or without the query."""
    name = f"jobs-{unique}"
    status, answer = await call(
        acl_target, "PUT", f"/v1/namespace/{name}", acl_target.management, {"Name": name}
    )
    assert 200 == status, answer
    rules = {"submitter": f'namespace "{name}" {{\n  capabilities = ["submit-job"]\n}}\n'}
    token = (await token_with(acl_target, rules, unique))["SecretID"]
    job = sleeper_job(f"ns-acl-{unique}")
    status, _ = await call(acl_target, "PUT", "/v1/jobs", token, job)
    assert 403 == status
    job["Job"]["Namespace"] = name
    status, answer = await call(acl_target, "PUT", "/v1/jobs", token, job)
    assert 200 == status, answer
    job["Job"]["Namespace"] = "default"
    status, answer = await call(acl_target, "PUT", f"/v1/jobs?namespace={name}", token, job)
    assert 200 == status, answer
    status, answer = await call(
        acl_target,
        "DELETE",
        f"/v1/job/ns-acl-{unique}?purge=true&namespace={name}",
        acl_target.management,
    )
    assert 200 == status, answer
