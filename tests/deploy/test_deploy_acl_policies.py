"""The least-privilege ACL policies in terraform/policies/, as Consul and Nomad would read them.

The templates are rendered with the module's defaults (KV prefix `caravan/`,
namespace `default`), or with the namespace `caravan` where the docs show
them (deploy.md and security.md create caravan's own), parsed as HCL, and
the grants are evaluated with Consul's rule: the longest matching prefix
decides, and an exact `key` rule beats any prefix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hcl_documents import ROOT, TERRAFORM, labelled_blocks, parse_hcl, parse_hcl_text

from caravan_llm.common.contract import KVLayout

POLICIES = TERRAFORM / "policies"
SECURITY_DOC = ROOT / "docs" / "security.md"
DEFAULTS = {
    "kv_prefix": KVLayout().prefix,
    "kv_history_prefix": KVLayout().history,
    "namespace": "default",
}
# The namespace the docs create and render the policies with (deploy.md section 2).
DOCS_NAMESPACE = "caravan"
RANK = {"deny": 0, "read": 1, "list": 1, "write": 2}


def render(name: str, *, namespace: str = DEFAULTS["namespace"]) -> str:
    text = (POLICIES / name).read_text(encoding="utf-8")
    for variable, value in {**DEFAULTS, "namespace": namespace}.items():
        text = text.replace("${" + variable + "}", value)
    assert "${" not in text, name
    return text


def consul_rules(component: str) -> dict[str, Any]:
    return parse_hcl_text(render(f"caravan-{component}.consul.hcl.tftpl"))


def consul_grant(rules: dict[str, Any], resource: str, name: str) -> str:
    """What a Consul policy allows on `resource` `name`: the longest prefix decides."""
    exact = labelled_blocks(rules, resource)
    if name in exact:
        policy: str = exact[name]["policy"]
        return policy
    best: tuple[int, str] = (-1, "deny")
    for prefix, body in labelled_blocks(rules, f"{resource}_prefix").items():
        if name.startswith(prefix) and len(prefix) > best[0]:
            best = (len(prefix), body["policy"])
    return best[1]


def allows(rules: dict[str, Any], resource: str, name: str, access: str) -> bool:
    return RANK[consul_grant(rules, resource, name)] >= RANK[access]


def test_every_template_in_the_folder_is_used_by_the_module():
    """acl.tf creates a policy from each template, and each template renders to valid HCL."""
    templates = sorted(p.name for p in POLICIES.glob("*.tftpl"))
    acl_tf = (TERRAFORM / "acl.tf").read_text(encoding="utf-8")
    for name in templates:
        parse_hcl_text(render(name))
        component, system = name.removeprefix("caravan-").split(".")[:2]
        assert f'"{component}"' in acl_tf, name
        assert f"caravan-${{each.key}}.{system}.hcl.tftpl" in acl_tf, name
    assert isinstance(parse_hcl(TERRAFORM / "acl.tf"), dict)


def test_router_writes_only_demand_records():
    """The router reads caravan's view and writes nothing but the cold-start demand keys."""
    rules = consul_rules("router")
    layout = KVLayout()
    assert allows(rules, "key", layout.demand_key("m"), "write")
    read_only = [
        layout.model_key("m"),
        layout.desired_key("m"),
        layout.draining_key("j"),
        layout.placements_key("m"),
    ]
    for key in read_only:
        assert allows(rules, "key", key, "read"), key
        assert not allows(rules, "key", key, "write"), key
    assert not allows(rules, "key", "other-app/secret", "read")
    assert not allows(rules, "service", "caravan-m", "write")
    assert not allows(rules, "session", "node-1", "write")


def test_scheduler_owns_the_prefix_and_nothing_else_writable():
    """The scheduler writes caravan's prefix and its lock sessions; services it only reads."""
    rules = consul_rules("scheduler")
    layout = KVLayout()
    for key in [
        layout.model_key("m"),
        layout.desired_key("m"),
        layout.leader,
        layout.cluster_config,
    ]:
        assert allows(rules, "key", key, "write"), key
    assert not allows(rules, "key", "other-app/secret", "read")
    assert allows(rules, "session", "node-1", "write")
    assert allows(rules, "service", "caravan-m", "read")
    assert not allows(rules, "service", "caravan-m", "write")
    assert not allows(rules, "service", "billing", "read")


