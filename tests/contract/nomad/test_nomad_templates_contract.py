"""A task `template` with `nomadVar` waits for its variable, then feeds the task's env.

Runs against devcluster or a real Nomad (CARAVAN_REAL_NOMAD=1, raw_exec on);
reading the rendered file back from the allocation directory is devcluster-only.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import aiohttp
from nomad_contract_support import NS, NomadTarget, eventually, get_json, sleeper_job
from pydantic import SecretStr

from caravan_llm.common.nomad_api import NomadClient, NomadSettings
from caravan_llm.devcluster.nomad.server import NomadServer

# Exits 3 unless the env var and the rendered file carry the variable's value,
# else writes `ok` into the alloc dir and sleeps.
CHECKER = """
import os, pathlib, sys, time
key = os.environ.get("ENGINE_KEY")
text = pathlib.Path("secrets/key.env").read_text()
if key != "v1-secret" or "ENGINE_KEY=v1-secret" not in text or os.environ.get("OTHER") != "x":
    sys.exit(3)
pathlib.Path(os.environ["NOMAD_ALLOC_DIR"], "ok").write_text("ok")
time.sleep(600)
"""


def template_job(job_id: str, embedded: str) -> dict[str, Any]:
    body = sleeper_job(job_id)
    group = body["Job"]["TaskGroups"][0]
    group["RestartPolicy"] = {"Attempts": 0, "Mode": "fail", "Interval": 30 * NS, "Delay": NS}
    task = group["Tasks"][0]
    task["Config"] = {"command": sys.executable, "args": ["-c", CHECKER]}
    task["Env"] = {"ENGINE_KEY": "from-env-block"}
    task["Templates"] = [
        {
            "EmbeddedTmpl": embedded,
            "DestPath": "secrets/key.env",
            "Envvars": True,
            "ChangeMode": "restart",
        }
    ]
    return body


def checker_job(job_id: str) -> dict[str, Any]:
    return template_job(
        job_id,
        f'{{{{ with nomadVar "nomad/jobs/{job_id}" }}}}'
        "ENGINE_KEY={{ .key }}\n"
        "{{- range .Tuples }}\n{{ .K }}_ITEM={{ .V }}{{ end }}\n"
        "{{ end }}OTHER=x\n",
    )


async def _task_events(http: aiohttp.ClientSession, address: str, job_id: str) -> list[str]:
    allocs = await get_json(http, f"{address}/v1/job/{job_id}/allocations")
    return [
        f"{event['Type']}: {event['DisplayMessage']}"
        for alloc in allocs
        for state in (alloc.get("TaskStates") or {}).values()
        for event in state.get("Events") or []
    ]


async def test_template_waits_for_the_variable_then_sets_the_env(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Missing variable: a `Template` event and no start; once written, the task runs
    with the rendered env (overriding its `env` block) and file."""
    job_id = f"tpl-{unique}"
    path = f"nomad/jobs/{job_id}"
    async with NomadClient(NomadSettings(address=target.address)) as nomad:
        await nomad.register_job(checker_job(job_id))

        async def missing_reported() -> bool:
            events = await _task_events(http, target.address, job_id)
            return any(e.startswith("Template: Missing: nomad.var.block(") for e in events)

        await eventually(missing_reported, timeout_s=20)
        events = await _task_events(http, target.address, job_id)
        assert not any(e.startswith("Started") for e in events)
        await nomad.put_variable(path, {"key": "v1-secret"})

        async def running() -> list[dict[str, Any]] | None:
            allocs = await get_json(http, f"{target.address}/v1/job/{job_id}/allocations")
            live = [a for a in allocs if a["ClientStatus"] == "running"]
            return live or None

        alloc = (await eventually(running, timeout_s=20))[0]
        if target.server is not None:
            server = target.server
            node = server.state.nodes[alloc["NodeID"]]
            alloc_dir = server.data_dir / node.name / "alloc" / alloc["ID"]

            async def ok_written() -> bool:
                return (alloc_dir / "alloc" / "ok").exists()

            await eventually(ok_written, timeout_s=20)
            rendered = (alloc_dir / "sleep" / "secrets" / "key.env").read_text()
            assert "ENGINE_KEY=v1-secret\nkey_ITEM=v1-secret\nOTHER=x\n" == rendered
            assert 0o644 == Path(alloc_dir / "sleep" / "secrets" / "key.env").stat().st_mode & 0o777
        await nomad.deregister_job(job_id, purge=True)
        await nomad.delete_variable(path)


