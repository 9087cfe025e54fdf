"""Errors raised by caravan's Nomad and Consul adapters.

    HashiError                      base; `retryable` says if trying again may help
    ├── HashiUnavailable            connection refused, timeout, 5xx      (retryable)
    ├── HashiPermissionDenied       403: token missing or lacking a policy
    ├── HashiNotFound               404 where the caller needed the object
    ├── HashiConflict               a check-and-set or EnforceIndex lost a race  (retryable)
    │   └── JobModifyIndexConflict  a job register's EnforceIndex lost (retryable: re-read, re-plan)
    └── HashiBadRequest             400 / validation failure: the request itself is wrong

Messages never include tokens.
"""

from __future__ import annotations


class HashiError(Exception):
    """Base of every Nomad/Consul adapter error."""

    retryable: bool = False

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class HashiUnavailable(HashiError):
    """The server could not be reached or answered 5xx; try again later."""

    retryable = True


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
