"""`caravan submit --wait`, plan, history, revert and logs against devcluster, as CI runs them.

A broken profile here is one whose engine refuses its flags
(`engine_args: [--no-such-flag]`): the simulated llama.cpp exits 2 at once,
Nomad restarts it twice (1 s apart: the cluster config's `restart_delay_s`
is shortened, the chain is what is tested) and then stops, and the
scheduler records the model as failed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import eventually

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_stack
from caravan_llm.common.contract import KVLayout

NAME = "tiny-chat"
GOOD = f"""\
name: {NAME}
model: /opt/models/tiny-llama.gguf
engine: llamacpp
replicas: {{min: 1, max: 2, initial: 1}}
resources: {{cores: 1, memory_mb: 512}}
drain_s: 1
"""
BROKEN = GOOD + 'engine_args: ["--no-such-flag"]\n'
RESTARTS_GIVEN_UP = "the engine failed and Nomad stopped restarting it"


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[LocalStack]:
    options = StackOptions(
        prefer_real_llama_server=False,
        cpu_nodes=2,
        gpu_nodes=0,
        autoscale=False,
        work_dir=tmp_path,
        resync_s=1.0,
        restart_delay_s=1,
    )
    async with local_stack(options) as running:
        yield running


def profile_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


async def caravan(stack: LocalStack, *args: str, timeout_s: float = 200) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.cli",
        *args,
        env=dict(stack.env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout_s)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def failure_recorded(stack: LocalStack) -> bool:
    _, entry = await stack.scheduler.consul.kv_get(KVLayout().failure_key(NAME))
    return entry is not None


@pytest.mark.timeout(240)
async def test_wait_on_a_fixed_profile_after_a_failed_one_waits_for_the_fix(
    stack: LocalStack, tmp_path: Path
):
    """The fixed profile's wait exits 0 when it is ready, never with the old failure."""
    code, _, err = await caravan(
        stack, "submit", profile_file(tmp_path, "bad.yaml", BROKEN), "--wait", "--timeout", "90"
    )
    assert 1 == code, err
    assert f"{NAME} failed: replica 0: {RESTARTS_GIVEN_UP}" in err
    # The finding's setting: the scheduler's failure record of the broken version is in KV.
    await eventually(lambda: failure_recorded(stack))

    code, out, err = await caravan(
        stack, "submit", profile_file(tmp_path, "good.yaml", GOOD), "--wait", "--timeout", "90"
    )

    assert (0, "") == (code, err)
    assert f"submitted {NAME}" in out
    assert out.rstrip().endswith("all replicas ready")


@pytest.mark.timeout(240)
async def test_a_broken_update_fails_the_wait_with_the_reason(stack: LocalStack, tmp_path: Path):
    """An update whose new replica never starts exits non-zero naming why, not a silent timeout."""
    good = profile_file(tmp_path, "good.yaml", GOOD)
    code, _, err = await caravan(stack, "submit", good, "--wait", "--timeout", "90")
    assert (0, "") == (code, err)

    code, out, err = await caravan(
        stack,
        "submit",
        profile_file(tmp_path, "bad.yaml", BROKEN),
        "--wait",
        "--timeout",
        "90",
        "--json",
    )

    document = json.loads(out)
    assert 1 == code
    assert "timed out" not in err
    assert RESTARTS_GIVEN_UP in err
    assert "failed" == document["wait"]["outcome"]
    (rollout,) = document["wait"]["models"]
    assert "failed" == rollout["outcome"]
    assert RESTARTS_GIVEN_UP in rollout["reasons"][0]
    # The previous version keeps serving meanwhile.
    code, out, _ = await caravan(stack, "status", NAME, "--json")
    replicas = json.loads(out)["replicas"]
    assert ["ready"] == [r["state"] for r in replicas if not r["current"]]


@pytest.mark.timeout(300)
async def test_plan_history_and_revert_round_trip(stack: LocalStack, tmp_path: Path):
    """plan shows the update's changed engine argument; revert brings version 0 back as 2."""
    good = profile_file(tmp_path, "good.yaml", GOOD)
    longer = profile_file(tmp_path, "longer.yaml", GOOD + "context_length: 2048\n")
    code, out, err = await caravan(stack, "plan", good, "--json")
    assert (1, "") == (code, err)
    plan = json.loads(out)
    assert ["create"] == [job["change"] for job in plan["models"][0]["jobs"]]

    assert 0 == (await caravan(stack, "submit", good, "--wait", "--timeout", "90"))[0]
    code, out, _ = await caravan(stack, "plan", good)
    assert 0 == code
    assert out.rstrip().endswith("no job would change (exit 0)")
    code, out, _ = await caravan(stack, "plan", longer)
    assert 1 == code
    assert "+/- Job: 'caravan-tiny-chat-0' (update: spec" in out
    assert "+/- TaskGroups[engine].Tasks[engine].Config.args[" in out

    assert 0 == (await caravan(stack, "submit", longer))[0]
    code, out, _ = await caravan(stack, "history", NAME, "--json")
    history: dict[str, Any] = json.loads(out)
    assert (0, 1, [1, 0]) == (code, history["current"], [v["version"] for v in history["versions"]])

    code, out, err = await caravan(stack, "revert", NAME, "0", "--wait", "--timeout", "90")
    assert (0, "") == (code, err)
    assert f"reverted {NAME} to version 0: it is now version 2" in out
    code, out, _ = await caravan(stack, "history", NAME, "--json")
    history = json.loads(out)
    assert (2, 0) == (history["current"], history["versions"][0]["reverted_from"])
    assert "context_length" not in history["versions"][0]["profile"]
    code, out, _ = await caravan(stack, "status", NAME, "--json")
    assert 2 == json.loads(out)["version"]

    code, out, _ = await caravan(stack, "revert", NAME, "2", "--json")
    assert 1 == code
    assert "nothing_to_revert" == json.loads(out)["error"]["type"]
    code, out, _ = await caravan(stack, "revert", NAME, "9", "--json")
    assert (1, "not_found") == (code, json.loads(out)["error"]["type"])


