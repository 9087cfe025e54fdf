"""One raft-like index shared by every table, and the wake-up of blocking readers.

Every write takes the next index, stamps the rows it changes and the tables
it touches, then notifies: all blocking queries wake at once, recompute
their own index and either answer or go back to waiting.
"""

from __future__ import annotations

import asyncio

TABLES = ("nodes", "services", "checks", "kvs", "tombstones", "sessions")

# A fresh `consul agent -dev` has already committed a few raft entries (config,
# its own node, the consul service) before the first client request.
INITIAL_INDEX = 10


class Raft:
    """The index counter and the change signal; writes are synchronous on the loop."""

    def __init__(self, initial_index: int = INITIAL_INDEX) -> None:
        self._last_index = initial_index
        self._table_index: dict[str, int] = dict.fromkeys(TABLES, 0)
        self._changed = asyncio.Event()

    @property
    def last_index(self) -> int:
        return self._last_index

    def next_index(self) -> int:
        self._last_index += 1
        return self._last_index

    def touch(self, index: int, *tables: str) -> None:
        for table in tables:
            self._table_index[table] = index

    def table_index(self, *tables: str) -> int:
        return max(self._table_index[t] for t in tables)

    @property
    def changed(self) -> asyncio.Event:
        """Set (and replaced) by the next `notify`; wait on the one you read before computing."""
        return self._changed

    def notify(self) -> None:
        previous, self._changed = self._changed, asyncio.Event()
        previous.set()
