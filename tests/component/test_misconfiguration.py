"""Issue 23, finding 2: a scheduler or router whose token lacks a grant says so at start.

devcluster's Nomad runs with ACLs on. The router's token has no Variables
grant (or it has no token at all) and the scheduler's policy is the one
deploy.md used to show, without a `variables` block. Both name the missing
grant in their log, in /health (503 `misconfigured`) and in `caravan status`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from polling import eventually

from caravan_llm.cli.local_stack import (
    LocalStack,
    NomadAcl,
    StackOptions,
    local_stack,
    running_router,
)
from caravan_llm.common.consul_api import ConsulClient, ConsulSettings
from caravan_llm.common.nomad_api import NomadClient, NomadSettings
from caravan_llm.router.settings import RouterSettings

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "profiles"
ROUTER_GRANT = "nomad: variables read on nomad/jobs/caravan-engine-keys/models/*"
# The scheduler policy deploy.md showed before issue 23: no `variables` block.
SCHEDULER_WITHOUT_VARIABLES = """
namespace "default" {
  capabilities = ["submit-job", "read-job", "list-jobs"]
}

node {
  policy = "read"
}
"""
ROUTER_WITHOUT_VARIABLES = """
node {
  policy = "read"
}
"""


def options(tmp_path: Path) -> StackOptions:
    return StackOptions(
        prefer_real_llama_server=False,
        gpu_nodes=0,
        autoscale=False,
        work_dir=tmp_path,
        router=RouterSettings(port=0, log_level="warning"),
        nomad_acl=NomadAcl(
            management_token=str(uuid.uuid4()),
            scheduler_rules=SCHEDULER_WITHOUT_VARIABLES,
            router_rules=ROUTER_WITHOUT_VARIABLES,
        ),
    )


async def health(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as answer:
        return answer.status, await answer.json()


async def caravan(stack: LocalStack, *args: str) -> tuple[int, str, str]:
    env = {**stack.env, "CARAVAN_SCHEDULER_ADDR": stack.scheduler_url}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.cli",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_tokens_without_their_grants_are_named_in_log_health_and_status(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Router and scheduler each answer /health 503 naming the grant, log it, and
    `caravan status` repeats both."""
    caplog.set_level(logging.ERROR)
    async with local_stack(options(tmp_path)) as stack:
        assert stack.router is not None

        async def router_misconfigured() -> dict[str, Any] | None:
            status, body = await health(stack.router.base_url)  # type: ignore[union-attr]
            return body if status == 503 and body["status"] == "misconfigured" else None

        router_body = await eventually(router_misconfigured, 30.0, "router /health says it")
        scheduler_status, scheduler_body = await health(stack.scheduler_url)

        code, _, err = await caravan(stack, "submit", str(EXAMPLES / "tiny-llamacpp-cpu.yaml"))
        assert (0, "") == (code, err)

        async def status_names_both() -> str | None:
            code, out, _ = await caravan(stack, "status", "tiny-chat")
            both = "this scheduler: token lacks" in out and "caravan-router on" in out
            return out if code == 0 and both else None

        shown = await eventually(status_names_both, 60.0, "caravan status names both")

    assert [ROUTER_GRANT] == router_body["missing"]
    assert 503 == scheduler_status
    assert [
        "nomad: variables read on nomad/jobs/caravan-*",
        "nomad: variables write on nomad/jobs/caravan-*",
    ] == scheduler_body["missing"]
    assert "control plane: this scheduler: token lacks nomad: variables write on" in shown
    assert f"token lacks {ROUTER_GRANT}" in shown
    logged = {
        (
            record.getMessage(),
            getattr(record, "component", None),
            getattr(record, "capability", None),
        )
        for record in caplog.records
    }
    assert ("preflight_failed", "router", ROUTER_GRANT) in logged
    assert (
        "preflight_failed",
        "scheduler",
        "nomad: variables read on nomad/jobs/caravan-*",
    ) in logged


async def test_a_router_without_a_nomad_token_is_not_ok(tmp_path: Path) -> None:
    """With Nomad's ACLs on, a router with no token (the anonymous one) answers /health 503."""
    async with local_stack(options(tmp_path)) as stack:
        environ = {k: v for k, v in stack.env.items() if k != "NOMAD_TOKEN"}
        async with (
            ConsulClient(ConsulSettings.from_env(environ)) as consul,
            NomadClient(NomadSettings.from_env(environ)) as nomad,
            running_router(
                RouterSettings(port=0, register_service=False, log_level="warning"),
                consul,
                nomad=nomad,
            ) as router,
        ):

            async def misconfigured() -> dict[str, Any] | None:
                status, body = await health(router.base_url)
                return body if (status, body["status"]) == (503, "misconfigured") else None

            body = await eventually(misconfigured, 30.0, "router /health 503")

    assert {"status": "misconfigured", "missing": [ROUTER_GRANT]} == body