@pytest.mark.timeout(240)
async def test_logs_of_a_replica_through_nomad(stack: LocalStack, tmp_path: Path):
    """`caravan logs` prints a replica engine log, plain or as JSON lines, and follows it."""
    good = profile_file(tmp_path, "good.yaml", GOOD)
    assert 0 == (await caravan(stack, "submit", good, "--wait", "--timeout", "90"))[0]

    code, out, err = await caravan(stack, "logs", NAME, "--stderr")
    assert (0, "") == (code, err)
    assert "server is listening on" in out

    code, out, _ = await caravan(stack, "logs", NAME, "--stderr", "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert 0 == code
    assert {(NAME, 0, "stderr")} == {(d["model"], d["replica"], d["type"]) for d in lines}
    assert "server is listening on" in "".join(d["data"] for d in lines)

    code, out, _ = await caravan(stack, "logs", NAME, "--stderr", "--tail", "-n", "1")
    assert 0 == code
    assert 1 == len(out.splitlines())

    code, out, _ = await caravan(stack, "logs", NAME, "--replica", "7", "--json")
    assert (1, "not_found") == (code, json.loads(out)["error"]["type"])

    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.cli",
        "logs",
        NAME,
        "--stderr",
        "-f",
        env=dict(stack.env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        first = await asyncio.wait_for(process.stdout.readline(), 30)
        assert first
        # Still following: the process does not exit after the lines it has.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(process.wait(), 1.0)
    finally:
        process.terminate()
        await process.wait()


@pytest.mark.timeout(360)
async def test_every_command_prints_parseable_json(stack: LocalStack, tmp_path: Path):
    """With --json each command's stdout is one JSON document, on success and on error."""
    good = profile_file(tmp_path, "good.yaml", GOOD)
    commands: list[tuple[str, ...]] = [
        ("validate", good),
        ("render", good),
        ("plan", good),
        ("submit", good, "--wait", "--timeout", "150"),
        ("list",),
        ("status", NAME),
        ("scale", NAME, "2"),
        ("history", NAME),
        ("history", NAME, "--version", "0"),
        ("delete", NAME),
        ("revert", NAME, "0"),
        ("status", "no-such-model"),
        ("scale", NAME, "--auto"),
        ("submit", str(tmp_path / "missing.yaml")),
        ("validate", "--bogus-flag"),
    ]
    seen = []
    for command in commands:
        code, out, _ = await caravan(stack, *command, "--json")
        document = json.loads(out)
        seen.append((command[0], code, "error" in document))
    assert [
        ("validate", 0, False),
        ("render", 0, False),
        ("plan", 1, False),
        ("submit", 0, False),
        ("list", 0, False),
        ("status", 0, False),
        ("scale", 0, False),
        ("history", 0, False),
        ("history", 0, False),
        ("delete", 0, False),
        ("revert", 0, False),
        ("status", 1, True),
        ("scale", 1, True),
        ("submit", 1, True),
        ("validate", 2, True),
    ] == seen


async def test_plan_history_and_revert_through_the_schedulers_api(
    stack: LocalStack, tmp_path: Path
):
    """With --scheduler the same commands go through the API and answer the same."""
    base = f"http://127.0.0.1:{stack.scheduler.bound_port}"
    good = profile_file(tmp_path, "good.yaml", GOOD)
    longer = profile_file(tmp_path, "longer.yaml", GOOD + "context_length: 2048\n")
    code, out, _ = await caravan(stack, "submit", good, "--scheduler", base, "--json")
    assert (0, {NAME: 0}) == (code, json.loads(out)["versions"])
    code, out, _ = await caravan(stack, "plan", longer, "--scheduler", base, "--json")
    assert (1, "update") == (code, json.loads(out)["models"][0]["change"])
    assert 0 == (await caravan(stack, "submit", longer, "--scheduler", base))[0]
    code, out, _ = await caravan(stack, "revert", NAME, "0", "--scheduler", base, "--json")
    assert (0, 2) == (code, json.loads(out)["version"])
    code, out, _ = await caravan(stack, "history", NAME, "--scheduler", base, "--json")
    assert [2, 1, 0] == [v["version"] for v in json.loads(out)["versions"]]
