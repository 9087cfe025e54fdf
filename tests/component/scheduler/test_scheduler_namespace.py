"""Issue 23, finding 10: caravan works in a Nomad namespace of its own, `caravan`.

devcluster's Nomad runs with ACLs on; the scheduler and the router hold tokens
of exactly terraform/policies rendered with `namespace "caravan"`, and every
component has NOMAD_NAMESPACE=caravan (as Nomad gives a task its job's
namespace). The replica jobs and their engine keys land in `caravan` and
nothing in `default`; the router authenticates to the engines with keys read
there; `caravan status` shows a crashed engine's last stderr lines (read-logs
in `caravan`) and explains a placement that cannot happen; `caravan logs`
reads an engine's log there.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from polling import eventually

from caravan_llm.cli.local_stack import LocalStack, NomadAcl, StackOptions, local_stack
from caravan_llm.router.settings import RouterSettings

ROOT = Path(__file__).resolve().parents[3]
POLICIES = ROOT / "terraform" / "policies"
EXAMPLES = ROOT / "examples" / "profiles"
NAMESPACE = "caravan"
MISSING = "/opt/models/no-such-model.gguf"
LOST = f"""\
name: lost-model
model: {MISSING}
engine: llamacpp
replicas: {{min: 1, max: 1, initial: 1}}
resources: {{cores: 1, memory_mb: 512}}
"""
ENGINE_LINE = f"srv    load_model: failed to load model, '{MISSING}'"


def nomad_policy(component: str) -> str:
    text = (POLICIES / f"caravan-{component}.nomad.hcl.tftpl").read_text(encoding="utf-8")
    return text.replace("${namespace}", NAMESPACE)


def options(tmp_path: Path) -> StackOptions:
    return StackOptions(
        prefer_real_llama_server=False,
        cpu_nodes=2,
        gpu_nodes=0,
        autoscale=False,
        secure=False,
        work_dir=tmp_path,
        resync_s=1.0,
        restart_delay_s=1,
        router=RouterSettings(port=0, log_level="warning"),
        nomad_namespace=NAMESPACE,
        nomad_acl=NomadAcl(
            management_token=str(uuid.uuid4()),
            scheduler_rules=nomad_policy("scheduler"),
            router_rules=nomad_policy("router"),
        ),
    )


async def caravan(stack: LocalStack, *args: str, via_scheduler: bool = True) -> tuple[int, str]:
    """The CLI: through the scheduler's API (its token reads the logs), or straight to Nomad."""
    env = dict(stack.env)
    if via_scheduler:
        env["CARAVAN_SCHEDULER_ADDR"] = stack.scheduler_url
        env.pop("NOMAD_TOKEN", None)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "caravan_llm.cli", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode()


async def objects_in(stack: LocalStack, namespace: str) -> dict[str, list[str]]:
    """The caravan replica jobs and engine-key Variables in `namespace` (management token)."""
    assert stack.env.get("NOMAD_TOKEN")
    headers = {"X-Nomad-Token": stack.env["NOMAD_TOKEN"]}
    base, query = stack.cluster.nomad.address, f"namespace={namespace}"
    keys = "nomad/jobs/caravan-engine-keys"
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(f"{base}/v1/jobs?{query}&prefix=caravan-") as answer:
            jobs = sorted(job["ID"] for job in await answer.json())
        async with session.get(f"{base}/v1/vars?{query}&prefix={keys}") as answer:
            variables = sorted(var["Path"] for var in await answer.json())
    return {"jobs": jobs, "engine_keys": variables}


@pytest.mark.timeout(300)
async def test_caravan_serves_explains_and_reads_logs_in_its_own_namespace(
    tmp_path: Path,
) -> None:
    """Everything of caravan's is in `caravan`; serving, status and logs work there."""
    lost = tmp_path / "lost.yaml"
    lost.write_text(LOST, encoding="utf-8")
    async with local_stack(options(tmp_path)) as stack:
        assert stack.router is not None
        assert NAMESPACE == stack.config.namespace
        for profile in (
            EXAMPLES / "tiny-llamacpp-cpu.yaml",
            lost,
            EXAMPLES / "qwen-vllm-h100.yaml",
        ):
            code, out = await caravan(stack, "submit", str(profile))
            assert 0 == code, out

        async def answered() -> dict[str, Any] | None:
            body = {
                "model": "tiny-chat",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}],
            }
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{stack.router.base_url}/v1/chat/completions", json=body) as answer,  # type: ignore[union-attr]
            ):
                return dict(await answer.json()) if answer.status == 200 else None

        completion = await eventually(answered, 120.0, "a completion from tiny-chat")

        async def status_of(name: str, needle: str) -> str | None:
            code, out = await caravan(stack, "status", name)
            return out if code == 0 and needle in out else None

        crashed = await eventually(
            lambda: status_of("lost-model", ENGINE_LINE), 150.0, "the engine's stderr in status"
        )
        unplaceable = await eventually(
            lambda: status_of("qwen2-5-7b", "no node has"), 60.0, "the placement explained"
        )
        logs_code, logs = await caravan(
            stack, "logs", "tiny-chat", "--replica", "0", via_scheduler=False
        )
        mine, default = await objects_in(stack, NAMESPACE), await objects_in(stack, "default")

    assert completion["choices"]
    assert "engine stderr (last lines):" in crashed
    assert "H100" in unplaceable
    assert 0 == logs_code, logs
    assert "caravan-tiny-chat-0" in mine["jobs"]
    assert "caravan-lost-model-0" in mine["jobs"]
    assert "caravan-qwen2-5-7b-0" in mine["jobs"]
    assert "nomad/jobs/caravan-engine-keys/models/tiny-chat/key" in mine["engine_keys"]
    assert {"jobs": [], "engine_keys": []} == default
