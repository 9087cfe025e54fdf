"""Issue 14 item 8, end to end: a stream survives the loss of the only replica.

devcluster (3 CPU nodes), the scheduler and a router, through
`caravan_llm.cli.local_stack` with the API key the stack generates, and a llama.cpp
model at exactly one replica (min 1, max 1). Four clients stream chat
completions; once each has received some tokens, the replica's node is
killed. Nothing else can serve the model, so the router holds the four
streams (SSE keep-alive comments) until Nomad has marked the node down and the
replica is rebuilt on another node, then continues each stream there. Every
client gets its full answer: the same text, token for token, that the rebuilt
replica gives for the same request, no error event, `[DONE]`, one continuation.

This test is about the router's hold, not about how long failure detection
takes, so Nomad's heartbeat TTL and grace are shortened to 1 s + 1 s (as the
scheduler component tests do; tests/component/test_exit_criterion.py runs
through the real 10-30 s). Consul's serf detection keeps its real pace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from polling import eventually

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_profile, local_stack
from caravan_llm.common.contract import KVLayout, model_service_name
from caravan_llm.router.settings import RouterSettings
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.profiles import ModelProfile, load_profile

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 4
MAX_TOKENS = 120
KEEPALIVE = b": waiting for a replica"


@dataclass
class Stream:
    """What one client received, parsed as it arrives."""

    status: int = 0
    raw: bytes = b""
    tokens: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    errors: list[Any] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    done: bool = False
    keepalives: int = 0

    def feed(self, data: bytes) -> None:
        self.raw += data
        *events, self.raw = self.raw.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(KEEPALIVE):
                    self.keepalives += 1
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    self.done = True
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    self.errors.append(chunk["error"])
                    continue
                self.ids.add(chunk["id"])
                for choice in chunk["choices"]:
                    content = choice.get("delta", {}).get("content")
                    if content:
                        self.tokens.append(content)
                    if choice.get("finish_reason"):
                        self.finish_reasons.append(choice["finish_reason"])


def one_replica_profile() -> ModelProfile:
    """The tiny llama.cpp example at exactly one replica, room for the four clients."""
    document = load_profile(ROOT / "examples/profiles/tiny-llamacpp-cpu.yaml").model_dump(
        mode="json", by_alias=True, exclude_none=True
    )
    document.pop("autoscaling", None)
    document.update(
        replicas={"min": 1, "max": 1},
        max_concurrency=CLIENTS,
        # 50 ms a token and at least 200 tokens before EOS: every reply ends at max_tokens.
        env={"CARAVAN_SIM_STEP_SECONDS": "0.05", "CARAVAN_SIM_OUTPUT_TOKENS": "400"},
    )
    return ModelProfile.model_validate(document)


@pytest.mark.slow
async def test_four_streams_survive_the_loss_of_the_only_replica(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Kill the only replica's node under 4 streaming clients: none of them fails."""
    # The canonical request lines are written at info level.
    caplog.set_level(logging.INFO, logger="router.proxy")
    lines: list[dict[str, Any]] = []
    options = StackOptions(
        prefer_real_llama_server=False,
        gpu_nodes=0,
        autoscale=False,
        work_dir=tmp_path,
        resync_s=2.0,
        heartbeat_grace_s=1.0,
        min_heartbeat_ttl_s=1.0,
        router=RouterSettings(
            port=0, scrape_interval_s=0.5, log_level="warning", cold_start_keepalive_s=1.0
        ),
        request_log=lines.append,
    )
    async with local_stack(options) as stack:
        await run_scenario(stack, lines)


async def run_scenario(stack: LocalStack, lines: list[dict[str, Any]]) -> None:
    assert stack.router is not None
    router = stack.router
    consul, nomad = stack.scheduler.consul, stack.scheduler.nomad
    profile = one_replica_profile()
    await ModelStore(consul, KVLayout()).submit([local_profile(profile, stack.engine)])
    service = model_service_name(profile.name)

    async def passing() -> tuple[Any, ...]:
        return (await consul.health_service(service, passing=True))[1]

    async def one_passing() -> bool:
        return len(await passing()) == 1

    await eventually(one_passing, 60, "the replica to pass")
    (victim,) = await passing()
    url = f"{router.base_url}/v1/chat/completions"
    bodies = [
        {
            "model": profile.served_name,
            "stream": True,
            "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": f"client {number}: tell me about caravans"}],
        }
        for number in range(CLIENTS)
    ]
    async with aiohttp.ClientSession() as session:

        async def routable() -> bool:
            async with session.get(f"{router.base_url}/v1/models", headers=router.headers) as r:
                return profile.served_name in {m["id"] for m in (await r.json())["data"]}

        await eventually(routable, 10, "the router to see the model")
        streams = [Stream() for _ in range(CLIENTS)]

        async def client(body: dict[str, Any], stream: Stream) -> None:
            async with session.post(url, json=body, headers=router.headers) as response:
                stream.status = response.status
                async for data in response.content.iter_any():
                    stream.feed(data)

        clients = [asyncio.create_task(client(b, s)) for b, s in zip(bodies, streams, strict=True)]

        async def all_streaming() -> bool:
            return all(len(s.tokens) >= 5 for s in streams)

        await eventually(all_streaming, 30, "every client to receive tokens")
        assert all(len(s.tokens) < MAX_TOKENS for s in streams), "a stream ended before the kill"
        node_ids = {n.name: n.id for n in (await nomad.list_nodes()).value}
        await stack.cluster.nomad.kill_node(node_ids[victim.node])
        killed_at = time.monotonic()

        async def rebuilt() -> bool:
            entries = await passing()
            return len(entries) == 1 and entries[0].node != victim.node

        await eventually(rebuilt, 90, "the replica to be rebuilt on another node")
        rebuilt_s = time.monotonic() - killed_at
        await asyncio.wait_for(asyncio.gather(*clients), 120)
        finished_s = time.monotonic() - killed_at

        # The full expected output: what the rebuilt replica answers the same requests
        # (the simulated engine's text is a pure function of the prompt and position).
        # Asked all at once (max_concurrency is CLIENTS), not one after the other.
        async def answer(body: dict[str, Any]) -> str:
            async with session.post(
                url, json={**body, "stream": False}, headers=router.headers
            ) as response:
                assert response.status == 200
                return str((await response.json())["choices"][0]["message"]["content"])

        expected = await asyncio.gather(*(answer(body) for body in bodies))
    print(  # noqa: T201 - the measured hold is part of the report
        f"\nlast replica: kill -> replacement passing {rebuilt_s:.1f}s -> "
        f"all {CLIENTS} streams complete {finished_s:.1f}s"
    )

    for number, stream in enumerate(streams):
        assert (200, True, []) == (stream.status, stream.done, stream.errors), number
        assert MAX_TOKENS == len(stream.tokens), number
        assert expected[number] == "".join(stream.tokens), number
        assert (1, ["length"]) == (len(stream.ids), stream.finish_reasons), number
        assert stream.keepalives >= 1, f"client {number} was never held"
    streamed = [line for line in lines if line.get("stream")]
    assert CLIENTS == len(streamed)
    assert [(200, "ok", 1)] * CLIENTS == [
        (line["status"], line["outcome"], line["failovers"]) for line in streamed
    ]
    model = profile.served_name
    registry = router.registry
    assert CLIENTS == registry.get_sample_value(
        "caravan_router_replacement_holds_total",
        {"model": model, "kind": "stream", "outcome": "resumed"},
    )
    assert CLIENTS == registry.get_sample_value(
        "caravan_router_failovers_total", {"model": model, "outcome": "resumed"}
    )
