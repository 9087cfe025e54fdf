"""The benches' helper processes: start one, wait for its ready line, stop it (both benches).

Each process writes to its own temporary log, read for the ready pattern
and shown (its last 3,000 characters) when it exits or does not get ready
in time. The log is deleted afterwards unless `CARAVAN_BENCH_KEEP_LOGS` is
set, in which case its path is printed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 90.0


@dataclass
class Proc:
    process: subprocess.Popen[str]
    log: Path
    group: bool = False  # started in a session of its own: stop its whole process group

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s (to the process group, when it leads one)."""
        if self.group:
            self._stop_group()
        elif self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _stop_group(self) -> None:
        pgid = self.process.pid
        with suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.process.wait()
        # Children (vLLM's EngineCore and worker) may outlive the leader by a moment.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        with suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


@contextmanager
def started(
    command: list[str],
    pattern: str,
    env: dict[str, str] | None = None,
    *,
    new_session: bool = False,
    timeout_s: float = START_TIMEOUT_S,
    log_path: Path | None = None,
) -> Iterator[tuple[Proc, re.Match[str]]]:
    """Run `command` from the repository root until the block ends; yields it and its ready match.

    Raises RuntimeError when the process exits, or prints nothing matching
    `pattern`, within `timeout_s`. With `new_session`, it runs in a session
    of its own and its whole process group is stopped at the end. With
    `log_path` (a new file per process: the ready pattern is searched in all
    of it), the output goes there and the file is kept.
    """
    if log_path is None:
        handle, name = tempfile.mkstemp(prefix="caravan-bench-", suffix=".log")
        log, keep = Path(name), bool(os.environ.get("CARAVAN_BENCH_KEEP_LOGS"))
    else:
        handle = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        log, keep = log_path, True
    with os.fdopen(handle, "w") as out:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=new_session,
        )
    proc = Proc(process, log, group=new_session)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            match = re.search(pattern, log.read_text(errors="replace"))
            if match:
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[:4]} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        yield proc, match
    finally:
        proc.stop()
        if keep and log_path is None:
            print(f"  log of {Path(command[0]).name} {' '.join(command[1:3])}: {log}", flush=True)
        elif not keep:
            log.unlink(missing_ok=True)
