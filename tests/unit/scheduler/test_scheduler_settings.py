"""SchedulerSettings: environment names, the deprecated alias, the parts built from it, docs."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from caravan_llm.common.consul_api import ConsulClient, ConsulSettings
from caravan_llm.common.leader import ElectionSettings
from caravan_llm.common.nomad_api import NomadClient, NomadSettings
from caravan_llm.common.settings_help import env_names, setting_docs, settings_error_lines
from caravan_llm.router.settings import RouterSettings
from caravan_llm.scheduler.app import build_scheduler
from caravan_llm.scheduler.autoscale.loop import AutoscalerSettings
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.controller import ControllerSettings
from caravan_llm.scheduler.plan import PlanSettings
from caravan_llm.scheduler.server import deprecated_alias_used
from caravan_llm.scheduler.settings import SchedulerSettings

REPO = Path(__file__).resolve().parents[3]
TOKEN = "t" * 32


@pytest.fixture(autouse=True)
def _no_inherited_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Variables of the machine running the tests do not leak into these settings."""
    for name in list(os.environ):
        if name.startswith(("CARAVAN_SCHEDULER_", "CARAVAN_KV_PREFIX")):
            monkeypatch.delenv(name)


def test_every_tunable_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """CARAVAN_SCHEDULER_<FIELD> sets the controller, planner, autoscaler and election settings."""
    for name, value in {
        "RESYNC_S": "7",
        "APPLY_CONCURRENCY": "9",
        "EMPTY_LIST_CONFIRM_S": "11",
        "BACKOFF_INITIAL_S": "0.5",
        "BACKOFF_MAX_S": "12",
        "REPLACE_LOST_AFTER_S": "13",
        "ORPHAN_CONFIRM_S": "14",
        "SIBLING_WAIT_S": "16",
        "MOVE_BACKOFF_S": "17",
        "REQUEUE_S": "3",
        "AUTOSCALE_TICK_S": "4",
        "AUTOSCALE_SCRAPE_TIMEOUT_S": "1.5",
        "LEADER_TTL_S": "20",
        "LEADER_LOCK_DELAY_S": "2",
        "LEADER_RETRY_INTERVAL_S": "0.25",
        "LEADER_RESIGN_TIMEOUT_S": "3",
        "INSTANCE_ID": "sched-a",
        "KV_PREFIX": "team/",
    }.items():
        monkeypatch.setenv(f"CARAVAN_SCHEDULER_{name}", value)

    settings = SchedulerSettings()

    assert (
        ControllerSettings(
            plan=PlanSettings(
                replace_lost_after_s=13,
                orphan_confirm_s=14,
                sibling_wait_s=16,
                move_backoff_s=17,
                requeue_s=3,
            ),
            resync_s=7,
            apply_concurrency=9,
            empty_list_confirm_s=11,
            backoff_initial_s=0.5,
            backoff_max_s=12,
        )
        == settings.controller_settings()
    )
    assert AutoscalerSettings(tick_s=4, scrape_timeout_s=1.5) == settings.autoscaler_settings()
    election = settings.election_settings()
    assert ("team/leader", b"sched-a", 20, 2, 0.25, 3) == (
        election.key,
        election.value,
        election.ttl_s,
        election.lock_delay_s,
        election.retry_interval_s,
        election.shutdown_timeout_s,
    )


def test_the_defaults_are_those_of_the_parts() -> None:
    """With nothing set, the settings build exactly the parts' own defaults."""
    settings = SchedulerSettings()
    assert ControllerSettings() == settings.controller_settings()
    assert AutoscalerSettings() == settings.autoscaler_settings()
    assert ("127.0.0.1", 8090, "caravan/", True) == (
        settings.http_host,
        settings.http_port,
        settings.kv_prefix,
        settings.autoscale,
    )


def test_the_deprecated_kv_prefix_variable_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """CARAVAN_KV_PREFIX sets kv_prefix; CARAVAN_SCHEDULER_KV_PREFIX wins when both are set."""
    monkeypatch.setenv("CARAVAN_KV_PREFIX", "old/")
    assert "old/" == SchedulerSettings().kv_prefix
    assert deprecated_alias_used({"CARAVAN_KV_PREFIX": "old/"})

    monkeypatch.setenv("CARAVAN_SCHEDULER_KV_PREFIX", "new/")
    assert "new/" == SchedulerSettings().kv_prefix
    assert not deprecated_alias_used(
        {"CARAVAN_KV_PREFIX": "old/", "CARAVAN_SCHEDULER_KV_PREFIX": "new/"}
    )


