"""The router's descriptor and connection bounds (issue 26, deliver 7).

The router raises its soft open-file limit to the hard limit at start, and a
connection over its cap reads a whole 503 with `Retry-After`.

A process started at a soft RLIMIT_NOFILE of 256 under a higher hard limit
would cap itself at (256 - 64) / 2 = 96 client connections; the router lifts
its soft limit first, so its default connection cap follows the hard limit.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
from pathlib import Path

import aiohttp
import pytest
from router_hardening_harness import (
    REPO,
    OrderEngine,
    chat,
    register_engine,
    running_consul,
    running_router,
    wait_until,
)

from caravan_llm.router.edge.http_limits import nofile_soft_target

UNLIMITED = -1


@pytest.mark.parametrize(
    ("soft", "hard", "expected"),
    [
        (1024, 524288, 524288),
        (256, 20000, 20000),
        (20000, 20000, None),
        (1024, UNLIMITED, 1_048_576),
        (UNLIMITED, UNLIMITED, None),
    ],
)
def test_the_soft_limit_is_raised_to_the_hard_limit(
    soft: int, hard: int, expected: int | None
) -> None:
    """Soft goes up to hard (Linux's per-process ceiling when hard is unlimited), never down."""
    assert expected == nofile_soft_target(soft, hard, unlimited=UNLIMITED)


_SOFT_256 = (
    "import resource, sys\n"
    "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
    "from caravan_llm.cli.main import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def soft_nofile_of(pid: int) -> int:
    """The soft `Max open files` of a running process, from /proc."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no 'Max open files' line")


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="needs Linux /proc")
async def test_caravan_router_started_at_a_soft_256_runs_at_the_hard_limit(tmp_path: Path) -> None:
    """`caravan router` launched with a soft limit of 256 serves with soft = hard."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:  # pragma: no cover - a tiny machine
        pytest.fail(f"the hard RLIMIT_NOFILE here is {hard}: the test needs more than 256")
    async with running_consul() as (server, _):
        log_path = tmp_path / "router.log"
        with log_path.open("wb") as log_file:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _SOFT_256,
                "router",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                cwd=REPO,
                env={
                    **os.environ,
                    "CONSUL_HTTP_ADDR": server.http_addr,
                    "CARAVAN_ROUTER_LOG_FORMAT": "text",
                    "CARAVAN_ROUTER_REGISTER_SERVICE": "false",
                    "CARAVAN_ROUTER_SHUTDOWN_TIMEOUT_S": "1",
                },
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
            )
        try:
            assert process.stdout is not None
            line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
            assert line.startswith("caravan router listening on "), log_path.read_text()
            soft = soft_nofile_of(process.pid)
        finally:
            process.terminate()
            await asyncio.wait_for(process.wait(), 15)

    expected = 1_048_576 if hard == resource.RLIM_INFINITY else hard
    assert expected == soft


# -- at the cap: a clean 503, never a reset or a hang ------------------------------------------


async def newcomer_answer(port: int) -> bytes | str:
    """A request on a new connection, read to the end: the bytes, or the error's name."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(5):
                return await reader.read()
        finally:
            writer.close()
    except (ConnectionError, TimeoutError) as exc:
        return type(exc).__name__


async def newcomers_at_a_full_cap(count: int) -> list[bytes | str]:
    """A router with a cap of 2, both connections inside requests: `count` newcomers at once."""
    async with running_consul() as (_, consul), aiohttp.ClientSession() as http:
        async with OrderEngine(held=frozenset({"a", "b"})) as engine:
            await register_engine(consul, engine.port)
            async with running_router(consul, max_connections=2) as router:
                await wait_until(router.routable, timeout_s=5, what="endpoint")
                url = router.url + "/v1/chat/completions"
                busy = [asyncio.create_task(http.post(url, json=chat(n))) for n in ("a", "b")]
                await wait_until(lambda: 2 == len(engine.order), timeout_s=5, what="both held")
                port = int(router.url.rsplit(":", 1)[-1])
                answers = await asyncio.gather(*(newcomer_answer(port) for _ in range(count)))
                engine.release.set()
                for task in busy:
                    async with await task as response:
                        await response.read()
    return answers


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_every_newcomer_at_the_cap_reads_a_whole_503_with_retry_after(loop: str) -> None:
    """50 connections at once over a full cap: each reads the JSON 503, none a reset or a hang.

    uvloop is the router's production loop; its transports reset a connection
    closed with the client's request unread, which the lingering close avoids.
    """
    factory = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        answers = runner.run(newcomers_at_a_full_cap(50))

    heads = [a.split(b"\r\n\r\n", 1)[0] if isinstance(a, bytes) else a for a in answers]
    clean = [
        h
        for h in heads
        if isinstance(h, bytes)
        and h.startswith(b"HTTP/1.1 503 ")
        and b"Retry-After: 1" in h
        and b"Connection: close" in h
    ]
    assert (50, []) == (len(clean), [h for h in heads if h not in clean])
    bodies = {json.loads(a.split(b"\r\n\r\n", 1)[1])["error"]["code"] for a in answers}  # type: ignore[union-attr]
    assert {"too_many_connections"} == bodies
