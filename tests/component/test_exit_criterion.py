"""The seed's exit criterion, end to end: a node dies under four streaming clients.

devcluster (3 CPU nodes), the scheduler, a router, and a llama.cpp model with
3 replicas. While four clients stream chat completions without pause, the
node of one replica is killed. No request may fail: streams cut by the kill
are continued on a survivor; Nomad marks the node down and the allocation
lost, the replica is rebuilt on a surviving node, and from the moment Consul
reports the dead endpoint, the router sends it nothing new.

Failure detection runs through the real mechanisms at a real pace: Consul's
serf marks the node's agent failed after memberlist's default probe and
suspicion timeouts (seconds); Nomad marks the node down when the TTL it handed
the node plus `heartbeat_grace` (10 s, the default) has passed since the
node's last heartbeat. The one setting that differs from a default Nomad
server is `min_heartbeat_ttl`: 5 s, not 10 s (an operator's server option,
docs/nomad-consul-facts.md N22), so the node is down 10-20 s after the kill
rather than 10-30 s and the test stays under 30 s (issue 15). The defaults themselves
are covered by tests/contract/nomad/test_nomad_heartbeat_contract.py, and
`CARAVAN_EXIT_MIN_HEARTBEAT_TTL_S=10` runs this test on them. The test prints
the timeline it measured (`pytest -s`): kill -> Consul reports the endpoint
critical -> Nomad marks the node down -> the rebuilt replica passes, and the
streams each client completed.

Outcomes are recorded per client and asserted per client: every client's
every stream completed, and every client completed a stream after Consul
reported the dead endpoint (none was left stuck on it).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from polling import eventually

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_profile, local_stack
from caravan_llm.common.contract import (
    ENGINE_KEY_ITEM,
    KVLayout,
    engine_key_path,
    model_service_name,
)
from caravan_llm.router.settings import RouterSettings
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.profiles import load_profile

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 4
# Nomad's heartbeat_grace (the default) and this test's min_heartbeat_ttl (see above).
GRACE_S = 10.0
MIN_TTL_S = float(os.environ.get("CARAVAN_EXIT_MIN_HEARTBEAT_TTL_S", "5"))
# Each stream lasts about 2 s (100 tokens, 20 ms apart): always one to cut, and
# little to wait for once the clients stop.
STREAM_TOKENS = 100


@dataclass(frozen=True, slots=True)
class StreamOutcome:
    """One streamed completion of one client, as the client saw it."""

    client: int
    turn: int
    status: int
    done: bool
    errors: list[Any]
    text: str
    finished_at: float

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done and not self.errors and bool(self.text)


def read_stream(raw: bytes) -> tuple[str, bool, list[Any]]:
    """The text, whether `[DONE]` came, and any error events of an SSE body."""
    text, done, errors = [], False, []
    for line in raw.decode().splitlines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            errors.append(event["error"])
            continue
        text.extend(
            choice.get("delta", {}).get("content") or "" for choice in event.get("choices", [])
        )
    return "".join(text), done, errors


@pytest.mark.slow
async def test_four_streaming_clients_survive_a_node_kill(tmp_path: Path):
    """No request fails, the replica returns on a survivor, the dead endpoint gets nothing new."""
    lines: list[tuple[float, dict[str, Any]]] = []
    options = StackOptions(
        prefer_real_llama_server=False,
        gpu_nodes=0,
        autoscale=False,
        work_dir=tmp_path,
        resync_s=2.0,
        heartbeat_grace_s=GRACE_S,
        min_heartbeat_ttl_s=MIN_TTL_S,
        router=RouterSettings(port=0, scrape_interval_s=0.5, log_level="warning"),
        request_log=lambda line: lines.append((time.monotonic(), line)),
    )
    async with local_stack(options) as stack:
        await run_scenario(stack, lines)


async def run_scenario(stack: LocalStack, lines: list[tuple[float, dict[str, Any]]]) -> None:
    assert stack.router is not None
    consul, nomad = stack.scheduler.consul, stack.scheduler.nomad
    profile = load_profile(ROOT / "examples/profiles/tiny-llamacpp-cpu.yaml").model_copy(
        update={"env": {"CARAVAN_SIM_STEP_SECONDS": "0.02", "CARAVAN_SIM_OUTPUT_TOKENS": "400"}}
    )
    await ModelStore(consul, KVLayout()).submit([local_profile(profile, stack.engine)])
    service = model_service_name(profile.name)

    async def passing_entries() -> tuple[Any, ...]:
        return (await consul.health_service(service, passing=True))[1]

    await eventually(lambda: _count(passing_entries(), 3), 60, "3 passing replicas")
    url = f"{stack.router.base_url}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:

        async def routable() -> bool:
            async with session.get(
                f"{stack.router.base_url}/v1/models", headers=stack.router.headers
            ) as response:
                return profile.served_name in {m["id"] for m in (await response.json())["data"]}

        await eventually(routable, 10, "the router to see the model")
        outcomes: dict[int, list[StreamOutcome]] = {n: [] for n in range(CLIENTS)}
        streaming: set[int] = set()
        stop = asyncio.Event()

        async def client(number: int) -> None:
            turn = 0
            while not stop.is_set():
                body = {
                    "model": profile.served_name,
                    "stream": True,
                    "max_tokens": STREAM_TOKENS,
                    "messages": [{"role": "user", "content": f"client {number} turn {turn}"}],
                }
                async with session.post(url, json=body, headers=stack.router.headers) as response:
                    streaming.add(number)
                    raw = await response.read()
                text, done, errors = read_stream(raw)
                outcomes[number].append(
                    StreamOutcome(
                        number, turn, response.status, done, errors, text, time.monotonic()
                    )
                )
                turn += 1

        async def every_client_streaming() -> bool:
            return len(streaming) == CLIENTS

        clients = [asyncio.create_task(client(n)) for n in range(CLIENTS)]
        await eventually(every_client_streaming, 10, "every client to have a stream open")
        # The engines answer only with their model's key (docs/security.md).
        key = await nomad.get_variable(engine_key_path(profile.name))
        assert key is not None
        headers = {"Authorization": f"Bearer {key.items[ENGINE_KEY_ITEM]}"}
        victim = await busy_replica(session, await passing_entries(), headers)
        node_ids = {n.name: n.id for n in (await nomad.list_nodes()).value}
        victim_node_id = node_ids[victim.node]
        await stack.cluster.nomad.kill_node(victim_node_id)
        killed_at = time.monotonic()

        async def dead_reported() -> bool:
            _, all_entries = await consul.health_service(service)
            states = {e.service_id: e.status for e in all_entries}
            return states.get(victim.service_id, "critical") == "critical"

        async def node_down() -> bool:
            nodes = (await nomad.list_nodes(resources=False)).value
            return any(n.id == victim_node_id and n.status == "down" for n in nodes)

        async def rebuilt() -> bool:
            entries = await passing_entries()
            return len(entries) == 3 and victim.node not in {e.node for e in entries}

        async def since_kill(check: Any, timeout_s: float, what: str) -> float:
            await eventually(check, timeout_s, what)
            return time.monotonic() - killed_at

        reported_s, down_s, rebuilt_s = await asyncio.gather(
            since_kill(dead_reported, 30, "Consul to report the dead endpoint"),
            since_kill(node_down, 2 * MIN_TTL_S + GRACE_S + 10, "Nomad to mark the node down"),
            since_kill(rebuilt, 90, "the replica to be rebuilt on a survivor"),
        )
        reported_at = killed_at + reported_s

        async def every_client_served_after_the_report() -> bool:
            return all(
                any(o.completed and o.finished_at > reported_at for o in outcomes[n])
                for n in range(CLIENTS)
            )

        # Each client goes on being served after the report, by the survivors.
        await eventually(
            every_client_served_after_the_report, 30, "a completed stream for every client"
        )
        stop.set()
        await asyncio.gather(*clients)
        completed = {n: sum(o.completed for o in outcomes[n]) for n in range(CLIENTS)}
        print(  # noqa: T201 - the measured timeline is part of the exit criterion's report
            f"\nexit criterion timeline: kill -> Consul reports the endpoint critical "
            f"{reported_s:.1f}s -> Nomad marks the node down {down_s:.1f}s -> rebuilt "
            f"replica passing {rebuilt_s:.1f}s; completed streams per client {completed}"
        )

    failed = {
        n: [(o.turn, o.status, o.done, o.errors) for o in outcomes[n] if not o.completed]
        for n in range(CLIENTS)
    }
    assert all(not f for f in failed.values()), f"failed streams per client: {failed}"
    for n in range(CLIENTS):
        assert any(o.finished_at > reported_at for o in outcomes[n]), (
            f"client {n} completed nothing after Consul reported the dead endpoint"
        )
    failovers = stack.router.registry.get_sample_value(
        "caravan_router_failovers_total", {"model": profile.served_name, "outcome": "resumed"}
    )
    assert (failovers or 0) >= 1, "no stream was cut by the kill: the test proved nothing"
    # Give the router's blocking query a moment to deliver what Consul reported.
    settled = reported_at + 0.5
    late = [
        line
        for finished, line in lines
        if line.get("endpoint") == victim.service_id
        and finished - float(line.get("duration_s") or 0) > settled
    ]
    assert late == [], f"the dead endpoint got {len(late)} new requests after Consul reported it"
    # Real detection delays: serf's in seconds; Nomad's TTL (min_heartbeat_ttl plus
    # a stagger of up to as much again) + grace, counted from the last heartbeat.
    assert reported_s < 30
    assert GRACE_S - 0.5 <= down_s <= 2 * MIN_TTL_S + GRACE_S + 1
    assert down_s <= rebuilt_s


async def busy_replica(
    session: aiohttp.ClientSession, entries: tuple[Any, ...], headers: dict[str, str]
) -> Any:
    """A replica streaming right now (so the kill cuts a stream), by its engine's metrics."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for entry in entries:
            url = f"http://{entry.address}:{entry.port}/metrics"
            async with session.get(url, headers=headers) as response:
                text = await response.text()
            processing = [
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("llamacpp:requests_processing")
            ]
            if processing and processing[0] >= 1:
                return entry
        await asyncio.sleep(0.05)
    pytest.fail("no replica was streaming")


async def _count(awaitable, count: int) -> bool:
    return len(await awaitable) == count
