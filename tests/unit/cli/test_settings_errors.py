"""A setting that cannot be used is reported the same way by every command that reads it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from caravan_llm.cli.main import main
from caravan_llm.common.settings_help import SETTINGS_EXIT_CODE, print_settings_errors
from caravan_llm.router.settings import RouterSettings
from caravan_llm.scheduler.settings import SchedulerSettings


@pytest.mark.parametrize(
    ("settings_cls", "variable"),
    [(RouterSettings, "CARAVAN_ROUTER_PORT"), (SchedulerSettings, "CARAVAN_SCHEDULER_HTTP_PORT")],
)
def test_a_bad_value_is_one_error_line_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    settings_cls: type[BaseSettings],
    variable: str,
) -> None:
    """One `error: VARIABLE: problem` line on stderr, never the value, and exit status 2."""
    monkeypatch.setenv(variable, "secret-looking-value")
    with pytest.raises(ValidationError) as caught:
        settings_cls()

    code = print_settings_errors(settings_cls, caught.value)

    lines = capsys.readouterr().err.splitlines()
    assert (2, 1) == (code, len(lines))
    assert lines[0].startswith(f"error: {variable}: ")
    assert "secret-looking-value" not in lines[0]


@pytest.mark.parametrize("command", ["router", "scheduler"])
def test_the_cli_commands_name_the_variable_as_the_processes_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """`caravan router|scheduler` with a bad port name its variable, as `python -m` does."""
    variable = {"router": "CARAVAN_ROUTER_PORT", "scheduler": "CARAVAN_SCHEDULER_HTTP_PORT"}
    monkeypatch.setenv(variable[command], "eighty")

    code = main([command])

    [line] = capsys.readouterr().err.splitlines()
    assert SETTINGS_EXIT_CODE == code
    assert line.startswith(f"error: {variable[command]}: ")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["router", "--workers", "0"], "workers"),
        (["scheduler", "--http-port", "70000"], "http_port"),
    ],
)
def test_a_bad_flag_is_named_as_the_flag_not_the_variable(
    capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    """A value given on the command line is named by its flag's field, not by a variable."""
    assert SETTINGS_EXIT_CODE == main(argv)
    assert capsys.readouterr().err.startswith(f"error: {named}: ")
