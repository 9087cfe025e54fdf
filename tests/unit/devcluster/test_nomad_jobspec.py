"""devcluster's jobs/parse: HCL2 jobspecs to Nomad's API JSON, and what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from caravan_llm.devcluster.nomad.jobspec import JobspecError, parse_jobspec

ROUTER = (Path(__file__).resolve().parents[3] / "jobspecs" / "caravan-router.nomad.hcl").read_text()


def test_variable_validation_refuses_a_bad_value() -> None:
    """caravan's kv_prefix validation runs: a prefix without a trailing slash is refused."""
    with pytest.raises(JobspecError, match="The kv_prefix must end with a slash"):
        parse_jobspec(ROUTER, variables={"kv_prefix": "caravan"})


def test_variables_override_defaults_with_their_types() -> None:
    """A number variable given as text becomes a number; interpolation uses the value."""
    job = parse_jobspec(ROUTER, variables={"http_port": "9000", "kv_prefix": "x/"})
    group = job["TaskGroups"][0]
    assert 9000 == group["Networks"][0]["ReservedPorts"][0]["Value"]
    assert "x/" == group["Tasks"][0]["Config"]["args"][-1]


def test_heredoc_is_dedented_and_keeps_its_last_newline() -> None:
    """`<<-EOT` strips the common indentation, as HCL does."""
    hcl = 'job "x" {\n  meta {\n    a = <<-EOT\n      one\n        two\n      EOT\n  }\n}\n'
    assert "one\n  two\n" == parse_jobspec(hcl)["Meta"]["a"]


def test_escaped_interpolation_stays_literal() -> None:
    """`$${x}` is the text `${x}`; `${node.class}` stays for the client to fill in."""
    hcl = 'job "x" {\n  meta {\n    a = "$${var.y} ${node.class}"\n  }\n}\n'
    assert "${var.y} ${node.class}" == parse_jobspec(hcl)["Meta"]["a"]


@pytest.mark.parametrize(
    ("hcl", "message"),
    [
        ('job "x" { priority = var.nope }', 'undeclared input variable: "nope"'),
        ('job "x" { priority = max(1, 2) }', 'Call to unknown function: "max"'),
        ('job "x" {}\njob "y" {}', "expected 1 job block, found 2"),
        ('job "x" { kill_timeout = "soon" }', '"kill_timeout" = "soon" is not a duration'),
        ('job "x" {\n  vault {\n    role = "r"\n  }\n}\n', 'block "vault" is not supported'),
    ],
)
def test_unsupported_hcl_is_refused_by_name(hcl: str, message: str) -> None:
    """Anything devcluster does not evaluate is an error saying what, never a guess."""
    with pytest.raises(JobspecError, match=message):
        parse_jobspec(hcl)


def test_lifecycle_is_one_object() -> None:
    """A task's lifecycle block is Nomad's single TaskLifecycle object, not a list."""
    hcl = (
        'job "x" {\n  group "g" {\n    task "t" {\n      lifecycle {\n'
        '        hook    = "prestart"\n        sidecar = true\n      }\n    }\n  }\n}\n'
    )
    task = parse_jobspec(hcl)["TaskGroups"][0]["Tasks"][0]
    assert {"Hook": "prestart", "Sidecar": True} == task["Lifecycle"]


def test_undeclared_variable_values_are_refused() -> None:
    """A value for a variable the jobspec does not declare is an error naming it."""
    with pytest.raises(JobspecError, match='"nope" was assigned'):
        parse_jobspec(ROUTER, variables={"nope": "1"})
