"""`caravan demo` is secure by default: its key and token work as printed (item 7)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import aiohttp
import openai
import pytest


def clean_environ() -> dict[str, str]:
    """A second shell's environment before it evals the demo's export lines."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NOMAD_", "CONSUL_", "OPENAI_", "CARAVAN_"))
    }


async def read_until(process: asyncio.subprocess.Process, marker: str, timeout_s: float) -> str:
    assert process.stdout is not None
    seen: list[str] = []
    async with asyncio.timeout(timeout_s):
        while True:
            line = (await process.stdout.readline()).decode()
            if not line:
                pytest.fail("demo exited early:\n" + "".join(seen))
            seen.append(line)
            if marker in line:
                return "".join(seen)


async def caravan(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.cli",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.mark.slow
async def test_demo_keys_refuse_strangers_and_work_as_printed(monkeypatch):
    """Without the key the router refuses; the printed exports drive openai and the CLI as is."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.cli",
        "demo",
        "--simulated-llama",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=clean_environ(),
    )
    try:
        text = await read_until(process, "running until Ctrl-C", 240)
        exports = dict(
            line.removeprefix("export ").split("=", 1)
            for line in text.splitlines()
            if line.startswith("export ")
        )
        assert {"OPENAI_API_KEY", "CARAVAN_API_TOKEN", "CARAVAN_SCHEDULER_ADDR"} <= set(exports)
        key, token = exports["OPENAI_API_KEY"], exports["CARAVAN_API_TOKEN"]
        assert len(key) >= 32
        assert len(token) >= 32
        assert key != token
        assert "a request without the API key: HTTP 401 (refused)" in text

        base = exports["OPENAI_BASE_URL"]
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{base}/chat/completions", json=body) as response:
                assert 401 == response.status
                assert "error" in await response.json()
            async with session.get(f"{base}/models") as response:
                assert 401 == response.status
            scheduler = exports["CARAVAN_SCHEDULER_ADDR"]
            async with session.get(f"{scheduler}/v1/models") as response:
                assert 401 == response.status

        # The official client, configured only by the exported variables.
        for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
            monkeypatch.setenv(name, exports[name])
        client = openai.AsyncOpenAI()
        try:
            answer = await client.chat.completions.create(
                model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
            assert answer.choices[0].message.content
        finally:
            await client.close()
        stranger = openai.AsyncOpenAI(api_key="sk-not-the-demo-key-at-all", max_retries=0)
        try:
            with pytest.raises(openai.AuthenticationError):
                await stranger.models.list()
        finally:
            await stranger.close()

        # The CLI in a second shell: the exports alone reach the scheduler's API.
        shell = {**clean_environ(), **exports}
        code, out, err = await caravan(shell, "list")
        assert (0, "") == (code, err)
        assert "tiny-chat" in out
        no_token = {k: v for k, v in shell.items() if k != "CARAVAN_API_TOKEN"}
        code, _, err = await caravan(no_token, "list")
        assert 1 == code
        assert [
            f"error: the scheduler at {scheduler} needs a token: set CARAVAN_API_TOKEN"
        ] == err.splitlines()

        process.send_signal(signal.SIGINT)
        await asyncio.wait_for(process.wait(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert 0 == process.returncode
