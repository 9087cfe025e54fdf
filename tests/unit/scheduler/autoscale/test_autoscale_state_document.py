"""The KV state document: the autoscaler memory plus what status shows."""

from __future__ import annotations

import json
import math

from caravan_llm.scheduler.autoscale.loop import state_document
from caravan_llm.scheduler.autoscale.memory import (
    Direction,
    Memory,
    memory_from_json,
    memory_to_json,
)
from caravan_llm.scheduler.autoscale.policy import ScaleDecision


def test_state_document_keeps_the_memory_readable_and_adds_signals():
    """The extra keys ride along: the memory reads back the same, NaN becomes null."""
    memory = Memory(last_busy_at=5.0)
    decision = ScaleDecision(
        direction=Direction.NONE,
        target=1,
        reason="steady",
        signals_used={"inflight_per_replica": 2.0, "router_queue_depth": math.nan},
    )
    text = state_document(memory, decision, cold_start_s=7.5)
    document = json.loads(text)
    assert document["last_signals"] == {"inflight_per_replica": 2.0, "router_queue_depth": None}
    assert document["last_cold_start_s"] == 7.5
    assert memory_to_json(memory_from_json(text)) == memory_to_json(memory)
