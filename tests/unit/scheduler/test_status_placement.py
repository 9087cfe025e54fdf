"""`caravan status` of a replica Nomad cannot place (pure `assess` and `replica_status`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from profile_builders import make_llamacpp

from caravan_llm.common.nomad_api import Allocation, Evaluation, JobStub
from caravan_llm.scheduler.assess import assess
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.render import render
from caravan_llm.scheduler.status import replica_status
from caravan_llm.scheduler.world import DesiredModel, Observation, replica_from_job_stub

BLOCKED = {
    "Status": "blocked",
    "CreateIndex": 20,
    "FailedTGAllocs": {
        "engine": {"NodesEvaluated": 1, "NodesInPool": 1, "DimensionExhausted": {"cores": 1}}
    },
}


def status_of(allocs: list[dict[str, Any]], evaluations: list[dict[str, Any]]) -> Any:
    profile = make_llamacpp(resources={"cores": 3})
    config = ClusterConfig()
    stub = JobStub.from_api(render(profile, 1, config=config)["Job"])
    seen = replica_from_job_stub(stub)
    assert seen is not None
    seen = replace(seen, allocs=tuple(Allocation.from_api(a) for a in allocs))
    observation = Observation(
        replicas={seen.job_id: seen},
        nodes={},
        draining={},
        taken_at=100.0,
        evaluations={seen.job_id: tuple(Evaluation.from_api(e) for e in evaluations)},
    )
    judged = assess({profile.name: DesiredModel(profile, 1)}, observation, config, 100.0)
    return replica_status(judged.replicas[seen.job_id], seen, observation, 100.0)


def test_lost_replica_waiting_for_a_node_says_why_naming_the_pool():
    """A replica whose only allocation was lost with its node, and whose replacement is
    blocked, is 'pending placement' with the blocked evaluation's reason and the pool."""
    lost = {"ID": "a1", "NodeID": "n1", "DesiredStatus": "stop", "ClientStatus": "lost"}
    status = status_of([lost], [BLOCKED])
    assert "pending placement" == status.state
    assert status.pending_reason == (
        'every matching node in node pool "default" is full '
        "(1 node has fewer than 3 free cores; 1 node evaluated)"
    )


def test_running_replica_ignores_old_blocked_evaluations():
    """A replica with a running allocation shows it (starting: no check passes yet),
    whatever evaluations say."""
    alive = {"ID": "a2", "NodeID": "n2", "DesiredStatus": "run", "ClientStatus": "running"}
    status = status_of([alive], [BLOCKED])
    assert ("starting", None) == (status.state, status.pending_reason)


def test_lost_replica_without_blocked_evaluation_reports_the_loss():
    """With no blocked evaluation (Nomad is placing it now) the lost allocation is shown."""
    lost = {"ID": "a3", "NodeID": "n1", "DesiredStatus": "stop", "ClientStatus": "lost"}
    assert "lost" == status_of([lost], []).state
