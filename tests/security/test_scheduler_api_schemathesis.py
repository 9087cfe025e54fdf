"""Schemathesis against a scheduler on a devcluster, from its API's OpenAPI document (issue 26).

`schemathesis run` runs in a subprocess while the scheduler serves on this
test's loop, three times:

1. without a token (Schemathesis also sends malformed and wrong ones): every
   answer on a secured route is 401 or 403, and Consul KV under caravan's
   prefixes and Nomad's job list are what they were before;
2. with the token, negative data only (bodies and paths the document does
   not allow): every answer is a 4xx, and again nothing changed;
3. with the token, every mode and phase, writes included.

Each run checks that no answer is a 5xx and that every answer has a
documented status, content type, headers and body; the scheduler's log holds
no traceback afterwards. The runs are seeded and bounded so the test takes
seconds; CARAVAN_SCHEMATHESIS_EXAMPLES and CARAVAN_SCHEMATHESIS_SEED make a
longer or different run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from polling import eventually

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_stack
from caravan_llm.scheduler.openapi import EXAMPLE_NAME, EXAMPLE_PROFILE, api_document

EXAMPLES = int(os.environ.get("CARAVAN_SCHEMATHESIS_EXAMPLES", "10"))
SEED = os.environ.get("CARAVAN_SCHEMATHESIS_SEED", "26")
# positive_data_acceptance is left out: whether a profile is accepted depends on
# what no JSON schema can say (the engine's rules, the path's name, the models
# stored), so schema-valid bodies are rightly refused with a 400 naming why.
# negative_data_rejection is left out too: a profile is validated by pydantic in
# lax mode, which takes some values its own JSON schema calls wrong (0 for false,
# "5" for 5). The negative run below still asserts that every write was refused.
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_headers_conformance,response_schema_conformance,unsupported_method,ignored_auth"
)
# Where the API's writes land: caravan/ and the history beside it.
KV_PREFIXES = ("caravan/", "caravan-history/")


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[LocalStack]:
    options = StackOptions(
        cpu_nodes=1, gpu_nodes=0, prefer_real_llama_server=False, autoscale=False, work_dir=tmp_path
    )
    async with local_stack(options) as running:
        yield running


async def world(stack: LocalStack) -> tuple[Any, ...]:
    """Every KV entry under caravan's prefixes (key, value, index) and every Nomad job's version."""
    entries = []
    for prefix in KV_PREFIXES:
        _, found = await stack.scheduler.consul.kv_get_recurse(prefix)
        entries.extend((e.key, e.value, e.modify_index) for e in found)
    jobs = (await stack.scheduler.nomad.list_jobs()).value
    return (
        tuple(sorted(entries)),
        tuple(sorted((j.id, j.version, j.job_modify_index, j.stop) for j in jobs)),
    )


async def settled_world(stack: LocalStack) -> tuple[Any, ...]:
    """The world once the example model is ready and two readings a moment apart agree."""

    async def ready() -> bool:
        url = f"{stack.scheduler_url}/v1/models/{EXAMPLE_NAME}"
        async with (
            aiohttp.ClientSession() as session,
            session.get(url, headers=stack.scheduler_headers) as response,
        ):
            status = await response.json()
        return 200 == response.status and status["ready"] == status["desired"] > 0

    await eventually(ready, 60, f"{EXAMPLE_NAME} ready")
    readings: list[tuple[Any, ...]] = []

    async def steady() -> tuple[Any, ...] | None:
        readings.append(await world(stack))
        return readings[-1] if readings[-2:] == [readings[-1]] * 2 else None

    steady_world: tuple[Any, ...] = await eventually(steady, 30, "a steady world", interval_s=0.5)
    return steady_world


async def schemathesis(
    stack: LocalStack, document: Path, report: Path, *options: str
) -> list[tuple[str, str, int]]:
    """Run `schemathesis run` against the scheduler; (method, path, status) of every request."""
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", str(document)),
        *("--url", stack.scheduler_url, "--checks", CHECKS),
        *("--max-examples", str(EXAMPLES), "--seed", SEED, "--workers", "1"),
        *("--report", "har", "--report-har-path", str(report), *options),
    ]
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(report.parent), "NO_COLOR": "1"}
    process = await asyncio.create_subprocess_exec(
        *command,
        cwd=report.parent,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 120)
    assert 0 == process.returncode, out.decode(errors="replace")[-8000:]
    entries = json.loads(report.read_text(encoding="utf-8"))["log"]["entries"]
    return [
        (e["request"]["method"], urlsplit(e["request"]["url"]).path, e["response"]["status"])
        for e in entries
    ]


# About 30 s on an idle 2-core machine; the timeout leaves room for a loaded one.
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_schemathesis_finds_nothing_and_refused_requests_change_nothing(
    stack: LocalStack, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """No 5xx, no undocumented answer, no traceback; refused requests leave KV and Nomad alone."""
    document = tmp_path / "openapi.json"
    document.write_text(json.dumps(api_document()), encoding="utf-8")
    token = ("-H", f"Authorization: Bearer {stack.scheduler_api_token}")
    caplog.set_level(logging.WARNING)
    async with aiohttp.ClientSession() as session:
        # A model exists, so a DELETE, a scale or a revert has something to change.
        put = session.put(
            f"{stack.scheduler_url}/v1/models/{EXAMPLE_NAME}",
            json=dict(EXAMPLE_PROFILE),
            headers=stack.scheduler_headers,
        )
        async with put as response:
            assert 200 == response.status
    before = await settled_world(stack)

    anonymous = await schemathesis(stack, document, tmp_path / "anonymous.har")
    refused = {status for method, path, status in anonymous if path != "/health"}
    # 405: a method no route has; Schemathesis sends wrong tokens too (403).
    assert {401, 403, 405} == refused
    assert before == await world(stack)

    negative = await schemathesis(
        stack,
        document,
        tmp_path / "negative.har",
        *token,
        "--mode",
        "negative",
        "--phases",
        "coverage,fuzzing",
    )
    # Every write was refused (a read cannot change anything, and has little to negate).
    writes = [(m, p, s) for m, p, s in negative if m in {"PUT", "POST", "DELETE"}]
    assert [] == [(m, p, s) for m, p, s in writes if not 400 <= s < 500]
    assert before == await world(stack)

    everything = await schemathesis(stack, document, tmp_path / "everything.har", *token)
    assert 200 in {status for _, _, status in everything}
    tracebacks = [
        r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR
    ]
    assert [] == tracebacks
