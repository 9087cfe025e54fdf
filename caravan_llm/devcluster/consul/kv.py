"""The KV store: entries, tombstones for delete indexes, locks and lock-delays.

Semantics follow Consul's state store: identical writes do not bump the
index, a plain PUT keeps an existing lock holder, `acquire` bumps
`LockIndex` only when the key was free, a released or deleted key keeps a
tombstone so blocking lists see the delete, and invalidated sessions leave
a lock-delay on the keys they held.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from caravan_llm.devcluster.consul.raft import Raft
from caravan_llm.devcluster.consul.records import KVEntry, SessionBehavior

KEY_PATTERN = re.compile(r"^[a-zA-Z0-9,\-_./]+$")
_TRAVERSAL = re.compile(r"(\.\.[\\/])|(\.\.\\)|(^\.\.)|(\.\.$)")
_SUSPICIOUS_EXTENSION = re.compile(
    r"(?i)\.(js|css|html?|xml|json|txt|log|php|asp|jsp|cgi|pl|py|rb|sh|exe|dll|bat|cmd|com|scr|"
    r"vbs|pdf|docx?|xlsx?|pptx?|zip|rar|tar|gz|7z|bz2|jpe?g|png|gif|svg|ico|bmp|mp[34]|avi|mov|"
    r"wmv|flv|swf|woff2?|ttf|eot|otf)(\?|$)"
)
MAX_VALUE_BYTES = 512 * 1024


def key_problem(key: str) -> str | None:
    """Why Consul's HTTP layer refuses this key (current releases validate keys), or None."""
    if key.startswith("/"):
        return "key must not begin with a '/'"
    if not KEY_PATTERN.match(key):
        return "key contains invalid characters. Only alphanumeric characters and ,-_./ are allowed"
    if _TRAVERSAL.search(key):
        return "key contains path traversal sequence"
    if _SUSPICIOUS_EXTENSION.search(key):
        return "key contains suspicious file extension that may be cached by proxies or exploited"
    return None


def _content(entry: KVEntry) -> tuple[bytes, int, str | None, int]:
    return entry.value, entry.flags, entry.session, entry.lock_index


class InvalidSessionError(ValueError):
    """A lock named a session that does not exist (Consul answers 500 with this text)."""


@dataclass(frozen=True, slots=True)
class KVCheckpoint:
    """The KV table as it was before a transaction, to put back if one of its ops fails."""

    entries: tuple[tuple[str, KVEntry], ...]
    tombstones: tuple[tuple[str, int], ...]


class KVStore:
    def __init__(self, raft: Raft) -> None:
        self._raft = raft
        self._entries: dict[str, KVEntry] = {}
        self._tombstones: dict[str, int] = {}
        self._lock_delays: dict[str, float] = {}

    # -- reads ---------------------------------------------------------------

    def table_index(self) -> int:
        return self._raft.table_index("kvs", "tombstones")

    def get(self, key: str) -> tuple[int, KVEntry | None]:
        entry = self._entries.get(key)
        if entry is not None:
            return entry.modify_index, entry
        return self.table_index(), None

    def list_prefix(self, prefix: str) -> tuple[int, list[KVEntry]]:
        entries = [e for k, e in sorted(self._entries.items()) if k.startswith(prefix)]
        if not prefix:
            return self.table_index(), entries
        index = max((e.modify_index for e in entries), default=0)
        graveyard = max((i for k, i in self._tombstones.items() if k.startswith(prefix)), default=0)
        index = max(index, graveyard)
        return (index or self.table_index()), entries

    def held_by(self, session_id: str) -> list[KVEntry]:
        return [e for e in self._entries.values() if e.session == session_id]

    def lock_delay_until(self, key: str) -> float:
        return self._lock_delays.get(key, 0.0)

    # -- writes (each returns whether it applied; callers notify) -------------

    def _write(self, entry: KVEntry) -> bool:
        existing = self._entries.get(entry.key)
        if existing is not None and _content(existing) == _content(entry):
            return False
        index = self._raft.next_index()
        create_index = existing.create_index if existing is not None else index
        self._entries[entry.key] = replace(entry, create_index=create_index, modify_index=index)
        self._tombstones.pop(entry.key, None)
        self._raft.touch(index, "kvs")
        return True

    def set(self, key: str, value: bytes, flags: int) -> bool:
        existing = self._entries.get(key)
        self._write(
            KVEntry(
                key=key,
                value=value,
                flags=flags,
                session=existing.session if existing else None,
                lock_index=existing.lock_index if existing else 0,
                create_index=0,
                modify_index=0,
            )
        )
        return True

    def cas(self, key: str, value: bytes, flags: int, modify_index: int) -> bool:
        existing = self._entries.get(key)
        if modify_index == 0 and existing is not None:
            return False
        if modify_index != 0 and (existing is None or existing.modify_index != modify_index):
            return False
        return self.set(key, value, flags)

    def lock(self, key: str, value: bytes, flags: int, session_id: str) -> bool:
        """Acquire; the caller has checked that the session exists and lock-delay is over."""
        existing = self._entries.get(key)
        if existing is not None and existing.session not in (None, session_id):
            return False
        if existing is not None and existing.session == session_id:
            lock_index = existing.lock_index
        else:
            lock_index = (existing.lock_index if existing else 0) + 1
        self._write(
            KVEntry(
                key=key,
                value=value,
                flags=flags,
                session=session_id,
                lock_index=lock_index,
                create_index=0,
                modify_index=0,
            )
        )
        return True

    def unlock(self, key: str, value: bytes, flags: int, session_id: str) -> bool:
        existing = self._entries.get(key)
        if existing is None or existing.session != session_id:
            return False
        self._write(replace(existing, value=value, flags=flags, session=None))
        return True

    def _delete(self, key: str) -> bool:
        if key not in self._entries:
            return False
        index = self._raft.next_index()
        del self._entries[key]
        self._tombstones[key] = index
        self._raft.touch(index, "kvs", "tombstones")
        return True

    def delete(self, key: str) -> bool:
        self._delete(key)
        return True

    def delete_cas(self, key: str, modify_index: int) -> bool:
        # Consul's kvsDeleteCASTxn: a key that is already gone counts as deleted,
        # whatever the index; a present one only at its current ModifyIndex.
        existing = self._entries.get(key)
        if existing is None:
            return True
        if existing.modify_index != modify_index:
            return False
        return self._delete(key)

    def delete_tree(self, prefix: str) -> bool:
        for key in [k for k in self._entries if k.startswith(prefix)]:
            self._delete(key)
        return True

    def release_session(
        self, session_id: str, behavior: SessionBehavior, lock_delay_s: float, now: float
    ) -> None:
        """What invalidating a session does to the keys it holds."""
        for entry in self.held_by(session_id):
            if lock_delay_s > 0:
                self._lock_delays[entry.key] = now + lock_delay_s
            if behavior is SessionBehavior.DELETE:
                self._delete(entry.key)
            else:
                self._write(replace(entry, session=None))

    # -- transactions (/v1/txn) ------------------------------------------------

    def checkpoint(self) -> KVCheckpoint:
        return KVCheckpoint(tuple(self._entries.items()), tuple(self._tombstones.items()))

    def restore(self, checkpoint: KVCheckpoint) -> None:
        """Roll back to `checkpoint`: a failed transaction leaves no trace."""
        self._entries = dict(checkpoint.entries)
        self._tombstones = dict(checkpoint.tombstones)
