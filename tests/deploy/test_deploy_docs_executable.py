"""Issue 23, deliver 1: deploy.md's setup, run literally, serves a model on a cluster with ACLs on.

Every ```sh block of deploy.md's sections 2 ("Namespace, tokens and policies") and 3
("Deploy with the jobspecs", up to the sidecar alternative) is run by bash, in
order, as written: policies, tokens, Nomad Variables, secrets bindings,
`caravan validate` / `caravan render`, the jobs, the KV put. Each ```hcl block
whose first line names a file (`# caravan-scheduler.nomad-policy.hcl`) is
saved under that name first, as the doc asks. devcluster runs with ACLs on in
Nomad and Consul; the shell starts with the management tokens only.

`nomad` and `consul` cannot be installed here: on PATH they are shims for
tests/deploy/doc_commands.py, which translates each documented CLI command
into the HTTP API call it makes through a small, explicit table (tested in
test_deploy_doc_commands.py); `nomad job run` of caravan's jobspecs starts the
process the jobspec's task runs, with the tokens its template renders from the
job's Nomad Variable. `caravan`, `jq` and `openssl` run as they are. The test
ends with a streamed completion through the router so started, which holds
exactly the tokens the doc gave it. Everything of caravan's is in the
namespace the doc creates, `caravan`: the jobs, their Variables, the replica
jobs and the engine keys; nothing is left in `default`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml
from polling import eventually

from caravan_llm.devcluster.cluster import ClusterConfig as DevClusterConfig
from caravan_llm.devcluster.cluster import DevCluster
from caravan_llm.devcluster.consul.server import ConsulConfig
from caravan_llm.devcluster.nomad.settings import NomadServerSettings, default_nodes

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
# (first heading, heading that ends it): the setup the test runs.
SETUP_SECTIONS = [
    ("## 2. Namespace, tokens and policies", "## 3. Deploy with the jobspecs"),
    ("## 3. Deploy with the jobspecs", "### The router: a system job, or a sidecar"),
]
_FENCE = re.compile(r"^([ \t]*)```(sh|hcl)\n(.*?)^\1```", re.DOTALL | re.MULTILINE)
_NAMED = re.compile(r"\A# ([\w.-]+\.hcl)\n")
MANAGEMENT = "00000000-0000-4000-8000-00000000beef"
NAMESPACE = "caravan"
SERVED = "qwen2.5-7b-instruct"

pytestmark = pytest.mark.slow


def setup_blocks(doc: Path = DEPLOY_DOC) -> list[tuple[str, str]]:
    """(kind, text) of each sh and hcl block of the setup sections, in order."""
    text = doc.read_text(encoding="utf-8")
    blocks: list[tuple[str, str]] = []
    for start, end in SETUP_SECTIONS:
        section = text[text.index(start) : text.index(end)]
        blocks += [(kind, textwrap.dedent(body)) for _, kind, body in _FENCE.findall(section)]
    return blocks


def test_the_setup_sections_hold_the_commands_the_issue_names():
    """The extracted setup has policies, tokens, variables, the jobs and the KV put."""
    script = "\n".join(body for kind, body in setup_blocks() if kind == "sh")
    for command in [
        "nomad namespace apply -description",
        "nomad acl policy apply",
        "nomad acl token create",
        "consul acl policy create",
        "consul acl token create",
        f"nomad var put -namespace {NAMESPACE} nomad/jobs/caravan-scheduler",
        f"nomad var put -namespace {NAMESPACE} nomad/jobs/caravan-router",
        f"-var namespace={NAMESPACE}",
        "nomad job run",
        "consul kv put caravan/models/",
        "caravan validate",
    ]:
        assert command in script, command


def _shims(folder: Path) -> Path:
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    for agent in ("nomad", "consul"):
        shim = bin_dir / agent
        shim.write_text(
            f'#!/bin/sh\nexec "{sys.executable}" "{HERE / "doc_commands.py"}" {agent} "$@"\n'
        )
        shim.chmod(0o755)
    return bin_dir


def _work_dir(folder: Path) -> Path:
    """The operator's folder: the repository's examples and jobspecs, and their cluster.yaml."""
    work = folder / "work"
    work.mkdir()
    for name in ("examples", "jobspecs"):
        (work / name).symlink_to(ROOT / name)
    cluster = {
        "datacenters": ["dc1"],
        "check_interval_s": 1,
        "check_timeout_s": 1,
        "reschedule_delay_s": 5,
    }
    (work / "cluster.yaml").write_text(yaml.safe_dump(cluster), encoding="utf-8")
    for kind, body in setup_blocks():
        named = _NAMED.match(body)
        if kind == "hcl" and named:
            (work / named.group(1)).write_text(body, encoding="utf-8")
    return work


@contextlib.contextmanager
def _stopped_at_exit(launch_dir: Path) -> Iterator[None]:
    try:
        yield
    finally:
        for record in launch_dir.glob("*.json"):
            pid = json.loads(record.read_text())["pid"]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)


async def _streamed(session: aiohttp.ClientSession, base: str) -> str | None:
    body = {
        "model": SERVED,
        "stream": True,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    async with session.post(f"{base}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            return None
        text, done = "", False
        async for raw in response.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for choice in json.loads(line.removeprefix("data: ")).get("choices", []):
                    text += (choice.get("delta") or {}).get("content") or ""
        return text if done else None


async def test_deploy_doc_setup_run_literally_serves_a_streamed_completion(tmp_path: Path):
    """Sections 2 and 3 of deploy.md, run as written with ACLs on, end in a streamed answer."""
    launch_dir = tmp_path / "launched"
    launch_dir.mkdir()
    work = _work_dir(tmp_path)
    bin_dir = _shims(tmp_path)
    script = "\n".join(body for kind, body in setup_blocks() if kind == "sh")
    config = DevClusterConfig(
        consul=ConsulConfig(session_ttl_min_s=1.0, management_token=MANAGEMENT),
        nomad=NomadServerSettings(
            nodes=default_nodes(cpu_nodes=1, gpu_nodes=2, gpu_node_pool="gpu"),
            data_dir=tmp_path / "nomad",
            token=MANAGEMENT,
        ),
    )
    async with DevCluster(config) as cluster:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("NOMAD_", "CONSUL_", "CARAVAN"))
        }
        env.update(
            PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
            NOMAD_ADDR=cluster.nomad.address,
            CONSUL_HTTP_ADDR=cluster.consul.http_addr,
            NOMAD_TOKEN=MANAGEMENT,
            CONSUL_HTTP_TOKEN=MANAGEMENT,
            DOCS_LAUNCH_DIR=str(launch_dir),
        )
        with _stopped_at_exit(launch_dir):
            shell = await asyncio.create_subprocess_exec(
                "bash", "-euo", "pipefail", "-c", script,
                cwd=work, env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            out, _ = await asyncio.wait_for(shell.communicate(), 120)
            assert 0 == shell.returncode, out.decode()
            router = json.loads((launch_dir / "caravan-router.json").read_text())
            base = f"http://127.0.0.1:{router['port']}"

            def logs() -> str:
                return "\n".join(p.read_text(errors="replace") for p in launch_dir.glob("*.log"))

            async with aiohttp.ClientSession() as session:

                async def answered() -> str | None:
                    with contextlib.suppress(aiohttp.ClientError):
                        return await _streamed(session, base)
                    return None

                text = await eventually(answered, 90, f"a streamed completion\n{logs()[-4000:]}")
                placed = await _caravan_objects(session, cluster.nomad.address)
            assert text
            assert "HTTP 403" not in logs()
            assert {NAMESPACE} == {router["namespace"]}
            assert "caravan-qwen2-5-7b-0" in placed[NAMESPACE]["jobs"]
            assert placed[NAMESPACE]["engine_keys"]
            assert {"jobs": [], "engine_keys": []} == placed["default"]


async def _caravan_objects(
    session: aiohttp.ClientSession, nomad: str
) -> dict[str, dict[str, list[str]]]:
    """Per namespace: the replica jobs (`caravan-<model>-<N>`) and the engine-key Variables."""
    headers = {"X-Nomad-Token": MANAGEMENT}
    found: dict[str, dict[str, list[str]]] = {}
    for namespace in (NAMESPACE, "default"):
        query = f"namespace={namespace}"
        async with session.get(f"{nomad}/v1/jobs?{query}&prefix=caravan-", headers=headers) as got:
            jobs = [job["ID"] for job in await got.json()]
        keys = "nomad/jobs/caravan-engine-keys"
        async with session.get(f"{nomad}/v1/vars?{query}&prefix={keys}", headers=headers) as got:
            variables = [var["Path"] for var in await got.json()]
        found[namespace] = {
            "jobs": sorted(jobs),
            "engine_keys": variables,
        }
    return found
