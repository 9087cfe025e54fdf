"""The control-plane jobspecs: the parts of them caravan relies on."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hcl_documents import (
    JOBSPECS,
    duration_s,
    labelled_blocks,
    only,
    parse_hcl,
    parse_hcl_text,
    plain_blocks,
    resolve_default,
    variable_references,
    walk_keys,
)

from caravan_llm.common.contract import ROUTER_SERVICE, SCHEDULER_SERVICE, SERVICE_TAG, KVLayout

SCHEDULER = JOBSPECS / "caravan-scheduler.nomad.hcl"
ROUTER = JOBSPECS / "caravan-router.nomad.hcl"
ALL_JOBSPECS = [SCHEDULER, ROUTER]
IDS = [path.name for path in ALL_JOBSPECS]

# Environment variables that carry credentials; none may be set inline.
TOKEN_ENV_NAMES = frozenset({"NOMAD_TOKEN", "CONSUL_HTTP_TOKEN", "VAULT_TOKEN"})
_PORT_REFERENCE = re.compile(r"\$\{NOMAD_(?:PORT|IP|ADDR|HOST_PORT|HOST_IP|HOST_ADDR)_(\w+)\}")
_NOMAD_VAR_PATH = re.compile(r'nomadVar "([^"]+)"')


@dataclass(frozen=True, slots=True)
class Jobspec:
    job_id: str
    job: dict[str, Any]
    variables: dict[str, dict[str, Any]]

    @property
    def groups(self) -> dict[str, dict[str, Any]]:
        return labelled_blocks(self.job, "group")

    def group(self) -> dict[str, Any]:
        group: dict[str, Any] = only(self.groups)[1]
        return group

    def task(self) -> dict[str, Any]:
        task: dict[str, Any] = only(labelled_blocks(self.group(), "task"))[1]
        return task

    def default(self, value: Any) -> Any:
        return resolve_default(value, self.variables)


def load_jobspec(path: Path) -> Jobspec:
    return jobspec_from_document(parse_hcl(path))


def jobspec_from_document(document: dict[str, Any]) -> Jobspec:
    job_id, job = only(labelled_blocks(document, "job"))
    return Jobspec(job_id, job, labelled_blocks(document, "variable"))


def services_of(group: dict[str, Any]) -> list[dict[str, Any]]:
    """Group-level and task-level services of a task group."""
    found = list(plain_blocks(group, "service"))
    for task in labelled_blocks(group, "task").values():
        found.extend(plain_blocks(task, "service"))
    return found


def inline_credentials(document: dict[str, Any]) -> list[str]:
    """Where a jobspec sets a credential itself instead of templating it from a secret store."""
    problems = [f"{key} is set inline" for key in walk_keys(document) if key in TOKEN_ENV_NAMES]
    problems.extend(
        f"variable {name!r} would put a secret into the job specification"
        for name in labelled_blocks(document, "variable")
        if "token" in name.lower()
    )
    return problems


def secret_env_templates(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The task's templates that render environment variables from Nomad Variables."""
    return [
        template
        for template in plain_blocks(task, "template")
        if template.get("env") is True and "nomadVar" in template.get("data", "")
    ]


def port_labels_used(group: dict[str, Any]) -> set[str]:
    """Every port label the group's services, checks and tasks refer to."""
    used: set[str] = set()
    for service in services_of(group):
        used.add(service["port"])
        used.update(check["port"] for check in plain_blocks(service, "check") if "port" in check)
    for task in labelled_blocks(group, "task").values():
        for config in plain_blocks(task, "config"):
            used.update(config.get("ports", []))
            used.update(_PORT_REFERENCE.findall(str(config.get("args", []))))
    return used


def port_labels_declared(group: dict[str, Any]) -> set[str]:
    labels: set[str] = set()
    for network in plain_blocks(group, "network"):
        labels.update(labelled_blocks(network, "port"))
    return labels


@pytest.fixture(scope="module")
def scheduler() -> Jobspec:
    return load_jobspec(SCHEDULER)


@pytest.fixture(scope="module")
def router() -> Jobspec:
    return load_jobspec(ROUTER)


def test_scheduler_is_a_service_job_of_two_instances(scheduler: Jobspec):
    """The scheduler is a service job whose single group runs two instances by default."""
    assert ("caravan-scheduler", "service") == (scheduler.job_id, scheduler.job["type"])
    assert scheduler.default(scheduler.group()["count"]) == 2


def test_router_is_a_system_job(router: Jobspec):
    """The router is a system job, so every eligible node runs one."""
    assert ("caravan-router", "system") == (router.job_id, router.job["type"])
    assert "count" not in router.group()


def test_scheduler_instances_spread_across_nodes(scheduler: Jobspec):
    """The scheduler's standbys prefer other nodes than the leader's."""
    spreads = plain_blocks(scheduler.group(), "spread")
    assert ["${node.unique.id}"] == [spread["attribute"] for spread in spreads]


