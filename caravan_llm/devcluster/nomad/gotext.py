"""How Nomad, a Go program, writes values into its error messages and headers.

Nomad's messages embed Go's `%v` of a `time.Duration` ("1m30s", "500ms"),
Go's `%q` of strings, and go-multierror's list format. Clients (and caravan's
own error mapping) match on this text, so the stand-in writes it the same way.
"""

from __future__ import annotations

import json
import re
import time

NS_PER_US = 1_000
NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000
NS_PER_MIN = 60 * NS_PER_S
NS_PER_HOUR = 60 * NS_PER_MIN

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_NS = {
    "ns": 1,
    "us": NS_PER_US,
    "µs": NS_PER_US,
    "μs": NS_PER_US,
    "ms": NS_PER_MS,
    "s": NS_PER_S,
    "m": NS_PER_MIN,
    "h": NS_PER_HOUR,
}


def _trim_fraction(whole: int, fraction: int, digits: int) -> str:
    if fraction == 0:
        return str(whole)
    text = f"{fraction:0{digits}d}".rstrip("0")
    return f"{whole}.{text}"


def go_duration(ns: int) -> str:
    """`time.Duration.String()`: 0s, 500ms, 1.5s, 1m30s, 1h0m0s."""
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    ns = abs(ns)
    if ns < NS_PER_US:
        return f"{sign}{ns}ns"
    if ns < NS_PER_MS:
        return f"{sign}{_trim_fraction(ns // NS_PER_US, ns % NS_PER_US, 3)}µs"
    if ns < NS_PER_S:
        return f"{sign}{_trim_fraction(ns // NS_PER_MS, ns % NS_PER_MS, 6)}ms"
    hours, rest = divmod(ns, NS_PER_HOUR)
    minutes, rest = divmod(rest, NS_PER_MIN)
    seconds = _trim_fraction(rest // NS_PER_S, rest % NS_PER_S, 9)
    if hours:
        return f"{sign}{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{sign}{minutes}m{seconds}s"
    return f"{sign}{seconds}s"


def parse_go_duration(text: str) -> int:
    """`time.ParseDuration` for the forms Nomad's `wait` parameter takes; ns out."""
    body = text.strip()
    sign = 1
    if body[:1] in "+-":
        sign = -1 if body[0] == "-" else 1
        body = body[1:]
    if body == "0":
        return 0
    if not body:
        raise ValueError(f"time: invalid duration {go_quote(text)}")
    total = 0.0
    position = 0
    while position < len(body):
        match = _DURATION_PART.match(body, position)
        if match is None:
            raise ValueError(f"time: invalid duration {go_quote(text)}")
        total += float(match.group(1)) * _UNIT_NS[match.group(2)]
        position = match.end()
    return sign * round(total)


def go_quote(text: str) -> str:
    """Go's `%q` for the strings that appear in Nomad's messages."""
    return json.dumps(text, ensure_ascii=False)


def multierror(errors: list[str]) -> str:
    """go-multierror's `ListFormatFunc` text for a list of error messages."""
    if len(errors) == 1:
        return f"1 error occurred:\n\t* {errors[0]}\n\n"
    points = "\n\t".join(f"* {error}" for error in errors)
    return f"{len(errors)} errors occurred:\n\t{points}\n\n"


def go_time(ns: int | None) -> str:
    """A Go `time.Time` in JSON (RFC 3339 with nanoseconds); None is Go's zero time."""
    if ns is None or ns <= 0:
        return "0001-01-01T00:00:00Z"
    seconds, fraction = divmod(ns, NS_PER_S)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    if fraction:
        stamp += "." + f"{fraction:09d}".rstrip("0")
    return stamp + "Z"
