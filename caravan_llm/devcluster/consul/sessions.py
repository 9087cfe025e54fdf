"""Sessions: create, renew, destroy, TTL expiry and what invalidation does to locks.

A session is invalidated when it is destroyed, when its TTL runs out
without a renew, when its node goes away, or when one of the checks it
watches goes critical. Invalidation releases (or deletes) the keys it held
and leaves the session's lock-delay on each of them.

Consul promises expiry no earlier than the TTL and may wait up to twice the
TTL; the emulator expires at the TTL so tests stay short.
"""

from __future__ import annotations

import uuid

from caravan_llm.devcluster.consul.kv import KVStore
from caravan_llm.devcluster.consul.raft import Raft
from caravan_llm.devcluster.consul.records import SessionBehavior, SessionRecord

SESSION_TTL_MAX_S = 86400.0
DEFAULT_LOCK_DELAY_S = 15.0


class SessionStore:
    def __init__(self, raft: Raft, kv: KVStore) -> None:
        self._raft = raft
        self._kv = kv
        self._sessions: dict[str, SessionRecord] = {}
        self._deadlines: dict[str, float] = {}

    def table_index(self) -> int:
        return self._raft.table_index("sessions")

    def get(self, session_id: str) -> SessionRecord | None:
        return self._sessions.get(session_id)

    def all(self) -> list[SessionRecord]:
        return sorted(self._sessions.values(), key=lambda s: (s.create_index, s.session_id))

    def create(
        self,
        *,
        name: str,
        node: str,
        lock_delay_s: float,
        behavior: SessionBehavior,
        ttl: str,
        ttl_s: float,
        node_checks: tuple[str, ...],
        service_checks: tuple[str, ...],
        legacy_checks: tuple[str, ...] | None,
        now: float,
    ) -> SessionRecord:
        index = self._raft.next_index()
        session = SessionRecord(
            session_id=str(uuid.uuid4()),
            name=name,
            node=node,
            lock_delay_s=lock_delay_s,
            behavior=behavior,
            ttl=ttl,
            ttl_s=ttl_s,
            node_checks=node_checks,
            service_checks=service_checks,
            legacy_checks=legacy_checks,
            create_index=index,
            modify_index=index,
        )
        self._sessions[session.session_id] = session
        if ttl_s > 0:
            self._deadlines[session.session_id] = now + ttl_s
        self._raft.touch(index, "sessions")
        return session

    def renew(self, session_id: str, now: float) -> SessionRecord | None:
        """Reset the TTL timer; like Consul this writes nothing, so no index changes."""
        session = self._sessions.get(session_id)
        if session is None:
            return None
        if session.ttl_s > 0:
            self._deadlines[session_id] = now + session.ttl_s
        return session

    def invalidate(self, session_id: str, now: float) -> bool:
        session = self._sessions.pop(session_id, None)
        self._deadlines.pop(session_id, None)
        if session is None:
            return False
        self._kv.release_session(session_id, session.behavior, session.lock_delay_s, now)
        self._raft.touch(self._raft.next_index(), "sessions")
        return True

    def invalidate_for_node(self, node: str, now: float) -> None:
        for session in [s for s in self._sessions.values() if s.node == node]:
            self.invalidate(session.session_id, now)

    def invalidate_watching(self, node: str, check_id: str, now: float) -> None:
        """A watched check went critical or disappeared."""
        for session in [
            s for s in self._sessions.values() if s.node == node and check_id in s.watched_checks
        ]:
            self.invalidate(session.session_id, now)

    def next_deadline(self) -> float | None:
        return min(self._deadlines.values(), default=None)

    def expire_due(self, now: float) -> list[str]:
        due = [sid for sid, deadline in self._deadlines.items() if deadline <= now]
        for session_id in due:
            self.invalidate(session_id, now)
        return due
