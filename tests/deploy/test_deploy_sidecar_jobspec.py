"""The sidecar router example: a router task in the application's own group, on its loopback."""

from __future__ import annotations

from typing import Any

import pytest
from hcl_documents import JOBSPECS, labelled_blocks, only, parse_hcl, plain_blocks
from test_deploy_jobspecs import inline_credentials, secret_env_templates, services_of

from caravan_llm.common.contract import KVLayout
from caravan_llm.router.settings import RouterSettings

SIDECAR = JOBSPECS / "caravan-router-sidecar.nomad.hcl"


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return parse_hcl(SIDECAR)


@pytest.fixture(scope="module")
def group(document: dict[str, Any]) -> dict[str, Any]:
    _, job = only(labelled_blocks(document, "job"))
    _, body = only(labelled_blocks(job, "group"))
    return body


def tasks(group: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return labelled_blocks(group, "task")


def env_of(task: dict[str, Any]) -> dict[str, Any]:
    env: dict[str, Any] = {}
    for block in plain_blocks(task, "env"):
        env.update(block)
    return env


def variable_default(document: dict[str, Any], name: str) -> Any:
    return labelled_blocks(document, "variable")[name]["default"]


def test_router_is_a_prestart_sidecar_of_the_application(group: dict[str, Any]):
    """The router task starts before the application and runs beside it, in the same group."""
    router = tasks(group)["caravan-router"]
    assert [{"hook": "prestart", "sidecar": True}] == plain_blocks(router, "lifecycle")
    assert "app" in tasks(group)


def test_router_listens_on_the_groups_loopback_only(
    document: dict[str, Any], group: dict[str, Any]
):
    """Bridge networking gives the group its own loopback; the router binds 127.0.0.1 there."""
    assert ["bridge"] == [network["mode"] for network in plain_blocks(group, "network")]
    args = plain_blocks(tasks(group)["caravan-router"], "config")[0]["args"]
    assert "router" == args[0]
    assert "127.0.0.1" == args[args.index("--host") + 1]
    assert "${var.router_port}" == args[args.index("--port") + 1]
    assert KVLayout().prefix == variable_default(document, "kv_prefix")


def test_application_calls_the_sidecar(document: dict[str, Any], group: dict[str, Any]):
    """The application's OpenAI base URL is the sidecar's loopback address and port."""
    env = env_of(tasks(group)["app"])
    assert "http://127.0.0.1:${var.router_port}/v1" == env["OPENAI_BASE_URL"]
    assert isinstance(variable_default(document, "router_port"), int)


def test_sidecar_settings_are_valid_router_settings(group: dict[str, Any]):
    """Every CARAVAN_ROUTER_* the sidecar sets is a router setting with a valid value."""
    env = env_of(tasks(group)["caravan-router"])
    router_env = {k: v for k, v in env.items() if k.startswith("CARAVAN_ROUTER_")}
    fields = {
        name.removeprefix("CARAVAN_ROUTER_").lower(): value for name, value in router_env.items()
    }
    assert set(fields) <= set(RouterSettings.model_fields)
    settings = RouterSettings(**fields)
    assert settings.register_service is False


def test_sidecar_registers_no_service_of_its_own(group: dict[str, Any]):
    """Clients never look a sidecar up, so the group registers no router service."""
    assert [] == services_of(group)


def test_sidecar_is_small(document: dict[str, Any]):
    """The sidecar's default footprint is a fraction of the system-job router's."""
    assert variable_default(document, "cpu") <= 250
    assert variable_default(document, "memory") <= 128


def test_sidecar_tokens_come_from_the_jobs_nomad_variable(group: dict[str, Any]):
    """The sidecar's tokens are rendered from the application job's own Nomad Variable."""
    templates = secret_env_templates(tasks(group)["caravan-router"])
    assert len(templates) == 1
    assert 'nomadVar "nomad/jobs/chat-app"' in templates[0]["data"]
    assert templates[0]["destination"].startswith("secrets/")


def test_sidecar_sets_no_credential_inline(document: dict[str, Any]):
    """No token in an env block or a variable."""
    assert [] == inline_credentials(document)
