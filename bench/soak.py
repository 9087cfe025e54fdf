"""An hour of load and faults on the demo stack: nothing lost while 2 replicas stand, no leaks.

    .venv/bin/python bench/soak.py                        # 60 minutes, a fault every 1-3 minutes
    .venv/bin/python bench/soak.py --minutes 4 --fault-interval 30-60 --warmup-minutes 1
    .venv/bin/python bench/soak.py --faults node_kill,router_restart --seed 7 --out soak.json

The stack is the demo's (caravan_llm/cli/local_stack.py): devcluster's Consul
and Nomad in this process (4 CPU nodes, 3 GPU nodes with 2 simulated H100s
each), and as separate OS processes two `caravan scheduler`s (one leads, one
stands by) and two `caravan router`s. Two models with 2 replicas each:
`tiny-chat` (llama.cpp: the real llama-server when `make llama-server` built
it, else the simulated one) and `qwen2.5-7b-instruct` (simulated vLLM, 2
sequences per replica so the engines, not the machine, bound the capacity).

1. Capacity: both models are loaded together at 1, 2, 4, ... clients each
   (closed loop, half streaming) until a model's throughput stops growing by
   10%; its capacity is the best throughput seen (`--capacity` skips this).
   Then (`--saturate-queues`, on by default) each router's admission queue
   of each model is filled to its bound once, one model at a time
   (`saturate_queues`: the router's RSS steps up once, the first time a
   queue fills, and stays; this puts that step in the warm-up).
2. Load: `--load-fraction` (0.7) of each model's capacity, Poisson arrivals,
   half of them streaming, sent to the routers that a health-checking
   balancer keeps in rotation (/health 200, checked every second), to the
   one with the fewest requests outstanding (`--balancer least-request`, as
   HAProxy's leastconn; `round-robin` alternates); a connection refused goes
   to the other router.
3. Faults: one every `--fault-interval` seconds (60-180), drawn from `--seed`
   out of `--faults` (all by default):
   node_kill (powered off, back empty after 30-60 s), alloc_crash (SIGKILL;
   Nomad restarts it), leader_kill (SIGKILL of the leading scheduler, started
   again as a standby 5-15 s later), consul_down (HTTP listener closed for
   10-30 s), nomad_down (devcluster's outage switch: 500 `No cluster leader`
   for 10-30 s), router_restart (out of the balancer for 5 s, as Nomad's
   shutdown_delay does, then SIGTERM, graceful, and started again),
   engine_freeze (SIGSTOP of a replica's processes, SIGCONT 20-60 s later),
   netem (200 ms +- 50 ms on loopback to and from one replica for 20-60 s,
   with `tc`; needs the prio and netem qdiscs), disk_full (a replica's node
   folder is a 256 MiB tmpfs mounted before the stack starts; its log folder
   is filled for 20-60 s). A fault this machine cannot make is reported
   "unavailable" at start and skipped, never failing the run.
4. Sampling every `--sample-interval` s: ready (passing) replicas per model
   from Consul, and for every caravan process its RSS and open descriptors
   (/proc), `caravan_process_asyncio_tasks` and `caravan_process_python_blocks`
   (its /metrics).

The report (printed, and `--out` as JSON): the fault timeline; per period
between faults and per model the fewest ready replicas, the requests and the
failures by cause; requests, failures, TTFT and end-to-end p50/p99 per
minute; RSS, descriptors and tasks per process over time and their trend
from `--warmup-minutes` to the end; tracebacks found in the processes' logs;
and issue 26's acceptance as PASS/FAIL lines (bench/soak_plan.py).
Runs as root for netem and disk_full; without root both are "unavailable".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.processes import Proc, started  # noqa: E402 - needs the repository on sys.path
from bench.soak_plan import (  # noqa: E402
    BALANCERS,
    FAULT_KINDS,
    PlannedFault,
    ProcessSample,
    ReadySample,
    RequestRecord,
    account_periods,
    balance_order,
    classify_failure,
    is_classified,
    judge,
    judge_processes,
    minute_stats,
    parse_faults,
    parse_range,
    periods,
    pick_target,
    plan_faults,
)
from caravan_llm.cli.example_profiles import example_profiles_dir  # noqa: E402
from caravan_llm.cli.local_stack import (  # noqa: E402
    LocalStack,
    StackOptions,
    local_profile,
    local_stack,
    new_secret,
)
from caravan_llm.common.contract import KVLayout, model_service_name  # noqa: E402
from caravan_llm.common.log_format import configure_logging  # noqa: E402
from caravan_llm.common.process_metrics import ASYNCIO_TASKS, PYTHON_BLOCKS  # noqa: E402
from caravan_llm.router.settings import RouterSettings  # noqa: E402
from caravan_llm.scheduler.model_store import ModelStore  # noqa: E402
from caravan_llm.scheduler.profiles import ModelProfile, load_profile  # noqa: E402

CPU_NODES = 4
GPU_NODES = 3
GPUS_PER_NODE = 2
NODE_TMPFS = "256m"
NODE_TMPFS_BYTES = 256 * 1024 * 1024
NETEM = ("delay", "200ms", "50ms")
IN_FLIGHT_CAP = 1000
# The load balancer's health check interval, and how long a router is out of
# it before its restart (Nomad's shutdown_delay; the router jobspec's is 15 s).
HEALTH_INTERVAL_S = 1.0
ROUTER_DRAIN_S = 5.0
REQUEST_TIMEOUT_S = 180.0
CAPACITY_CLIENTS = (1, 2, 4, 8, 16, 32)
# The warm-up's saturation: requests sent at once to one router per model, past its
# admission queue's bound (the router's default QUEUE_MAX_PER_MODEL) by this many.
SATURATION_EXTRA = 128
# The demo stack's scheduler timings (caravan_llm/cli/local_stack.py StackOptions).
SCHEDULER_ENV = {
    "CARAVAN_SCHEDULER_RESYNC_S": "5",
    "CARAVAN_SCHEDULER_REPLACE_LOST_AFTER_S": "20",
    "CARAVAN_SCHEDULER_ORPHAN_CONFIRM_S": "3",
    "CARAVAN_SCHEDULER_REQUEUE_S": "1",
    "CARAVAN_SCHEDULER_LEADER_TTL_S": "10",
    "CARAVAN_SCHEDULER_LEADER_LOCK_DELAY_S": "1",
}
TRACEBACK = re.compile(r"Traceback \(most recent call last\)")


def say(line: str = "") -> None:
    print(line, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- caravan processes -------------------------------------------------------------------------


class Managed:
    """One caravan process by name, through its restarts (each an incarnation, logged apart)."""

    def __init__(
        self, name: str, command: list[str], pattern: str, env: dict[str, str], logs: Path
    ) -> None:
        self.name = name
        self.command = command
        self.pattern = pattern
        self.env = env
        self.logs = logs
        self.incarnation = -1
        self.proc: Proc | None = None
        self._exit: contextlib.ExitStack | None = None

    @property
    def pid(self) -> int | None:
        if self.proc is None or self.proc.process.poll() is not None:
            return None
        return self.proc.process.pid

    def log_files(self) -> list[Path]:
        return sorted(self.logs.glob(f"{self.name}-*.log"))

    async def start(self) -> None:
        self.incarnation += 1
        exit_stack = contextlib.ExitStack()
        log = self.logs / f"{self.name}-{self.incarnation}.log"
        self.proc, _ = await asyncio.to_thread(
            exit_stack.enter_context,
            started(self.command, self.pattern, self.env, new_session=True, log_path=log),
        )
        self._exit = exit_stack

    async def stop(self) -> None:
        """SIGTERM (its whole group), SIGKILL after 10 s."""
        exit_stack, self._exit = self._exit, None
        if exit_stack is not None:
            await asyncio.to_thread(exit_stack.close)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL its process group now (a crash); `stop` then only reaps it."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.process.pid, signal.SIGKILL)


def proc_stats(pid: int | None) -> tuple[float | None, float | None]:
    """RSS bytes and open descriptors of a live process, from /proc (None when gone)."""
    if pid is None:
        return None, None
    rss = None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = float(line.split()[1]) * 1024
        fds = float(sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return None, None
    return rss, fds


def metric_value(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            with contextlib.suppress(ValueError):
                return float(line.rsplit(" ", 1)[1])
    return None


# -- availability of the faults that need the kernel's help ------------------------------------


async def run_command(*argv: str) -> tuple[int, str]:
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    except OSError as exc:
        return 127, str(exc)
    out, _ = await process.communicate()
    return int(process.returncode or 0), out.decode(errors="replace").strip()


async def netem_unavailable() -> str | None:
    """Why `tc netem` on loopback cannot be used here, or None when it can.

    Probes by installing, on lo, a prio qdisc that keeps every packet in its
    first band and a netem qdisc on its last band (no filter, so no packet is
    delayed), then removing both. Refuses to touch a loopback that already
    has a qdisc of its own (another user's).
    """
    if shutil.which("tc") is None:
        return "no `tc` command"
    code, out = await run_command("tc", "qdisc", "show", "dev", "lo")
    if code != 0:
        return f"tc qdisc show failed: {out}"
    if out and not out.startswith("qdisc noqueue"):
        return f"loopback already has a qdisc, left alone: {out.splitlines()[0]}"
    code, out = await run_command(*PRIO_ADD)
    if code != 0:
        return f"tc cannot add a prio qdisc on lo: {out}"
    code, out = await run_command(*NETEM_ADD)
    await run_command(*PRIO_DEL)
    if code != 0:
        return f"tc cannot add a netem qdisc: {out}"
    return None


PRIO_ADD = (
    "tc",
    "qdisc",
    "add",
    "dev",
    "lo",
    "root",
    "handle",
    "1:",
    "prio",
    "bands",
    "4",
    "priomap",
    *(["0"] * 16),
)
NETEM_ADD = ("tc", "qdisc", "add", "dev", "lo", "parent", "1:4", "handle", "40:", "netem", *NETEM)
PRIO_DEL = ("tc", "qdisc", "del", "dev", "lo", "root", "handle", "1:")


def netem_filters(address: str, port: int) -> list[tuple[str, ...]]:
    """u32 filters sending the packets to and from address:port to the netem band."""
    base = (
        "tc",
        "filter",
        "add",
        "dev",
        "lo",
        "parent",
        "1:0",
        "protocol",
        "ip",
        "prio",
        "1",
        "u32",
    )
    return [
        (
            *base,
            "match",
            "ip",
            "dst",
            f"{address}/32",
            "match",
            "ip",
            "dport",
            str(port),
            "0xffff",
            "flowid",
            "1:4",
        ),
        (
            *base,
            "match",
            "ip",
            "src",
            f"{address}/32",
            "match",
            "ip",
            "sport",
            str(port),
            "0xffff",
            "flowid",
            "1:4",
        ),
    ]


async def mount_node_folders(nomad_dir: Path, nodes: int) -> tuple[list[Path], str | None]:
    """A small tmpfs for each node's folder (before devcluster creates them); why not, if not."""
    mounted: list[Path] = []
    for number in range(1, nodes + 1):
        folder = nomad_dir / f"node-{number}"
        folder.mkdir(parents=True, exist_ok=True)
        code, out = await run_command(
            "mount", "-t", "tmpfs", "-o", f"size={NODE_TMPFS}", "tmpfs", str(folder)
        )
        if code != 0:
            await unmount(mounted)
            return [], f"cannot mount a tmpfs for a node's folder: {out or code}"
        mounted.append(folder)
    return mounted, None


async def unmount(folders: list[Path]) -> None:
    for folder in folders:
        await run_command("umount", "-l", str(folder))


def fill(folder: Path, *, limit_bytes: int = NODE_TMPFS_BYTES) -> Path:
    """A file taking every free byte of `folder`'s file system, the soak's own tmpfs; its path.

    Refuses (RuntimeError) a file system larger than `limit_bytes`: once a
    node's tmpfs is gone (unmounted at the end of a run, or never mounted),
    the folder is on the machine's own disk, which must never be filled.
    """
    stats = os.statvfs(folder)
    size = stats.f_blocks * stats.f_frsize
    if size > limit_bytes:
        msg = f"{folder} is not on a node tmpfs of {NODE_TMPFS} ({size} bytes): not filled"
        raise RuntimeError(msg)
    filler = folder / ".soak-filler"
    try:
        # Unbuffered: a write past the end fails in the loop below, where it is expected,
        # never in a flush on close (a run once reported a filled folder as not filled).
        with filler.open("wb", buffering=0) as out:
            free = stats.f_bavail * stats.f_frsize
            if free > 0:
                with contextlib.suppress(OSError):
                    os.posix_fallocate(out.fileno(), 0, free)
            chunk = b"\0" * 65536
            written = 0
            with contextlib.suppress(OSError):
                while written <= size:
                    written += out.write(chunk) or len(chunk)
    except BaseException:
        # Not injected: nothing left behind, since no undo frees it.
        filler.unlink(missing_ok=True)
        raise
    return filler


# -- the load ----------------------------------------------------------------------------------


def chat_body(model: str, name: str, max_tokens: int, *, stream: bool) -> dict[str, Any]:
    """The chat request every soak client sends, named in its prompt."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"{name}: tell a story"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


@dataclass
class Load:
    """Requests to the routers; every outcome is a RequestRecord."""

    routers: list[Managed]
    ports: dict[str, int]
    key: str
    max_tokens: int
    stream_fraction: float
    t0: float
    session: aiohttp.ClientSession
    # How the balancer in front of the routers picks (bench.soak_plan.BALANCERS).
    balancer: str = "least-request"
    records: list[RequestRecord] = field(default_factory=list)
    in_flight: int = 0
    router_failovers: int = 0
    # Successful answers without any text (the tiny GGUF model may sample its end at once).
    empty_answers: int = 0
    # The load balancer's view (health_checks): routers it sends to, routers drained.
    in_rotation: set[str] = field(default_factory=set)
    draining: set[str] = field(default_factory=set)
    # Requests sent to each router and not yet answered (least-request reads them).
    outstanding: dict[str, int] = field(default_factory=dict)
    _turn: int = 0
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def router_order(self) -> list[str]:
        """The routers in balancing order (`balance_order`): those in rotation (all if none is)."""
        self._turn += 1
        names = [r.name for r in self.routers if r.name in self.in_rotation] or [
            r.name for r in self.routers
        ]
        return balance_order(names, self.outstanding, self._turn, self.balancer)

    async def health_checks(self) -> None:
        """As a load balancer in front of the routers does: every HEALTH_INTERVAL_S, a
        router is in rotation when its /health answers 200 (discovery synced) and it is
        not being drained (taken out before a restart, as Nomad's shutdown_delay does)."""
        while True:
            healthy = set()
            for router in self.routers:
                if router.name in self.draining:
                    continue
                url = f"http://127.0.0.1:{self.ports[router.name]}/health"
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with self.session.get(
                        url, timeout=aiohttp.ClientTimeout(total=HEALTH_INTERVAL_S)
                    ) as response:
                        if response.status == 200:
                            healthy.add(router.name)
            self.in_rotation = healthy - self.draining
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def one(self, model: str, stream: bool, number: int) -> RequestRecord:
        body = chat_body(model, f"soak request {number}", self.max_tokens, stream=stream)
        request_id = f"soak-{number}"
        headers = {"Authorization": f"Bearer {self.key}", "x-request-id": request_id}
        start = time.monotonic()
        ttft: float | None = None
        cause: str | None = None
        routers = self.router_order()
        router = routers[0]
        for attempt, router in enumerate(routers):
            url = f"http://127.0.0.1:{self.ports[router]}/v1/chat/completions"
            self.outstanding[router] = self.outstanding.get(router, 0) + 1
            try:
                async with self.session.post(url, json=body, headers=headers) as response:
                    if response.status != 200:
                        raw = await response.read()
                        try:
                            decoded = json.loads(raw)
                        except ValueError:
                            decoded = None
                        cause = classify_failure(status=response.status, body=decoded)
                    elif stream:
                        ttft, cause = await self._read_stream(response, start)
                    else:
                        answer = await response.json()
                        choices = answer.get("choices") or [{}]
                        # An empty text is an answer (a tiny model may end at once);
                        # no finish_reason is not.
                        if not (choices[0].get("message") or {}).get("content"):
                            self.empty_answers += 1
                        finished = bool(choices[0].get("finish_reason"))
                        cause = None if finished else classify_failure(status=200, unfinished=True)
                break
            except aiohttp.ClientConnectorError as exc:
                # Never reached a router (one restarting): the next one, as a balancer would.
                if attempt + 1 < len(routers):
                    self.router_failovers += 1
                    continue
                cause = classify_failure(
                    status=None, exception=f"{type(exc).__name__} (every router)"
                )
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                name = type(exc).__name__
                if type(exc) is TimeoutError:
                    # aiohttp's connect timeout is its own class; a bare one is the total.
                    name = f"TimeoutError (no whole answer within {REQUEST_TIMEOUT_S:.0f} s)"
                cause = classify_failure(status=None, exception=name)
                break
            finally:
                self.outstanding[router] -= 1
        end = time.monotonic()
        return RequestRecord(
            model,
            stream,
            round(start - self.t0, 4),
            round(end - self.t0, 4),
            None if ttft is None else round(ttft, 4),
            cause,
            None if cause is None else request_id,
            None if cause is None else router,
        )

    async def _read_stream(
        self, response: aiohttp.ClientResponse, start: float
    ) -> tuple[float | None, str | None]:
        ttft = None
        done = False
        finished = False
        text = []
        async for raw in response.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if ttft is None:
                ttft = time.monotonic() - start
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                return ttft, classify_failure(status=200, stream_error=event["error"])
            for choice in event.get("choices") or ():
                text.append((choice.get("delta") or {}).get("content") or "")
                finished = finished or bool(choice.get("finish_reason"))
        if not done:
            return ttft, classify_failure(status=200, done=False)
        if not finished:
            return ttft, classify_failure(status=200, unfinished=True)
        if not "".join(text):
            self.empty_answers += 1
        return ttft, None

    async def record_one(self, model: str, stream: bool, number: int) -> None:
        self.in_flight += 1
        try:
            self.records.append(await self.one(model, stream, number))
        finally:
            self.in_flight -= 1

    def fire(self, model: str, stream: bool, number: int) -> None:
        if self.in_flight >= IN_FLIGHT_CAP:
            now = round(time.monotonic() - self.t0, 4)
            cause = f"client overload ({IN_FLIGHT_CAP} in flight)"
            self.records.append(RequestRecord(model, stream, now, now, None, cause))
            return
        task = asyncio.create_task(self.record_one(model, stream, number))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def open_loop(self, model: str, rate: float, until: float, rng: random.Random) -> None:
        """Poisson arrivals at `rate` per second until the monotonic time `until`."""
        number = 0
        next_at = time.monotonic() + rng.expovariate(rate)
        while next_at < until:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            self.fire(model, rng.random() < self.stream_fraction, number)
            number += 1
            next_at += rng.expovariate(rate)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=REQUEST_TIMEOUT_S)


async def measure_capacity(
    load: Load, models: list[str], step_s: float, rng: random.Random
) -> dict[str, float]:
    """Each model's best throughput (successful requests/s) under a closed loop that doubles its
    clients each step, both models loaded together; a model stops at a gain under 10%."""
    best: dict[str, float] = dict.fromkeys(models, 0.0)
    growing = set(models)
    for clients in CAPACITY_CLIENTS:
        if not growing:
            break
        load.records = []
        stop_at = time.monotonic() + step_s

        async def client(model: str, number: int, stop_at: float = stop_at) -> None:
            turn = 0
            while time.monotonic() < stop_at:
                await load.record_one(
                    model, rng.random() < load.stream_fraction, number * 10000 + turn
                )
                turn += 1

        await asyncio.gather(*(client(m, n) for m in growing for n in range(clients)))
        counted = [r for r in load.records if r.end_s <= stop_at - load.t0]
        line = []
        for model in sorted(growing):
            ok = sum(1 for r in counted if r.model == model and not r.failed)
            failed = sum(1 for r in counted if r.model == model and r.failed)
            rate = ok / step_s
            line.append(f"{model} {rate:.1f}/s" + (f" ({failed} failed)" if failed else ""))
            causes = sorted({r.cause for r in counted if r.model == model and r.cause})
            if causes:
                line.append(f"[{'; '.join(causes)}]")
            if rate < best[model] * 1.1 or failed:
                growing.discard(model)
            best[model] = max(best[model], rate)
        say(f"  {clients:>2} clients per model: " + ", ".join(line))
    load.records = []
    return best


@dataclass(frozen=True, slots=True)
class Saturation:
    """One router's warm-up saturation: RSS before and after, what each model's burst got."""

    router: str
    rss_before_bytes: float | None
    rss_after_bytes: float | None
    deepest_queue: dict[str, float]
    statuses: dict[str, dict[str, int]]

    @property
    def filled(self) -> bool:
        """Every model's queue reached its bound (some of its burst refused as queue_full)."""
        return all(counts.get("429 queue_full", 0) > 0 for counts in self.statuses.values())


async def saturate_queues(
    load: Load, models: list[str], *, queue_max: int, max_tokens: int, metrics_token: str
) -> list[Saturation]:
    """Fill each router's admission queue of each model to its bound, once, before the load.

    A queued request holds about 17-19 KiB (its connection, parser, parsed
    body, handler task and queue entry: docs/benchmarks.md "Bursts of held
    requests"), and CPython keeps that memory after the burst (an arena goes
    back only when every object in it is gone), so a router's RSS steps up
    once, the first time its queue fills, and stays there. Filling each
    queue during warm-up puts that step before the judged window, which then
    shows growth past the process's bounded high water: a leak, not the
    timing of its first overload (attempt 8: the first full queue came at
    minute 26 and the line failed; attempt 7: at minute 3 and it passed).
    The interpreter's blocks (`caravan_process_python_blocks`) are judged
    too, since the memory freed after this burst is reused before RSS grows.
    """
    rows = []
    for router in load.routers:
        port = load.ports[router.name]
        before = proc_stats(router.pid)[0]
        deepest = dict.fromkeys(models, 0.0)
        statuses: dict[str, dict[str, int]] = {m: {} for m in models}
        watcher = asyncio.create_task(_deepest_queues(load.session, port, metrics_token, deepest))
        try:
            # One model at a time: a router's high water is one full queue (the soak's
            # faults fill one model's at a time), not every model's at once.
            for model in models:
                labels = await asyncio.gather(
                    *(
                        _saturating_request(load, port, model, number, max_tokens)
                        for number in range(queue_max + SATURATION_EXTRA)
                    )
                )
                for label in labels:
                    statuses[model][label] = statuses[model].get(label, 0) + 1
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        row = Saturation(router.name, before, proc_stats(router.pid)[0], deepest, statuses)
        rows.append(row)
        say(
            f"  {router.name}: RSS {_num(before, 2**20)} -> "
            f"{_num(row.rss_after_bytes, 2**20)} MiB; "
            + "; ".join(
                f"{m}: deepest queue {deepest[m]:.0f}, "
                + ", ".join(f"{k} x{v}" for k, v in sorted(statuses[m].items()))
                for m in models
            )
            + ("" if row.filled else "  (NOT FILLED)")
        )
    return rows


async def _saturating_request(
    load: Load, port: int, model: str, number: int, max_tokens: int
) -> str:
    """One request of a saturating burst: its status, with the error code if any."""
    body = chat_body(model, f"saturation {number}", max_tokens, stream=False)
    headers = {"Authorization": f"Bearer {load.key}"}
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        async with load.session.post(url, json=body, headers=headers) as response:
            raw = await response.read()
            label = str(response.status)
            if response.status != 200:
                with contextlib.suppress(ValueError, LookupError, TypeError):
                    label += " " + str(json.loads(raw)["error"]["code"])
    except (aiohttp.ClientError, TimeoutError) as exc:
        label = type(exc).__name__
    return label


async def _deepest_queues(
    session: aiohttp.ClientSession, port: int, token: str, deepest: dict[str, float]
) -> None:
    """Keep `deepest` at the deepest admission queue the router's /metrics showed per model."""
    while True:
        text = await scrape(session, port, token) or ""
        for model, seen in deepest.items():
            depth = metric_value(text, f'caravan_router_queue_depth{{model="{model}"}}')
            if depth is not None:
                deepest[model] = max(seen, depth)
        await asyncio.sleep(0.2)


async def scrape(session: aiohttp.ClientSession, port: int, token: str) -> str | None:
    """A caravan process's /metrics text; None when it did not answer 200 within 2 s."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with session.get(
            f"http://127.0.0.1:{port}/metrics",
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=2),
        ) as response:
            if response.status == 200:
                return await response.text()
    return None


# -- the faults --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FaultEvent:
    index: int
    kind: str
    at_s: float
    target: str | None
    planned_s: float
    lasted_s: float | None
    note: str

    @property
    def injected(self) -> bool:
        return self.lasted_s is not None


Undo = Callable[[], Awaitable[None]]


class Faults:
    """Makes each fault on the running stack and undoes it."""

    def __init__(
        self,
        stack: LocalStack,
        *,
        schedulers: list[Managed],
        scheduler_ports: dict[str, int],
        routers: list[Managed],
        session: aiohttp.ClientSession,
        mounted: list[Path],
        load: Load,
    ) -> None:
        self.load = load
        self.stack = stack
        self.schedulers = schedulers
        self.scheduler_ports = scheduler_ports
        self.routers = routers
        self.session = session
        self.mounted = mounted
        self.pending: list[Undo] = []

    def running_allocs(self) -> dict[str, tuple[str, str]]:
        """Running caravan allocations: alloc id -> (node id, node name)."""
        found = {}
        for node_id, client in self.stack.cluster.nomad.clients.items():
            if client.killed:
                continue
            for alloc_id, runner in client.runners.items():
                if runner.dead or not runner.alloc.job_id.startswith("caravan-"):
                    continue
                if all(t.state.state == "running" for t in runner.tasks.values()):
                    found[alloc_id] = (node_id, client.node.name)
        return found

    async def inject(self, fault: PlannedFault) -> tuple[str | None, Undo | None]:
        """Make the fault; its target and how to undo it (None: nothing to undo)."""
        maker: Callable[[float], Awaitable[tuple[str | None, Undo | None]]] = getattr(
            self, f"_{fault.kind}"
        )
        return await maker(fault.pick)

    async def _node_kill(self, pick: float) -> tuple[str | None, Undo | None]:
        nodes = {name: node_id for node_id, name in self.running_allocs().values()}
        name = pick_target(list(nodes), pick)
        if name is None:
            return None, None
        nomad = self.stack.cluster.nomad
        await nomad.kill_node(nodes[name])

        async def power_on() -> None:
            await nomad.restart_node(nodes[name])

        return name, power_on

    async def _alloc_crash(self, pick: float) -> tuple[str | None, Undo | None]:
        allocs = self.running_allocs()
        alloc = pick_target(list(allocs), pick)
        if alloc is None:
            return None, None
        self.stack.cluster.nomad.crash_alloc(alloc)
        return f"{alloc[:8]} on {allocs[alloc][1]}", None

    async def _leader_kill(self, pick: float) -> tuple[str | None, Undo | None]:
        del pick
        leader = None
        for managed in self.schedulers:
            port = self.scheduler_ports[managed.name]
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with self.session.get(
                    f"http://127.0.0.1:{port}/health", timeout=aiohttp.ClientTimeout(total=2)
                ) as response:
                    if (await response.json()).get("leader"):
                        leader = managed
        if leader is None:
            return None, None
        leader.kill()
        await leader.stop()

        async def start_again() -> None:
            await leader.start()

        return leader.name, start_again

    async def _consul_down(self, pick: float) -> tuple[str | None, Undo | None]:
        del pick
        consul = self.stack.cluster.consul
        await consul.stop_http()
        return "consul", consul.start_http

    async def _nomad_down(self, pick: float) -> tuple[str | None, Undo | None]:
        del pick
        nomad = self.stack.cluster.nomad
        nomad.outage = True

        async def back() -> None:
            nomad.outage = False

        return "nomad", back

    async def _router_restart(self, pick: float) -> tuple[str | None, Undo | None]:
        name = pick_target([r.name for r in self.routers], pick)
        router = next(r for r in self.routers if r.name == name)
        # As a Nomad rollout does: out of the balancer first (service deregistered,
        # shutdown_delay), then SIGTERM (in-flight requests finish), then a new one,
        # which the balancer takes back once its /health passes.
        self.load.draining.add(router.name)
        self.load.in_rotation.discard(router.name)
        try:
            await asyncio.sleep(ROUTER_DRAIN_S)
            await router.stop()
            await router.start()
        finally:
            self.load.draining.discard(router.name)
        return router.name, None

    async def _engine_freeze(self, pick: float) -> tuple[str | None, Undo | None]:
        allocs = self.running_allocs()
        alloc = pick_target(list(allocs), pick)
        if alloc is None:
            return None, None
        nomad = self.stack.cluster.nomad
        pids = nomad.signal_alloc(alloc, signal.SIGSTOP)

        async def thaw() -> None:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(os.getpgid(pid), signal.SIGCONT)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

        return f"{alloc[:8]} on {allocs[alloc][1]}", thaw

    async def _netem(self, pick: float) -> tuple[str | None, Undo | None]:
        endpoints: dict[str, tuple[str, int]] = {}
        consul = self.stack.scheduler.consul
        for model in ("tiny-chat", "qwen2-5-7b"):
            _, entries = await consul.health_service(model_service_name(model), passing=True)
            for entry in entries:
                endpoints[entry.service_id] = (entry.address, entry.port)
        chosen = pick_target(list(endpoints), pick)
        if chosen is None:
            return None, None
        address, port = endpoints[chosen]
        for command in (PRIO_ADD, NETEM_ADD, *netem_filters(address, port)):
            code, out = await run_command(*command)
            if code != 0:
                await run_command(*PRIO_DEL)
                raise RuntimeError(f"{' '.join(command[:4])}: {out}")

        async def remove() -> None:
            await run_command(*PRIO_DEL)

        return f"{address}:{port} ({' '.join(NETEM)})", remove

    async def _disk_full(self, pick: float) -> tuple[str | None, Undo | None]:
        allocs = self.running_allocs()
        alloc = pick_target(list(allocs), pick)
        if alloc is None:
            return None, None
        node = allocs[alloc][1]
        logs = self.stack.cluster.nomad.data_dir / node / "alloc" / alloc / "alloc" / "logs"
        filler = await asyncio.to_thread(fill, logs)

        async def free() -> None:
            filler.unlink(missing_ok=True)

        return f"{alloc[:8]} on {node} ({logs.name}/ full)", free

    async def undo_all(self) -> None:
        while self.pending:
            undo = self.pending.pop()
            with contextlib.suppress(Exception):
                await undo()


def skipped(fault: PlannedFault, at: float, note: str) -> FaultEvent:
    """The timeline's entry for a fault that was not injected, and why."""
    return FaultEvent(fault.index, fault.kind, round(at, 2), None, fault.duration_s, None, note)


async def run_faults(
    plan: tuple[PlannedFault, ...],
    faults: Faults,
    unavailable: dict[str, str],
    t0: float,
    events: list[FaultEvent],
) -> None:
    for fault in plan:
        await asyncio.sleep(max(0.0, t0 + fault.at_s - time.monotonic()))
        at = time.monotonic() - t0
        if fault.kind in unavailable:
            events.append(skipped(fault, at, "unavailable: " + unavailable[fault.kind]))
            say(f"  [{at:7.1f}s] {fault.kind}: unavailable, skipped")
            continue
        try:
            target, undo = await faults.inject(fault)
        except Exception as exc:
            events.append(skipped(fault, at, f"not injected: {type(exc).__name__}: {exc}"))
            say(f"  [{at:7.1f}s] {fault.kind}: not injected ({exc})")
            continue
        if target is None:
            events.append(skipped(fault, at, "no target"))
            say(f"  [{at:7.1f}s] {fault.kind}: no target, skipped")
            continue
        say(f"  [{at:7.1f}s] {fault.kind} -> {target}")
        note = ""
        if undo is not None:
            faults.pending.append(undo)
            await asyncio.sleep(max(0.0, t0 + fault.at_s + fault.duration_s - time.monotonic()))
            faults.pending.remove(undo)
            try:
                await undo()
            except Exception as exc:
                note = f"undo failed: {type(exc).__name__}: {exc}"
                say(f"  [{time.monotonic() - t0:7.1f}s] {fault.kind}: {note}")
        lasted = time.monotonic() - t0 - at
        events.append(
            FaultEvent(
                fault.index,
                fault.kind,
                round(at, 2),
                target,
                fault.duration_s,
                round(lasted, 2),
                note,
            )
        )


# -- sampling ----------------------------------------------------------------------------------


async def sample_forever(
    stack: LocalStack,
    *,
    models: dict[str, str],
    processes: list[Managed],
    ports: dict[str, int],
    token: str,
    session: aiohttp.ClientSession,
    t0: float,
    interval_s: float,
    ready: list[ReadySample],
    samples: list[ProcessSample],
) -> None:
    consul = stack.scheduler.consul
    while True:
        at = round(time.monotonic() - t0, 2)
        for served, profile_name in models.items():
            try:
                async with asyncio.timeout(3):
                    _, entries = await consul.health_service(
                        model_service_name(profile_name), passing=True
                    )
                count: int | None = len(entries)
            except Exception:
                count = None
            ready.append(ReadySample(at, served, count))
        for managed in processes:
            rss, fds = proc_stats(managed.pid)
            text = None
            if managed.pid is not None:
                text = await scrape(session, ports[managed.name], token)
            tasks = metric_value(text or "", ASYNCIO_TASKS)
            blocks = metric_value(text or "", PYTHON_BLOCKS)
            samples.append(
                ProcessSample(at, managed.name, managed.incarnation, rss, fds, tasks, blocks)
            )
        await asyncio.sleep(max(0.0, t0 + at + interval_s - time.monotonic()))


# -- the run -----------------------------------------------------------------------------------


def soak_profiles() -> list[ModelProfile]:
    """The demo's two example models with 2 replicas each, fixed (no autoscaling)."""
    tiny = load_profile(example_profiles_dir() / "tiny-llamacpp-cpu.yaml")
    qwen = load_profile(example_profiles_dir() / "qwen-vllm-h100.yaml")
    fixed = {"min": 2, "max": 2, "initial": 2}
    return [
        tiny.model_copy(update={"replicas": tiny.replicas.model_copy(update=fixed)}),
        qwen.model_copy(
            update={"replicas": qwen.replicas.model_copy(update=fixed), "max_concurrency": 2}
        ),
    ]


@dataclass
class Outcome:
    config: dict[str, Any]
    capacity: dict[str, float]
    rates: dict[str, float]
    unavailable: dict[str, str]
    events: list[FaultEvent]
    records: list[RequestRecord]
    ready: list[ReadySample]
    samples: list[ProcessSample]
    run_s: float
    router_failovers: int
    empty_answers: int
    tracebacks: dict[str, int]
    engine: str
    saturation: list[Saturation] = field(default_factory=list)


async def soak(args: argparse.Namespace) -> Outcome:
    # SIGINT and SIGTERM end the run with its cleanup (every process stopped, the node
    # folders unmounted): a run started in the background (`nohup ... &`) ignores SIGINT,
    # and SIGTERM's default ends the process at once, leaving all of it behind.
    main_task = asyncio.current_task()
    assert main_task is not None
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, main_task.cancel)
    run_s = args.minutes * 60
    kinds = args.faults
    work = Path(tempfile.mkdtemp(prefix="caravan-soak-"))
    logs = work / "logs"
    logs.mkdir()
    say(f"work folder: {work} ({'kept' if args.keep_work else 'deleted at the end'})")
    unavailable: dict[str, str] = {}
    if "netem" in kinds:
        reason = await netem_unavailable()
        if reason is not None:
            unavailable["netem"] = reason
    mounted: list[Path] = []
    if "disk_full" in kinds:
        mounted, reason = await mount_node_folders(work / "nomad", CPU_NODES + GPU_NODES)
        if reason is not None:
            unavailable["disk_full"] = reason
    for kind, reason in sorted(unavailable.items()):
        say(f"fault {kind}: unavailable on this machine ({reason})")
    # The timeline is drawn from the faults this machine can make.
    plan = plan_faults(
        args.seed, run_s, args.fault_interval, [k for k in kinds if k not in unavailable]
    )
    try:
        return await _soak(
            args,
            run_s=run_s,
            plan=plan,
            work=work,
            logs=logs,
            unavailable=unavailable,
            mounted=mounted,
        )
    finally:
        await unmount(mounted)
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)


