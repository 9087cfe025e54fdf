"""Issue 23, deliverable 8: a model path a node lacks is reported with the engine's own words.

The local stack's simulated llama.cpp engine fails as llama-server does on a
missing `-m` file (devcluster's `check_model_files`): it writes llama.cpp's
error lines and exits 1. Nomad restarts it, gives up, and the scheduler,
reading the end of the allocation's stderr with its own least-privilege
token, shows those lines in `caravan status` and `caravan submit --wait`
(both through the scheduler's API here). A token without `read-logs` is
named instead.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import pytest

from caravan_llm.cli.local_stack import LocalStack, NomadAcl, StackOptions, local_stack

POLICIES = Path(__file__).resolve().parents[2] / "terraform" / "policies"
NAME = "lost-model"
MISSING = "/opt/models/no-such-model.gguf"
PROFILE = f"""\
name: {NAME}
model: {MISSING}
engine: llamacpp
replicas: {{min: 1, max: 1, initial: 1}}
resources: {{cores: 1, memory_mb: 512}}
"""
ENGINE_LINE = f"srv    load_model: failed to load model, '{MISSING}'"


def nomad_policy(component: str) -> str:
    text = (POLICIES / f"caravan-{component}.nomad.hcl.tftpl").read_text(encoding="utf-8")
    return text.replace("${namespace}", "default")


def options(tmp_path: Path, scheduler_rules: str) -> StackOptions:
    return StackOptions(
        prefer_real_llama_server=False,
        cpu_nodes=1,
        gpu_nodes=0,
        autoscale=False,
        work_dir=tmp_path,
        resync_s=1.0,
        restart_delay_s=1,
        nomad_acl=NomadAcl(
            management_token=str(uuid.uuid4()),
            scheduler_rules=scheduler_rules,
            router_rules=nomad_policy("router"),
        ),
    )


async def caravan(stack: LocalStack, *args: str) -> tuple[int, str, str]:
    """The CLI through the scheduler's API, so the scheduler's token reads the logs."""
    env = dict(stack.env)
    env["CARAVAN_SCHEDULER_ADDR"] = stack.scheduler_url
    env.pop("NOMAD_TOKEN", None)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.cli",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 150)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.mark.timeout(240)
async def test_a_missing_model_file_fails_the_wait_and_status_with_the_engines_error(
    tmp_path: Path,
) -> None:
    """submit --wait exits 1 and prints llama-server's line; status shows it too."""
    profile = tmp_path / "lost.yaml"
    profile.write_text(PROFILE, encoding="utf-8")
    async with local_stack(options(tmp_path, nomad_policy("scheduler"))) as stack:
        code, _, err = await caravan(stack, "submit", str(profile), "--wait", "--timeout", "120")
        status_code, status, status_err = await caravan(stack, "status", NAME)

    assert 1 == code, err
    assert "timed out" not in err
    assert f"{NAME} failed: replica 0: the engine failed" in err
    assert "engine stderr (last lines):" in err
    assert ENGINE_LINE in err
    assert (0, "") == (status_code, status_err)
    assert "  replica 0 engine stderr (last lines):" in status.splitlines()
    assert f"    {ENGINE_LINE}" in status.splitlines()


@pytest.mark.timeout(240)
async def test_a_scheduler_token_without_read_logs_is_named_instead_of_the_lines(
    tmp_path: Path,
) -> None:
    """No crash and no lines: status says the scheduler's token lacks read-logs."""
    rules = nomad_policy("scheduler").replace(', "read-logs"', "")
    assert "read-logs" not in rules.split("capabilities = [", 1)[1].split("]", 1)[0]
    profile = tmp_path / "lost.yaml"
    profile.write_text(PROFILE, encoding="utf-8")
    async with local_stack(options(tmp_path, rules)) as stack:
        code, _, err = await caravan(stack, "submit", str(profile), "--wait", "--timeout", "120")
        status_code, status, _ = await caravan(stack, "status", NAME)

    expected = "engine stderr unavailable: the scheduler's Nomad token lacks read-logs (HTTP 403)"
    assert 1 == code, err
    assert expected in err
    assert ENGINE_LINE not in err
    assert 0 == status_code
    assert f"  replica 0 {expected}" in status.splitlines()
