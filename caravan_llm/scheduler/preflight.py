"""The scheduler's preflight: the grants its tokens need, each with a probe
(caravan_llm/common/preflight.py).

* nomad: `list-jobs` (watches and plans the replica jobs). Probe: list jobs
  under a prefix no job has.
* nomad: `read-job` (a replica job's evaluations and allocations). Probe: a
  job that does not exist.
* nomad: `node` read (explains placements). Probe: list the nodes.
* nomad: variables read and write on `nomad/jobs/caravan-*` (each model's
  engine API key, with `engine_api_keys`). Probes: read a key that does not
  exist; a check-and-set write that cannot succeed.
* consul: `key_prefix "<prefix>"` write (profiles, desired counts, state, the
  leader lock). Probe: a check-and-set write that cannot succeed.

* nomad: `submit-job` (registers and stops the replica jobs). Probe: plan
  (`POST /v1/job/:id/plan`, a dry run that writes nothing) a minimal valid
  job with no allocations to place. Nomad validates the job before it
  checks `submit-job`, so the job must be valid for a refusal to be 403.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from caravan_llm.common.contract import KVLayout, engine_key_path
from caravan_llm.common.nomad_api import (
    Evaluation,
    JobStub,
    Node,
    QueryResult,
    Variable,
    VariableMetadata,
)
from caravan_llm.common.preflight import IMPOSSIBLE_CAS_INDEX, PROBE_NAME, Capability


class PreflightNomad(Protocol):
    """The Nomad calls the probes make (caravan_llm.common.nomad_api.NomadClient)."""

    async def list_jobs(self, prefix: str = "") -> QueryResult[list[JobStub]]: ...

    async def job_evaluations(self, job_id: str) -> QueryResult[list[Evaluation]]: ...

    async def list_nodes(self, *, resources: bool = True) -> QueryResult[list[Node]]: ...

    async def plan_job(self, job: Mapping[str, Any], *, diff: bool = False) -> dict[str, Any]: ...

    async def get_variable(self, path: str) -> Variable | None: ...

    async def put_variable(
        self, path: str, items: Mapping[str, str], *, cas: int | None = None
    ) -> VariableMetadata: ...


class PreflightConsul(Protocol):
    """The Consul calls the probes make (caravan_llm.common.consul_api.ConsulClient)."""

    async def kv_put(self, key: str, value: bytes | str, *, cas: int | None = None) -> bool: ...


def plan_probe_job() -> dict[str, Any]:
    """The smallest job Nomad validates: one group of count 0, so a plan places nothing."""
    return {
        "ID": PROBE_NAME,
        "Name": PROBE_NAME,
        "Type": "service",
        "Datacenters": ["*"],
        "TaskGroups": [
            {
                "Name": "probe",
                "Count": 0,
                "Tasks": [
                    {
                        "Name": "probe",
                        "Driver": "raw_exec",
                        "Config": {"command": "/bin/true"},
                        "Resources": {"CPU": 10, "MemoryMB": 10},
                    }
                ],
            }
        ],
    }


def scheduler_capabilities(
    layout: KVLayout,
    consul: PreflightConsul,
    nomad: PreflightNomad,
    *,
    engine_api_keys: bool,
) -> list[Capability]:
    """What this scheduler must be allowed; the Variables grants only with engine keys."""
    probe_key = engine_key_path(PROBE_NAME)

    async def write_variable() -> Any:
        return await nomad.put_variable(
            probe_key, {"probe": "never written"}, cas=IMPOSSIBLE_CAS_INDEX
        )

    capabilities = [
        Capability("nomad", "submit-job", lambda: nomad.plan_job(plan_probe_job())),
        Capability("nomad", "list-jobs", lambda: nomad.list_jobs(PROBE_NAME)),
        Capability("nomad", "read-job", lambda: nomad.job_evaluations(PROBE_NAME)),
        Capability("nomad", 'node { policy = "read" }', lambda: nomad.list_nodes(resources=False)),
    ]
    if engine_api_keys:
        capabilities += [
            Capability(
                "nomad",
                "variables read on nomad/jobs/caravan-*",
                lambda: nomad.get_variable(probe_key),
            ),
            Capability("nomad", "variables write on nomad/jobs/caravan-*", write_variable),
        ]
    capabilities.append(
        Capability(
            "consul",
            f'key_prefix "{layout.prefix}" write',
            lambda: consul.kv_put(f"{layout.prefix}{PROBE_NAME}", b"", cas=IMPOSSIBLE_CAS_INDEX),
        )
    )
    return capabilities
