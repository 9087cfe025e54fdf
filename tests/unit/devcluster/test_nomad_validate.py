"""Nomad's job validation messages and their go-multierror nesting (facts N2, N8)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from caravan_llm.devcluster.nomad.canonicalize import add_implied_constraints, canonicalize_job
from caravan_llm.devcluster.nomad.validate import (
    constraint_errors,
    job_warnings,
    validate_job,
    validation_failure_text,
    warnings_text,
)

FIXTURES = Path(__file__).parents[2] / "contract" / "nomad" / "fixtures"
NS = 1_000_000_000


def example_job(name: str) -> dict[str, Any]:
    job: dict[str, Any] = json.loads((FIXTURES / name).read_text())["Job"]
    return job


def admitted(job: dict[str, Any]) -> dict[str, Any]:
    return add_implied_constraints(canonicalize_job(job))


def cpu_job() -> dict[str, Any]:
    return example_job("llamacpp_cpu_job.json")


@pytest.mark.parametrize("name", ["vllm_gpu_job.json", "llamacpp_cpu_job.json"])
def test_worked_examples_are_valid(name: str) -> None:
    """Both example jobs pass validation."""
    assert [] == validate_job(admitted(example_job(name)))


def test_nested_failure_text_matches_nomads_shape() -> None:
    """A bad service name and a short check interval nest under the group, as in #10781."""
    job = cpu_job()
    service = job["TaskGroups"][0]["Services"][0]
    service["Name"] = "qwen2.5"
    service["Checks"][0]["Interval"] = NS // 2
    expected = (
        "1 error occurred:\n"
        "\t* Task group server validation failed: 1 error occurred:\n"
        "\t* Task group service validation failed: 1 error occurred:\n"
        "\t* Service[0] qwen2.5 validation failed: 2 errors occurred:\n"
        "\t* Service name must be valid per RFC 1123 and can contain only alphanumeric "
        'characters or dashes and must be no longer than 63 characters: "qwen2.5"\n'
        '\t* Check service: "qwen2.5" check invalid: interval (500ms) cannot be lower than 1s'
        "\n\n\n\n\n\n\n\n"
    )
    assert expected == validation_failure_text(validate_job(admitted(job)))


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            lambda job: job["TaskGroups"][0]["Services"][0]["Checks"][0].update(Timeout=NS // 10),
            "timeout (100ms) is lower than required minimum timeout 1s",
        ),
        (
            lambda job: job["TaskGroups"][0]["Services"][0]["Checks"][0].pop("Interval"),
            "missing required value interval. Interval cannot be less than 1s",
        ),
        (
            lambda job: job["TaskGroups"][0]["Services"][0].update(Name="x" * 64),
            "must be no longer than 63 characters",
        ),
        (
            lambda job: job["TaskGroups"][0]["Tasks"][0]["Resources"].update(CPU=500),
            "Task can only ask for 'cpu' or 'cores' resource, not both.",
        ),
        (
            lambda job: job["TaskGroups"][0]["Tasks"][0]["Resources"].update(
                Devices=[{"Name": ""}]
            ),
            (
                "device 1 failed validation: 1 error occurred:\n\t* device name must be given "
                "as one of the following: type, vendor/type, or vendor/type/name"
            ),
        ),
        (
            lambda job: job["Constraints"][0].update(Operand=""),
            "Constraint 1 validation failed: 1 error occurred:\n\t* Missing constraint operand",
        ),
        (
            lambda job: job["Constraints"][0].update(LTarget="${node.bogus}"),
            'unsupported attribute "${node.bogus}"',
        ),
        (
            lambda job: job["TaskGroups"][0].update(
                ReschedulePolicy={"Delay": NS, "DelayFunction": "exponential", "Unlimited": True}
            ),
            "Delay cannot be less than 5s (got 1s)",
        ),
        (
            lambda job: job["TaskGroups"][0].update(
                RestartPolicy={"Attempts": 3, "Interval": 10 * NS, "Delay": 5 * NS, "Mode": "fail"}
            ),
            "Nomad can't restart the TaskGroup 3 times in an interval of 10s with a delay of 5s",
        ),
        (
            lambda job: job["TaskGroups"][0].update(
                Update={"MinHealthyTime": 60 * NS, "HealthyDeadline": 30 * NS}
            ),
            "Minimum healthy time must be less than healthy deadline: 1m0s > 30s",
        ),
        (
            lambda job: job.update(
                Affinities=[
                    {"LTarget": "${node.class}", "RTarget": "a", "Operand": "=", "Weight": 0}
                ]
            ),
            "Affinity weight cannot be zero",
        ),
        (
            lambda job: job["Spreads"][0].update(Weight=0),
            "Spread block must have a positive weight from 0 to 100",
        ),
        (
            lambda job: job.update(Type="bogus"),
            'Invalid job type: "bogus"',
        ),
        (
            lambda job: job.update(Priority=101),
            "job priority must be between [1, 100]",
        ),
        (
            lambda job: job["TaskGroups"][0]["Tasks"][0].update(Driver=""),
            "Missing task driver",
        ),
    ],
)
def test_each_rule_reports_nomads_message(change: Any, fragment: str) -> None:
    """Each broken field yields Nomad's own wording somewhere in the error text."""
    job = cpu_job()
    change(job)
    text = validation_failure_text(validate_job(admitted(job)))
    assert fragment in text


