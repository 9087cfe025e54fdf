"""`caravan demo --vllm real`: the demo's vLLM model served by real vLLM processes that
caravan placed on devcluster GPU nodes, every substitution said, and routed on the engines'
own KV-cache events (issue 24), whose publishers listen only inside their allocations; its
two example LoRA adapters (tiny ones the demo builds) listed with their parent, each
answering from those same replicas (issue 25).

One demo for the module, running (not `--once`) with `--json` (its addresses and keys on
stdout, the narration on stderr) and `--request-log` (the router's request lines); the
tests share it, and it must stop on SIGINT with status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from polling import eventually

from caravan_llm.devcluster.vllm_build import API_SERVER_MODULE, CPU_BLOCK_SIZE, VllmBuild

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVED = "qwen2.5-7b-instruct"
ADAPTERS = ("qwen2.5-7b-poet", "qwen2.5-7b-sql")
MODEL = "qwen2-5-7b"
# The demo's own readiness limit with real vLLM is 420 s; then its first completions.
READY_S = 480.0
STOP_S = 60.0
# A system prompt of several full 128-token blocks of the tiny model, well under its
# 2048 positions; the requests differ only in their short user turn.
SHARED_SYSTEM = "You are the caravan demo assistant. " + " ".join(
    f"rule {n} says keep the caravan moving" for n in range(40)
)
# Requests sent at most before the request log must show one routed on the events: the
# first ones can be routed before the tokenizer is loaded or over the tokenizing budget.
MAX_REQUESTS = 12
_VLLM_MARKS = (API_SERVER_MODULE, "VLLM::EngineCore", "VLLM::Worker", "vllm.v1.")
_TCP_LISTEN = "0A"
_UNIX_ACCEPTING = 0x00010000  # __SO_ACCEPTCON: a listening Unix socket


@dataclass(slots=True)
class Demo:
    """The running demo: its ready document (the `--json` object), narration and logs."""

    document: dict[str, Any]
    narration: Path
    request_log: Path

    @property
    def router_url(self) -> str:
        return str(self.document["openai_base_url"]).removesuffix("/v1")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.document['openai_api_key']}"}

    @property
    def engine_dir(self) -> Path:
        """devcluster's Nomad folder: <node>/alloc/<alloc id>/ for every allocation."""
        return Path(self.document["engine_logs"])

    def request_lines(self) -> list[dict[str, Any]]:
        if not self.request_log.exists():
            return []
        text = self.request_log.read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def demo(
    vllm_build: VllmBuild, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Demo]:
    """`caravan demo --vllm real` until the module ends; then SIGINT, and it exits with 0."""
    assert vllm_build.python.is_file()
    folder = tmp_path_factory.mktemp("demo")
    narration, request_log = folder / "narration.txt", folder / "requests.jsonl"
    with narration.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "caravan_llm.cli", "demo", "--vllm", "real",
            "--simulated-llama", "--json", "--request-log", str(request_log),
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env={k: v for k, v in os.environ.items() if not k.startswith(("NOMAD_", "CONSUL_"))},
        )  # fmt: skip
    try:
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), READY_S)
        except TimeoutError:
            line = b""
        tail = narration.read_text(errors="replace")[-3000:]
        assert line, f"the demo printed no ready document; its narration ends:\n{tail}"
        yield Demo(json.loads(line), narration, request_log)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(process.wait(), STOP_S)
            except TimeoutError:
                process.kill()
                await process.wait()
    assert 0 == process.returncode, narration.read_text(errors="replace")[-3000:]


async def test_demo_streams_from_real_vllm_replicas(demo: Demo) -> None:
    """Two real replicas ready, each substitution printed (the tokenizer the routers use
    too), a streamed completion from the vLLM model."""
    text = demo.narration.read_text(errors="replace")

    assert "vLLM replicas run the real vLLM 0.32.0" in text
    for flag in ("--model", "--tensor-parallel-size", "--max-model-len"):
        assert f"    {flag}: " in text, flag
    assert "    profile tokenizer: " in text
    assert f"{MODEL}: 2/2 ready" in text
    assert demo.document["completions"][SERVED].strip(), "no streamed text"


async def test_the_demos_adapters_are_listed_with_their_parent_and_answer(demo: Demo) -> None:
    """Both example adapters in /v1/models with the vLLM model as parent (the demo's ready
    document and narration), their node paths said as substitutions, each with streamed text."""
    text = demo.narration.read_text(errors="replace")
    assert dict.fromkeys(ADAPTERS, SERVED) == demo.document["adapters"]
    for adapter in ADAPTERS:
        assert f"  {adapter} (parent {SERVED})" in text
        assert f"  qwen2-5-7b: adapter {adapter}: /opt/loras/{adapter} -> " in text
        answer = demo.document["adapter_completions"][adapter]
        assert answer, f"no streamed text from {adapter}"
        assert answer.strip(), f"no streamed text from {adapter}"


