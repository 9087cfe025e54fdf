"""How many simulated engines one machine runs: N instances, M concurrent streams.

    .venv/bin/python bench/engine_capacity.py                # 8 instances, 200 streams, 20 s
    .venv/bin/python bench/engine_capacity.py --flavor llamacpp --instances 4 --streams 50

Starts the instances as separate processes (`python -m caravan_llm.devcluster.engine`, as
devcluster runs them), keeps M streaming chat requests in flight, spread
round-robin, for the given time, and prints tokens per second delivered,
the engines' CPU use (from /proc) and the load generator's own CPU use.
Linux only (reads /proc/<pid>/stat).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Totals:
    requests: int = 0
    tokens: int = 0
    errors: int = 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@contextlib.asynccontextmanager
async def instances(
    flavor: str, count: int, extra: list[str]
) -> AsyncIterator[list[tuple[str, asyncio.subprocess.Process]]]:
    started: list[tuple[str, asyncio.subprocess.Process]] = []
    try:
        for index in range(count):
            port = free_port()
            model = ["--model", f"m{index}"] if flavor == "vllm" else ["-m", f"/m/{index}.gguf"]
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "caravan_llm.devcluster.engine",
                "--flavor",
                flavor,
                *model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--sim-load-seconds",
                "0",
                *extra,
                cwd=REPO,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            started.append((f"http://127.0.0.1:{port}", process))
        yield started
    finally:
        for _, process in started:
            if process.returncode is None:
                process.terminate()
        for _, process in started:
            try:
                await asyncio.wait_for(process.wait(), timeout=5)
            except TimeoutError:
                process.kill()
                await process.wait()


async def wait_ready(session: aiohttp.ClientSession, urls: list[str]) -> None:
    for url in urls:
        for _ in range(500):
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/health") as response:
                    if response.status == 200:
                        break
            await asyncio.sleep(0.02)
        else:
            raise SystemExit(f"{url} did not become healthy")


async def stream_forever(
    session: aiohttp.ClientSession, url: str, max_tokens: int, stop_at: float, totals: Totals
) -> None:
    body = {
        "messages": [{"role": "user", "content": "benchmark"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    while time.monotonic() < stop_at:
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as response:
                async for line in response.content:
                    if b'"content":"' in line and b'"content":""' not in line:
                        totals.tokens += 1
            totals.requests += 1
        except aiohttp.ClientError:
            totals.errors += 1


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--flavor", choices=["vllm", "llamacpp"], default="vllm")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("engine_args", nargs="*", help="extra engine flags, after --")
    args = parser.parse_args()
    extra = list(args.engine_args)
    if args.flavor == "llamacpp" and not any(a in {"-np", "--parallel"} for a in extra):
        extra += ["-np", str(max(1, args.streams // args.instances))]

    async with instances(args.flavor, args.instances, extra) as running:
        urls = [url for url, _ in running]
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            await wait_ready(session, urls)
            engine_cpu_before = sum(cpu_seconds(p.pid) for _, p in running)
            own_before = os.times()
            started = time.monotonic()
            totals = Totals()
            stop_at = started + args.seconds
            await asyncio.gather(
                *(
                    stream_forever(session, urls[i % len(urls)], args.max_tokens, stop_at, totals)
                    for i in range(args.streams)
                )
            )
            elapsed = time.monotonic() - started
            own_after = os.times()
            engine_cpu = sum(cpu_seconds(p.pid) for _, p in running) - engine_cpu_before
    own_cpu = (own_after.user - own_before.user) + (own_after.system - own_before.system)
    print(f"{args.instances} {args.flavor} instances, {args.streams} streams, {elapsed:.1f} s")
    print(f"  requests {totals.requests}, errors {totals.errors}")
    print(f"  tokens/s delivered     {totals.tokens / elapsed:10.0f}")
    print(f"  engines CPU (cores)    {engine_cpu / elapsed:10.2f}")
    print(f"  load generator (cores) {own_cpu / elapsed:10.2f}")
    print(f"  machine cores          {os.cpu_count():10d}")


if __name__ == "__main__":
    asyncio.run(main())
