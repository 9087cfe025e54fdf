"""Go `time.Duration` text, as Consul reads and writes it.

Consul parses `?wait=`, check intervals and session TTLs with Go's
`time.ParseDuration`, and prints durations (for example in the session TTL
error) with `Duration.String()`. Both are pure functions here so the
emulator accepts and rejects exactly the strings a real agent does.
"""

from __future__ import annotations

import re

NANOS_PER_SECOND = 1_000_000_000

_UNIT_NANOS = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # micro sign
    "\u03bcs": 1_000,  # Greek mu
    "ms": 1_000_000,
    "s": NANOS_PER_SECOND,
    "m": 60 * NANOS_PER_SECOND,
    "h": 3600 * NANOS_PER_SECOND,
}
_COMPONENT = re.compile(r"(\d*)(?:\.(\d*))?([^\d.]*)")


def _go_quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def parse_go_duration_ns(text: str) -> int:
    """Nanoseconds of a Go duration string ("10s", "1m30s", "500ms"); ValueError as Go words it."""
    original = text
    invalid = ValueError(f"time: invalid duration {_go_quote(original)}")
    sign = 1
    if text[:1] in ("-", "+"):
        sign = -1 if text[0] == "-" else 1
        text = text[1:]
    if text == "0":
        return 0
    if not text:
        raise invalid
    total = 0
    position = 0
    while position < len(text):
        match = _COMPONENT.match(text, position)
        if match is None or match.end() == position:
            raise invalid
        whole, fraction, unit = match.group(1), match.group(2), match.group(3)
        if not whole and not fraction:
            raise invalid
        if not unit:
            raise ValueError(f"time: missing unit in duration {_go_quote(original)}")
        if unit not in _UNIT_NANOS:
            raise ValueError(
                f"time: unknown unit {_go_quote(unit)} in duration {_go_quote(original)}"
            )
        scale = _UNIT_NANOS[unit]
        value = int(whole or "0") * scale
        if fraction:
            value += int(fraction) * scale // (10 ** len(fraction))
        total += value
        position = match.end()
    if total > (1 << 63) - 1:
        raise invalid
    return sign * total


def parse_go_duration_s(text: str) -> float:
    """Seconds of a Go duration string."""
    return parse_go_duration_ns(text) / NANOS_PER_SECOND


def _fraction(value: int, digits: int) -> str:
    """`value` scaled down by 10**digits, printed without trailing zeros (Go's fmtFrac)."""
    whole, rest = divmod(value, 10**digits)
    if rest == 0:
        return str(whole)
    decimals = str(rest).rjust(digits, "0").rstrip("0")
    return f"{whole}.{decimals}"


def format_go_duration_ns(nanos: int) -> str:
    """What Go's `time.Duration.String()` prints for this many nanoseconds."""
    if nanos == 0:
        return "0s"
    sign = "-" if nanos < 0 else ""
    nanos = abs(nanos)
    if nanos < NANOS_PER_SECOND:
        if nanos < 1_000:
            return f"{sign}{nanos}ns"
        if nanos < 1_000_000:
            return f"{sign}{_fraction(nanos, 3)}\u00b5s"
        return f"{sign}{_fraction(nanos, 6)}ms"
    hours, rest = divmod(nanos, 3600 * NANOS_PER_SECOND)
    minutes, rest = divmod(rest, 60 * NANOS_PER_SECOND)
    seconds = _fraction(rest, 9) + "s"
    if hours:
        return f"{sign}{hours}h{minutes}m{seconds}"
    if minutes:
        return f"{sign}{minutes}m{seconds}"
    return f"{sign}{seconds}"


def format_go_duration_s(seconds: float) -> str:
    """Go's `Duration.String()` for a number of seconds."""
    return format_go_duration_ns(round(seconds * NANOS_PER_SECOND))