async def test_shared_prompts_are_routed_on_the_engines_kv_events(demo: Demo) -> None:
    """After a few requests sharing a prompt longer than a block, the router has applied KV
    events and its request log shows `prefix_source` `events` for a request sent after that."""
    async with aiohttp.ClientSession(headers=demo.headers) as session:
        sent: list[int] = []
        # The request lines written once the router had applied events (None: not yet).
        since: list[int] = []

        async def events_applied() -> float:
            async with session.get(f"{demo.router_url}/metrics") as response:
                return _sample_sum(await response.text(), "caravan_router_kv_events_total")

        async def routed_on_events() -> bool:
            if not since and await events_applied() > 0:
                since.append(len(demo.request_lines()))
            if since and any(_on_events(line) for line in demo.request_lines()[since[0] :]):
                return True
            if len(sent) >= MAX_REQUESTS:
                return True  # no more requests: the assertions below say what was seen
            body = {
                "model": SERVED,
                "max_tokens": 2,
                "messages": [
                    {"role": "system", "content": SHARED_SYSTEM},
                    {"role": "user", "content": f"question {len(sent)}"},
                ],
            }
            async with session.post(f"{demo.router_url}/v1/chat/completions", json=body) as r:
                answer = await r.json()
                assert 200 == r.status, answer
            sent.append(int(answer["usage"]["prompt_tokens"]))
            return False

        await eventually(routed_on_events, 120, "a request routed on KV events", interval_s=0)
        applied = await events_applied()

    assert min(sent) > 2 * CPU_BLOCK_SIZE  # the shared prompt spans full KV blocks
    assert 0 < applied
    assert since, "the router applied no KV event"
    later = [line["prefix_source"] for line in demo.request_lines()[since[0] :]]
    assert "events" in later, later


async def test_kv_event_publishers_listen_only_inside_their_allocations(demo: Demo) -> None:
    """Each replica's KV-event and replay sockets (its /kv_event_sources) are ipc sockets its
    own vLLM processes listen on, inside its allocation; no vLLM process listens on TCP
    anywhere but loopback (never `tcp://*`)."""
    placements = await _placements(demo)
    assert 2 == len(placements)
    processes = _vllm_processes(demo.engine_dir)
    async with aiohttp.ClientSession() as session:
        for placed in placements:
            alloc_id = str(placed["alloc_id"])
            url = f"http://{placed['address']}:{placed['port']}/kv_event_sources"
            async with session.get(url) as response:
                sources = await response.json()
            mine = [pid for pid, cwd in processes.items() if f"/alloc/{alloc_id}/" in f"{cwd}/"]
            assert mine, f"no vLLM process of allocation {alloc_id}"
            listening = _unix_listeners(mine)
            for config in sources.values():
                assert config["enable_kv_cache_events"] is True
                for endpoint in (config["endpoint"], config["replay_endpoint"]):
                    assert endpoint.startswith("ipc://"), endpoint
                    path = endpoint.removeprefix("ipc://")
                    assert path in listening, (path, sorted(listening))
                    real = Path(path).resolve()
                    inside = list(demo.engine_dir.glob(f"*/alloc/{alloc_id}/alloc"))
                    assert 1 == len(inside)
                    assert real.is_relative_to(inside[0].resolve()), (endpoint, real)
    tcp = _tcp_listeners(list(processes))
    assert tcp, "no TCP listener found: the probe reads nothing"
    assert [] == [address for address in tcp if not _loopback(address)]


# -- helpers ----------------------------------------------------------------------------------


def _on_events(line: dict[str, Any]) -> bool:
    return line.get("model") == SERVED and line.get("prefix_source") == "events"


def _sample_sum(metrics: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith((f"{name}{{", f"{name} "))
    )


async def _placements(demo: Demo) -> list[dict[str, Any]]:
    url = f"http://{demo.document['consul_http_addr']}/v1/kv/caravan/placements/{MODEL}?raw"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert 200 == response.status
        return list(json.loads(await response.text())["allocations"])


def _vllm_processes(engine_dir: Path) -> dict[int, str]:
    """pid -> working directory of every vLLM process run in one of the demo's allocations."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = str((entry / "cwd").readlink())
        except OSError:
            continue
        if Path(cwd).is_relative_to(engine_dir) and any(m in command for m in _VLLM_MARKS):
            found[int(entry.name)] = cwd
    return found


def _socket_inodes(pids: list[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = str(fd.readlink())
                    if target.startswith("socket:["):
                        inodes.add(int(target.removeprefix("socket:[").removesuffix("]")))
    return inodes


def _unix_listeners(pids: list[int]) -> set[str]:
    """The paths of the listening Unix sockets these processes hold (/proc/net/unix)."""
    inodes = _socket_inodes(pids)
    paths = set()
    for line in Path(f"/proc/{pids[0]}/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) > 7 and int(fields[6]) in inodes and int(fields[3], 16) & _UNIX_ACCEPTING:
            paths.add(fields[7])
    return paths


def _tcp_listeners(pids: list[int]) -> list[str]:
    """The local addresses of the listening TCP sockets these processes hold (/proc/net/tcp*)."""
    inodes = _socket_inodes(pids)
    addresses = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pids[0]}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _TCP_LISTEN and int(fields[9]) in inodes:
                addresses.append(fields[1].split(":")[0])
    return addresses


def _loopback(hex_address: str) -> bool:
    """Whether a /proc/net/tcp* local address (host byte order, 32-bit words) is loopback."""
    words = [bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8)]
    address = ipaddress.ip_address(b"".join(words))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback
