"""A replica's state is read from its engine task's events, never its KV relay's."""

from __future__ import annotations

from caravan_llm.common.nomad_api import Allocation, TaskEvent
from caravan_llm.scheduler.engine_logs import engine_exits
from caravan_llm.scheduler.world import engine_events

WAITING = TaskEvent("Template", "Missing: nomad.var.block(caravan/secrets/hf)", 1, task="engine")
RELAY_STARTED = TaskEvent("Started", "Task started by client", 2, task="kv-relay")
RELAY_EXIT = TaskEvent("Terminated", "Exit Code: 1", 3, task="kv-relay", exit_code=1)


def test_the_relays_events_are_left_out() -> None:
    """Only the engine task's events (or those of a task-less record) count."""
    alloc = Allocation("a", task_events=(WAITING, RELAY_STARTED, RELAY_EXIT))
    assert (WAITING,) == engine_events(alloc)


def test_a_crashing_relay_is_not_an_engine_crash() -> None:
    """A relay's non-zero exit is not counted as the engine's."""
    assert 0 == engine_exits(Allocation("a", task_events=(WAITING, RELAY_EXIT)))
