"""One raft-like index shared by every table, and the wake-up of blocking readers.

Every write takes the next index, stamps the rows it changes and the tables
it touches, then notifies: all blocking queries wake at once, recompute
their own index and either answer or go back to waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

TABLES = ("nodes", "services", "checks", "kvs", "tombstones", "sessions")

# A fresh `consul agent -dev` has already committed a few raft entries (config,
# its own node, the consul service) before the first client request.
INITIAL_INDEX = 10


@dataclass(frozen=True, slots=True)
class RaftCheckpoint:
    """The table indexes before a transaction, to put back if it fails."""

    table_index: tuple[tuple[str, int], ...]


class Raft:
    """The index counter and the change signal; writes are synchronous on the loop."""

    def __init__(self, initial_index: int = INITIAL_INDEX) -> None:
        self._last_index = initial_index
        self._table_index: dict[str, int] = dict.fromkeys(TABLES, 0)
        self._changed = asyncio.Event()
        # Inside `one_entry()`: the index every write of the transaction shares.
        self._in_entry = False
        self._entry_index: int | None = None

    @property
    def last_index(self) -> int:
        return self._last_index

    def next_index(self) -> int:
        if self._in_entry and self._entry_index is not None:
            return self._entry_index
        self._last_index += 1
        if self._in_entry:
            self._entry_index = self._last_index
        return self._last_index

    @contextlib.contextmanager
    def one_entry(self) -> Iterator[None]:
        """Every write inside shares one index, as a transaction is one raft log entry."""
        self._in_entry, self._entry_index = True, None
        try:
            yield
        finally:
            self._in_entry, self._entry_index = False, None

    def checkpoint(self) -> RaftCheckpoint:
        return RaftCheckpoint(tuple(self._table_index.items()))

    def restore(self, checkpoint: RaftCheckpoint) -> None:
        """Undo the table indexes of a failed transaction (the entry's index stays used)."""
        self._table_index = dict(checkpoint.table_index)

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
