"""Log lines: one JSON object per record, event first, context fields from `extra`."""

from __future__ import annotations

import json
import logging

from caravan.log_format import JsonLineFormatter, TextFormatter


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
