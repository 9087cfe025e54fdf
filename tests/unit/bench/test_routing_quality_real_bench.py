"""bench/routing_quality_real's verdicts on issue 24's 2-replica bars."""

from __future__ import annotations

from typing import Any

from bench_scripts import load_bench

routing_quality_real = load_bench("routing_quality_real")


def pooled(target: str, hits: float, queries: float) -> Any:
    cell = routing_quality_real.Cell(target, -1)
    cell.hits, cell.queries = hits, queries
    return cell


def test_the_verdict_is_judged_on_the_unrounded_ratio() -> None:
    """0.886 / 0.889 prints as 1.00 to two decimals; it is below the bar of 1."""
    precise = pooled("precise", 886.0, 1000.0)
    assert routing_quality_real.precise_verdict(precise, pooled("caravan", 889.0, 1000.0), 1.0) == (
        "NO (0.9966)"
    )
    assert routing_quality_real.precise_verdict(precise, pooled("caravan", 886.0, 1000.0), 1.0) == (
        "yes (1.0000)"
    )
    assert routing_quality_real.precise_verdict(precise, pooled("oracle", 930.0, 1000.0), 0.95) == (
        "yes (0.9527)"
    )


def test_no_verdict_without_a_base_or_a_query() -> None:
    precise = pooled("precise", 886.0, 1000.0)
    assert routing_quality_real.precise_verdict(precise, None, 1.0) == "n/a (-)"
    assert routing_quality_real.precise_verdict(precise, pooled("caravan", 0.0, 0.0), 1.0) == (
        "n/a (-)"
    )
    assert routing_quality_real.precise_verdict(pooled("precise", 0, 0), precise, 1.0) == "n/a (-)"
