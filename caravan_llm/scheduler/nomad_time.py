"""Nomad's clock: its timestamps (SubmitTime, CreateTime, ModifyTime) and durations are
nanoseconds, caravan's are seconds."""

from __future__ import annotations

NS_PER_S = 1_000_000_000
