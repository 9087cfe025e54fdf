"""What every command prints: text for people, or with `--json` one JSON document.

With `--json` a command writes exactly one JSON document to stdout, also
when it fails: `{"error": {"message": ..., "type": ..., "problems": [...]}}`,
the shape of the scheduler API's errors, with a non-zero exit status. Text
mode prints results on stdout and errors on stderr, one `error:` line each.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any


def wants_json(args: object) -> bool:
    return bool(getattr(args, "json", False))


def print_json(document: Any) -> None:
    print(json.dumps(document, indent=2, default=str))


def emit(args: object, document: Any, text: str) -> None:
    """Print `document` as JSON with --json, else `text` (when there is any)."""
    if wants_json(args):
        print_json(document)
    elif text:
        print(text)


def error_document(message: str, kind: str, problems: Sequence[str] = ()) -> dict[str, Any]:
    error: dict[str, Any] = {"message": message, "type": kind}
    if problems:
        error["problems"] = list(problems)
    return {"error": error}


def fail(
    args: object,
    message: str,
    *,
    kind: str = "error",
    problems: Sequence[str] = (),
    hint: str | None = None,
    code: int = 1,
) -> int:
    """Report a failure the way the output mode asks; returns the exit status."""
    if wants_json(args):
        document = error_document(message, kind, problems)
        if hint:
            document["error"]["hint"] = hint
        print_json(document)
        return code
    if problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        if message:
            print(message, file=sys.stderr)
    else:
        print(f"error: {message}", file=sys.stderr)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)
    return code


def progress(args: object, line: str) -> None:
    """A line about work in progress: stdout in text mode, stderr with --json."""
    print(line, file=sys.stderr if wants_json(args) else sys.stdout, flush=True)
