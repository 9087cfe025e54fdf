"""The Terraform module in terraform/ and its example root, read with python-hcl2."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hcl_documents import (
    JOBSPECS,
    TERRAFORM,
    labelled_blocks,
    parse_hcl,
    plain_blocks,
    variable_references,
)

from caravan_llm.common.contract import ROUTER_SERVICE, KVLayout
from caravan_llm.scheduler.cluster_config import load_cluster_config
from caravan_llm.scheduler.profiles import parse_profile_text

EXAMPLE_ROOT = TERRAFORM / "examples" / "basic"
MODULE_FILES = sorted(TERRAFORM.glob("*.tf"))
ALL_TF_FILES = sorted(TERRAFORM.rglob("*.tf"))
# Arguments of a module block that are Terraform's own, not module variables.
MODULE_META_ARGUMENTS = frozenset(
    {"source", "version", "providers", "depends_on", "count", "for_each"}
)
_JOBSPEC_FILE = re.compile(r'file\("\$\{path\.module\}/([^"]+)"\)')


def merged(paths: list[Path]) -> dict[str, list[Any]]:
    """The top-level blocks of several files, as Terraform reads a directory."""
    document: dict[str, list[Any]] = {}
    for path in paths:
        for kind, entries in parse_hcl(path).items():
            document.setdefault(kind, []).extend(entries)
    return document


def resources(document: dict[str, list[Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Resource bodies by (type, name)."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for entry in document.get("resource", []):
        for resource_type, by_name in entry.items():
            for name, body in by_name.items():
                found[resource_type, name] = body
    return found


@pytest.fixture(scope="module")
def module() -> dict[str, list[Any]]:
    return merged(MODULE_FILES)


@pytest.fixture(scope="module")
def module_variables(module: dict[str, list[Any]]) -> dict[str, dict[str, Any]]:
    return labelled_blocks(module, "variable")


@pytest.mark.parametrize(
    "path", ALL_TF_FILES, ids=[str(p.relative_to(TERRAFORM)) for p in ALL_TF_FILES]
)
def test_every_tf_file_parses(path: Path):
    """Every .tf file in terraform/ is valid HCL."""
    assert isinstance(parse_hcl(path), dict)


def test_module_requires_the_nomad_and_consul_providers():
    """versions.tf pins the HashiCorp Nomad and Consul providers."""
    terraform = plain_blocks(parse_hcl(TERRAFORM / "versions.tf"), "terraform")[0]
    providers = plain_blocks(terraform, "required_providers")[0]
    sources = {name: spec["source"] for name, spec in providers.items()}
    assert {"nomad": "hashicorp/nomad", "consul": "hashicorp/consul"} == sources


def test_every_variable_has_a_description_and_a_type(module_variables: dict[str, dict[str, Any]]):
    """Each module variable says what it is and what type it takes."""
    for name, variable in module_variables.items():
        assert variable.get("description"), name
        assert variable.get("type"), name


def test_every_variable_is_used(module: dict[str, list[Any]], module_variables: dict[str, Any]):
    """Each module variable is referenced outside its own declaration."""
    body_without_variables = {kind: v for kind, v in module.items() if kind != "variable"}
    assert set(module_variables) == variable_references(body_without_variables)


def test_every_variable_and_output_is_documented(
    module: dict[str, list[Any]], module_variables: dict[str, Any]
):
    """terraform/README.md names every variable and every output of the module."""
    readme = (TERRAFORM / "README.md").read_text(encoding="utf-8")
    for name in [*module_variables, *labelled_blocks(module, "output")]:
        assert f"`{name}`" in readme, name


def test_every_output_has_a_description(module: dict[str, list[Any]]):
    """Each module output says what it holds."""
    for name, output in labelled_blocks(module, "output").items():
        assert output.get("description"), name


def test_router_dns_output_is_the_contract_service(module: dict[str, list[Any]]):
    """The DNS name the module reports is the router's Consul service name."""
    dns_name = labelled_blocks(module, "output")["router_dns_name"]["value"]
    assert f"{ROUTER_SERVICE}.service.consul" == dns_name


def test_kv_prefix_default_is_the_contract_default(module_variables: dict[str, dict[str, Any]]):
    """The module writes models under the prefix the processes read by default."""
    assert KVLayout().prefix == module_variables["kv_prefix"]["default"]


