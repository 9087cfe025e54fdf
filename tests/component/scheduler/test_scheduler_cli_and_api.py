"""`caravan submit/list/status/scale/delete` and the scheduler's HTTP API, as users run them."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
from conftest import EXAMPLES

from caravan_llm.cli.local_stack import LocalStack
from caravan_llm.common.contract import KVLayout


async def caravan(stack: LocalStack, *args: str, timeout_s: float = 120) -> tuple[int, str, str]:
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


async def test_submit_wait_list_status_scale_delete(stack: LocalStack):
    """The model commands work end to end against Consul and Nomad."""
    profile = str(EXAMPLES / "qwen-vllm-h100.yaml")
    code, out, err = await caravan(stack, "submit", profile, "--wait", "--timeout", "90")
    assert (code, err) == (0, "")
    assert "submitted qwen2-5-7b" in out
    assert out.rstrip().endswith("all replicas ready")

    code, out, _ = await caravan(stack, "list")
    assert code == 0
    header, row = out.splitlines()[:2]
    assert header.split() == ["NAME", "ENGINE", "GPU", "READY/DESIRED", "STATUS"]
    assert row.split() == ["qwen2-5-7b", "vllm", "2x", "h100", "2/2", "ready"]

    code, out, _ = await caravan(stack, "status", "qwen2-5-7b")
    assert code == 0
    assert "2/2 ready, ready" in out.splitlines()[0]
    assert "caravan-qwen2-5-7b-0" in out
    assert "passing" in out

    code, _, err = await caravan(stack, "scale", "qwen2-5-7b", "9")
    assert code == 1
    assert "outside replicas.min..max (1..4)" in err

    code, out, _ = await caravan(stack, "delete", "qwen2-5-7b")
    assert code == 0
    code, _, err = await caravan(stack, "status", "qwen2-5-7b")
    assert code == 1
    assert "no model named 'qwen2-5-7b'" in err


async def test_invalid_submission_writes_nothing(stack: LocalStack, tmp_path: Path):
    """A batch with one invalid profile is refused whole: nothing reaches KV."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmodel: m\nengine: vllm\n", encoding="utf-8")
    good = str(EXAMPLES / "qwen-vllm-h100.yaml")
    code, _, err = await caravan(stack, "submit", good, str(bad))
    assert code == 1
    assert f"{bad}: gpu: engine 'vllm' needs a gpu block" in err
    assert "nothing was submitted" in err
    _, entries = await stack.scheduler.consul.kv_get_recurse(KVLayout().models)
    assert entries == ()


async def test_http_api_and_the_cli_through_it(stack: LocalStack):
    """The scheduler API accepts profiles, lists, scales and deletes; the CLI can use it."""
    base = f"http://127.0.0.1:{stack.scheduler.bound_port}"
    text = (EXAMPLES / "tiny-llamacpp-cpu.yaml").read_text(encoding="utf-8")
    async with aiohttp.ClientSession(headers=stack.scheduler_headers) as session:
        async with session.put(f"{base}/v1/models/tiny-chat", data=text) as response:
            assert response.status == 200
        async with session.put(f"{base}/v1/models/other", data=text) as response:
            assert response.status == 400
            problems = " ".join((await response.json())["error"]["problems"])
            assert "named 'tiny-chat' but was sent as 'other'" in problems
        async with session.put(f"{base}/v1/models/x", data="name: x\nengine: vllm\n") as response:
            body = await response.json()
            assert response.status == 400
            assert "model: required field is missing" in " ".join(body["error"]["problems"])
        async with session.post(
            f"{base}/v1/models/tiny-chat/scale", json={"replicas": 2}
        ) as response:
            assert response.status == 200
        async with session.post(f"{base}/v1/models/nope/scale", json={"replicas": 2}) as response:
            assert response.status == 404
        async with session.get(f"{base}/health") as response:
            assert (await response.json()) == {"status": "ok", "leader": True}
        async with session.get(f"{base}/metrics") as response:
            assert "caravan_scheduler_leader 1.0" in await response.text()
    code, out, _ = await caravan(stack, "list", "--scheduler", base)
    assert code == 0
    assert "tiny-chat" in out
    code, out, _ = await caravan(stack, "delete", "tiny-chat", "--scheduler", base)
    assert code == 0
