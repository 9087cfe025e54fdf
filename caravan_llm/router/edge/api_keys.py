"""API keys: who a client is, how far its `x-caravan-priority` may go, how fast it may ask.

Keys come from two places, both read once at startup by the wiring:

- `CARAVAN_ROUTER_API_KEYS`: plain keys, comma-separated. They are named
  `key-1`, `key-2`, ... in their order, may not raise their priority above the
  default, and have no rate limit;
- `CARAVAN_ROUTER_API_KEYS_FILE`: a YAML (or JSON) list of entries
  `{name, key, max_priority, rps, burst}`.

A presented key is compared in constant time with every configured key, so
the time of the answer says nothing about which key (or how much of one)
matched. Keys are never logged; a key's `name` (bounded, `[A-Za-z0-9_.-]`)
may label metrics and the canonical log line.

Priority: a lower number goes first (`caravan_llm.router.core.admission`). A key's
`max_priority` is the most urgent number it may ask for; a header asking for
more is served at `max_priority`. Without any key configured the header is
ignored (everyone gets the default) unless the operator trusts it
(`CARAVAN_ROUTER_TRUST_PRIORITY_HEADER`).

Rate limits are token buckets (`take_token`, pure, time passed in), one per
key, `rps` tokens a second up to `burst`.
"""

from __future__ import annotations

import hmac
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

# Below every client: continuations of broken streams go first
# (caravan_llm.router.edge.admission_gate).
MIN_PRIORITY = -(2**31) + 1
MAX_PRIORITY = 2**31 - 1
KEY_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
_MIN_KEY_CHARS = 8

Priority = Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)]


class ApiKeyError(ValueError):
    """The key configuration is unusable; the message names the file and entry, never a key."""


class ApiKeyEntry(BaseModel):
    """One entry of the key file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=KEY_NAME_PATTERN)
    key: SecretStr = Field(min_length=_MIN_KEY_CHARS)
    # The most urgent priority (lowest number) this key may ask for; None = the default.
    max_priority: Priority | None = None
    # Requests per second (token bucket); None = no limit.
    rps: float | None = Field(default=None, gt=0)
    # Requests the bucket holds when full; default: max(1, ceil(rps)).
    burst: int | None = Field(default=None, ge=1)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A configured key, decoded."""

    name: str
    secret: bytes
    max_priority: int
    rps: float | None = None
    burst: int = 1


@dataclass(frozen=True, slots=True)
class KeyRing:
    """The configured keys; empty means the router is open."""

    keys: tuple[ApiKey, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key an `Authorization: Bearer <key>` header presents; None if it is no key.

        Compares with every key, always, in constant time per key.
        """
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode()
        found: ApiKey | None = None
        for key in self.keys:
            if hmac.compare_digest(presented, key.secret):
                found = key
        if scheme.lower() != "bearer" or not presented:
            return None
        return found


def build_key_ring(
    plain_keys: tuple[SecretStr, ...],
    entries: tuple[ApiKeyEntry, ...],
    *,
    default_priority: int,
) -> KeyRing:
    """All keys, plain ones named `key-<n>`; ApiKeyError on a duplicate name or key."""
    keys: list[ApiKey] = [
        ApiKey(f"key-{index}", secret.get_secret_value().encode(), default_priority)
        for index, secret in enumerate(plain_keys, start=1)
    ]
    for entry in entries:
        rps = entry.rps
        burst = entry.burst or (max(1, math.ceil(rps)) if rps is not None else 1)
        max_priority = default_priority if entry.max_priority is None else entry.max_priority
        keys.append(
            ApiKey(entry.name, entry.key.get_secret_value().encode(), max_priority, rps, burst)
        )
    names: set[str] = set()
    secrets: set[bytes] = set()
    for key in keys:
        if key.name in names:
            raise ApiKeyError(f"API key name {key.name!r} is used twice")
        if key.secret in secrets:
            # Two names for one key would make the name (and its grants) ambiguous.
            raise ApiKeyError(f"API key {key.name!r} has the same key as another entry")
        names.add(key.name)
        secrets.add(key.secret)
    return KeyRing(tuple(keys))


def parse_key_file(text: str, source: str) -> tuple[ApiKeyEntry, ...]:
    """The entries of a key file (a YAML or JSON list); ApiKeyError naming `source` and entry."""
    try:
        document: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # The problem's position only: YAML's message may quote the file's text (a key).
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ApiKeyError(f"{source}: not valid YAML or JSON{where}") from None
    if document is None:
        return ()
    if not isinstance(document, list):
        raise ApiKeyError(f"{source}: must be a list of {{name, key, max_priority, rps}} entries")
    entries: list[ApiKeyEntry] = []
    for index, raw in enumerate(document):
        try:
            entries.append(ApiKeyEntry.model_validate(raw))
        except ValidationError as exc:
            # Field names and messages only, never the input (it may be a key).
            problems = "; ".join(
                f"{'.'.join(str(part) for part in error['loc']) or 'entry'}: {error['msg']}"
                for error in exc.errors(include_input=False, include_url=False)
            )
            raise ApiKeyError(f"{source}: entry {index}: {problems}") from None
    return tuple(entries)


def load_key_file(path: Path) -> tuple[ApiKeyEntry, ...]:
    """Read and parse the key file; ApiKeyError naming the file when it cannot be read."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "unreadable"
        raise ApiKeyError(f"{path}: cannot read the API key file ({reason})") from None
    return parse_key_file(text, str(path))


def grant_priority(
    requested: int | None,
    key: ApiKey | None,
    *,
    default: int,
    trust_header: bool,
) -> int:
    """The priority a request is served at.

    1. No header: the default.
    2. A key: the header, but never more urgent (lower) than the key's `max_priority`.
    3. No key (an open router): the default, unless the operator trusts the header.
    Always within [MIN_PRIORITY, MAX_PRIORITY], so no client passes continuations.
    """
    if requested is None:
        return default
    if key is not None:
        granted = max(requested, key.max_priority)
    elif trust_header:
        granted = requested
    else:
        granted = default
    return min(MAX_PRIORITY, max(MIN_PRIORITY, granted))


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket's state: tokens left when it was last looked at."""

    tokens: float
    updated_at: float


def take_token(
    bucket: Bucket | None, *, rps: float, burst: int, now: float
) -> tuple[Bucket, float | None]:
    """Take one token: the new state, and None if allowed or the seconds until a token.

    A new bucket starts full. Time going backwards refills nothing.
    """
    if bucket is None:
        tokens = float(burst)
    else:
        elapsed = max(0.0, now - bucket.updated_at)
        tokens = min(float(burst), bucket.tokens + elapsed * rps)
    if tokens >= 1.0:
        return Bucket(tokens - 1.0, now), None
    return Bucket(tokens, now), (1.0 - tokens) / rps


class RateLimits:
    """One token bucket per rate-limited key, keyed by the key's name."""

    def __init__(self) -> None:
        self._buckets: dict[str, Bucket] = {}

    def check(self, key: ApiKey, now: float) -> float | None:
        """None if the key may send this request now, else the seconds to wait."""
        if key.rps is None:
            return None
        bucket, wait_s = take_token(
            self._buckets.get(key.name), rps=key.rps, burst=key.burst, now=now
        )
        self._buckets[key.name] = bucket
        return wait_s