@pytest.mark.parametrize(
    ("path", "service_name"),
    [(SCHEDULER, SCHEDULER_SERVICE), (ROUTER, ROUTER_SERVICE)],
    ids=IDS,
)
def test_service_name_is_the_contract_name(path: Path, service_name: str):
    """Each job registers exactly one Consul service, under the name the contract gives it."""
    services = services_of(load_jobspec(path).group())
    assert [(service_name, "consul")] == [(s["name"], s["provider"]) for s in services]


@pytest.mark.parametrize("path", ALL_JOBSPECS, ids=IDS)
def test_control_plane_services_never_carry_the_model_tag(path: Path):
    """No control-plane service carries the tag the routers discover model replicas by."""
    for service in services_of(load_jobspec(path).group()):
        assert SERVICE_TAG not in service.get("tags", [])


@pytest.mark.parametrize("path", ALL_JOBSPECS, ids=IDS)
def test_every_service_has_an_http_health_check(path: Path):
    """Each service is checked by an HTTP GET of /health, interval and timeout at least 1 s."""
    for service in services_of(load_jobspec(path).group()):
        checks = plain_blocks(service, "check")
        assert [("http", "/health")] == [(c["type"], c["path"]) for c in checks]
        for check in checks:
            assert duration_s(check["interval"]) >= 1
            assert duration_s(check["timeout"]) >= 1


@pytest.mark.parametrize("path", ALL_JOBSPECS, ids=IDS)
def test_port_labels_are_used_consistently(path: Path):
    """Every port label the services and the task use is declared, and every declared one used."""
    group = load_jobspec(path).group()
    assert port_labels_declared(group) == {"http"}
    assert port_labels_used(group) == port_labels_declared(group)


def test_processes_listen_on_the_nomad_port(scheduler: Jobspec, router: Jobspec):
    """Both processes bind the address and port Nomad allocated for the `http` label."""
    scheduler_args = plain_blocks(scheduler.task(), "config")[0]["args"]
    router_args = plain_blocks(router.task(), "config")[0]["args"]
    assert scheduler_args[0] == "scheduler"
    assert router_args[0] == "router"
    for flag, value in [("--http-host", "${NOMAD_IP_http}"), ("--http-port", "${NOMAD_PORT_http}")]:
        assert value == scheduler_args[scheduler_args.index(flag) + 1]
    for flag, value in [("--host", "${NOMAD_IP_http}"), ("--port", "${NOMAD_PORT_http}")]:
        assert value == router_args[router_args.index(flag) + 1]


def test_router_port_is_static_8080_by_default(router: Jobspec):
    """Clients can reach every node's router on port 8080 unless the operator picks another."""
    network = plain_blocks(router.group(), "network")[0]
    assert router.default(labelled_blocks(network, "port")["http"]["static"]) == 8080


def test_router_drains_before_it_stops(router: Jobspec):
    """The router leaves Consul before its stop signal, then has a minute or more for streams."""
    shutdown_delay = router.default(router.group()["shutdown_delay"])
    kill_timeout = router.default(router.task()["kill_timeout"])
    assert duration_s(shutdown_delay) >= 5
    assert duration_s(kill_timeout) >= 60


def test_system_job_has_no_reschedule_policy(router: Jobspec):
    """Nomad rejects a reschedule block in a system job, so the router has none."""
    assert "reschedule" not in router.group()
    assert "reschedule" not in router.job


def test_scheduler_has_update_restart_and_reschedule_policies(scheduler: Jobspec):
    """The scheduler rolls one instance at a time, reverts a failed update, restarts in place."""
    update = plain_blocks(scheduler.job, "update")[0]
    assert (1, True) == (update["max_parallel"], update["auto_revert"])
    assert duration_s(update["min_healthy_time"]) < duration_s(update["healthy_deadline"])
    assert duration_s(update["healthy_deadline"]) < duration_s(update["progress_deadline"])
    assert plain_blocks(scheduler.group(), "restart")
    assert plain_blocks(scheduler.group(), "reschedule")


@pytest.mark.parametrize(
    ("path", "token_lines"),
    [(SCHEDULER, ["NOMAD_TOKEN=", "CONSUL_HTTP_TOKEN="]), (ROUTER, ["CONSUL_HTTP_TOKEN="])],
    ids=IDS,
)
def test_tokens_come_from_the_jobs_nomad_variable(path: Path, token_lines: list[str]):
    """Tokens are rendered from the job's own Nomad Variable into an env file under secrets/."""
    spec = load_jobspec(path)
    templates = secret_env_templates(spec.task())
    assert len(templates) == 1
    template = templates[0]
    assert template["destination"].startswith("secrets/")
    assert [f"nomad/jobs/{spec.job_id}"] == sorted(set(_NOMAD_VAR_PATH.findall(template["data"])))
    for line in token_lines:
        assert line in template["data"]


@pytest.mark.parametrize("path", ALL_JOBSPECS, ids=IDS)
def test_no_credential_is_set_inline(path: Path):
    """Neither jobspec sets a token in an env block, a config or a job variable."""
    assert [] == inline_credentials(parse_hcl(path))