def test_operator_declares_models_but_cannot_forge_control_plane_records():
    """A model operator writes profiles and desired counts, never the lock or drain markers."""
    rules = consul_rules("operator")
    layout = KVLayout()
    assert allows(rules, "key", layout.model_key("m"), "write")
    assert allows(rules, "key", layout.desired_key("m"), "write")
    assert allows(rules, "key", layout.models_revision, "write")
    assert allows(rules, "key", layout.override_key("m"), "write")
    for key in [
        layout.leader,
        layout.draining_key("j"),
        layout.cluster_config,
        layout.failure_key("m"),
    ]:
        assert not allows(rules, "key", key, "write"), key


def nomad_variables(component: str) -> dict[str, list[str]]:
    rules = parse_hcl_text(render(f"caravan-{component}.nomad.hcl.tftpl"))
    namespace = labelled_blocks(rules, "namespace")["default"]
    paths: dict[str, list[str]] = {}
    for variables in namespace.get("variables", []):
        for path, body in labelled_blocks(variables, "path").items():
            paths[path] = body["capabilities"]
    return paths


@pytest.mark.parametrize("component", ["scheduler", "router"])
def test_nobody_reads_the_control_planes_own_variables(component: str):
    """The variables holding the scheduler's and router's tokens are denied to both tokens."""
    paths = nomad_variables(component)
    assert ["deny"] == paths["nomad/jobs/caravan-scheduler"]
    assert ["deny"] == paths["nomad/jobs/caravan-router"]


def test_router_nomad_policy_only_reads_variables():
    """The router's Nomad token reads engine keys and has no job or node capability."""
    rules = parse_hcl_text(render("caravan-router.nomad.hcl.tftpl"))
    namespace = labelled_blocks(rules, "namespace")["default"]
    assert "capabilities" not in namespace
    assert "node" not in rules
    for capabilities in nomad_variables("router").values():
        assert set(capabilities) <= {"read", "list", "deny"}


def test_security_doc_shows_the_rendered_policies():
    """docs/security.md carries every policy exactly as the module creates it with the defaults
    and `namespace = "caravan"`."""
    doc = SECURITY_DOC.read_text(encoding="utf-8")
    for path in sorted(POLICIES.glob("*.tftpl")):
        assert render(path.name, namespace=DOCS_NAMESPACE).strip() in doc, path.name


def test_docs_name_no_policy_file_that_does_not_exist():
    """Every policy template the docs point at exists."""
    doc = SECURITY_DOC.read_text(encoding="utf-8") + (TERRAFORM / "README.md").read_text(
        encoding="utf-8"
    )
    for word in doc.split("`"):
        if word.endswith(".hcl.tftpl"):
            assert (POLICIES / Path(word).name).is_file(), word


DEPLOY_DOC = ROOT / "docs" / "deploy.md"
_NAMED_HCL_BLOCK = re.compile(
    r"^```hcl\n# (caravan-[a-z]+)\.([a-z]+)-policy\.hcl\n(.*?)^```", re.MULTILINE | re.DOTALL
)


def deploy_doc_policies() -> dict[str, str]:
    """Each policy file deploy.md has the operator save: template name -> its text."""
    doc = DEPLOY_DOC.read_text(encoding="utf-8")
    return {
        f"{name}.{system}.hcl.tftpl": body.strip()
        for name, system, body in _NAMED_HCL_BLOCK.findall(doc)
    }


def test_deploy_doc_policies_are_the_rendered_templates():
    """deploy.md's scheduler and router policies are terraform/policies rendered, nothing else."""
    shown = deploy_doc_policies()
    expected = {
        f"caravan-{component}.{system}.hcl.tftpl"
        for component in ("scheduler", "router")
        for system in ("consul", "nomad")
    }
    assert expected == set(shown) & expected
    for name in sorted(expected):
        assert render(name, namespace=DOCS_NAMESPACE).strip() == shown[name], name


def test_deploy_doc_scheduler_nomad_policy_may_write_the_engine_keys():
    """The scheduler's policy in deploy.md reaches the engine keys' Variables (finding 1)."""
    rules = parse_hcl_text(deploy_doc_policies()["caravan-scheduler.nomad.hcl.tftpl"])
    namespace = labelled_blocks(rules, "namespace")[DOCS_NAMESPACE]
    paths = {
        path: body["capabilities"]
        for variables in namespace["variables"]
        for path, body in labelled_blocks(variables, "path").items()
    }
    assert {"read", "write"} <= set(paths["nomad/jobs/caravan-*"])
