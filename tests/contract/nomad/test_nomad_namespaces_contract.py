"""Namespaces as Nomad CE answers them: `/v1/namespaces`, `/v1/namespace/:name`, the built-in
`default`, and jobs and Variables in a namespace of their own (issue 23, deliver 6)."""

from __future__ import annotations

import base64
from typing import Any

import aiohttp
from nomad_contract_support import NomadTarget, eventually, get_json, sleeper_job

NAMESPACE_KEYS = {
    "Name",
    "Description",
    "Quota",
    "Capabilities",
    "NodePoolConfiguration",
    "VaultConfiguration",
    "ConsulConfiguration",
    "Meta",
    "Hash",
    "CreateIndex",
    "ModifyIndex",
}


async def _answer(response: aiohttp.ClientResponse) -> tuple[int, str]:
    return response.status, (await response.text()).strip()


async def _put(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, str]:
    async with http.put(url, json=body) as response:
        return await _answer(response)


async def _delete(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with http.delete(url) as response:
        return await _answer(response)


async def test_default_namespace_always_exists(
    target: NomadTarget, http: aiohttp.ClientSession
) -> None:
    """`default` is listed and read with Nomad's description, created at index 1."""
    async with http.get(f"{target.address}/v1/namespaces") as response:
        assert 200 == response.status
        assert int(response.headers["X-Nomad-Index"]) >= 1
        listed = {ns["Name"]: ns for ns in await response.json()}
    default = listed["default"]
    assert NAMESPACE_KEYS == set(default)
    assert ("Default shared namespace", "", None) == (
        default["Description"],
        default["Quota"],
        default["Meta"],
    )
    assert (1, 1) == (default["CreateIndex"], default["ModifyIndex"])
    assert 32 == len(base64.b64decode(default["Hash"]))
    assert default == await get_json(http, f"{target.address}/v1/namespace/default")
    prefixed = await get_json(http, f"{target.address}/v1/namespaces?prefix=defa")
    assert ["default"] == [ns["Name"] for ns in prefixed]


async def test_namespace_is_created_updated_and_deleted(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A write answers empty with its index; an update keeps CreateIndex; a delete removes it."""
    name = f"team-{unique}"
    url = f"{target.address}/v1/namespace/{name}"
    body = {"Name": name, "Description": "a team", "Meta": {"owner": "ml"}}
    async with http.put(url, json=body) as response:
        assert (200, "") == await _answer(response)
        created_at = int(response.headers["X-Nomad-Index"])
    created = await get_json(http, url)
    assert (name, "a team", {"owner": "ml"}, None) == (
        created["Name"],
        created["Description"],
        created["Meta"],
        created["Capabilities"],
    )
    assert created_at == created["CreateIndex"] == created["ModifyIndex"]
    async with http.post(
        f"{target.address}/v1/namespace", json={"Name": name, "Description": "renamed"}
    ) as response:
        assert 200 == response.status
        updated_at = int(response.headers["X-Nomad-Index"])
    updated = await get_json(http, url)
    assert ("renamed", None) == (updated["Description"], updated["Meta"])
    assert (created_at, updated_at) == (updated["CreateIndex"], updated["ModifyIndex"])
    assert created["Hash"] != updated["Hash"]
    assert (200, "") == await _delete(http, url)
    async with http.get(url) as response:
        assert (404, "Namespace not found") == await _answer(response)


async def test_namespace_writes_are_validated_with_nomads_texts(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A bad name, a long description, Enterprise settings and a mismatched path are refused."""
    base = f"{target.address}/v1/namespace"
    assert (400, "Namespace name does not match request path") == await _put(
        http, f"{base}/a-{unique}", {"Name": f"b-{unique}"}
    )
    assert (
        500,
        (
            'Invalid namespace "bad_name": 1 error occurred:\n'
            '\t* invalid name "bad_name". Must match regex ^[a-zA-Z0-9-]{1,128}$'
        ),
    ) == await _put(http, base, {"Name": "bad_name"})
    assert (
        500,
        f'Invalid namespace "d-{unique}": 1 error occurred:\n\t* description longer than 256',
    ) == await _put(http, base, {"Name": f"d-{unique}", "Description": "x" * 257})
    assert (
        500,
        (
            f'Invalid namespace "p-{unique}": 1 error occurred:\n'
            "\t* invalid node pool configuration: Node Pools Governance is unlicensed."
        ),
    ) == await _put(http, base, {"Name": f"p-{unique}", "NodePoolConfiguration": {}})
    assert (500, f'namespace "q-{unique}" using non-existent quota "gold"') == await _put(
        http, base, {"Name": f"q-{unique}", "Quota": "gold"}
    )
    assert (
        400,
        "json: cannot unmarshal number into Go struct field Namespace.Description of type string",
    ) == await _put(http, base, {"Name": f"t-{unique}", "Description": 3})
    async with http.get(f"{base}/q-{unique}") as response:
        assert 404 == response.status


async def test_default_and_unknown_namespaces_are_not_deleted(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Deleting `default` or a namespace that does not exist is a 500 with Nomad's text."""
    base = f"{target.address}/v1/namespace"
    assert (500, "can not delete default namespace") == await _delete(http, f"{base}/default")
    assert (500, "namespace not found") == await _delete(http, f"{base}/nope-{unique}")


async def test_a_job_in_a_nonexistent_namespace_is_refused(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Registering or planning into a namespace that does not exist is Nomad's 500."""
    job_id = f"ns-{unique}"
    expected = (
        500,
        f'1 error occurred:\n\t* job "{job_id}" is in nonexistent namespace "nope-{unique}"',
    )
    body = sleeper_job(job_id)
    assert expected == await _put(http, f"{target.address}/v1/jobs?namespace=nope-{unique}", body)
    body["Job"]["Namespace"] = f"nope-{unique}"
    assert expected == await _put(http, f"{target.address}/v1/jobs", body)
    async with http.post(f"{target.address}/v1/job/{job_id}/plan", json=body) as response:
        assert expected == await _answer(response)


async def test_a_job_runs_in_its_namespace_and_holds_it(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """The query's namespace wins over the job's; a namespace with live work is not deleted."""
    name, job_id = f"run-{unique}", f"ns-job-{unique}"
    assert (200, "") == await _put(http, f"{target.address}/v1/namespace/{name}", {"Name": name})
    body = sleeper_job(job_id)
    body["Job"]["Namespace"] = "default"
    status, text = await _put(http, f"{target.address}/v1/jobs?namespace={name}", body)
    assert 200 == status, text
    job = await get_json(http, f"{target.address}/v1/job/{job_id}?namespace={name}")
    assert name == job["Namespace"]
    async with http.get(f"{target.address}/v1/job/{job_id}") as response:
        assert 404 == response.status
    allocs_url = f"{target.address}/v1/job/{job_id}/allocations?namespace={name}"

    async def running() -> list[dict[str, Any]] | None:
        allocs = await get_json(http, allocs_url)
        return allocs if any(a["ClientStatus"] == "running" for a in allocs) else None

    allocs = await eventually(running)
    assert {name} == {alloc["Namespace"] for alloc in allocs}
    listed = await get_json(http, f"{target.address}/v1/jobs?namespace=*&prefix={job_id}")
    assert [(job_id, name)] == [(j["ID"], j["Namespace"]) for j in listed]
    assert [] == await get_json(http, f"{target.address}/v1/jobs?prefix={job_id}")
    assert (
        500,
        (
            "2 errors occurred:\n"
            f'\t* namespace "{name}" has non-terminal jobs in regions: [global]\n'
            f'\t* namespace "{name}" has non-terminal allocations in regions: [global]'
        ),
    ) == await _delete(http, f"{target.address}/v1/namespace/{name}")
    status, _ = await _delete(http, f"{target.address}/v1/job/{job_id}?purge=true&namespace={name}")
    assert 200 == status

    async def deleted() -> bool:
        status, _ = await _delete(http, f"{target.address}/v1/namespace/{name}")
        return status == 200

    assert await eventually(deleted, timeout_s=30)


async def test_variables_are_written_in_any_namespace_and_hold_theirs(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """As Nomad does (its issue 15379), a variable may go to a namespace that does not exist;
    a namespace holding variables is not deleted."""
    name = f"vars-{unique}"
    body = {"Items": {"k": "v"}}
    status, text = await _put(http, f"{target.address}/v1/var/a/b?namespace=none-{unique}", body)
    assert 200 == status, text
    assert (200, "") == await _put(http, f"{target.address}/v1/namespace/{name}", {"Name": name})
    status, text = await _put(http, f"{target.address}/v1/var/a/b?namespace={name}", body)
    assert 200 == status, text
    assert (
        500,
        (
            f'1 error occurred:\n\t* namespace "{name}" has variables associated with it '
            "in regions: [global]"
        ),
    ) == await _delete(http, f"{target.address}/v1/namespace/{name}")
    async with http.delete(f"{target.address}/v1/var/a/b?namespace={name}") as response:
        assert 204 == response.status
    assert (200, "") == await _delete(http, f"{target.address}/v1/namespace/{name}")
    async with http.delete(f"{target.address}/v1/var/a/b?namespace=none-{unique}") as response:
        assert 204 == response.status
