"""`GET /v1/client/fs/logs/:alloc`: framing, parameters, status codes and error texts.

The answers are Nomad's (`command/agent/fs_endpoint.go`, `client/fs_endpoint.go`,
`nomad/client_fs_endpoint.go`); with CARAVAN_REAL_NOMAD=1 the same tests run
against a real agent. `caravan logs` reads logs through
`caravan_llm.common.nomad_api.NomadClient.stream_logs`, tested here on the same target.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from typing import Any

import aiohttp
import pytest
from nomad_contract_support import NomadTarget, eventually, running_allocs, sleeper_job

from caravan_llm.common.nomad_api import LogFrameDecoder, NomadClient, NomadSettings

LINES = "".join(f"line {i}\n" for i in range(5))


def talker_job(job_id: str) -> dict[str, Any]:
    """A raw_exec job that writes five lines to stdout, one to stderr, then sleeps."""
    body = sleeper_job(job_id)
    program = (
        "import sys, time; "
        f"sys.stdout.write({LINES!r}); sys.stdout.flush(); "
        "sys.stderr.write('oops\\n'); sys.stderr.flush(); time.sleep(600)"
    )
    task = body["Job"]["TaskGroups"][0]["Tasks"][0]
    task["Config"] = {"command": sys.executable, "args": ["-c", program]}
    return body


async def started_alloc(http: aiohttp.ClientSession, address: str, job_id: str) -> str:
    await http.put(f"{address}/v1/jobs", json=talker_job(job_id))
    (alloc,) = await running_allocs(http, address, job_id)
    alloc_id: str = alloc["ID"]
    return alloc_id


async def logs(
    http: aiohttp.ClientSession, address: str, alloc_id: str, **params: str
) -> tuple[int, str, bytes]:
    url = f"{address}/v1/client/fs/logs/{alloc_id}"
    async with http.get(url, params=params) as response:
        return response.status, response.headers.get("Content-Type", ""), await response.read()


def frames_of(body: bytes) -> list[dict[str, Any]]:
    decoder = json.JSONDecoder()
    text, found = body.decode(), []
    while text.strip():
        document, end = decoder.raw_decode(text.lstrip())
        found.append(document)
        text = text.lstrip()[end:]
    return found


async def test_logs_are_json_frames_of_base64_data(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Without follow the stream is StreamFrames, ends at the end, and holds the whole log."""
    alloc_id = await started_alloc(http, target.address, f"logs-{unique}")

    async def written() -> list[dict[str, Any]] | None:
        status, kind, body = await logs(http, target.address, alloc_id, task="sleep", type="stdout")
        assert (200, "application/json") == (status, kind.split(";")[0])
        frames = [f for f in frames_of(body) if f]
        data = b"".join(base64.b64decode(f["Data"]) for f in frames)
        return frames if data == LINES.encode() else None

    frames = await eventually(written)
    assert {"alloc/logs/sleep.stdout.0"} == {f["File"] for f in frames}
    assert len(LINES) == frames[-1]["Offset"]

    status, kind, body = await logs(
        http, target.address, alloc_id, task="sleep", type="stderr", plain="true"
    )
    assert (200, "text/plain", b"oops\n") == (status, kind.split(";")[0], body)
    status, _, body = await logs(
        http, target.address, alloc_id, task="sleep", type="stdout", plain="true",
        origin="end", offset="7",
    )  # fmt: skip
    assert (200, b"line 4\n") == (status, body)
    await http.delete(f"{target.address}/v1/job/logs-{unique}?purge=true")


@pytest.mark.parametrize(
    ("params", "status", "text"),
    [
        ({}, 400, "must provide task name"),
        ({"task": "sleep"}, 400, "must provide log type (stdout/stderr)"),
        ({"task": "sleep", "type": "both"}, 400, "must provide log type (stdout/stderr)"),
        (
            {"task": "sleep", "type": "stdout", "follow": "maybe"},
            400,
            (
                'failed to parse follow field to boolean: strconv.ParseBool: parsing "maybe": '
                "invalid syntax"
            ),
        ),
        (
            {"task": "sleep", "type": "stdout", "offset": "x"},
            400,
            'error parsing offset: strconv.ParseInt: parsing "x": invalid syntax',
        ),
        (
            {"task": "sleep", "type": "stdout", "origin": "middle"},
            400,
            "origin must be start or end",
        ),
    ],
)
async def test_bad_parameters_are_400_with_nomads_text(
    target: NomadTarget,
    http: aiohttp.ClientSession,
    params: dict[str, str],
    status: int,
    text: str,
) -> None:
    """Each parameter is checked before anything is looked up, with Nomad's words."""
    answer = await logs(http, target.address, "00000000-0000-0000-0000-000000000000", **params)
    assert (status, text) == (answer[0], answer[2].decode().strip())


async def test_unknown_allocation_and_task(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """An unknown allocation is 404 naming it; an unknown task of a known one is 400."""
    missing = "00000000-0000-0000-0000-000000000000"
    status, _, body = await logs(http, target.address, missing, task="sleep", type="stdout")
    assert (404, f'Unknown allocation "{missing}"') == (status, body.decode().strip())
    alloc_id = await started_alloc(http, target.address, f"logs-{unique}")
    status, _, body = await logs(http, target.address, alloc_id, task="nope", type="stdout")
    assert (400, 'unknown task name "nope"') == (status, body.decode().strip())
    await http.delete(f"{target.address}/v1/job/logs-{unique}?purge=true")


async def test_caravans_client_follows_a_log(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """`NomadClient.stream_logs(follow=True)` yields the log and keeps the stream open."""
    alloc_id = await started_alloc(http, target.address, f"logs-{unique}")
    settings = NomadSettings.from_env({"NOMAD_ADDR": target.address})
    received = b""
    async with NomadClient(settings) as nomad:
        stream = nomad.stream_logs(alloc_id, "sleep", follow=True)
        async with asyncio.timeout(15):
            async for frame in stream:
                received += frame.data
                if received == LINES.encode():
                    break
        await stream.aclose()
    assert LINES.encode() == received
    await http.delete(f"{target.address}/v1/job/logs-{unique}?purge=true")


def test_frames_split_anywhere_decode_alike() -> None:
    """Frames cut at any byte (mid-frame, mid-character) decode to the same data."""
    data = "héllo\n".encode()
    stream = (
        b"{}"
        + json.dumps({"Offset": 7, "Data": base64.b64encode(data).decode(), "File": "f"}).encode()
        + b"{}"
    )
    for cut in range(len(stream) + 1):
        decoder = LogFrameDecoder()
        frames = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        decoder.close()
        assert [b"", data, b""] == [f.data for f in frames]
