"""The runbook's drain procedure, as written, on an idle autoscaled model (devcluster).

The test reads the command block of docs/operations.md ("Draining with the
replacements started first") and runs it line by line: `caravan` lines with
the real CLI (a subprocess, as an operator runs it), `nomad node ...` lines
as the Nomad HTTP calls the `nomad` CLI makes. Without the override the
autoscaler would take the idle model back to 1 replica within its 2 s down
window; with it, the raised count holds through the drain until
`caravan scale NAME --auto`.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from polling import eventually

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_stack
from caravan_llm.common.contract import KVLayout, model_service_name
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.profiles import ModelProfile

ROOT = Path(__file__).resolve().parents[3]
RUNBOOK = ROOT / "docs" / "operations.md"
NAME = "held"
DOWN_WINDOW_S = 2.0


def drain_procedure() -> list[str]:
    """The command lines of the runbook's drain-with-replacements block."""
    text = RUNBOOK.read_text(encoding="utf-8")
    section = text.split("### Draining with the replacements started first", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert block is not None
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def idle_profile() -> ModelProfile:
    return ModelProfile.model_validate(
        {
            "name": NAME,
            "model": "sim/held",
            "engine": "vllm",
            "gpu": {"class": "h100", "count": 1},
            "replicas": {"min": 1, "max": 3, "initial": 1},
            "drain_s": 1,
            "startup_timeout_s": 60,
            "env": {"CARAVAN_SIM_LOAD_SECONDS": "0.5"},
            "autoscaling": {
                "target_inflight": 4,
                "scale_up_window_s": 0,
                "scale_down_window_s": DOWN_WINDOW_S,
                "evaluation_interval_s": 1,
            },
        }
    )


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[LocalStack]:
    options = StackOptions(
        prefer_real_llama_server=False,
        cpu_nodes=1,
        gpu_nodes=2,
        gpus_per_node=2,
        autoscale=True,
        autoscale_tick_s=0.5,
        work_dir=tmp_path,
        resync_s=1.0,
    )
    async with local_stack(options) as running:
        yield running


async def caravan(stack: LocalStack, argv: list[str]) -> str:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.cli",
        *argv,
        env=dict(stack.env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert (process.returncode, err.decode()) == (0, ""), argv
    return out.decode()


async def nomad(stack: LocalStack, argv: list[str], node_id: str) -> None:
    """`nomad node eligibility|drain ...` as the HTTP call the nomad CLI makes."""
    base = stack.env["NOMAD_ADDR"].rstrip("/")
    if argv[:3] == ["node", "eligibility", "-disable"]:
        path, body = "eligibility", {"NodeID": node_id, "Eligibility": "ineligible"}
    elif argv[:3] == ["node", "drain", "-enable"]:
        deadline = argv[argv.index("-deadline") + 1]
        assert deadline == "1h"
        spec = {"Deadline": 3600 * 10**9, "IgnoreSystemJobs": False}
        message = argv[argv.index("-m") + 1]
        path, body = "drain", {"NodeID": node_id, "DrainSpec": spec, "Meta": {"message": message}}
    else:
        pytest.fail(f"the runbook names a nomad command this test cannot run: {argv}")
    async with (
        aiohttp.ClientSession() as session,
        session.put(f"{base}/v1/node/{node_id}/{path}", json=body) as response,
    ):
        assert response.status == 200, await response.text()


async def desired(stack: LocalStack) -> int:
    return (await ModelStore(stack.scheduler.consul, KVLayout()).read()).desired_count(NAME)


async def running_nodes(stack: LocalStack) -> list[str]:
    allocations = (await stack.scheduler.nomad.list_allocations()).value
    return [
        a.node_id
        for a in allocations
        if a.job_id.startswith(f"caravan-{NAME}-") and a.client_status == "running"
    ]


async def autoscaler_state(stack: LocalStack) -> dict[str, Any]:
    _, entry = await stack.scheduler.consul.kv_get(KVLayout().state_key(NAME))
    return json.loads(entry.value) if entry is not None else {}


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_the_drain_procedure_works_as_written_for_an_idle_autoscaled_model(
    stack: LocalStack,
):
    """Raise with a hold, wait until ready, drain: the count holds; --auto hands it back."""
    store = ModelStore(stack.scheduler.consul, KVLayout())
    await store.submit([idle_profile()])

    async def one_passing() -> bool:
        _, entries = await stack.scheduler.consul.health_service(
            model_service_name(NAME), passing=True
        )
        return len(entries) == 1

    await eventually(one_passing, 60, "the first replica")
    node_id = (await running_nodes(stack))[0]
    held_since: float | None = None

    for line in drain_procedure():
        argv = shlex.split(line.replace("<node-id>", node_id))
        if argv[0] == "nomad":
            await nomad(stack, argv[1:], node_id)
            if argv[2] == "drain":
                # Drained: the replica on the node moves; the raised count holds meanwhile.
                async def moved() -> bool:
                    nodes = await running_nodes(stack)
                    return len(nodes) == 2 and node_id not in nodes

                await eventually(moved, 90, "the replica moved off the drained node")
                assert 2 == await desired(stack)
            continue
        assert argv[0] == "caravan"
        argv = [arg.replace("NAME", NAME).replace("N+k", "2") for arg in argv[1:]]
        if argv[:1] == ["status"]:
            # "wait until `caravan status NAME` shows them ready"
            async def ready(command: list[str] = argv) -> bool:
                return "2/2 ready" in (await caravan(stack, command)).splitlines()[0]

            await eventually(ready, 60, "caravan status: 2/2 ready")
            continue
        if "--auto" in argv:
            await assert_held_while_the_load_says_down(stack)
            out = await caravan(stack, argv)
            assert "the autoscaler decides the count again" in out
            continue
        out = await caravan(stack, argv)
        assert "held against the autoscaler for 2h" in out
        held_since = time.monotonic()
        listing = await caravan(stack, ["list"])
        assert "held at 2 until" in listing

    assert held_since is not None

    # After --auto the autoscaler takes the idle model back down on its own.
    async def back_to_one() -> bool:
        return await desired(stack) == 1

    await eventually(back_to_one, 30, "the autoscaler scaled the idle model back to 1")
    state = await autoscaler_state(stack)
    assert "overridden" not in state
    assert 0 == overridden_gauge(stack)


def overridden_gauge(stack: LocalStack) -> float | None:
    return stack.scheduler.registry.get_sample_value(
        "caravan_scheduler_autoscale_overridden", {"model": NAME}
    )


async def assert_held_while_the_load_says_down(stack: LocalStack) -> None:
    """The autoscaler itself says the idle load asks for 1, and still holds 2 (the override)."""

    async def overridden_down() -> bool:
        decision = (await autoscaler_state(stack)).get("last_decision") or {}
        reason = str(decision.get("reason", ""))
        return reason.startswith("overridden") and "the load alone says down to 1" in reason

    await eventually(overridden_down, 60, "an overridden decision that would scale down")
    state = await autoscaler_state(stack)
    assert 2 == await desired(stack)
    assert 2 == state["overridden"]["count"]
    assert 1 == overridden_gauge(stack)
    assert "held at 2 by `caravan scale` until" in await caravan(stack, ["status", NAME])
