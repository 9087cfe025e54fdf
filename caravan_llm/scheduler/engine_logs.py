"""The last stderr lines of an engine that crashed: which allocation (pure), reading them (I/O).

When a replica's engine exits with a non-zero status (a `Terminated` task
event of the `engine` task with an exit code), the cause is usually in its
own last words: llama-server's `failed to load model, '/opt/models/x.gguf'`,
vLLM's Python traceback. `crashed_alloc` says which allocation of a replica
to read (pure); `EngineLogReader` reads the end of its stderr through
Nomad's `/v1/client/fs/logs` API (at most `TAIL_BYTES`, never following),
and `tail_lines` turns those bytes into a few printable lines (pure).
`scheduler/observe.py` reads them into the observation, `scheduler/assess.py`
attaches them to the replica's assessment, and `caravan status` and
`caravan submit --wait` show them.

The lines are the operator's data (the engine's own log), but an engine
may log anything: they are capped in count and length, stripped of control
characters, and never written to the scheduler's log. A token without
`read-logs` gets no lines and a reason that says so.
"""

from __future__ import annotations

import logging
import unicodedata
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Protocol

from caravan_llm.common.contract import TASK_NAME
from caravan_llm.common.errors import HashiError
from caravan_llm.common.nomad_api import Allocation, LogFrame
from caravan_llm.scheduler.world import EngineLogTail, ObservedReplica, engine_events

log = logging.getLogger(__name__)

# How much of the end of stderr is read: a few lines of any engine's error.
TAIL_BYTES = 4096
# How many lines, and how long each, are kept.
MAX_LINES = 8
MAX_LINE_CHARS = 300
# Tails remembered by (allocation, number of exits): a crashed run's last
# words do not change until the engine exits again.
CACHE_ENTRIES = 256
HTTP_FORBIDDEN = 403
SCHEDULER_READER = "the scheduler's Nomad token"


def engine_exits(alloc: Allocation) -> int:
    """How many times the allocation's engine task exited with a non-zero status."""
    return sum(1 for e in engine_events(alloc) if e.type == "Terminated" and e.exit_code != 0)


def crashed_alloc(replica: ObservedReplica) -> Allocation | None:
    """The newest allocation of the replica's current version whose engine exited non-zero;
    None when none did (pure)."""
    crashed = [
        a for a in replica.allocs if a.job_version == replica.version and engine_exits(a) > 0
    ]
    return max(crashed, key=lambda a: (a.modify_time_ns, a.id), default=None)


def _printable(line: str) -> str:
    """The line without control characters (tabs become spaces), trimmed and capped."""
    kept = "".join(
        " " if ch == "\t" else ch for ch in line if ch == "\t" or unicodedata.category(ch)[0] != "C"
    ).strip()
    if len(kept) > MAX_LINE_CHARS:
        kept = kept[: MAX_LINE_CHARS - 1] + "…"
    return kept


def tail_lines(data: bytes, *, from_start: bool) -> tuple[str, ...]:
    """The last non-empty lines of a log's end, printable (pure).

    `from_start` says `data` begins at the start of the file; otherwise its
    first line is cut and dropped.
    """
    text = data.decode("utf-8", errors="replace")
    lines = text.splitlines()
    if not from_start and lines:
        lines = lines[1:]
    kept = [p for p in (_printable(line) for line in lines) if p]
    return tuple(kept[-MAX_LINES:])


def unavailable_words(exc: HashiError, reader: str = SCHEDULER_READER) -> str:
    """Why the lines could not be read, in `caravan status`'s words (pure); `reader` names
    the token that read."""
    if exc.status == HTTP_FORBIDDEN:
        return f"{reader} lacks read-logs (HTTP 403)"
    return f"reading the log failed: {str(exc)[:200]}"


class LogReads(Protocol):
    """The Nomad log read this needs (implemented by caravan_llm.common.nomad_api.NomadClient)."""

    def stream_logs(
        self,
        alloc_id: str,
        task: str,
        *,
        log_type: str = "stdout",
        follow: bool = False,
        origin: str = "start",
        offset: int = 0,
    ) -> AsyncIterator[LogFrame]: ...


class EngineLogReader:
    """Reads crashed engines' stderr tails, remembering each until the engine exits again."""

    def __init__(self, nomad: LogReads, *, reader: str = SCHEDULER_READER) -> None:
        self._nomad = nomad
        # Names the token in "... lacks read-logs".
        self._reader = reader
        self._cache: OrderedDict[tuple[str, int], EngineLogTail] = OrderedDict()

    async def tail(self, alloc: Allocation) -> EngineLogTail:
        key = (alloc.id, engine_exits(alloc))
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        found = await self._read(alloc.id)
        self._cache[key] = found
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return found

    async def _read(self, alloc_id: str) -> EngineLogTail:
        data = b""
        start: int | None = None
        try:
            async for frame in self._nomad.stream_logs(
                alloc_id, TASK_NAME, log_type="stderr", origin="end", offset=TAIL_BYTES
            ):
                if start is None:
                    start = frame.offset - len(frame.data)
                data += frame.data
                if len(data) >= 2 * TAIL_BYTES:
                    break
        except HashiError as exc:
            log.debug(
                "engine_log_not_read",
                extra={"alloc_id": alloc_id, "status": exc.status, "error": str(exc)[:200]},
            )
            return EngineLogTail(alloc_id, unavailable=unavailable_words(exc, self._reader))
        from_start = start == 0 and len(data) <= TAIL_BYTES
        return EngineLogTail(alloc_id, tail_lines(data[-TAIL_BYTES:], from_start=from_start))
