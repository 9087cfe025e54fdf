"""bench/prefix_routing's own arithmetic: the means over repetitions it reads its ratios from."""

from __future__ import annotations

import math
from typing import Any

import pytest
from bench_scripts import load_bench

prefix_routing = load_bench("prefix_routing")


def cell(target: str, rep: int, hit: float, history: float | None, p50: float | None) -> Any:
    return prefix_routing.PrefixCell(
        "shared",
        "near",
        target,
        rep,
        hit_rate=hit,
        history_cached=history,
        ttft_ms={} if p50 is None else {"p50": p50, "p99": 4 * p50},
    )


def test_mean_cells_averages_each_target_over_its_repetitions() -> None:
    cells = [
        cell("approx", 0, 0.78, 0.90, 400.0),
        cell("precise", 0, 0.80, 0.95, 380.0),
        cell("approx", 1, 0.76, 0.80, 600.0),
        cell("precise", 1, 0.79, 0.93, 420.0),
    ]

    means = prefix_routing.mean_cells(cells)

    assert set(means) == {"approx", "precise"}
    assert means["approx"].hit_rate == pytest.approx(0.77)
    assert means["precise"].hit_rate == pytest.approx(0.795)
    assert means["approx"].history_cached == pytest.approx(0.85)
    assert means["precise"].ttft_ms == pytest.approx({"p50": 400.0, "p99": 1600.0})
    assert [c.hit_rate for c in cells[:2]] == [0.78, 0.80]  # the cells are left as they were


def test_mean_cells_leaves_out_missing_figures_and_keeps_all_missing_ones_missing() -> None:
    cells = [
        cell("oracle", 0, math.nan, None, None),
        cell("oracle", 1, 0.81, None, 390.0),
        cell("rr", 0, math.nan, None, None),
    ]

    means = prefix_routing.mean_cells(cells)

    assert means["oracle"].hit_rate == pytest.approx(0.81)
    assert means["oracle"].history_cached is None
    assert means["oracle"].ttft_ms == pytest.approx({"p50": 390.0, "p99": 1560.0})
    assert math.isnan(means["rr"].hit_rate)
    assert means["rr"].ttft_ms == {}