def test_inline_credential_detector_finds_an_inline_token():
    """The inline-credential check reports a token in an env block and a token variable."""
    document = parse_hcl_text(
        'variable "consul_token" {\n  type = string\n}\n\n'
        'job "x" {\n  group "g" {\n    task "t" {\n      env {\n'
        "        CONSUL_HTTP_TOKEN = var.consul_token\n      }\n    }\n  }\n}\n"
    )
    expected = [
        "CONSUL_HTTP_TOKEN is set inline",
        "variable 'consul_token' would put a secret into the job specification",
    ]
    assert expected == inline_credentials(document)


@pytest.mark.parametrize("path", ALL_JOBSPECS, ids=IDS)
def test_templates_write_inside_the_task_directory(path: Path):
    """Every template renders to a relative path under local/ or secrets/."""
    for template in plain_blocks(load_jobspec(path).task(), "template"):
        assert template["destination"].startswith(("local/", "secrets/"))


@pytest.mark.parametrize("path", ALL_JOBSPECS, ids=IDS)
def test_every_declared_variable_is_used(path: Path):
    """Each variable a jobspec declares is referenced by its job."""
    spec = load_jobspec(path)
    assert set(spec.variables) == variable_references(spec.job)


@pytest.mark.parametrize("path", ALL_JOBSPECS, ids=IDS)
def test_every_variable_has_a_type_a_description_and_a_default(path: Path):
    """`nomad job run` works without -var flags, and every variable says what it is."""
    for name, variable in load_jobspec(path).variables.items():
        assert {"type", "description", "default"} <= set(variable), name


@pytest.mark.parametrize("path", ALL_JOBSPECS, ids=IDS)
def test_kv_prefix_default_is_the_contract_default(path: Path):
    """The jobs default to the KV prefix the processes use when given none."""
    assert KVLayout().prefix == load_jobspec(path).variables["kv_prefix"]["default"]


@pytest.mark.parametrize("path", ALL_JOBSPECS, ids=IDS)
def test_image_is_a_variable(path: Path):
    """The container image is chosen by the operator, never fixed in the job."""
    spec = load_jobspec(path)
    assert "${var.image}" == plain_blocks(spec.task(), "config")[0]["image"]


def test_every_jobspec_variable_is_documented():
    """jobspecs/README.md names every variable of both jobspecs."""
    readme = (JOBSPECS / "README.md").read_text(encoding="utf-8")
    for path in ALL_JOBSPECS:
        for name in load_jobspec(path).variables:
            assert f"`{name}`" in readme, f"{path.name}: {name}"


def test_scheduler_api_tokens_come_from_its_variable_and_rotate_without_restart(
    scheduler: Jobspec,
):
    """`api_tokens` becomes a 0400 file the scheduler re-reads (noop), named by the env file."""
    templates = plain_blocks(scheduler.task(), "template")
    [tokens] = [t for t in templates if t["destination"] == "secrets/api-tokens"]
    assert ("noop", "0400") == (tokens["change_mode"], tokens.get("perms"))
    assert ["nomad/jobs/caravan-scheduler"] == sorted(set(_NOMAD_VAR_PATH.findall(tokens["data"])))
    assert ".api_tokens.Value" in tokens["data"]
    [env] = secret_env_templates(scheduler.task())
    assert "CARAVAN_SCHEDULER_API_TOKENS_FILE=" in env["data"]
    assert "/api-tokens" in env["data"]


# Variable key -> (environment variable, file under secrets/) for TLS and mutual TLS.
TLS_FILES = {
    "nomad_cacert": ("NOMAD_CACERT", "nomad-ca.pem"),
    "consul_cacert": ("CONSUL_CACERT", "consul-ca.pem"),
    "nomad_client_cert": ("NOMAD_CLIENT_CERT", "nomad-client.pem"),
    "nomad_client_key": ("NOMAD_CLIENT_KEY", "nomad-client-key.pem"),
    "consul_client_cert": ("CONSUL_CLIENT_CERT", "consul-client.pem"),
    "consul_client_key": ("CONSUL_CLIENT_KEY", "consul-client-key.pem"),
}


@pytest.mark.parametrize("path", ALL_JOBSPECS, ids=IDS)
def test_ca_bundles_and_client_certificates_come_from_the_jobs_variable(path: Path):
    """Both jobs take each CA and mTLS file from their variable, keys readable by the task only."""
    spec = load_jobspec(path)
    (env_template,) = secret_env_templates(spec.task())
    files = {
        template["destination"]: template
        for template in spec.task()["template"]
        if template["destination"].endswith(".pem")
    }
    for key, (variable, name) in TLS_FILES.items():
        line = f'{{{{ with .{key}.Value }}}}{variable}={{{{ env "NOMAD_SECRETS_DIR" }}}}/{name}'
        assert line in env_template["data"], (path.name, key)
        rendered = files[f"secrets/{name}"]
        assert f"{{{{ .{key}.Value }}}}" in rendered["data"], (path.name, key)
        assert ("0400" if key.endswith("_key") else None) == rendered.get("perms"), key