async def test_unsupported_template_kills_the_task(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A template devcluster cannot render fails the task with `Template failed`."""
    server = target.devcluster()
    job_id = f"tplbad-{unique}"
    async with NomadClient(NomadSettings(address=server.address)) as nomad:
        await nomad.put_variable(f"nomad/jobs/{job_id}", {"key": "v"})
        await nomad.register_job(
            template_job(job_id, '{{ with nomadVar "nomad/jobs/x" }}{{ .key | toUpper }}{{ end }}')
        )

        async def failed() -> list[str] | None:
            events = await _task_events(http, server.address, job_id)
            return [e for e in events if e.startswith("Killing: Template failed:")] or None

        assert await eventually(failed, timeout_s=20)
        await nomad.deregister_job(job_id, purge=True)


async def test_with_acls_a_task_reads_only_its_implicit_paths(unique: str) -> None:
    """With ACLs on, a variable outside `nomad/jobs/<job>` stays missing for the task."""
    job_id = f"tplacl-{unique}"
    settings = NomadSettings(address="http://unused", token=SecretStr("mgmt"))
    async with NomadServer(nodes=1, token="mgmt") as server:
        settings = settings.model_copy(update={"address": server.address})
        async with (
            NomadClient(settings) as nomad,
            aiohttp.ClientSession(headers={"X-Nomad-Token": "mgmt"}) as http,
        ):
            await nomad.put_variable("caravan/other", {"key": "v1-secret"})
            await nomad.register_job(
                template_job(job_id, '{{ with nomadVar "caravan/other" }}K={{ .key }}{{ end }}')
            )

            async def missing_reported() -> bool:
                events = await _task_events(http, server.address, job_id)
                return any("nomad.var.block(caravan/other@default.global)" in e for e in events)

            await eventually(missing_reported, timeout_s=20)
            events = await _task_events(http, server.address, job_id)
            assert not any(e.startswith("Started") for e in events)


# Writes the key it started with into the alloc dir, then sleeps.
RECORDER = """
import os, pathlib, time
pathlib.Path(os.environ["NOMAD_ALLOC_DIR"], "seen-" + os.environ["ENGINE_KEY"]).write_text("")
time.sleep(600)
"""


async def test_changed_variable_restarts_the_task_with_the_new_value(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """`ChangeMode: restart`: writing the variable again restarts the task, which then
    sees the new value; the restart does not count against the restart policy."""
    server = target.devcluster()
    job_id = f"tplchg-{unique}"
    path = f"nomad/jobs/{job_id}"
    body = template_job(
        job_id, f'{{{{ with nomadVar "{path}" }}}}ENGINE_KEY={{{{ .key }}}}\n{{{{ end }}}}'
    )
    body["Job"]["TaskGroups"][0]["Tasks"][0]["Config"]["args"] = ["-c", RECORDER]
    async with NomadClient(NomadSettings(address=server.address)) as nomad:
        await nomad.put_variable(path, {"key": "one"})
        await nomad.register_job(body)

        async def alloc_dir() -> Path | None:
            allocs = await get_json(http, f"{server.address}/v1/job/{job_id}/allocations")
            live = [a for a in allocs if a["ClientStatus"] == "running"]
            if not live:
                return None
            node = server.state.nodes[live[0]["NodeID"]]
            folder = server.data_dir / node.name / "alloc" / live[0]["ID"] / "alloc"
            return folder if (folder / "seen-one").exists() else None

        folder = await eventually(alloc_dir, timeout_s=20)
        await nomad.put_variable(path, {"key": "two"})

        async def restarted() -> bool:
            return (folder / "seen-two").exists()

        await eventually(restarted, timeout_s=20)
        events = await _task_events(http, server.address, job_id)
        assert "Restart Signal: Template with change_mode restart re-rendered" in events
        assert not any(e.startswith("Not Restarting") for e in events)
        await nomad.deregister_job(job_id, purge=True)
