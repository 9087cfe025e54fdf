"""devcluster's Nomad ACL core: rule parsing, merging, matching and route requirements."""

from __future__ import annotations

import pytest

from caravan_llm.devcluster.nomad.acl import (
    AclRequestError,
    AclStore,
    Management,
    NamespaceOp,
    PolicyError,
    Scalar,
    VariableOp,
    allowed,
    compile_acl,
    glob_match,
    job_volumes_allowed,
    parse_rules,
    requirement,
)


def acl_of(*texts: str):
    return compile_acl("accessor", [parse_rules(t) for t in texts])


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("*", "anything/at/all", True),
        ("nomad/jobs/caravan-*", "nomad/jobs/caravan-a-0", True),
        ("nomad/jobs/caravan-*", "nomad/jobs/other", False),
        ("a*c", "abc", True),
        ("a*c", "ac", True),
        ("a*b*c", "axxbyyc", True),
        ("a*b*c", "acb", False),
        ("exact", "exact", True),
        ("exact", "exactly", False),
    ],
)
def test_glob_matches_like_go_glob(pattern: str, name: str, expected: bool) -> None:
    """`*` matches any run of characters, `/` included."""
    assert expected == glob_match(pattern, name)


def test_policy_shorthand_expands_and_read_implies_list() -> None:
    """`policy = "read"` gives read-job/list-jobs, not submit-job; a read path may be listed."""
    acl = acl_of(
        'namespace "default" {\n  policy = "read"\n'
        '  variables {\n    path "a/*" {\n      capabilities = ["read"]\n    }\n  }\n}\n'
    )
    assert acl.allow_namespace_op("default", "read-job")
    assert acl.allow_namespace_op("default", "list-jobs")
    assert not acl.allow_namespace_op("default", "submit-job")
    assert acl.allow_variable_op("default", "a/b", "list")
    assert not acl.allow_variable_op("default", "a/b", "write")
    assert not acl.allow_namespace_op("other", "read-job")


def test_deny_clears_a_namespace_in_either_order() -> None:
    """deny wins whether it comes before or after a grant."""
    write = 'namespace "default" {\n  policy = "write"\n}\n'
    deny = 'namespace "default" {\n  capabilities = ["deny"]\n}\n'
    for order in ((write, deny), (deny, write)):
        assert not acl_of(*order).allow_namespace_op("default", "submit-job")


def test_exact_namespace_beats_glob_and_closest_glob_wins() -> None:
    """An exact namespace rule wins over globs; among globs the closest one."""
    acl = acl_of(
        'namespace "*" {\n  policy = "write"\n}\n'
        'namespace "prod-*" {\n  policy = "read"\n}\n'
        'namespace "prod-secret" {\n  policy = "deny"\n}\n'
    )
    assert acl.allow_namespace_op("dev", "submit-job")
    assert not acl.allow_namespace_op("prod-a", "submit-job")
    assert acl.allow_namespace_op("prod-a", "read-job")
    assert not acl.allow_namespace_op("prod-secret", "read-job")
    # `*` asks whether any namespace allows the operation.
    assert acl.allow_namespace_op("*", "submit-job")


def test_scalar_blocks_take_the_highest_privilege_and_deny_above_all() -> None:
    """node read + node write = write; anything + deny = deny."""
    read, write = 'node {\n  policy = "read"\n}\n', 'node {\n  policy = "write"\n}\n'
    deny = 'node {\n  policy = "deny"\n}\n'
    assert acl_of(read, write).allow_node_write()
    assert not acl_of(write, deny).allow_node_read()
    assert not acl_of(read).allow_agent_read()


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('namespace "default" {\n  capabilities = ["fly"]\n}\n', "Invalid namespace capability"),
        ('namespace "default" {\n  policy = "all"\n}\n', "Invalid namespace policy"),
        ('node {\n  policy = "everything"\n}\n', "Invalid node policy"),
        ('namespace "default" {\n  variables {\n  }\n}\n', "no variable paths"),
        (
            (
                'namespace "d" {\n  variables {\n    path "/x" {\n      capabilities = ["read"]\n'
                "    }\n  }\n}\n"
            ),
            "leading '/'",
        ),
        ('namespace "default" {\n  polcy = "read"\n}\n', "polcy"),
        ('nodes {\n  policy = "read"\n}\n', "nodes"),
        ('node_pool "gpu" {\n  policy = "read"\n}\n', "node_pool"),
        ('sentinel {\n  policy = "read"\n}\n', "sentinel"),
        ('{"namespace": {"default": {"policy": "read"}}}', "JSON"),
        ("namespace {", "Failed to parse"),
    ],
)
def test_rules_nomad_or_devcluster_refuse_are_errors_naming_the_problem(
    text: str, fragment: str
) -> None:
    """Nothing is silently ignored."""
    with pytest.raises(PolicyError, match=fragment):
        parse_rules(text)


