"""Log records as one JSON object per line, the event name first, context as fields.

Modules log snake_case event names with their context in `extra`
(`log.info("request", extra={"model": ..., "status": ...})`); this formatter
writes the standard fields (`ts`, `level`, `logger`, `event`) and then every
extra field. Nothing here reads request bodies or headers: only what the
caller put in `extra` appears.

The router writes one line per request, so lines are buffered and written
in batches (`BufferedLineHandler`): at most `_BATCH_LINES` lines or one
`flush_every_s` late, and at once for warnings and errors. A write per line
costs a system call per request, which at a few thousand requests a second
is a measurable share of the router's CPU. The scheduler logs little and
writes every line at once (`configure_logging(..., batch_lines=1)`), so an
operator sees its first line when it happens, not at shutdown.

Repeated warnings and errors are rate-limited (`RepeatLimiter`): the same
event for the same model and reason (a profile that stays invalid, a token
that stays refused) is written once per `every_s`, and the next line that
gets through says how many were suppressed (`suppressed=N`). Info lines are
never limited: the router's one line per request is not a repeat.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import IO, Any

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
}
_BATCH_LINES = 256
# Every logger is named after its module; lines name the component without it.
_PACKAGE_PREFIX = __name__.partition(".")[0] + "."
# The context fields that make two warnings "the same event" for the limiter;
# fields that vary per line (counts, indexes, durations) are left out on purpose.
_IDENTITY_FIELDS = (
    "model",
    "reason",
    "capability",
    "error",
    "status",
    "path",
    "job_id",
    "service_id",
)
REPEAT_EVERY_S = 60.0


def _extras(record: logging.LogRecord) -> list[str]:
    # In the order the caller gave them (a record's dict keeps insertion order).
    return [key for key in record.__dict__ if key not in _STANDARD and not key.startswith("_")]


def component(logger: str) -> str:
    """The logger's name as a log line shows it: `scheduler.controller`, not the package path."""
    return logger.removeprefix(_PACKAGE_PREFIX)


class JsonLineFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._second_text = ""

    def _timestamp(self, created: float) -> str:
        second = int(created)
        if second != self._second:
            self._second = second
            self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._second_text}.{int((created - second) * 1000):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        fields = record.__dict__
        extras = {key: fields[key] for key in _extras(record)}
        if record.exc_info:
            extras["exception"] = self.formatException(record.exc_info)
        return self.format_fields(
            record.created,
            record.levelname.lower(),
            component(record.name),
            record.getMessage(),
            extras,
        )

    def format_fields(
        self, created: float, level: str, logger: str, event: str, fields: dict[str, Any]
    ) -> str:
        entry: dict[str, Any] = {
            "ts": self._timestamp(created),
            "level": level,
            "logger": logger,
            "event": event,
        }
        entry.update(fields)
        return json.dumps(entry, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """`time level logger event key=value ...`, for people reading a terminal.

    The time is UTC with milliseconds and a `Z`, as in the JSON lines.
    """

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        del datefmt
        second = int(record.created)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{stamp}.{int((record.created - second) * 1000):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{key}={record.__dict__[key]}" for key in _extras(record))
        line = (
            f"{self.formatTime(record)} {record.levelname} {component(record.name)} "
            f"{record.getMessage()}"
        )
        if fields:
            line = f"{line} {fields}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


class RepeatLimiter(logging.Filter):
    """Lets the same warning through once per `every_s`; counts what it holds back.

    "The same" is the logger, the event and the identity fields
    (`_IDENTITY_FIELDS`: model, reason, ...). The line that gets through
    after a quiet spell carries `suppressed=N`, the repeats held back since
    the last one. Records below WARNING always pass.
    """

    def __init__(
        self, every_s: float = REPEAT_EVERY_S, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self._every_s = every_s
        self._clock = clock
        # identity -> (when it last got through, repeats held back since)
        self._seen: dict[tuple[object, ...], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        fields = record.__dict__
        identity = (
            record.name,
            record.levelno,
            record.msg,
            *(str(fields.get(key)) for key in _IDENTITY_FIELDS),
        )
        now = self._clock()
        seen = self._seen.get(identity)
        if seen is not None and now - seen[0] < self._every_s:
            self._seen[identity] = (seen[0], seen[1] + 1)
            return False
        if seen is not None and seen[1]:
            record.suppressed = seen[1]
        self._seen[identity] = (now, 0)
        if len(self._seen) > 4096:
            # Bounded: forget identities quiet for a whole window.
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self._every_s}
        return True


class BufferedLineHandler(logging.Handler):
    """Collects formatted lines and writes them in batches (module docstring)."""

    def __init__(
        self,
        stream: IO[str] | None = None,
        *,
        flush_every_s: float = 0.5,
        batch_lines: int = _BATCH_LINES,
    ) -> None:
        super().__init__()
        self._stream = stream if stream is not None else sys.stderr
        self._lines: list[str] = []
        self._flush_every_s = flush_every_s
        self._batch_lines = batch_lines
        self._flushed_at = time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.append(self.format(record))
        except Exception:  # logging must never raise into the caller
            self.handleError(record)
            return
        if (
            record.levelno >= logging.WARNING
            or len(self._lines) >= self._batch_lines
            or time.monotonic() - self._flushed_at >= self._flush_every_s
        ):
            self.flush()

    def write_event(self, logger: str, event: str, fields: dict[str, Any]) -> None:
        """Write one info line straight from its fields, without a LogRecord.

        For the canonical per-request line: same JSON shape as records get from
        `JsonLineFormatter`, at a fraction of the cost (no record, no caller
        lookup); the caller checks the logger's level first.
        """
        formatter = self.formatter
        if isinstance(formatter, JsonLineFormatter):
            line = formatter.format_fields(time.time(), "info", logger, event, fields)
        else:
            pairs = " ".join(f"{key}={value}" for key, value in fields.items())
            line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} INFO {logger} {event} {pairs}"
        self._lines.append(line)
        if len(self._lines) >= self._batch_lines:
            self.flush()

    def flush(self) -> None:
        self._flushed_at = time.monotonic()
        if not self._lines:
            return
        lines, self._lines = self._lines, []
        try:
            self._stream.write("\n".join(lines) + "\n")
            self._stream.flush()
        except (OSError, ValueError):
            # A closed or broken stderr: nothing sensible left to do with the lines.
            return


def configure_logging(
    level: str,
    log_format: str,
    *,
    batch_lines: int = _BATCH_LINES,
    stream: IO[str] | None = None,
    repeat_every_s: float = REPEAT_EVERY_S,
) -> BufferedLineHandler:
    """Root logging for a caravan process: one handler on stderr, JSON or text.

    `batch_lines=1` writes every line at once (the scheduler, the demo);
    repeated warnings are limited to one per `repeat_every_s` (RepeatLimiter).
    """
    handler = BufferedLineHandler(stream, batch_lines=batch_lines)
    handler.setFormatter(JsonLineFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RepeatLimiter(repeat_every_s))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log repeats the canonical request line; keep it quiet.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    return handler