def test_the_settings_are_frozen() -> None:
    """A built settings object cannot be changed afterwards."""
    settings = SchedulerSettings()
    with pytest.raises(ValidationError):
        settings.http_port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CARAVAN_SCHEDULER_HTTP_PORT", "70000"),
        ("CARAVAN_SCHEDULER_RESYNC_S", "0"),
        ("CARAVAN_SCHEDULER_APPLY_CONCURRENCY", "zero"),
        ("CARAVAN_SCHEDULER_KV_PREFIX", "/no-slash"),
        ("CARAVAN_KV_PREFIX", "no-slash"),
        ("CARAVAN_SCHEDULER_LOG_LEVEL", "loud"),
    ],
)
def test_a_bad_value_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """Each refused value gives one line that starts with the variable to fix."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as caught:
        SchedulerSettings()
    lines = settings_error_lines(SchedulerSettings, caught.value)
    assert 1 == len(lines)
    assert variable in lines[0].split(": ")[0].split(" or ")


def test_backoff_bounds_must_be_ordered() -> None:
    """backoff_initial_s above backoff_max_s is refused, naming both."""
    with pytest.raises(ValidationError, match="backoff_initial_s"):
        SchedulerSettings(backoff_initial_s=10, backoff_max_s=5)


def test_the_token_source_reads_the_same_variables(tmp_path: Path) -> None:
    """api_tokens / api_tokens_file become the API's token source; none means loopback only."""
    assert SchedulerSettings().token_source() is None
    static = SchedulerSettings(api_tokens=SecretStr(TOKEN)).token_source()
    assert static is not None
    assert 1 == len(static.current().digests)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n{'u' * 32}\n", encoding="utf-8")
    from_file = SchedulerSettings(api_tokens_file=tokens).token_source()
    assert from_file is not None
    assert 2 == len(from_file.current().digests)


async def test_every_part_is_built_before_run() -> None:
    """build_scheduler returns the controller, autoscaler, election, API and watches, configured."""
    settings = SchedulerSettings(
        resync_s=3, autoscale_tick_s=1, instance_id="me", kv_prefix="x/", http_port=0
    )
    consul = ConsulClient(ConsulSettings.from_env({"CONSUL_HTTP_ADDR": "127.0.0.1:1"}))
    nomad = NomadClient(NomadSettings.from_env({"NOMAD_ADDR": "http://127.0.0.1:1"}))
    process = build_scheduler(settings, config=ClusterConfig(), consul=consul, nomad=nomad)

    assert settings.controller_settings() == process.controller.settings
    assert settings.autoscaler_settings() == process.autoscaler.settings
    assert settings.election_settings() == process.election.settings
    assert "x/" == process.watches.layout.prefix
    assert process.watches.wake is process.wake
    assert (False, None) == (process.ready.is_set(), process.bound_port)


def _readme_table_variables() -> set[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("| scheduler setting |")
    table = text[start : text.index("\n\n", start)]
    names: set[str] = set()
    for row in table.splitlines()[2:]:
        first_cell = row.split("|")[1]
        names.update(re.findall(r"`(CARAVAN_[A-Z0-9_]+)`", first_cell))
    return names


def test_the_readme_table_lists_exactly_the_settings() -> None:
    """README's scheduler settings table names every field's variables, and nothing else."""
    expected = {
        name
        for field in SchedulerSettings.model_fields
        for name in env_names(SchedulerSettings, field)
    }
    assert expected == _readme_table_variables()


@pytest.mark.parametrize(
    ("module", "settings_cls"), [("scheduler", SchedulerSettings), ("router", RouterSettings)]
)
def test_help_lists_every_setting(module: str, settings_cls: type[SchedulerSettings]) -> None:
    """`python -m caravan_llm.scheduler --help` and `python -m caravan_llm.router --help` name
    every variable, exit 0."""
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (0, "") == (done.returncode, done.stderr)
    missing = [doc.env[0] for doc in setting_docs(settings_cls) if doc.env[0] not in done.stdout]
    assert [] == missing


def test_no_tunable_of_the_parts_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every field of ControllerSettings, PlanSettings, AutoscalerSettings and ElectionSettings
    follows a SchedulerSettings field: with every variable set off its default, none of them
    keeps its own default (a tunable added to a part without a setting fails here)."""
    off_default = {
        name: "0.125"
        for name, info in SchedulerSettings.model_fields.items()
        if info.annotation is float
    }
    more = {"apply_concurrency": "9", "kv_prefix": "x/", "instance_id": "me", "backoff_max_s": "9"}
    for name, value in {**off_default, **more}.items():
        monkeypatch.setenv(f"CARAVAN_SCHEDULER_{name.upper()}", value)
    settings = SchedulerSettings()
    built = {
        "controller": settings.controller_settings(),
        "plan": settings.plan_settings(),
        "autoscaler": settings.autoscaler_settings(),
        "election": settings.election_settings(),
    }
    defaults = {
        "controller": ControllerSettings(),
        "plan": PlanSettings(),
        "autoscaler": AutoscalerSettings(),
        "election": ElectionSettings(key="caravan/leader"),
    }
    unset = [
        f"{part}.{field.name}"
        for part, value in built.items()
        for field in dataclasses.fields(value)
        if field.name not in {"plan", "session_name"}
        and getattr(value, field.name) == getattr(defaults[part], field.name)
    ]
    assert [] == unset