def test_http_check_path_must_be_relative() -> None:
    """An absolute URL as the check path is refused."""
    job = cpu_job()
    job["TaskGroups"][0]["Services"][0]["Checks"][0]["Path"] = "http://x/health"
    text = validation_failure_text(validate_job(admitted(job)))
    assert "http type must have relative http path" in text


def test_check_without_any_port_is_refused() -> None:
    """An HTTP check on a service with no port label cannot be registered."""
    job = cpu_job()
    del job["TaskGroups"][0]["Services"][0]["PortLabel"]
    text = validation_failure_text(validate_job(admitted(job)))
    assert "check requires a port but neither check nor service" in text


@pytest.mark.parametrize(
    ("constraint", "errors"),
    [
        ({"LTarget": "${attr.kernel.name}", "RTarget": "linux", "Operand": "="}, []),
        ({"Operand": "distinct_hosts"}, []),
        ({"LTarget": "${attr.x}", "Operand": "="}, ['Operator "=" requires an RTarget']),
        ({"LTarget": "${attr.x}", "RTarget": "a", "Operand": "~"}, ['Unknown constraint type "~"']),
        (
            {"LTarget": "${attr.x}", "RTarget": "y", "Operand": "is_set"},
            ['Operator "is_set" does not support an RTarget'],
        ),
        ({"LTarget": "${attr.x}", "RTarget": "(", "Operand": "regexp"}, None),
        (
            {"LTarget": "${attr.x}", "Operand": "set_contains"},
            ["Set contains constraint requires an RTarget"],
        ),
        ({"RTarget": "a", "Operand": "="}, ["no attribute provided but is required by operator"]),
        (
            {"LTarget": "${attr.x", "RTarget": "a", "Operand": "="},
            ['attribute "${attr.x" is missing a closing brace'],
        ),
        ({"LTarget": "${attr.consul.version}", "RTarget": ">= 1.8.0", "Operand": "semver"}, []),
        (
            {"LTarget": "${attr.consul.version}", "RTarget": "bogus", "Operand": "semver"},
            ["Semver constraint is invalid: Malformed constraint: bogus"],
        ),
    ],
)
def test_constraint_validation(constraint: dict[str, str], errors: list[str] | None) -> None:
    """`Constraint.Validate` per operand (None: any regexp compile message)."""
    actual = constraint_errors(constraint)
    if errors is None:
        assert 1 == len(actual)
        assert actual[0].startswith("Regular expression failed to compile")
    else:
        assert errors == actual


def test_shutdown_delay_warning_for_services_without_one() -> None:
    """A group service with no shutdown delay anywhere is a warning, not an error."""
    warnings = job_warnings(admitted(cpu_job()))
    expected = (
        '1 warning:\n\n* group "server" defines services, but neither the group nor any of '
        "its tasks have shutdown_delay set"
    )
    assert expected == warnings_text(warnings)


def test_max_parallel_above_count_warns() -> None:
    """Nomad's destructive-update warning when MaxParallel exceeds the count."""
    job = cpu_job()
    job["TaskGroups"][0]["Count"] = 2
    job["TaskGroups"][0]["ShutdownDelay"] = NS
    job["Update"] = {"MaxParallel": 3}
    text = warnings_text(job_warnings(admitted(job)))
    assert "Update max parallel count is greater than task group count (3 > 2)" in text
