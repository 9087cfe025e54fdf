"""`caravan demo`: a streamed completion from placed replicas, exports, and no orphans."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import dns.asyncquery
import dns.message
import dns.rdatatype
import pytest


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, grandchildren, ...)."""
    table = subprocess.run(
        ["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    children: dict[int, list[int]] = {}
    for line in table:
        if line.strip():
            child, parent = (int(x) for x in line.split())
            children.setdefault(parent, []).append(child)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text(encoding="ascii").split()[2] != "Z"
    except FileNotFoundError:
        return False


async def still_alive(pids: set[int], timeout_s: float) -> list[int]:
    """The `pids` still alive once all are gone or `timeout_s` has passed (polled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = sorted(pid for pid in pids if alive(pid))
        if not left or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(0.05)


async def start_demo(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.cli",
        "demo",
        "--simulated-llama",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith(("NOMAD_", "CONSUL_"))},
    )


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


@pytest.mark.slow
async def test_demo_once_streams_a_completion_and_exits_zero():
    """`caravan demo --once` prints a streamed completion and the export lines, then exits 0."""
    process = await start_demo("--once")
    out, err = await asyncio.wait_for(process.communicate(), 240)
    text = out.decode()
    assert process.returncode == 0, err.decode()
    assert "tiny-chat: 3/3 ready" in text
    assert "qwen2-5-7b: 2/2 ready" in text
    completion = next(line for line in text.splitlines() if line.startswith("tiny-chat < "))
    assert completion.removeprefix("tiny-chat < ").strip(), "no streamed text"
    for variable in ("NOMAD_ADDR", "CONSUL_HTTP_ADDR", "OPENAI_BASE_URL", "CARAVAN_DNS_PORT"):
        assert f"\nexport {variable}=" in text


@pytest.mark.slow
async def test_demo_json_prints_one_object_with_the_exports_and_narrates_on_stderr(
    tmp_path: Path,
):
    """`caravan demo --once --json`: stdout is one JSON object a script can read; the
    narration goes to stderr; the key and token it gives work as the export lines' do;
    `--request-log` has the router's line of each completion, without the prompt."""
    request_log = tmp_path / "requests.jsonl"
    process = await start_demo("--once", "--json", "--request-log", str(request_log))
    out, err = await asyncio.wait_for(process.communicate(), 240)
    assert process.returncode == 0, err.decode()
    (line,) = out.decode().splitlines()
    ready = json.loads(line)

    assert {
        "nomad_addr",
        "consul_http_addr",
        "openai_base_url",
        "openai_api_key",
        "caravan_scheduler_addr",
        "caravan_api_token",
        "dns_port",
        "engine_logs",
        "models",
        "completions",
        "adapters",
        "adapter_completions",
    } == set(ready)
    assert ["qwen2.5-7b-instruct", "tiny-chat"] == ready["models"]
    assert all(text.strip() for text in ready["completions"].values())
    adapters = {"qwen2.5-7b-sql": "qwen2.5-7b-instruct", "qwen2.5-7b-poet": "qwen2.5-7b-instruct"}
    assert adapters == ready["adapters"]
    assert sorted(adapters) == sorted(ready["adapter_completions"])
    assert all((text or "").strip() for text in ready["adapter_completions"].values())
    assert ready["openai_api_key"]
    assert ready["caravan_api_token"]
    assert "tiny-chat: 3/3 ready" in err.decode()
    logged = [json.loads(entry) for entry in request_log.read_text().splitlines()]
    # The demo's completions: each model's and each adapter's.
    assert sorted(["qwen2.5-7b-instruct", "tiny-chat", *adapters]) == sorted(
        entry["model"] for entry in logged
    )
    assert {200} == {entry["status"] for entry in logged}
    assert all("prefix_source" in entry for entry in logged)
    assert "say hello" not in request_log.read_text().lower()  # the demo's prompt


async def router_srv(dns_port: int) -> list[int]:
    """Ports of caravan-router in Consul DNS, as `dig ... SRV` would show them."""
    query = dns.message.make_query("caravan-router.service.consul", dns.rdatatype.SRV)
    answer = await dns.asyncquery.udp(query, "127.0.0.1", port=dns_port, timeout=2)
    return [item.port for rrset in answer.answer for item in rrset]


@pytest.mark.slow
async def test_demo_serves_dns_and_leaves_no_process_behind_after_ctrl_c():
    """During the demo DNS finds the router; after Ctrl-C every process it started is gone."""
    process = await start_demo()
    try:
        text = await read_until(process, "running until Ctrl-C", 240)
        exports = dict(
            line.removeprefix("export ").split("=", 1)
            for line in text.splitlines()
            if line.startswith("export ")
        )
        router_port = int(exports["OPENAI_BASE_URL"].rsplit(":", 1)[1].split("/")[0])
        assert await router_srv(int(exports["CARAVAN_DNS_PORT"])) == [router_port]
        started = descendants(process.pid)
        assert len(started) >= 5, f"expected the 5 engine processes, saw {len(started)}"
        process.send_signal(signal.SIGINT)
        await asyncio.wait_for(process.wait(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0
    # The demo has exited; what it killed may still be exiting.
    left = await still_alive(started, timeout_s=5)
    assert left == [], f"orphaned processes: {left}"


@pytest.mark.slow
async def test_demo_names_its_engine_logs_and_keeps_them_when_asked():
    """`--keep-logs`: the folder the demo names still holds every engine's stderr after exit."""
    process = await start_demo("--once", "--keep-logs")
    out, err = await asyncio.wait_for(process.communicate(), 240)
    assert process.returncode == 0, err.decode()
    line = next(line for line in out.decode().splitlines() if line.startswith("engine logs: "))
    folder = Path(line.removeprefix("engine logs: ").split("/<node>/", 1)[0])
    try:
        logs = sorted(folder.glob("*/alloc/*/alloc/logs/*.stderr.0"))
        assert len(logs) >= 5, f"expected the 5 replicas' engine logs under {folder}"
        assert line.endswith("(kept on exit)")
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)
