"""Earlier versions of each model's profile, for `caravan history` and `caravan revert`.

Every caravan write of a model's profile also writes the profile as a new
version, in the same Consul transaction (`scheduler/model_store.py`):
`<prefix>-history/<name>/<version>` holds a `ProfileVersion`, created with
check-and-set index 0 (it must not exist yet), so two writers can never
both claim one version and nothing is half-applied. Versions count up from
0 per model, like Nomad's job versions. A submission that does not change
the profile writes no new version (as `nomad job run` of an unchanged job).
The newest `KEPT_VERSIONS` are kept; older ones are deleted in the same
transaction, as far as the transaction's operation limit leaves room (the
rest go with a later write).

A model's history outlives its deletion, as a stopped Nomad job's versions
do: `caravan revert` brings a deleted model back, validated again.

Profiles written around caravan (`consul kv put`, Terraform's consul_keys)
have no version: `current_version` is None for them.

Everything here is pure; `ModelStore` reads and writes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from caravan_llm.common.consul_api import KVEntry, TxnCas, TxnDelete, TxnOp
from caravan_llm.common.contract import ContractDecodeError, KVLayout

# How many versions of each model's profile are kept.
KEPT_VERSIONS = 10


@dataclass(frozen=True, slots=True)
class ProfileVersion:
    """One version of a model's profile, as it was written to `models/<name>`."""

    version: int
    # Wall-clock Unix seconds of the write.
    submitted_at: float
    # The profile as stored (its JSON object).
    profile: Mapping[str, Any]
    # The version this one restored (`caravan revert`); None for a submission.
    reverted_from: int | None = None

    def encode(self) -> bytes:
        document = {
            "version": self.version,
            "submitted_at": self.submitted_at,
            "reverted_from": self.reverted_from,
            "profile": dict(self.profile),
        }
        return json.dumps(document, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes | str, *, key: str) -> ProfileVersion:
        what = f"profile version {key}"
        try:
            document = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ContractDecodeError(f"{what}: not JSON ({exc})") from None
        if not isinstance(document, dict):
            raise ContractDecodeError(f"{what}: not a JSON object")
        version = document.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ContractDecodeError(f"{what}: version must be an integer >= 0")
        at = document.get("submitted_at")
        if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
            raise ContractDecodeError(f"{what}: submitted_at must be a finite number")
        origin = document.get("reverted_from")
        if origin is not None and (isinstance(origin, bool) or not isinstance(origin, int)):
            raise ContractDecodeError(f"{what}: reverted_from must be an integer or null")
        profile = document.get("profile")
        if not isinstance(profile, dict):
            raise ContractDecodeError(f"{what}: profile must be a JSON object")
        return cls(version=version, submitted_at=float(at), profile=profile, reverted_from=origin)

    def profile_text(self) -> str:
        """The profile as a document to submit again (JSON, which the profile codec reads)."""
        return json.dumps(dict(self.profile), indent=2)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "submitted_at": self.submitted_at,
            "reverted_from": self.reverted_from,
            "profile": dict(self.profile),
        }


@dataclass(frozen=True, slots=True)
class ModelHistory:
    """The kept versions of one model's profile, oldest first."""

    name: str
    versions: tuple[ProfileVersion, ...] = ()
    # Every version number found under the model's prefix, readable or not.
    numbers: tuple[int, ...] = ()
    # `KEY: PROBLEM` for each version that could not be read.
    unreadable: tuple[str, ...] = ()

    @property
    def latest(self) -> ProfileVersion | None:
        return self.versions[-1] if self.versions else None

    @property
    def next_version(self) -> int:
        return max(self.numbers, default=-1) + 1

    def version(self, number: int) -> ProfileVersion | None:
        return next((v for v in self.versions if v.version == number), None)

    def current_version(self, stored: Mapping[str, Any] | None) -> int | None:
        """The newest version whose profile is `stored` (None: not written through caravan)."""
        if stored is None:
            return None
        matching = [v.version for v in self.versions if v.profile == stored]
        return max(matching, default=None)


def parse_history(name: str, entries: Sequence[KVEntry], layout: KVLayout) -> ModelHistory:
    """Sort a recursive read of `history_prefix(name)` into versions (pure)."""
    prefix = layout.history_prefix(name)
    versions: list[ProfileVersion] = []
    numbers: list[int] = []
    unreadable: list[str] = []
    for entry in entries:
        suffix = entry.key[len(prefix) :]
        if not suffix.isdigit():
            continue
        number = int(suffix)
        numbers.append(number)
        try:
            record = ProfileVersion.decode(entry.value, key=entry.key)
        except ContractDecodeError as exc:
            unreadable.append(str(exc))
            continue
        if record.version != number:
            unreadable.append(f"{entry.key}: holds version {record.version}")
            continue
        versions.append(record)
    versions.sort(key=lambda v: v.version)
    return ModelHistory(
        name=name,
        versions=tuple(versions),
        numbers=tuple(sorted(numbers)),
        unreadable=tuple(unreadable),
    )


def stored_document(profile_json: str) -> dict[str, Any]:
    """The JSON object of a profile as `models/<name>` stores it."""
    document: dict[str, Any] = json.loads(profile_json)
    return document


@dataclass(frozen=True, slots=True)
class VersionWrite:
    """What a profile write adds to its model's history: the version it becomes."""

    name: str
    version: int
    ops: tuple[TxnOp, ...]


def version_write(
    profile_json: str,
    history: ModelHistory,
    layout: KVLayout,
    *,
    now: float,
    reverted_from: int | None = None,
) -> VersionWrite:
    """The history write of one profile write (pure).

    An unchanged profile keeps its version and writes nothing; a changed one
    becomes `next_version`, created with cas 0.
    """
    document = stored_document(profile_json)
    latest = history.latest
    if latest is not None and latest.profile == document and reverted_from is None:
        return VersionWrite(history.name, latest.version, ())
    record = ProfileVersion(
        version=history.next_version,
        submitted_at=now,
        profile=document,
        reverted_from=reverted_from,
    )
    key = layout.history_key(history.name, record.version)
    return VersionWrite(history.name, record.version, (TxnCas(key, record.encode(), 0),))


def prune_ops(
    history: ModelHistory, added: int, layout: KVLayout, *, kept: int = KEPT_VERSIONS
) -> list[TxnOp]:
    """Delete the oldest versions beyond `kept`, counting `added` new ones (pure)."""
    excess = len(history.numbers) + added - kept
    return [TxnDelete(layout.history_key(history.name, n)) for n in history.numbers[:excess]]
