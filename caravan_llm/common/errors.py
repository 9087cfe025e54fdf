"""Errors raised by caravan's Nomad and Consul adapters.

    HashiError                      base; `retryable` says if trying again may help
    ├── HashiUnavailable            connection refused, timeout, 5xx      (retryable)
    │   └── HashiMalformedAnswer    an answer not in the API's shape (a proxy's page, garbage)
    ├── HashiPermissionDenied       403: token missing or lacking a policy
    ├── HashiNotFound               404 where the caller needed the object
    ├── HashiConflict               a check-and-set or EnforceIndex lost a race  (retryable)
    │   └── JobModifyIndexConflict  a job register's EnforceIndex lost (retryable: re-read, re-plan)
    └── HashiBadRequest             400 / validation failure: the request itself is wrong

Messages never include tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class HashiError(Exception):
    """Base of every Nomad/Consul adapter error."""

    retryable: bool = False

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class HashiUnavailable(HashiError):
    """The server could not be reached or answered 5xx; try again later."""

    retryable = True


class HashiMalformedAnswer(HashiUnavailable):
    """The server answered, but not in its API's shape (wrong types, missing fields,
    an index header that is no integer): what answered may be a proxy in between, or
    a server mid-upgrade; try again later."""


# What reading a decoded JSON answer of the wrong shape raises: a missing key, a
# method of the wrong type, int() of a non-number, nesting past the recursion limit.
_SHAPE_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError)


def decoded(what: str, decode: Callable[[], T]) -> T:
    """`decode()`, with any error of a wrongly shaped answer raised as HashiMalformedAnswer."""
    try:
        return decode()
    except HashiError:
        raise
    except _SHAPE_ERRORS as exc:
        raise HashiMalformedAnswer(
            f"{what}: the answer is not in the API's shape ({type(exc).__name__})"
        ) from None


def parse_index(raw: object, what: str) -> int:
    """A blocking-query index header (`X-Consul-Index`, `X-Nomad-Index`): a decimal uint64."""
    text = raw.strip() if isinstance(raw, str) else raw
    if isinstance(text, int) and not isinstance(text, bool) and 0 <= text < 2**64:
        return text
    if isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 20:
        index = int(text)
        if index < 2**64:
            return index
    raise HashiMalformedAnswer(f"{what}: the index header is not an integer: {str(raw)[:40]!r}")


class HashiPermissionDenied(HashiError):
    """The server refused the token (HTTP 403)."""


class HashiNotFound(HashiError):
    """The object does not exist (HTTP 404)."""


class HashiConflict(HashiError):
    """A compare-and-set lost a race; re-read and try again."""

    retryable = True


class JobModifyIndexConflict(HashiConflict):
    """A job registration with `EnforceIndex` lost: the job changed (or appeared, or went)
    after it was read. Nomad answers HTTP 500 with "Enforcing job modify index ..."
    (docs/nomad-consul-facts.md, N3). Retryable: re-read the job and decide again."""

    retryable = True


class HashiBadRequest(HashiError):
    """The server rejected the request as malformed or invalid."""


class SettingsError(ValueError):
    """A client setting read from the environment is unusable (a missing CA file, a bad
    client certificate, ...). The message names the variable and the file, never a secret.

    Not retryable: a person must fix the setting. The `caravan` command prints it
    as one line and exits 1.
    """

    retryable = False
