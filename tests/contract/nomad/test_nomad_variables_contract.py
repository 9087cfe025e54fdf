"""Nomad Variables (`/v1/vars`, `/v1/var/<path>`): shapes, CAS, errors, blocking.

Raw HTTP pins Nomad's answers; caravan's `NomadClient` calls are checked on
top. The same module runs against a real Nomad with CARAVAN_REAL_NOMAD=1.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import aiohttp
import pytest
from nomad_contract_support import NomadTarget

from caravan_llm.common.errors import HashiBadRequest, HashiConflict
from caravan_llm.common.nomad_api import NomadClient, NomadSettings
from caravan_llm.devcluster.nomad.server import NomadServer

METADATA_KEYS = {"Namespace", "Path", "CreateIndex", "CreateTime", "ModifyIndex", "ModifyTime"}


def _headers() -> dict[str, str]:
    token = os.environ.get("NOMAD_TOKEN", "")
    return {"X-Nomad-Token": token} if token else {}


async def _call(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None
) -> tuple[int, Any, aiohttp.typedefs.LooseHeaders]:
    async with http.request(method, url, json=body, headers=_headers()) as response:
        text = await response.text()
        try:
            data: Any = await response.json(content_type=None) if text else None
        except ValueError:
            data = text
        return response.status, data, response.headers


async def test_put_get_list_and_delete_have_nomads_shapes(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A write answers the variable with items; a list answers metadata only; delete is 204."""
    path = f"caravan-test/{unique}/a"
    url = f"{target.address}/v1/var/{path}"
    status, written, headers = await _call(http, "PUT", url, {"Items": {"key": "v1"}})
    assert 200 == status
    assert METADATA_KEYS | {"Items"} == set(written) - {"Lock"}
    assert (path, "default", {"key": "v1"}) == (
        written["Path"],
        written["Namespace"],
        written["Items"],
    )
    assert written["CreateIndex"] == written["ModifyIndex"]
    assert int(headers["X-Nomad-Index"]) == written["ModifyIndex"]
    status, read, _ = await _call(http, "GET", url)
    assert (200, written) == (status, read)
    status, listed, _ = await _call(http, "GET", f"{target.address}/v1/vars?prefix={path}")
    assert 200 == status
    assert [{k: v for k, v in written.items() if k != "Items"}] == listed
    status, body, _ = await _call(http, "DELETE", url)
    assert (204, None) == (status, body)
    status, body, _ = await _call(http, "GET", url)
    assert (404, "variable not found") == (status, body.strip())


async def test_cas_conflict_answers_409_with_the_stored_variable(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """`?cas=` with a stale index is 409 carrying what is stored; cas=0 means create-only."""
    path = f"caravan-test/{unique}/cas"
    url = f"{target.address}/v1/var/{path}"
    status, first, _ = await _call(http, "PUT", f"{url}?cas=0", {"Items": {"k": "1"}})
    assert 200 == status
    status, conflict, _ = await _call(http, "PUT", f"{url}?cas=0", {"Items": {"k": "2"}})
    assert (409, first) == (status, conflict)
    status, second, _ = await _call(
        http, "PUT", f"{url}?cas={first['ModifyIndex']}", {"Items": {"k": "2"}}
    )
    assert 200 == status
    assert second["ModifyIndex"] > first["ModifyIndex"]
    assert first["CreateIndex"] == second["CreateIndex"]
    status, conflict, _ = await _call(http, "DELETE", f"{url}?cas={first['ModifyIndex']}")
    assert (409, second) == (status, conflict)
    status, _, _ = await _call(http, "DELETE", f"{url}?cas={second['ModifyIndex']}")
    assert 204 == status
    missing = f"{target.address}/v1/var/{path}-none"
    status, conflict, _ = await _call(http, "PUT", f"{missing}?cas=7", {"Items": {"k": "1"}})
    assert 409 == status
    assert (f"{path}-none", 0, 0) == (
        conflict["Path"],
        conflict["ModifyIndex"],
        conflict["CreateIndex"],
    )
    assert "Items" not in conflict


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("caravan-test/x", {"Items": {}}, "variable missing required Items object"),
        ("caravan-test/x", {}, "variable missing required Items object"),
        ("caravan-test/b@d", {"Items": {"k": "v"}}, 'invalid path "caravan-test/b@d"'),
        ("nomad", {"Items": {"k": "v"}}, '"nomad" is a reserved top-level directory path'),
        ("nomad/other", {"Items": {"k": "v"}}, 'only paths at "nomad/jobs"'),
    ],
)
async def test_invalid_writes_are_400_with_nomads_text(
    target: NomadTarget, http: aiohttp.ClientSession, path: str, body: Any, message: str
) -> None:
    """Missing items and bad paths are refused with Nomad's messages."""
    status, text, _ = await _call(http, "PUT", f"{target.address}/v1/var/{path}", body)
    assert 400 == status
    assert message in str(text)


