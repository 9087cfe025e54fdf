"""Consul health entries decoded once, with their checks; one aggregate status (Consul's rule)."""

from __future__ import annotations

from typing import Any

import pytest

from caravan_llm.common.consul_api import CheckStatus, HealthCheck, HealthEntry, aggregate_status


def entry(*checks: dict[str, Any]) -> HealthEntry:
    return HealthEntry.from_api(
        {
            "Node": {"Node": "client-1", "Address": "10.0.0.11"},
            "Service": {"ID": "svc-1", "Service": "caravan-q", "Port": 8000, "Meta": {}},
            "Checks": list(checks),
        }
    )


SERF = {"CheckID": "serfHealth", "Name": "Serf Health Status", "Status": "passing"}


def test_checks_keep_their_ids_status_and_output() -> None:
    """Every check arrives with Consul's ID, status, owning service and output."""
    engine = {
        "CheckID": "_nomad-check-abc",
        "Name": "engine-health",
        "Status": "critical",
        "ServiceID": "svc-1",
        "Output": "HTTP GET http://10.0.0.11:8000/health: 503",
    }
    decoded = entry(SERF, engine)
    assert (
        HealthCheck("serfHealth", "passing", "Serf Health Status"),
        HealthCheck(
            "_nomad-check-abc",
            "critical",
            "engine-health",
            "svc-1",
            "HTTP GET http://10.0.0.11:8000/health: 503",
        ),
    ) == decoded.checks
    assert "HTTP GET http://10.0.0.11:8000/health: 503" == decoded.checks[1].output
    assert CheckStatus.CRITICAL == decoded.status


@pytest.mark.parametrize(
    ("checks", "expected"),
    [
        ((), CheckStatus.PASSING),
        ((SERF,), CheckStatus.PASSING),
        ((SERF, {"CheckID": "c", "Status": "warning"}), CheckStatus.WARNING),
        ((SERF, {"CheckID": "c", "Status": "critical"}), CheckStatus.CRITICAL),
        # Maintenance wins over everything, whatever the check's own status says.
        ((SERF, {"CheckID": "_node_maintenance", "Status": "passing"}), CheckStatus.CRITICAL),
        (
            (SERF, {"CheckID": "_service_maintenance:svc-1", "Status": "passing"}),
            CheckStatus.CRITICAL,
        ),
        # A status Consul does not know (its aggregate is "") fails closed.
        ((SERF, {"CheckID": "c", "Status": "unknown"}), CheckStatus.CRITICAL),
    ],
)
def test_aggregate_follows_consuls_rule(
    checks: tuple[dict[str, Any], ...], expected: CheckStatus
) -> None:
    """maintenance > critical > warning > passing; no checks is passing."""
    decoded = entry(*checks)
    assert expected == decoded.status == aggregate_status(decoded.checks)


def test_a_maintenance_check_made_by_devcluster_reads_critical() -> None:
    """devcluster's maintenance check (critical, `Service Maintenance Mode`) is maintenance."""
    check = HealthCheck("_service_maintenance:svc-1", "critical", "Service Maintenance Mode")
    assert check.is_maintenance
    assert not HealthCheck("serfHealth", "passing").is_maintenance