async def _soak(
    args: argparse.Namespace,
    *,
    run_s: float,
    plan: tuple[PlannedFault, ...],
    work: Path,
    logs: Path,
    unavailable: dict[str, str],
    mounted: list[Path],
) -> Outcome:
    options = StackOptions(
        work_dir=work,
        cpu_nodes=CPU_NODES,
        gpu_nodes=GPU_NODES,
        gpus_per_node=GPUS_PER_NODE,
        prefer_real_llama_server=not args.simulated_llama,
        autoscale=False,
        run_scheduler=False,
    )
    say(f"starting devcluster: {CPU_NODES} CPU nodes, {GPU_NODES} GPU nodes x {GPUS_PER_NODE} GPUs")
    async with local_stack(options) as stack:
        say(f"llama.cpp replicas run {stack.engine.description}")
        token = stack.scheduler_api_token or ""
        config_file = work / "cluster-config.yaml"
        config_file.write_text(
            yaml.safe_dump(stack.config.model_dump(mode="json", exclude_none=True))
        )
        base_env = {**stack.env, "PYTHONUNBUFFERED": "1"}
        scheduler_ports = {name: free_port() for name in ("scheduler-a", "scheduler-b")}
        schedulers = [
            Managed(
                name,
                [
                    sys.executable,
                    "-m",
                    "caravan_llm.cli",
                    "scheduler",
                    "--http-port",
                    str(port),
                    "--cluster-config",
                    str(config_file),
                    "--no-autoscale",
                ],
                r"caravan scheduler listening on",
                {
                    **base_env,
                    **SCHEDULER_ENV,
                    "CARAVAN_SCHEDULER_API_TOKENS": token,
                    "CARAVAN_SCHEDULER_LOG_LEVEL": args.scheduler_log_level,
                },
                logs,
            )
            for name, port in scheduler_ports.items()
        ]
        key = new_secret()
        router_ports = {name: free_port() for name in ("router-a", "router-b")}
        routers = [
            Managed(
                name,
                [sys.executable, "-m", "caravan_llm.cli", "router", "--port", str(port)],
                r"caravan router listening on",
                {
                    **base_env,
                    "CARAVAN_ROUTER_API_KEYS": key,
                    "CARAVAN_ROUTER_LOG_LEVEL": args.router_log_level,
                },
                logs,
            )
            for name, port in router_ports.items()
        ]
        everything = [*schedulers, *routers]
        ports = {**scheduler_ports, **router_ports}
        try:
            for managed in everything:
                await managed.start()
            say("schedulers: " + ", ".join(f"{n} :{p}" for n, p in scheduler_ports.items()))
            say("routers: " + ", ".join(f"{n} :{p}" for n, p in router_ports.items()))
            profiles = soak_profiles()
            await ModelStore(stack.scheduler.consul, KVLayout()).submit(
                [local_profile(p, stack.engine) for p in profiles]
            )
            models = {p.served_name: p.name for p in profiles}
            await wait_ready(stack, models, args.ready_timeout)
            async with aiohttp.ClientSession(
                # No keep-alive: a restarting router's idle connections are not reused
                # half-closed (a race every HTTP client with keep-alive has).
                connector=aiohttp.TCPConnector(force_close=True, limit=0),
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, sock_connect=5),
            ) as session:
                await wait_routable(session, router_ports, key, list(models))
                rng = random.Random(args.seed)
                load = Load(
                    routers,
                    router_ports,
                    key,
                    args.max_tokens,
                    args.stream_fraction,
                    time.monotonic(),
                    session,
                    balancer=args.balancer,
                )
                balancer = asyncio.create_task(load.health_checks())
                await wait_in_rotation(load, len(routers))
                if args.capacity:
                    capacity = args.capacity
                    say(f"capacity given: {capacity}")
                else:
                    say(f"measuring capacity ({args.capacity_step_seconds:.0f}s per step):")
                    capacity = await measure_capacity(
                        load, list(models), args.capacity_step_seconds, rng
                    )
                saturation: list[Saturation] = []
                if args.saturate_queues:
                    # The soak's routers run with the default bound.
                    queue_max = int(RouterSettings.model_fields["queue_max_per_model"].default)
                    say(
                        f"saturating each router's admission queue of each model once, one "
                        f"model at a time ({queue_max} held, +{SATURATION_EXTRA} refused):"
                    )
                    saturation = await saturate_queues(
                        load,
                        list(models),
                        queue_max=queue_max,
                        max_tokens=args.max_tokens,
                        metrics_token=token,
                    )
                missing = sorted(set(models) - set(capacity))
                if missing:
                    raise SystemExit(f"--capacity lacks {missing}")
                rates = {m: round(capacity[m] * args.load_fraction, 3) for m in models}
                say(
                    f"load: {rates} requests/s ({args.load_fraction:.0%} of capacity), "
                    f"{args.stream_fraction:.0%} streaming, max_tokens {args.max_tokens}"
                )
                say(f"faults planned: {len(plan)} (seed {args.seed})")
                t0 = time.monotonic()
                load.t0 = t0
                load.records = []
                load.empty_answers = load.router_failovers = 0
                ready: list[ReadySample] = []
                samples: list[ProcessSample] = []
                events: list[FaultEvent] = []
                faults = Faults(
                    stack,
                    schedulers=schedulers,
                    scheduler_ports=scheduler_ports,
                    routers=routers,
                    session=session,
                    mounted=mounted,
                    load=load,
                )
                sampler = asyncio.create_task(
                    sample_forever(
                        stack,
                        models=models,
                        processes=everything,
                        ports=ports,
                        token=token,
                        session=session,
                        t0=t0,
                        interval_s=args.sample_interval,
                        ready=ready,
                        samples=samples,
                    )
                )
                fault_task = asyncio.create_task(run_faults(plan, faults, unavailable, t0, events))
                until = t0 + run_s
                try:
                    await asyncio.gather(
                        *(
                            load.open_loop(m, rates[m], until, random.Random(f"{args.seed}-{m}"))
                            for m in models
                        )
                    )
                    await load.drain()
                finally:
                    fault_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await fault_task
                    await faults.undo_all()
                    for task in (sampler, balancer):
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
                run_end = time.monotonic() - t0
                records = list(load.records)
        finally:
            for managed in everything:
                await managed.stop()
        tracebacks = {
            path.name: len(TRACEBACK.findall(path.read_text(errors="replace")))
            for managed in everything
            for path in managed.log_files()
        }
    return Outcome(
        config={
            "minutes": args.minutes,
            "warmup_minutes": args.warmup_minutes,
            "seed": args.seed,
            "router_log_level": args.router_log_level,
            "balancer": args.balancer,
            "scheduler_log_level": args.scheduler_log_level,
            "fault_interval_s": list(args.fault_interval),
            "faults": list(args.faults),
            "load_fraction": args.load_fraction,
            "stream_fraction": args.stream_fraction,
            "max_tokens": args.max_tokens,
            "sample_interval_s": args.sample_interval,
            "saturate_queues": args.saturate_queues,
            "cores": os.cpu_count(),
        },
        capacity=capacity,
        rates=rates,
        unavailable=unavailable,
        events=events,
        records=records,
        ready=ready,
        samples=samples,
        run_s=min(run_s, max(run_end, 1.0)),
        router_failovers=load.router_failovers,
        empty_answers=load.empty_answers,
        tracebacks=tracebacks,
        engine=stack.engine.description,
        saturation=saturation,
    )


