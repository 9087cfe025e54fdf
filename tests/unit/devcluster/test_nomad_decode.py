"""Decoding, canonicalization and implied constraints of the Nomad stand-in (facts N1, N6, N7)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from caravan_llm.devcluster.nomad.canonicalize import add_implied_constraints, canonicalize_job
from caravan_llm.devcluster.nomad.decode import JOB_REGISTER_REQUEST, DecodeError, decode_body
from caravan_llm.devcluster.nomad.gotext import go_duration, multierror, parse_go_duration

# Copies of the worked examples in nomad-consul-examples/ (the facts sheet).
EXAMPLES = Path(__file__).parents[2] / "contract" / "nomad" / "fixtures"
NS = 1_000_000_000


def example(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((EXAMPLES / name).read_text())
    return document


def minimal_job(**overrides: Any) -> dict[str, Any]:
    job: dict[str, Any] = {
        "ID": "web",
        "TaskGroups": [
            {
                "Name": "g",
                "Tasks": [{"Name": "t", "Driver": "raw_exec", "Config": {"command": "true"}}],
            }
        ],
    }
    job.update(overrides)
    return job


def decode(document: Any) -> dict[str, Any]:
    return decode_body(json.dumps(document).encode(), JOB_REGISTER_REQUEST)


def test_keys_match_case_insensitively_and_unknown_keys_are_dropped() -> None:
    """`id`, `TASKGROUPS` and a made-up key decode like Go's encoding/json would."""
    decoded = decode({"job": {"id": "web", "TASKGROUPS": [{"name": "g"}], "Bogus": 1}})
    assert {"Job": {"ID": "web", "TaskGroups": [{"Name": "g"}]}} == decoded


def test_duration_given_as_string_is_gos_type_error() -> None:
    """A `"10s"` duration is refused with Go's unmarshal message and field path."""
    document = {"Job": minimal_job()}
    document["Job"]["TaskGroups"][0]["Tasks"][0]["KillTimeout"] = "10s"
    with pytest.raises(DecodeError) as caught:
        decode(document)
    expected = (
        "json: cannot unmarshal string into Go struct field "
        "Task.Job.TaskGroups.Tasks.KillTimeout of type time.Duration"
    )
    assert expected == str(caught.value)


def test_check_interval_string_names_the_check_field() -> None:
    """A string check interval fails on `ServiceCheck`, the struct that holds it."""
    document = {"Job": minimal_job()}
    document["Job"]["TaskGroups"][0]["Services"] = [{"Checks": [{"Interval": "10s"}]}]
    with pytest.raises(DecodeError) as caught:
        decode(document)
    assert "Go struct field ServiceCheck.Job.TaskGroups.Services.Checks.Interval" in str(
        caught.value
    )


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            ("Priority",),
            1.5,
            "cannot unmarshal number 1.5 into Go struct field Job.Job.Priority of type int",
        ),
        (
            ("Priority",),
            "50",
            "cannot unmarshal string into Go struct field Job.Job.Priority of type int",
        ),
        (
            ("Datacenters",),
            "dc1",
            "cannot unmarshal string into Go struct field Job.Job.Datacenters of type []string",
        ),
        (
            ("Meta",),
            {"a": 1},
            "cannot unmarshal number into Go struct field Job.Job.Meta of type string",
        ),
        (
            ("Affinities",),
            [{"Weight": 200}],
            (
                "cannot unmarshal number 200 into Go struct field "
                "Affinity.Job.Affinities.Weight of type int8"
            ),
        ),
        (
            ("AllAtOnce",),
            "yes",
            "cannot unmarshal string into Go struct field Job.Job.AllAtOnce of type bool",
        ),
    ],
)
def test_type_mismatches_carry_gos_text(path: tuple[str, ...], value: Any, message: str) -> None:
    """Each wrong JSON type is a DecodeError worded as Go words it."""
    job = minimal_job()
    job[path[0]] = value
    with pytest.raises(DecodeError) as caught:
        decode({"Job": job})
    assert f"json: {message}" == str(caught.value)


def test_null_leaves_a_field_unset() -> None:
    """`"Priority": null` is as if the key were absent."""
    assert "Priority" not in decode({"Job": minimal_job(Priority=None)})["Job"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "Request body is empty"),
        (b'{"Job": {', "unexpected EOF"),
        (b"nope", "invalid character 'n' looking for beginning of value"),
    ],
)
def test_malformed_bodies_are_refused_like_go(body: bytes, message: str) -> None:
    """Empty, truncated and non-JSON bodies give Go's decoder messages."""
    with pytest.raises(DecodeError) as caught:
        decode_body(body, JOB_REGISTER_REQUEST)
    assert message == str(caught.value)


def test_free_form_config_keeps_numbers_as_numbers() -> None:
    """Task `Config` values come through with JSON's own types."""
    document = {"Job": minimal_job()}
    document["Job"]["TaskGroups"][0]["Tasks"][0]["Config"] = {"shm_size": 8589934592, "x": 0.5}
    config = decode(document)["Job"]["TaskGroups"][0]["Tasks"][0]["Config"]
    assert {"shm_size": 8589934592, "x": 0.5} == config


