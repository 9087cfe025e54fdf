"""Bearer tokens for the scheduler's HTTP API: parsing, the file that rotates them, the check.

    tokens = load_token_source(environ.get(TOKENS_ENV), environ.get(TOKENS_FILE_ENV))
    outcome = check_authorization(request.headers.get("Authorization"), tokens.current())

Tokens come from `CARAVAN_SCHEDULER_API_TOKENS` (comma-separated) or
`CARAVAN_SCHEDULER_API_TOKENS_FILE` (one per line, `#` starts a comment). The
file is stat'ed on each request and re-read when it changes, so an operator
rotates without a restart: add the new token, move clients to it, remove the
old one. A file that disappears or becomes invalid refuses every token until
it is fixed (fail closed), and says so in the log.

Only SHA-256 digests of the tokens are kept. A presented token is hashed and
compared with `hmac.compare_digest` against every digest, always all of them,
so neither the time taken nor an early exit tells which token (or how much
of one) matched; hashing first also hides the tokens' lengths.

Error messages name the variable, the file and the line, never a token.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from caravan_llm.common.errors import SettingsError

log = logging.getLogger(__name__)

TOKENS_ENV = "CARAVAN_SCHEDULER_API_TOKENS"
TOKENS_FILE_ENV = "CARAVAN_SCHEDULER_API_TOKENS_FILE"
MIN_TOKEN_CHARS = 16
# RFC 6750 `b64token`: what may follow "Bearer " in an Authorization header.
_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")

Compare = Callable[[bytes, bytes], bool]


class ApiTokenError(SettingsError):
    """A token setting is invalid; the message names the variable or file, never a token.

    Not retryable: the operator must fix the setting.
    """

    retryable = False


class AuthOutcome(enum.Enum):
    """What an Authorization header amounts to; the failures are the metric's `reason`."""

    OK = "ok"
    MISSING = "missing"  # no Authorization header: 401
    MALFORMED = "malformed"  # not `Bearer <token>`: 401
    INVALID = "invalid"  # a well-formed token that is not configured: 403


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


@dataclass(frozen=True, slots=True)
class TokenSet:
    """The digests of the tokens currently accepted (empty: nothing is accepted)."""

    digests: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, tokens: Iterable[str]) -> TokenSet:
        return cls(tuple(_digest(token.encode()) for token in tokens))

    def __repr__(self) -> str:
        return f"TokenSet({len(self.digests)} tokens)"


def _checked(token: str, where: str) -> str:
    if not _B64TOKEN.fullmatch(token):
        raise ApiTokenError(
            f"{where}: a token may hold only letters, digits and -._~+/ (then '='), "
            "no spaces or other characters"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ApiTokenError(
            f"{where}: the token has {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "(for example `openssl rand -hex 32`)"
        )
    return token


def parse_token_list(value: str, *, variable: str = TOKENS_ENV) -> TokenSet:
    """Comma-separated tokens, as in CARAVAN_SCHEDULER_API_TOKENS; empty items are skipped."""
    items = [item.strip() for item in value.split(",")]
    tokens = [
        _checked(item, f"{variable}: token {number}")
        for number, item in enumerate(items, start=1)
        if item
    ]
    if not tokens:
        raise ApiTokenError(f"{variable} is set but holds no token")
    return TokenSet.of(tokens)


def parse_token_file(text: str, *, source: str) -> TokenSet:
    """One token per line; blank lines and everything after `#` are ignored."""
    tokens = []
    for number, line in enumerate(text.splitlines(), start=1):
        item = line.split("#", 1)[0].strip()
        if item:
            tokens.append(_checked(item, f"{source}: line {number}"))
    return TokenSet.of(tokens)


def check_authorization(
    header: str | None, tokens: TokenSet, *, compare: Compare = hmac.compare_digest
) -> AuthOutcome:
    """Decide what an Authorization header is worth against the accepted tokens.

    Every digest is compared, even after a match, so the time taken does not
    depend on which token (if any) matched.
    """
    if not header or not header.strip():
        return AuthOutcome.MISSING
    scheme, _, credentials = header.strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() != "bearer" or not _B64TOKEN.fullmatch(credentials):
        return AuthOutcome.MALFORMED
    presented = _digest(credentials.encode())
    matched = False
    for digest in tokens.digests:
        matched |= compare(presented, digest)
    return AuthOutcome.OK if matched else AuthOutcome.INVALID


class TokenSource(Protocol):
    """Where the API's middleware gets the tokens accepted right now."""

    def current(self) -> TokenSet:
        """The tokens to accept for this request."""


@dataclass(frozen=True, slots=True)
class StaticTokens:
    """Tokens fixed for the life of the process (CARAVAN_SCHEDULER_API_TOKENS)."""

    tokens: TokenSet

    def current(self) -> TokenSet:
        return self.tokens


_FileStamp = tuple[int, int, int, int]


class TokenFile:
    """Tokens read from a file, re-read whenever the file changes (rotation without restart).

    The constructor reads the file and raises `ApiTokenError` when it is
    missing, unreadable, invalid or empty: a scheduler must not start with a
    token file that accepts nothing. Later changes are read on the next
    request; a file that then disappears or turns invalid accepts nothing
    until it is fixed.
    """

    def __init__(self, path: Path, *, variable: str = TOKENS_FILE_ENV) -> None:
        self._path = path
        self._source = f"{variable} {path}"
        stamp = self._stamp()
        if stamp is None:
            raise ApiTokenError(f"{self._source}: the file does not exist or cannot be read")
        self._tokens = self._read()
        self._seen: _FileStamp | None = stamp
        if not self._tokens.digests:
            raise ApiTokenError(f"{self._source}: the file holds no token")

    def _stamp(self) -> _FileStamp | None:
        try:
            info = self._path.stat()
        except OSError:
            return None
        return (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)

    def _read(self) -> TokenSet:
        try:
            text = self._path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ApiTokenError(f"{self._source}: cannot be read: {reason}") from None
        return parse_token_file(text, source=self._source)

    def current(self) -> TokenSet:
        stamp = self._stamp()
        if stamp == self._seen:
            return self._tokens
        self._seen = stamp
        if stamp is None:
            self._tokens = TokenSet()
            log.error(
                "scheduler_api_tokens_file_missing",
                extra={"file": str(self._path), "effect": "every request is refused"},
            )
            return self._tokens
        try:
            self._tokens = self._read()
        except ApiTokenError as exc:
            self._tokens = TokenSet()
            log.error(  # noqa: TRY400 - the message says it all; no traceback wanted
                "scheduler_api_tokens_file_invalid",
                extra={"error": str(exc), "effect": "every request is refused"},
            )
            return self._tokens
        log.info(
            "scheduler_api_tokens_reloaded",
            extra={"file": str(self._path), "tokens": len(self._tokens.digests)},
        )
        return self._tokens


def load_token_source(tokens: str | None, tokens_file: str | None) -> TokenSource | None:
    """The configured token source, or None when no token is configured (loopback only)."""
    if tokens and tokens_file:
        raise ApiTokenError(f"set {TOKENS_ENV} or {TOKENS_FILE_ENV}, not both")
    if tokens_file:
        return TokenFile(Path(tokens_file))
    if tokens is not None and tokens.strip():
        return StaticTokens(parse_token_list(tokens))
    return None
