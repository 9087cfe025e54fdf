"""`caravan scale` flags, and how list and status show a hold and a failure."""

from __future__ import annotations

import argparse
import time

import pytest
from test_model_formatting import model

from caravan_llm.cli.model_commands import (
    CommandError,
    _wait_ready,
    add_commands,
    format_list,
    format_status,
    parse_duration,
)
from caravan_llm.scheduler.api import _scale_request

UNTIL = 1_700_003_600.0


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("1d", 86400)]
)
def test_durations_read_as_seconds(text: str, seconds: float):
    """--for takes s, m, h and d, alone or combined largest first."""
    assert seconds == parse_duration(text)


@pytest.mark.parametrize("text", ["", "10", "1x", "m", "30m1h", "0s", "-5m"])
def test_bad_durations_name_the_flag(text: str):
    """Anything else is refused with the flag and the value named."""
    with pytest.raises(CommandError, match="--for: "):
        parse_duration(text)


def test_help_states_the_default_hold():
    """The scale help says how long a count is held by default."""
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    scale = parser.parse_args(["scale", "m", "3"])
    auto = parser.parse_args(["scale", "m", "--auto"])
    text = parser._subparsers._group_actions[0].choices["scale"].format_help()

    assert (3, None, False) == (scale.replicas, scale.hold, scale.auto)
    assert (None, True) == (auto.replicas, auto.auto)
    assert "default 1h" in " ".join(text.split())


def test_list_and_status_show_the_hold_with_its_expiry_and_the_failure():
    """A held model says until when; a failed one says why, as the router does."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(UNTIL))
    held = model(status="ready", override={"count": 3, "until": UNTIL})
    failed = model(
        name="bad", status="failed", failure={"reason": "replica 0: exit 1", "since": UNTIL - 60}
    )

    listing = format_list([held, failed])
    status = format_status(held, UNTIL - 600)
    failed_status = format_status(failed, UNTIL)

    assert f"ready; held at 3 until {when}" in listing
    assert "failed: replica 0: exit 1" in listing
    assert f"held at 3 by `caravan scale` until {when} (10m left)" in status
    assert "`caravan scale qwen --auto` hands it back to the autoscaler" in status
    assert "failed 60s ago: replica 0: exit 1; requests get 503" in failed_status


@pytest.mark.parametrize(
    ("body", "parsed"),
    [
        ({"replicas": 2}, (2, None)),
        ({"replicas": 2, "hold_s": 60}, (2, 60.0)),
        ({"auto": True}, (None, None)),
        ({"replicas": "2"}, "replicas must be an integer, got '2'"),
        ({"replicas": 2, "hold_s": "1h"}, "hold_s must be a number of seconds, got '1h'"),
        ({"auto": True, "replicas": 2}, 'auto: give {"auto": true} alone'),
        ({"auto": False}, 'auto: give {"auto": true} alone'),
        ({"replica": 2}, "body must be JSON like"),
        ([], "body must be JSON like"),
    ],
)
def test_api_scale_bodies(body: object, parsed: object):
    """The API's scale route takes the CLI's options and names what is wrong otherwise."""
    result = _scale_request(body)
    if isinstance(parsed, str):
        assert isinstance(result, str)
        assert result.startswith(parsed)
    else:
        assert parsed == result


class FailedModels:
    """A model the scheduler recorded as failed, as `describe` returns it."""

    async def describe(self, name: str) -> dict[str, object]:
        return model(
            name=name,
            status="failed",
            ready=0,
            desired=1,
            failure={"reason": "replica 0: exit 1", "since": UNTIL},
        )


async def test_submit_wait_stops_at_once_on_a_failed_model(capsys: pytest.CaptureFixture[str]):
    """`submit --wait` gives up with the reason instead of waiting out its timeout."""
    code = await _wait_ready(FailedModels(), ["bad"], timeout_s=600)  # type: ignore[arg-type]

    assert 1 == code
    assert "bad failed: replica 0: exit 1" in capsys.readouterr().err