async def test_bad_cas_and_missing_path_are_400(
    target: NomadTarget, http: aiohttp.ClientSession
) -> None:
    """A non-numeric `cas` and an empty path are request errors."""
    status, text, _ = await _call(
        http, "PUT", f"{target.address}/v1/var/caravan-test/x?cas=abc", {"Items": {"k": "v"}}
    )
    assert 400 == status
    assert "can not parse cas" in str(text)
    status, text, _ = await _call(http, "GET", f"{target.address}/v1/var/")
    assert 400 == status
    assert "missing variable path" in str(text)


async def test_blocking_list_wakes_on_a_write(target: NomadTarget, unique: str) -> None:
    """A blocking list from the current index returns when a variable is written."""
    prefix = f"caravan-test/{unique}/"
    async with NomadClient(NomadSettings.from_env({"NOMAD_ADDR": target.address})) as nomad:
        first = await nomad.list_variables(prefix)
        assert [] == first.value
        waiter = asyncio.ensure_future(nomad.list_variables(prefix, index=first.index, wait_s=30))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        await nomad.put_variable(f"{prefix}one", {"k": "v"})
        woken = await asyncio.wait_for(waiter, 10)
        assert [f"{prefix}one"] == [meta.path for meta in woken.value]
        assert woken.index > first.index
        await nomad.delete_variable(f"{prefix}one")


async def test_caravan_client_calls_and_redacted_conflict(target: NomadTarget, unique: str) -> None:
    """put/get/delete round-trip; a lost CAS is HashiConflict whose text holds no item value."""
    path = f"caravan-test/{unique}/client"
    async with NomadClient(NomadSettings(address=target.address)) as nomad:
        assert await nomad.get_variable(path) is None
        meta = await nomad.put_variable(path, {"api_key": "s3cret-value"}, cas=0)
        got = await nomad.get_variable(path)
        assert got is not None
        assert ({"api_key": "s3cret-value"}, meta) == (dict(got.items), got.meta)
        assert "s3cret-value" not in repr(got)
        with pytest.raises(HashiConflict) as lost:
            await nomad.put_variable(path, {"api_key": "other"}, cas=0)
        assert "s3cret-value" not in str(lost.value)
        with pytest.raises(HashiBadRequest):
            await nomad.put_variable(f"{path}/b@d", {"k": "v"})
        await nomad.delete_variable(path, cas=meta.modify_index)
        assert await nomad.get_variable(path) is None
        await nomad.delete_variable(path)


async def test_variables_need_the_token_when_acls_are_on() -> None:
    """With ACLs on, a variable write without a token is 403; a list is filtered, not refused
    (Variables.List keeps what the anonymous token may list: nothing)."""
    async with (
        NomadServer(nodes=0, token="management-secret") as server,
        aiohttp.ClientSession() as http,
    ):
        url = f"{server.address}/v1/var/caravan-test/acl"
        async with http.put(url, json={"Items": {"k": "v"}}) as response:
            assert 403 == response.status
        headers = {"X-Nomad-Token": "management-secret"}
        async with http.put(url, json={"Items": {"k": "v"}}, headers=headers) as response:
            assert 200 == response.status
        async with http.get(f"{server.address}/v1/vars") as response:
            assert (200, []) == (response.status, await response.json())
        async with http.get(f"{server.address}/v1/vars", headers=headers) as response:
            assert ["caravan-test/acl"] == [v["Path"] for v in await response.json()]