@pytest.mark.parametrize(
    ("method", "path", "need"),
    [
        ("PUT", "/v1/jobs", NamespaceOp(("submit-job", "register-job"))),
        ("GET", "/v1/jobs", NamespaceOp(("list-jobs",))),
        ("GET", "/v1/job/x", NamespaceOp(("read-job",))),
        ("DELETE", "/v1/job/x", NamespaceOp(("submit-job", "purge-job", "deregister-job"))),
        ("GET", "/v1/job/x/evaluations", NamespaceOp(("read-job",))),
        ("POST", "/v1/job/x/plan", NamespaceOp(("submit-job", "plan-job"))),
        ("GET", "/v1/allocations", NamespaceOp(("read-job",))),
        ("POST", "/v1/allocation/a/stop", NamespaceOp(("alloc-lifecycle",))),
        ("POST", "/v1/deployment/fail/d", NamespaceOp(("submit-job", "fail-deployment"))),
        ("GET", "/v1/deployment/d", NamespaceOp(("read-job",))),
        ("GET", "/v1/nodes", Scalar("node", write=False)),
        ("POST", "/v1/node/n/drain", Scalar("node", write=True)),
        ("GET", "/v1/agent/self", Scalar("agent", write=False)),
        ("GET", "/v1/var/nomad/jobs/a", VariableOp("nomad/jobs/a", "read")),
        ("PUT", "/v1/var/nomad/jobs/a", VariableOp("nomad/jobs/a", "write")),
        ("DELETE", "/v1/var/nomad/jobs/a", VariableOp("nomad/jobs/a", "destroy")),
        ("POST", "/v1/devcluster/node", Management()),
    ],
)
def test_each_route_needs_what_nomads_endpoint_checks(method: str, path: str, need: object) -> None:
    """The route table behind the middleware."""
    assert need == requirement(method, path)


def test_a_requirement_is_met_only_by_a_matching_grant() -> None:
    """allowed() puts requirement and ACL together."""
    acl = acl_of('namespace "default" {\n  capabilities = ["register-job"]\n}\n')
    assert allowed(acl, requirement("PUT", "/v1/jobs"), "default")
    assert not allowed(acl, requirement("DELETE", "/v1/job/x"), "default")
    assert not allowed(acl, requirement("POST", "/v1/devcluster/node"), "default")


def test_host_volumes_need_a_mount_grant() -> None:
    """Job.Register: a read-only host volume needs mount-readonly (or readwrite)."""
    job = {"TaskGroups": [{"Volumes": {"w": {"Type": "host", "Source": "weights"}}}]}
    read_only = {"TaskGroups": [{"Volumes": {"w": {**job["TaskGroups"][0]["Volumes"]["w"]}}}]}
    read_only["TaskGroups"][0]["Volumes"]["w"]["ReadOnly"] = True
    reader = acl_of('host_volume "weights" {\n  policy = "read"\n}\n')
    assert job_volumes_allowed(reader, "default", read_only)
    assert not job_volumes_allowed(reader, "default", job)
    assert job_volumes_allowed(acl_of('host_volume "*" {\n  policy = "write"\n}\n'), "d", job)
    assert not job_volumes_allowed(acl_of('node {\n  policy = "read"\n}\n'), "default", job)


def test_csi_volumes_need_plugin_read_and_csi_mount_volume() -> None:
    """allowCSIMount: `plugin` read (write does not imply it) and csi-mount-volume."""
    job = {"TaskGroups": [{"Volumes": {"w": {"Type": "csi", "Source": "weights"}}}]}
    mount = 'namespace "default" {\n  capabilities = ["csi-mount-volume"]\n}\n'
    assert job_volumes_allowed(acl_of(mount, 'plugin {\n  policy = "read"\n}\n'), "default", job)
    assert not job_volumes_allowed(acl_of(mount), "default", job)
    assert not job_volumes_allowed(
        acl_of(mount, 'plugin {\n  policy = "write"\n}\n'), "default", job
    )


_SECRETS_RULES = """
namespace "default" {
  variables {
    path "caravan/secrets/*" {
      capabilities = ["read"]
    }
  }
}
"""


def _bound(store: AclStore, name: str, job_acl: dict[str, str]) -> None:
    body = {"Name": name, "Description": "", "Rules": _SECRETS_RULES, "JobACL": job_acl}
    store.store_policy(store.prepare_policy(name, body), index=2)


def test_a_policy_bound_to_a_job_grants_only_that_jobs_workloads() -> None:
    """`nomad acl policy apply -job J`: J's tasks read the path; other jobs' tasks do not."""
    store = AclStore("management")
    _bound(store, "secrets-j0", {"Namespace": "default", "JobID": "j0"})
    assert store.workload_acl("default", "j0", "g", "t").allow_variable_op(
        "default", "caravan/secrets/hf", "read"
    )
    assert not store.workload_acl("default", "j1", "g", "t").allow_variable_op(
        "default", "caravan/secrets/hf", "read"
    )
    assert not store.workload_acl("other", "j0", "g", "t").allow_variable_op(
        "other", "caravan/secrets/hf", "read"
    )


def test_a_job_binding_names_the_job_before_its_group_and_task() -> None:
    """Nomad refuses a JobACL with a group but no job, or a task but no group."""
    store = AclStore("management")
    body = {"Name": "p", "Rules": _SECRETS_RULES, "JobACL": {"Namespace": "default", "Task": "t"}}
    with pytest.raises(AclRequestError, match="group must be set to set task"):
        store.prepare_policy("p", body)