async def wait_in_rotation(load: Load, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(load.in_rotation) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"routers in rotation after 60 s: {sorted(load.in_rotation)}")
        await asyncio.sleep(HEALTH_INTERVAL_S)


async def wait_ready(stack: LocalStack, models: dict[str, str], timeout_s: float) -> None:
    consul = stack.scheduler.consul
    deadline = time.monotonic() + timeout_s
    while True:
        counts = {}
        for profile_name in models.values():
            _, entries = await consul.health_service(model_service_name(profile_name), passing=True)
            counts[profile_name] = len(entries)
        if all(c >= 2 for c in counts.values()):
            say(f"replicas ready: {counts}")
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"replicas not ready after {timeout_s:.0f}s: {counts}")
        await asyncio.sleep(1)


async def wait_routable(
    session: aiohttp.ClientSession, ports: dict[str, int], key: str, models: list[str]
) -> None:
    deadline = time.monotonic() + 60
    for port in ports.values():
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with session.get(
                    f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}
                ) as response:
                    served = {m["id"] for m in (await response.json()).get("data", [])}
                    if set(models) <= served:
                        break
            if time.monotonic() > deadline:
                raise SystemExit(f"router :{port} does not serve {models}")
            await asyncio.sleep(0.5)


# -- the report --------------------------------------------------------------------------------


