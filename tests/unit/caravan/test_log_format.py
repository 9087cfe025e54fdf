"""Log lines: one JSON object per record, event first, context fields from `extra`."""

from __future__ import annotations

import io
import json
import logging

from caravan_llm.common.log_format import (
    JsonLineFormatter,
    RepeatLimiter,
    TextFormatter,
    configure_logging,
)


def record(**extra: object) -> logging.LogRecord:
    entry = logging.LogRecord("router.proxy", logging.INFO, "proxy.py", 1, "request", (), None)
    for key, value in extra.items():
        setattr(entry, key, value)
    return entry


def test_json_line_has_event_level_and_extra_fields() -> None:
    """The event name, the level and every extra field appear; nothing else is invented."""
    line = json.loads(JsonLineFormatter().format(record(model="qwen", status=200)))

    assert {"ts", "level", "logger", "event", "model", "status"} == set(line)
    assert ("info", "request", "qwen", 200) == (
        line["level"],
        line["event"],
        line["model"],
        line["status"],
    )


def test_text_line_lists_extra_fields_as_key_values() -> None:
    """The text form ends with key=value pairs of the extra fields."""
    assert TextFormatter().format(record(model="qwen")).endswith("request model=qwen")


def warning(event: str = "profile_invalid", **extra: object) -> logging.LogRecord:
    entry = logging.LogRecord(
        "caravan_llm.scheduler.controller", logging.ERROR, "c.py", 1, event, (), None
    )
    for key, value in extra.items():
        setattr(entry, key, value)
    return entry


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_repeated_warning_is_written_once_per_window_with_the_count_held_back() -> None:
    """The same error for the same model and reason passes once per window; the next says how
    many were suppressed."""
    clock = Clock()
    limiter = RepeatLimiter(60.0, clock=clock)
    passed = []
    for step in range(10):
        clock.now = step * 0.7
        passed.append(limiter.filter(warning(model="m", reason="bad")))
    clock.now = 61.0
    again = warning(model="m", reason="bad")

    assert [True] + [False] * 9 == passed
    assert limiter.filter(again)
    assert 9 == again.suppressed


def test_a_different_model_or_reason_is_not_a_repeat() -> None:
    """Each model and reason has its own allowance."""
    limiter = RepeatLimiter(60.0, clock=Clock())

    assert [True, True, True, False] == [
        limiter.filter(warning(model="a", reason="x")),
        limiter.filter(warning(model="b", reason="x")),
        limiter.filter(warning(model="a", reason="y")),
        limiter.filter(warning(model="a", reason="x")),
    ]


def test_info_lines_are_never_limited() -> None:
    """Per-request info lines all pass, however alike."""
    limiter = RepeatLimiter(60.0, clock=Clock())

    assert all(limiter.filter(record(model="qwen")) for _ in range(5))


def test_text_line_starts_with_a_utc_timestamp_then_level_and_component() -> None:
    """A text line reads `<time>Z LEVEL component event key=value`."""
    entry = warning(model="m", reason="bad")
    entry.created = 0.25

    expected = (
        "1970-01-01T00:00:00.250Z ERROR scheduler.controller profile_invalid model=m reason=bad"
    )
    assert expected == TextFormatter().format(entry)


def test_configured_logging_with_batches_of_one_writes_each_info_line_at_once() -> None:
    """`batch_lines=1` (the scheduler) writes an info line before the next one is logged."""
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("info", "text", batch_lines=1, stream=stream)
        logging.getLogger("caravan_llm.scheduler.app").info(
            "scheduler_api_listening", extra={"port": 1}
        )
        written = stream.getvalue()
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)

    assert written.rstrip().endswith("INFO scheduler.app scheduler_api_listening port=1")