def test_canonicalize_fills_nomads_defaults() -> None:
    """A bare job gets the defaults of `Job.Canonicalize` (facts N6)."""
    job = canonicalize_job(minimal_job())
    group = job["TaskGroups"][0]
    task = group["Tasks"][0]
    expected_job = {
        "Name": "web",
        "Namespace": "default",
        "Region": "global",
        "Type": "service",
        "Priority": 50,
        "Datacenters": ["*"],
        "NodePool": "default",
    }
    assert expected_job == {key: job[key] for key in expected_job}
    assert 1 == group["Count"]
    assert {"Sticky": False, "Migrate": False, "SizeMB": 300} == group["EphemeralDisk"]
    assert {
        "Delay": 15 * NS,
        "Attempts": 2,
        "Interval": 30 * 60 * NS,
        "Mode": "fail",
        "RenderTemplates": False,
    } == group["RestartPolicy"]
    assert {
        "Attempts": 0,
        "Interval": 0,
        "Delay": 30 * NS,
        "DelayFunction": "exponential",
        "MaxDelay": 3600 * NS,
        "Unlimited": True,
    } == group["ReschedulePolicy"]
    assert {
        "MaxParallel": 1,
        "HealthCheck": "checks",
        "MinHealthyTime": 10 * NS,
        "HealthyDeadline": 300 * NS,
    } == group["Migrate"]
    assert 30 * NS == group["Update"]["Stagger"]
    assert {"CPU": 100, "Cores": 0, "MemoryMB": 300} == task["Resources"]
    assert 5 * NS == task["KillTimeout"]
    assert group["RestartPolicy"] == task["RestartPolicy"]


def test_cores_without_cpu_leaves_cpu_zero() -> None:
    """Asking for `Cores` makes the CPU default 0, not 100."""
    job = minimal_job()
    job["TaskGroups"][0]["Tasks"][0]["Resources"] = {"Cores": 2}
    resources = canonicalize_job(job)["TaskGroups"][0]["Tasks"][0]["Resources"]
    assert {"Cores": 2, "CPU": 0, "MemoryMB": 300} == resources


def test_job_update_is_merged_into_groups() -> None:
    """Group `Update` fields override the job's, the rest comes from the job and defaults."""
    job = minimal_job(Update={"MaxParallel": 3, "MinHealthyTime": 2 * NS})
    job["TaskGroups"][0]["Update"] = {"MaxParallel": 1}
    update = canonicalize_job(job)["TaskGroups"][0]["Update"]
    assert (1, 2 * NS, 300 * NS) == (
        update["MaxParallel"],
        update["MinHealthyTime"],
        update["HealthyDeadline"],
    )


def test_service_and_check_defaults() -> None:
    """Services get a name, provider and address mode; checks a name and check_restart grace."""
    job = minimal_job()
    job["TaskGroups"][0]["Services"] = [
        {"PortLabel": "http", "CheckRestart": {"Limit": 3}, "Checks": [{"Type": "http"}]}
    ]
    service = canonicalize_job(job)["TaskGroups"][0]["Services"][0]
    assert ("web-g", "consul", "auto", "default") == (
        service["Name"],
        service["Provider"],
        service["AddressMode"],
        service["Cluster"],
    )
    check = service["Checks"][0]
    assert 'service: "web-g" check' == check["Name"]
    assert {"Limit": 3, "Grace": NS, "IgnoreWarnings": False} == check["CheckRestart"]


def test_affinity_and_spread_weights_default_to_50() -> None:
    """Weights left out are 50, as in `Affinity.Canonicalize`."""
    job = minimal_job(
        Affinities=[{"LTarget": "${node.class}", "Operand": "=", "RTarget": "gpu"}],
        Spreads=[{"Attribute": "${node.datacenter}"}],
    )
    canonical = canonicalize_job(job)
    assert (50, 50) == (canonical["Affinities"][0]["Weight"], canonical["Spreads"][0]["Weight"])


def test_canonicalize_does_not_touch_its_input() -> None:
    """The decoded job is copied, never changed in place."""
    job = minimal_job()
    before = copy.deepcopy(job)
    canonicalize_job(job)
    assert before == job


def test_consul_services_and_kill_signal_imply_constraints() -> None:
    """The vLLM example reads back with the signal and Consul version constraints."""
    job = add_implied_constraints(canonicalize_job(decode(example("vllm_gpu_job.json"))["Job"]))
    expected = [
        {"LTarget": "${attr.os.signals}", "RTarget": "SIGTERM", "Operand": "set_contains"},
        {"LTarget": "${attr.consul.version}", "RTarget": ">= 1.8.0", "Operand": "semver"},
    ]
    assert expected == job["TaskGroups"][0]["Constraints"]


def test_implied_constraints_are_added_once() -> None:
    """Running the mutator twice (a re-register) does not duplicate constraints."""
    job = canonicalize_job(decode(example("llamacpp_cpu_job.json"))["Job"])
    once = add_implied_constraints(job)
    assert once == add_implied_constraints(once)


@pytest.mark.parametrize(
    ("ns", "text"),
    [
        (0, "0s"),
        (500_000_000, "500ms"),
        (1_500_000_000, "1.5s"),
        (90 * NS, "1m30s"),
        (3600 * NS, "1h0m0s"),
        (1500, "1.5µs"),
    ],
)
def test_go_duration_text(ns: int, text: str) -> None:
    """Durations print as Go's `time.Duration.String()`."""
    assert text == go_duration(ns)


@pytest.mark.parametrize(
    ("text", "ns"),
    [("30s", 30 * NS), ("1m", 60 * NS), ("1.5s", 1_500_000_000), ("250ms", 250_000_000)],
)
def test_parse_go_duration(text: str, ns: int) -> None:
    """The `wait` parameter parses Go duration strings."""
    assert ns == parse_go_duration(text)


def test_parse_go_duration_refuses_a_bare_number() -> None:
    """Go requires a unit except for 0."""
    with pytest.raises(ValueError, match="invalid duration"):
        parse_go_duration("30")


def test_multierror_text() -> None:
    """go-multierror's list format, singular and plural."""
    assert "1 error occurred:\n\t* a\n\n" == multierror(["a"])
    assert "2 errors occurred:\n\t* a\n\t* b\n\n" == multierror(["a", "b"])
