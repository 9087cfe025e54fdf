"""A crashed engine's last stderr lines: which allocation, how they are cut, and a 403."""

from __future__ import annotations

from collections.abc import AsyncIterator

from caravan_llm.common.errors import HashiPermissionDenied
from caravan_llm.common.nomad_api import Allocation, LogFrame, TaskEvent
from caravan_llm.scheduler.engine_logs import (
    MAX_LINE_CHARS,
    MAX_LINES,
    TAIL_BYTES,
    EngineLogReader,
    crashed_alloc,
    tail_lines,
)
from caravan_llm.scheduler.world import EngineLogTail, ObservedReplica

EXIT_1 = TaskEvent("Terminated", "Exit Code: 1", 5, task="engine", exit_code=1)


def replica(*allocs: Allocation, version: int = 1) -> ObservedReplica:
    return ObservedReplica(
        job_id="caravan-m-0",
        model="m",
        replica=0,
        spec_hash="h",
        job_status="running",
        stopped=False,
        submit_time_ns=0,
        allocs=allocs,
        version=version,
    )


def test_the_newest_allocation_of_this_version_whose_engine_exited_non_zero_is_read() -> None:
    """Clean exits, other tasks and the previous version's allocations are not crashes."""
    old = Allocation("a-old", job_version=0, modify_time_ns=9, task_events=(EXIT_1,))
    clean = Allocation(
        "a-clean",
        job_version=1,
        modify_time_ns=8,
        task_events=(TaskEvent("Terminated", "Exit Code: 0", 1, task="engine"),),
    )
    sidecar = Allocation(
        "a-sidecar",
        job_version=1,
        modify_time_ns=7,
        task_events=(TaskEvent("Terminated", "", 1, task="fetch", exit_code=2),),
    )
    crashed = Allocation("a-crashed", job_version=1, modify_time_ns=3, task_events=(EXIT_1,))

    assert crashed == crashed_alloc(replica(old, clean, sidecar, crashed))
    assert crashed_alloc(replica(old, clean, sidecar)) is None


def test_lines_are_the_last_few_printable_ones_with_the_cut_first_line_dropped() -> None:
    """Control characters go, long lines are capped, blank lines and a partial line are dropped."""
    many = "".join(f"line {n}\n" for n in range(20))
    data = b"tial line\n\x1b[31mred\x1b[0m\tok\n\n" + b"x" * 1000 + b"\n" + many.encode()

    lines = tail_lines(data, from_start=False)

    assert MAX_LINES == len(lines)
    assert "line 19" == lines[-1]
    assert all("\x1b" not in line and len(line) <= MAX_LINE_CHARS for line in lines)
    assert ("[31mred[0m ok", "x" * (MAX_LINE_CHARS - 1) + "…") == tail_lines(
        b"\x1b[31mred\x1b[0m\tok\n" + b"x" * 1000, from_start=True
    )


class FakeLogs:
    def __init__(self, data: bytes, *, denied: bool = False) -> None:
        self.data = data
        self.denied = denied
        self.calls: list[tuple[str, str, str, int]] = []

    async def stream_logs(
        self,
        alloc_id: str,
        task: str,
        *,
        log_type: str = "stdout",
        follow: bool = False,
        origin: str = "start",
        offset: int = 0,
    ) -> AsyncIterator[LogFrame]:
        self.calls.append((task, log_type, origin, offset))
        assert not follow
        if self.denied:
            raise HashiPermissionDenied("Nomad GET ... HTTP 403: Permission denied", status=403)
        yield LogFrame(self.data, file="engine.stderr.0", offset=len(self.data))


async def test_the_reader_asks_for_the_end_of_stderr_once_per_exit() -> None:
    """origin=end with a bounded offset, not following; a second look reads nothing new."""
    logs = FakeLogs(b"srv    load_model: failed to load model, '/opt/m.gguf'\n")
    reader = EngineLogReader(logs)
    alloc = Allocation("a1", task_events=(EXIT_1,))

    first = await reader.tail(alloc)
    second = await reader.tail(alloc)

    assert EngineLogTail("a1", ("srv    load_model: failed to load model, '/opt/m.gguf'",)) == first
    assert first == second
    assert [("engine", "stderr", "end", TAIL_BYTES)] == logs.calls


async def test_a_token_without_read_logs_says_so_instead_of_lines() -> None:
    """A 403 is no crash: the tail says which token lacks read-logs."""
    reader = EngineLogReader(FakeLogs(b"", denied=True), reader="NOMAD_TOKEN")

    tail = await reader.tail(Allocation("a1", task_events=(EXIT_1,)))

    assert EngineLogTail("a1", (), "NOMAD_TOKEN lacks read-logs (HTTP 403)") == tail
