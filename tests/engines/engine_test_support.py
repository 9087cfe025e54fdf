"""Helpers shared by the engine tests: SSE parsing, JSON posting, the real llama-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp
import polling

from caravan_llm.devcluster.engine.server import RunningEngine
from caravan_llm.scheduler.cluster_config import ClusterConfig, LlamaCppSettings
from caravan_llm.scheduler.profiles import load_profile
from caravan_llm.scheduler.render import render

T = TypeVar("T")


class StartEngine(Protocol):
    def __call__(
        self,
        flavor: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        wait_ready: bool = True,
    ) -> Awaitable[RunningEngine]: ...


def parse_sse(body: str) -> list[Any]:
    """The `data:` payloads of an SSE body: decoded JSON, or the literal "[DONE]"."""
    events: list[Any] = []
    for line in body.splitlines():
        if not line.startswith("data: "):
            continue
        payload = line.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chat_text(events: list[Any]) -> str:
    """The content a chat stream carries."""
    return "".join(
        choice["delta"].get("content") or ""
        for event in events
        if isinstance(event, dict)
        for choice in event["choices"]
    )


async def post_json(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as response:
        if response.content_type == "text/event-stream":
            return response.status, parse_sse(await response.text())
        return response.status, await response.json(content_type=None)


# --- the real llama-server, started from caravan's rendered job ----------------

REPO = Path(__file__).resolve().parents[2]
TINY_PROFILE = REPO / "examples" / "profiles" / "tiny-llamacpp-cpu.yaml"
LLAMA_SERVER_MISSING = (
    "the real llama-server is not built: run scripts/build-llama-server.sh "
    "(or set CARAVAN_LLAMA_SERVER)"
)


def free_port() -> int:
    """A free loopback port (bound and released; fine for one test's server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rendered_llama_server_command(
    binary: Path, model: Path, *, port: int, parallel: int = 2, ctx_size: int = 4096
) -> list[str]:
    """The llama-server command line of caravan's rendered raw_exec job for the tiny profile.

    `ctx_size` is llama-server's total --ctx-size; the profile's context_length
    is per slot, so the rendered flag is context_length x parallel.
    """
    profile = load_profile(TINY_PROFILE).model_copy(
        update={
            "model": str(model),
            "max_concurrency": parallel,
            "context_length": ctx_size // parallel,
        }
    )
    config = ClusterConfig(llamacpp=LlamaCppSettings(binary=str(binary)))
    task = render(profile, 0, config=config)["Job"]["TaskGroups"][0]["Tasks"][0]
    assert "raw_exec" == task["Driver"]
    args = [
        arg.replace("${NOMAD_IP_http}", "127.0.0.1").replace("${NOMAD_PORT_http}", str(port))
        for arg in task["Config"]["args"]
    ]
    return [task["Config"]["command"], *args]


@contextlib.asynccontextmanager
async def llama_server_process(
    command: list[str], env: Mapping[str, str] | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    """Run a llama-server; on exit SIGTERM, then SIGKILL if it hangs (it can mid-request)."""
    process = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        env=None if env is None else {**os.environ, **env},
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), timeout=3)
            except TimeoutError:
                process.kill()
                await process.wait()


async def eventually(
    check: Callable[[], Awaitable[T]], *, timeout_s: float, what: str, every_s: float = 0.02
) -> T:
    """Poll `check` until it returns something truthy and return that; fail naming `what`."""
    return await polling.eventually(check, timeout_s, what, interval_s=every_s)


async def wait_healthy(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float = 20
) -> None:
    async def healthy() -> bool:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(base_url + "/health") as response:
                return response.status == 200
        return False

    await eventually(healthy, timeout_s=timeout_s, what=f"{base_url} healthy")


def exposition_types(text: str) -> dict[str, str]:
    """Metric name -> type, from the `# TYPE` lines, in order."""
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
    return types


def json_shape(value: Any) -> Any:
    """The structure of a JSON value: keys and kinds, no values (numbers are one kind)."""
    if isinstance(value, dict):
        return {key: json_shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if value is None:
        return "null"
    return type(value).__name__
