"""The CLI-to-API table the executable-docs test runs the documented commands through.

Each row turns one documented `nomad` / `consul` command into the request the
real CLI sends (paths and bodies of the Nomad and Consul HTTP APIs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from doc_commands import Launch, NoTranslation, Request, parse_flags, translate


@pytest.fixture
def cwd(tmp_path: Path) -> Path:
    (tmp_path / "p.hcl").write_text('node {\n  policy = "read"\n}\n')
    (tmp_path / "tokens.txt").write_text("t1\n")
    (tmp_path / "m.yaml").write_bytes(b"name: m\n")
    return tmp_path


def test_go_flags_take_a_value_either_way_and_stop_at_the_first_argument():
    """`-a v`, `-a=v` and `--a v` are the same flag; arguments follow the flags."""
    flags, rest = parse_flags(["-a", "1", "--a=2", "-b", "x", "-a", "3"], {"a"}, {"b"})
    assert ({"a": ["1", "2"], "b": ["true"]}, ["x", "-a", "3"]) == (flags, rest)


def test_nomad_policy_apply_posts_the_file_and_a_job_binding(cwd: Path):
    """`nomad acl policy apply [-namespace N -job J] NAME FILE` posts the rules (and JobACL)."""
    plain = translate(["nomad", "acl", "policy", "apply", "-description", "d", "p", "p.hcl"], cwd)
    assert Request(
        "nomad", "POST", "/v1/acl/policy/p",
        {"Name": "p", "Description": "d", "Rules": (cwd / "p.hcl").read_text()},
    ) == plain  # fmt: skip
    bound = translate(
        ["nomad", "acl", "policy", "apply", "-namespace", "default", "-job", "j", "p", "p.hcl"], cwd
    )
    assert isinstance(bound, Request)
    assert {"Namespace": "default", "JobID": "j", "Group": "", "Task": ""} == bound.body["JobACL"]


def test_nomad_token_create_and_var_put(cwd: Path):
    """Token create posts name, type and policies; var put reads @files and honours -force."""
    token = translate(
        [
            "nomad",
            "acl",
            "token",
            "create",
            "-name",
            "n",
            "-type",
            "client",
            "-policy",
            "p",
            "-json",
        ],
        cwd,
    )
    assert Request(
        "nomad", "POST", "/v1/acl/token",
        {"Name": "n", "Type": "client", "Policies": ["p"], "Global": False}, output="json",
    ) == token  # fmt: skip
    put = translate(["nomad", "var", "put", "a/b", "k=v", "t=@tokens.txt"], cwd)
    assert Request(
        "nomad", "PUT", "/v1/var/a/b?cas=0",
        {"Namespace": "default", "Path": "a/b", "Items": {"k": "v", "t": "t1\n"}},
    ) == put  # fmt: skip
    forced = translate(["nomad", "var", "put", "-force", "a/b", "k=v"], cwd)
    assert isinstance(forced, Request)
    assert "/v1/var/a/b" == forced.path


def test_consul_commands(cwd: Path):
    """Consul's policy create, token create and kv put, as their HTTP calls."""
    policy = translate(["consul", "acl", "policy", "create", "-name", "p", "-rules", "@p.hcl"], cwd)
    assert Request(
        "consul", "PUT", "/v1/acl/policy",
        {"Name": "p", "Description": "", "Rules": (cwd / "p.hcl").read_text()},
    ) == policy  # fmt: skip
    token = translate(
        ["consul", "acl", "token", "create", "-description", "d", "-policy-name", "p",
         "-format=json"], cwd,
    )  # fmt: skip
    assert Request(
        "consul", "PUT", "/v1/acl/token",
        {"Description": "d", "Policies": [{"Name": "p"}]}, output="json",
    ) == token  # fmt: skip
    kv = translate(["consul", "kv", "put", "caravan/models/m", "@m.yaml"], cwd)
    assert Request("consul", "PUT", "/v1/kv/caravan/models/m", raw=b"name: m\n") == kv


def test_job_run_starts_the_jobspecs_task_and_unknown_commands_fail(cwd: Path):
    """`nomad job run` of a caravan jobspec is its process; a command with no row is refused."""
    run = translate(
        ["nomad", "job", "run", "-var", "image=x", "jobspecs/caravan-router.nomad.hcl"], cwd
    )
    assert Launch("router", {"image": "x"}) == run
    with pytest.raises(NoTranslation):
        translate(["nomad", "job", "stop", "x"], cwd)
    with pytest.raises(NoTranslation):
        translate(["consul", "acl", "token", "create", "-secret", "s"], cwd)


def test_namespace_apply_and_namespaced_commands(cwd: Path):
    """`nomad namespace apply` writes the namespace; -namespace goes with var put and job run."""
    apply = translate(["nomad", "namespace", "apply", "-description", "d", "caravan"], cwd)
    assert Request(
        "nomad", "PUT", "/v1/namespace", {"Name": "caravan", "Description": "d"}
    ) == apply  # fmt: skip
    put = translate(["nomad", "var", "put", "-namespace", "caravan", "a/b", "k=v"], cwd)
    assert Request(
        "nomad", "PUT", "/v1/var/a/b?cas=0&namespace=caravan",
        {"Namespace": "caravan", "Path": "a/b", "Items": {"k": "v"}},
    ) == put  # fmt: skip
    run = translate(
        ["nomad", "job", "run", "-var", "namespace=caravan", "jobspecs/caravan-router.nomad.hcl"],
        cwd,
    )
    assert isinstance(run, Launch)
    assert "caravan" == run.job_namespace
    flagged = translate(
        ["nomad", "job", "run", "-namespace", "ops", "jobspecs/caravan-router.nomad.hcl"], cwd
    )
    assert isinstance(flagged, Launch)
    assert "ops" == flagged.job_namespace
