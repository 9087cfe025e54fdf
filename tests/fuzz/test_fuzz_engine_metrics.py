"""Fuzzing the engine `/metrics` reader: any text is a reading or the typed parse error."""

from __future__ import annotations

import math

import pytest
from fuzz_strategies import exposition_texts, fuzz_settings, metric_names
from hypothesis import example, given
from hypothesis import strategies as st

from caravan_llm.common.engine_metrics import (
    EngineLoad,
    EngineMetricsParseError,
    MetricNames,
    parse_engine_load,
)
from caravan_llm.common.engine_scrape import relevant_lines

pytestmark = pytest.mark.fuzz

VLLM = MetricNames(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_cache_usage="vllm:kv_cache_usage_perc",
)
names = st.just(VLLM) | st.builds(
    MetricNames, st.none() | metric_names, st.none() | metric_names, st.none() | metric_names
)


def assert_a_reading(load: EngineLoad) -> None:
    """Each field is None (unknown) or a finite number: NaN and infinities are unknowns."""
    for value in (load.running, load.waiting, load.kv_cache_usage):
        assert value is None or (isinstance(value, float) and math.isfinite(value))


@fuzz_settings()
@given(exposition_texts(), names, st.booleans())
@example("vllm:num_requests_running +Inf\nvllm:num_requests_running -Inf\n", VLLM, True)
@example("vllm:num_requests_running 1e400\n", VLLM, False)
@example('vllm:num_requests_running{a="\\"} 1\n', VLLM, True)
def test_any_exposition_text_is_a_reading_or_the_typed_error(
    text: str, wanted: MetricNames, filtered: bool
) -> None:
    """Whole or cut to the wanted lines (as scraped): a finite reading or the parse error."""
    if filtered:
        text = relevant_lines(text, wanted)
    try:
        load = parse_engine_load(text, wanted)
    except EngineMetricsParseError:
        return
    assert_a_reading(load)


@fuzz_settings()
@given(st.text(max_size=200), names)
def test_any_text_at_all_is_a_reading_or_the_typed_error(text: str, wanted: MetricNames) -> None:
    """Random text is a finite reading or EngineMetricsParseError, never another exception."""
    try:
        load = parse_engine_load(relevant_lines(text, wanted), wanted)
    except EngineMetricsParseError:
        return
    assert_a_reading(load)
