"""caravan_llm.scheduler.server: the process leads, serves its API, and shuts down in order on a
stop."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest
from conftest import eventually

from caravan_llm.cli.local_stack import StackOptions, local_stack
from caravan_llm.common.consul_api import ConsulClient, ConsulSettings
from caravan_llm.common.contract import KVLayout
from caravan_llm.scheduler.server import serve
from caravan_llm.scheduler.settings import SchedulerSettings


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_serve_resigns_leadership_before_closing_its_api_on_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On stop: loops end, the lock is released and the session destroyed, then the API closes."""
    options = StackOptions(
        prefer_real_llama_server=False, run_scheduler=False, autoscale=False, work_dir=tmp_path
    )
    async with (
        local_stack(options) as stack,
        ConsulClient(ConsulSettings.from_env(stack.env)) as consul,
    ):
        port = _free_port()
        settings = SchedulerSettings(
            http_port=port,
            instance_id="server-under-test",
            leader_ttl_s=10.0,
            leader_lock_delay_s=1.0,
            autoscale=False,
            api_tokens=None,
            api_tokens_file=None,
        )
        stop = asyncio.Event()
        caplog.set_level(logging.INFO)
        serving = asyncio.create_task(serve(settings, stack.config, stack.env, stop=stop))

        async def holder() -> tuple[bytes, str] | None:
            _, entry = await consul.kv_get(KVLayout().leader)
            if entry is None or entry.session is None:
                return None
            return entry.value, entry.session

        value, session = await eventually(holder, timeout_s=30.0, interval_s=0.2)
        assert b"server-under-test" == value
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/health") as answer,
        ):
            assert 200 == answer.status

        stop.set()
        await asyncio.wait_for(serving, timeout=30.0)

        assert await holder() is None  # released, not left to the TTL
        _, still = await consul.session_info(session)
        assert still is None  # destroyed
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/health"):
                pass
        events = [record.getMessage() for record in caplog.records]
        order = ["leadership_released", "scheduler_stopped", "scheduler_clients_closed"]
        assert order == [event for event in events if event in order]


async def test_python_m_scheduler_reads_the_environment_and_stops_cleanly_on_sigterm(
    tmp_path: Path,
) -> None:
    """`python -m caravan_llm.scheduler` configured by variables only (the KV prefix by its
    deprecated
    alias) leads under that prefix; SIGTERM releases the lock and exits 0."""
    options = StackOptions(
        prefer_real_llama_server=False, run_scheduler=False, autoscale=False, work_dir=tmp_path
    )
    async with (
        local_stack(options) as stack,
        ConsulClient(ConsulSettings.from_env(stack.env)) as consul,
    ):
        port = _free_port()
        environ = {
            **stack.env,
            "CARAVAN_KV_PREFIX": "other/",
            "CARAVAN_SCHEDULER_HTTP_PORT": str(port),
            "CARAVAN_SCHEDULER_INSTANCE_ID": "by-environment",
            "CARAVAN_SCHEDULER_LEADER_TTL_S": "10",
            "CARAVAN_SCHEDULER_LEADER_LOCK_DELAY_S": "1",
            "CARAVAN_SCHEDULER_AUTOSCALE": "false",
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "caravan_llm.scheduler",
            env=environ,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:

            async def holder() -> bytes | None:
                _, entry = await consul.kv_get(KVLayout("other/").leader)
                return entry.value if entry is not None and entry.session else None

            assert b"by-environment" == await eventually(holder, timeout_s=60.0, interval_s=0.2)
            process.send_signal(signal.SIGTERM)
            stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=30.0)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()

        assert 0 == process.returncode
        assert await holder() is None
        assert f"caravan scheduler listening on http://127.0.0.1:{port}" in stdout.decode()
        assert "deprecated_setting" in stderr.decode()


async def test_python_m_scheduler_writes_its_first_info_line_while_running(
    tmp_path: Path,
) -> None:
    """The scheduler's log lines reach stderr when they happen, not at shutdown."""
    options = StackOptions(
        prefer_real_llama_server=False, run_scheduler=False, autoscale=False, work_dir=tmp_path
    )
    async with local_stack(options) as stack:
        environ = {
            **stack.env,
            "CARAVAN_SCHEDULER_HTTP_PORT": str(_free_port()),
            "CARAVAN_SCHEDULER_AUTOSCALE": "false",
            "CARAVAN_SCHEDULER_LOG_FORMAT": "text",
        }
        stderr_path = tmp_path / "scheduler.stderr"
        with stderr_path.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "caravan_llm.scheduler",
                env=environ,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=stderr,
            )
        try:

            async def listening_line() -> str | None:
                text = stderr_path.read_text()
                return text if "scheduler_api_listening" in text else None

            text = await eventually(listening_line, timeout_s=60.0, interval_s=0.2)
            assert process.returncode is None  # still running: the line did not wait for exit
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                await asyncio.wait_for(process.wait(), timeout=30.0)

    line = next(line for line in text.splitlines() if "scheduler_api_listening" in line)
    assert ("INFO", "scheduler.app") == tuple(line.split()[1:3])