def report(outcome: Outcome, args: argparse.Namespace) -> dict[str, Any]:
    models = sorted(outcome.rates)
    injected = [e for e in outcome.events if e.injected]
    cut = periods(outcome.run_s, [(e.at_s, e.kind) for e in injected])
    rows = account_periods(cut, models, outcome.records, outcome.ready)
    minutes = minute_stats(outcome.records, models, outcome.run_s)
    warmup_s = args.warmup_minutes * 60
    min_window_s = max(60.0, 0.5 * (outcome.run_s - warmup_s))
    processes = judge_processes(outcome.samples, warmup_s, outcome.run_s, min_window_s)
    verdicts = list(judge(rows, processes))
    traceback_total = sum(outcome.tracebacks.values())
    verdicts_json = [asdict(v) for v in verdicts]
    verdicts_json.append(
        {
            "name": "no traceback in any caravan process's log",
            "passed": traceback_total == 0,
            "detail": {k: v for k, v in outcome.tracebacks.items() if v} or "none",
        }
    )
    failures: dict[str, int] = {}
    for r in outcome.records:
        if r.cause is not None:
            failures[r.cause] = failures.get(r.cause, 0) + 1

    if outcome.saturation:
        say("\n== warm-up saturation (each router's admission queues filled once before the load)")
        for row in outcome.saturation:
            say(
                f"  {row.router}: RSS {_num(row.rss_before_bytes, 2**20)} -> "
                f"{_num(row.rss_after_bytes, 2**20)} MiB, queues filled: "
                + ("yes" if row.filled else "NO")
                + "; deepest "
                + ", ".join(f"{m} {d:.0f}" for m, d in sorted(row.deepest_queue.items()))
            )
    say("\n== fault timeline")
    say(f"{'#':>3} {'at':>8} {'kind':<15} {'lasted':>7}  target / note")
    for e in outcome.events:
        lasted = "-" if e.lasted_s is None else f"{e.lasted_s:.1f}s"
        say(
            f"{e.index:>3} {e.at_s:>7.1f}s {e.kind:<15} {lasted:>7}  "
            f"{e.target or ''} {e.note}".rstrip()
        )
    say("\n== periods between faults (fewest ready replicas; requests; failures)")
    say(
        f"{'#':>3} {'from':>8} {'to':>8} {'fault':<15} " + " ".join(f"{m[:20]:>28}" for m in models)
    )
    for period in cut:
        cells = []
        for model in models:
            row = next(r for r in rows if r.period == period.index and r.model == model)
            ready = "?" if row.min_ready is None else str(row.min_ready)
            flag = "" if not row.failures else (" !" if row.replicated else " *")
            cells.append(f"ready {ready}, {row.requests} req, {row.failures} fail{flag}".rjust(28))
        fault = period.fault or "(start)"
        say(
            f"{period.index:>3} {period.start_s:>7.0f}s {period.end_s:>7.0f}s {fault:<15} "
            + " ".join(cells)
        )
    say("  (! failures with >= 2 ready replicas; * failures with fewer)")
    say("\n== failures by cause")
    if not failures:
        say("  none")
    for cause, count in sorted(failures.items(), key=lambda item: -item[1]):
        mark = "" if is_classified(cause) else "  (UNEXPLAINED)"
        say(f"  {count:>6}  {cause}{mark}")
    say(
        "  (connections refused by a restarting router, sent to the other: "
        f"{outcome.router_failovers})"
    )
    say(f"  (successful answers without text, not failures: {outcome.empty_answers})")
    say("\n== per minute")
    say(
        f"{'min':>3} {'model':<22} {'req':>5} {'fail':>4} {'ttft p50':>9} {'p99':>7} "
        f"{'e2e p50':>8} {'p99':>7} {'ready':>6}"
    )
    for stats in minutes:
        ready_values = [
            s.ready
            for s in outcome.ready
            if s.model == stats.model and int(s.at_s // 60) == stats.minute and s.ready is not None
        ]
        ready_text = f"{min(ready_values)}-{max(ready_values)}" if ready_values else "?"
        say(
            f"{stats.minute:>3} {stats.model[:22]:<22} {stats.requests:>5} {stats.failures:>4} "
            f"{_ms(stats.ttft_p50_s):>9} {_ms(stats.ttft_p99_s):>7} {_ms(stats.e2e_p50_s):>8} "
            f"{_ms(stats.e2e_p99_s):>7} {ready_text:>6}"
        )
    say("\n== caravan processes (per minute: RSS MiB / open fds / asyncio tasks; last sample)")
    names = sorted({s.process for s in outcome.samples})
    say(f"{'min':>3} " + " ".join(f"{n:>22}" for n in names))
    last_minute = max(0, math.ceil(outcome.run_s / 60) - 1)
    for minute in range(last_minute + 1):
        cells = []
        for name in names:
            inside = [
                s
                for s in outcome.samples
                if s.process == name and min(int(s.at_s // 60), last_minute) == minute
            ]
            if not inside:
                cells.append(f"{'-':>22}")
                continue
            s = inside[-1]
            cells.append(
                f"{_num(s.rss_bytes, 2**20)}/{_num(s.fds)}/{_num(s.tasks)}#{s.incarnation}".rjust(
                    22
                )
            )
        say(f"{minute:>3} " + " ".join(cells))
    say(
        f"\n== trends after warm-up ({args.warmup_minutes} min; windows under "
        f"{min_window_s:.0f}s are not judged)"
    )
    for p in processes:
        if not p.judged:
            say(f"  {p.process}#{p.incarnation}: not judged ({p.reason})")
            continue
        assert p.window is not None
        say(
            f"  {p.process}#{p.incarnation} {p.window[0]:.0f}-{p.window[1]:.0f}s: "
            f"RSS {_trend(p.rss, 2**20, 'MiB')}, fds {_trend(p.fds)}, tasks {_trend(p.tasks)}, "
            f"Python blocks {_trend(p.blocks)}"
        )
    say("\n== tracebacks in the processes' logs")
    say("  " + (", ".join(f"{k}: {v}" for k, v in outcome.tracebacks.items() if v) or "none"))
    if outcome.unavailable:
        say("\n== faults unavailable on this machine")
        for kind, reason in sorted(outcome.unavailable.items()):
            say(f"  {kind}: {reason}")
    say("\n== acceptance")
    for v in verdicts_json:
        state = {True: "PASS", False: "FAIL", None: "N/A "}[v["passed"]]
        say(f"  {state}  {v['name']}: {v['detail']}")
    return {
        "config": outcome.config,
        "engine": outcome.engine,
        "capacity_rps": outcome.capacity,
        "load_rps": outcome.rates,
        "run_s": round(outcome.run_s, 2),
        "requests": len(outcome.records),
        "failed": sum(1 for r in outcome.records if r.failed),
        "failures_by_cause": failures,
        # Each failed request (the first 5,000): model, stream, start, end, ttft, cause,
        # request id, router.
        "failed_requests": [asdict(r) for r in outcome.records if r.failed][:5000],
        "router_failovers": outcome.router_failovers,
        "empty_answers": outcome.empty_answers,
        "unavailable_faults": outcome.unavailable,
        "faults": [asdict(e) for e in outcome.events],
        "periods": [
            {
                **asdict(period),
                "models": {r.model: asdict(r) for r in rows if r.period == period.index},
            }
            for period in cut
        ],
        "minutes": [asdict(m) for m in minutes],
        "ready_samples": [asdict(s) for s in outcome.ready],
        "process_samples": [asdict(s) for s in outcome.samples],
        "process_trends": [asdict(p) for p in processes],
        "saturation": [{**asdict(r), "filled": r.filled} for r in outcome.saturation],
        "tracebacks": outcome.tracebacks,
        "acceptance": verdicts_json,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}ms"


def _num(value: float | None, unit: float = 1.0) -> str:
    return "?" if value is None else f"{value / unit:.0f}"


def _trend(line: Any, unit: float = 1.0, name: str = "") -> str:
    if line is None:
        return "n/a"
    relative = "" if line.relative is None else f" ({line.relative:+.1%})"
    return f"{line.first / unit:.1f}{name} {line.change / unit:+.2f}{relative}"


def parse_capacity(text: str) -> dict[str, float]:
    """'tiny-chat=3,qwen2.5-7b-instruct=10' -> requests/s per served model name."""
    capacity = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        try:
            capacity[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected MODEL=RPS[,MODEL=RPS], got {part!r}"
            ) from None
    return capacity


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )

    def ranged(text: str) -> tuple[float, float]:
        try:
            return parse_range(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    def kinds(text: str) -> tuple[str, ...]:
        try:
            return parse_faults(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parser.add_argument("--minutes", type=float, default=60.0, help="load duration (default 60)")
    parser.add_argument("--warmup-minutes", type=float, default=10.0, help="trends start here (10)")
    parser.add_argument("--seed", type=int, default=1, help="fault timeline and load draws (1)")
    parser.add_argument(
        "--fault-interval",
        type=ranged,
        default=(60.0, 180.0),
        help="seconds between faults, LOW-HIGH (60-180)",
    )
    parser.add_argument(
        "--faults",
        type=kinds,
        default=FAULT_KINDS,
        help=f"comma-separated subset of {','.join(FAULT_KINDS)} (all)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("soak.json"), help="the JSON report (soak.json)"
    )
    parser.add_argument(
        "--load-fraction", type=float, default=0.7, help="of measured capacity (0.7)"
    )
    parser.add_argument(
        "--stream-fraction", type=float, default=0.5, help="share of streaming requests (0.5)"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="per request (16)")
    parser.add_argument(
        "--capacity",
        type=parse_capacity,
        default=None,
        help="skip measuring: MODEL=RPS,MODEL=RPS (served names)",
    )
    parser.add_argument(
        "--capacity-step-seconds", type=float, default=10.0, help="per capacity step (10)"
    )
    parser.add_argument(
        "--sample-interval", type=float, default=5.0, help="seconds between samples (5)"
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=240.0, help="for the replicas at start (240 s)"
    )
    parser.add_argument(
        "--saturate-queues",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fill each router's admission queues to their bound once before the load, so the "
        "judged window starts above that high water (on)",
    )
    parser.add_argument(
        "--simulated-llama",
        action="store_true",
        help="the simulated llama.cpp even if the real one is built",
    )
    parser.add_argument(
        "--keep-work", action="store_true", help="keep the work folder (process and engine logs)"
    )
    parser.add_argument(
        "--balancer",
        default="least-request",
        choices=BALANCERS,
        help="how the balancer in front of the routers picks one (least-request: the fewest "
        "outstanding, as HAProxy's leastconn; round-robin)",
    )
    parser.add_argument(
        "--router-log-level",
        default="info",
        choices=("debug", "info", "warning"),
        help="info (default): a request line per request, the report's request ids findable",
    )
    parser.add_argument(
        "--scheduler-log-level",
        default="info",
        choices=("debug", "info", "warning"),
        help="info (default): each plan action with its reason (a replica moved apart, drained)",
    )
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if args.minutes <= 0 or not 0 < args.load_fraction <= 1 or not 0 <= args.stream_fraction <= 1:
        raise SystemExit(
            "--minutes must be > 0, --load-fraction in (0, 1], --stream-fraction in [0, 1]"
        )
    configure_logging("warning", "text", batch_lines=1)
    try:
        outcome = asyncio.run(soak(args))
    except asyncio.CancelledError:
        say("\nstopped by a signal: every process stopped, the node folders unmounted")
        return 130
    document = report(outcome, args)
    args.out.write_text(json.dumps(document, indent=1, default=str))
    say(f"\nJSON report: {args.out}")
    return 0 if all(v["passed"] is not False for v in document["acceptance"]) else 1


if __name__ == "__main__":
    sys.exit(main())