@pytest.mark.parametrize("job", ["scheduler", "router"])
def test_jobs_pass_only_variables_their_jobspec_declares(module: dict[str, list[Any]], job: str):
    """Each nomad_job reads an existing jobspec and passes it only variables it declares.

    Nomad rejects an undeclared variable, and parses list values as HCL, so
    lists must travel JSON-encoded.
    """
    body = resources(module)["nomad_job", job]
    match = _JOBSPEC_FILE.search(body["jobspec"])
    assert match is not None
    jobspec_path = (TERRAFORM / match.group(1)).resolve()
    assert jobspec_path.parent == JOBSPECS
    jobspec_variables = labelled_blocks(parse_hcl(jobspec_path), "variable")
    passed = plain_blocks(body, "hcl2")[0]["vars"]
    assert set(passed) <= set(jobspec_variables)
    for name, value in passed.items():
        if jobspec_variables[name]["type"].startswith(("${list", "${map", "${set", "${object")):
            assert value.startswith("${jsonencode("), name


def test_both_jobs_get_every_shared_setting(module: dict[str, list[Any]]):
    """Image, placement and KV prefix reach both jobs, so they can never disagree."""
    found = resources(module)
    for job in ["scheduler", "router"]:
        passed = plain_blocks(found["nomad_job", job], "hcl2")[0]["vars"]
        for name in ["image", "datacenters", "namespace", "region", "kv_prefix", "consul_addr"]:
            assert name in passed, f"{job}: {name}"


def test_models_are_consul_keys_named_after_the_profile(module: dict[str, list[Any]]):
    """One KV entry per profile file, at <prefix>models/<name>, holding the profile as JSON."""
    locals_block = {k: v for block in plain_blocks(module, "locals") for k, v in block.items()}
    assert "var.profile_files" in locals_block["profiles"]
    assert "yamldecode(file(path)).name" in locals_block["profiles"]
    models = resources(module)["consul_keys", "models"]
    assert "${local.profiles}" == models["for_each"]
    key = plain_blocks(models, "key")[0]
    assert "${var.kv_prefix}models/${each.key}" == key["path"]
    assert "${jsonencode(yamldecode(file(each.value)))}" == key["value"]
    assert key["delete"] is True


def test_example_passes_only_declared_variables(module_variables: dict[str, dict[str, Any]]):
    """The example root sets only variables the module declares, and every required one."""
    example = merged(sorted(EXAMPLE_ROOT.glob("*.tf")))
    call = labelled_blocks(example, "module")["caravan"]
    assert (EXAMPLE_ROOT / call["source"]).resolve() == TERRAFORM
    passed = set(call) - MODULE_META_ARGUMENTS
    required = {name for name, variable in module_variables.items() if "default" not in variable}
    assert passed <= set(module_variables)
    assert required <= passed


def test_example_root_variables_are_used_and_described():
    """The example root's own variables are described and referenced."""
    example = merged(sorted(EXAMPLE_ROOT.glob("*.tf")))
    variables = labelled_blocks(example, "variable")
    for name, variable in variables.items():
        assert variable.get("description"), name
    body_without_variables = {kind: v for kind, v in example.items() if kind != "variable"}
    assert set(variables) == variable_references(body_without_variables)


def _example_profile_paths() -> list[Path]:
    call = labelled_blocks(merged(sorted(EXAMPLE_ROOT.glob("*.tf"))), "module")["caravan"]
    return [
        (EXAMPLE_ROOT / path.replace("${path.module}/", "")).resolve()
        for path in call["profile_files"]
    ]


def test_example_profiles_become_valid_kv_values():
    """Each example profile, as jsonencode(yamldecode(file(...))) writes it, is a valid profile."""
    names: list[str] = []
    for path in _example_profile_paths():
        value = json.dumps(yaml.safe_load(path.read_text(encoding="utf-8")))
        profile = parse_profile_text(value, str(path))
        names.append(profile.name)
    assert len(names) >= 2
    assert sorted(set(names)) == sorted(names)


def test_example_cluster_config_is_valid():
    """The example's cluster config loads as a scheduler cluster config."""
    config = load_cluster_config(EXAMPLE_ROOT / "cluster.yaml")
    assert ("*",) == config.datacenters
