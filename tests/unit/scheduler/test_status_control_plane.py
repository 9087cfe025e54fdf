"""scheduler/status.py: what misconfigured schedulers and routers say in their health checks."""

from __future__ import annotations

from caravan_llm.common.consul_api import HealthCheck, HealthEntry
from caravan_llm.scheduler.status import misconfigured_instances


def entry(output: str, node: str = "n1") -> HealthEntry:
    return HealthEntry(
        node=node,
        node_address="10.0.0.1",
        service_id="caravan-router-1",
        service_name="caravan-router",
        service_address="10.0.0.1",
        port=8080,
        tags=(),
        meta={},
        checks=(HealthCheck(check_id="c", status="critical", output=output),),
    )


def test_the_missing_grants_of_a_misconfigured_instance_are_named_with_its_node() -> None:
    """A 503 `misconfigured` body in a check's output lists each missing grant."""
    output = (
        "HTTP GET http://10.0.0.1:8080/health: 503 Service Unavailable Output: "
        '{"status":"misconfigured","missing":["nomad: variables read on a/*"]}'
    )

    assert ["caravan-router on n1: token lacks nomad: variables read on a/*"] == (
        misconfigured_instances([entry(output)])
    )


def test_other_failures_and_healthy_answers_name_nothing() -> None:
    """A starting router, a dial error or a passing check is not a missing grant."""
    outputs = [
        'HTTP GET http://x/health: 503 Service Unavailable Output: {"status":"starting"}',
        'Get "http://x/health": dial tcp 10.0.0.1:8080: connect: connection refused',
        'HTTP GET http://x/health: 200 OK Output: {"status":"ok"}',
        "HTTP GET http://x/health: 503 Service Unavailable Output: not json",
    ]

    assert [] == misconfigured_instances([entry(o) for o in outputs])
