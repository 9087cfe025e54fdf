"""Engine metrics: exposition text plus metric names -> EngineLoad, and the seed rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from caravan_llm.common.engine_metrics import (
    EngineLoad,
    EngineMetricsParseError,
    MetricNames,
    metric_names_as_published,
    parse_engine_load,
    resolve_metric_names,
)
from caravan_llm.scheduler.engines.llamacpp import LLAMACPP_METRIC_NAMES
from caravan_llm.scheduler.engines.vllm import VLLM_METRIC_NAMES

FIXTURES = Path(__file__).parents[2] / "fixtures" / "metrics"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


class TestParseEngineLoad:
    def test_vllm_exposition_reads_running_waiting_and_kv_usage(self) -> None:
        """A vLLM scrape among histograms, counters and process metrics gives its three gauges."""
        expected = EngineLoad(running=7.0, waiting=3.0, kv_cache_usage=0.4215)

        assert expected == parse_engine_load(fixture("vllm.txt"), VLLM_METRIC_NAMES)

    def test_vllm_data_parallel_sums_counts_and_averages_kv_usage(self) -> None:
        """With two engine cores, request counts add up and the KV fraction is their mean."""
        load = parse_engine_load(fixture("vllm_data_parallel.txt"), VLLM_METRIC_NAMES)

        assert load.running == 21.0
        assert load.waiting == 2.0
        assert load.kv_cache_usage == pytest.approx(0.6)

    def test_llamacpp_exposition_has_no_kv_usage(self) -> None:
        """llama.cpp's processing/deferred gauges are read and its KV usage stays None."""
        expected = EngineLoad(running=2.0, waiting=4.0, kv_cache_usage=None)

        assert expected == parse_engine_load(fixture("llamacpp.txt"), LLAMACPP_METRIC_NAMES)

    def test_missing_metric_is_none_and_zero_stays_zero(self) -> None:
        """An idle engine reads 0 where it reports 0, and None where the metric is absent."""
        expected = EngineLoad(running=0.0, waiting=0.0, kv_cache_usage=None)

        assert expected == parse_engine_load(fixture("vllm_idle.txt"), VLLM_METRIC_NAMES)

    def test_wrong_engine_names_read_as_all_none(self) -> None:
        """Reading llama.cpp text with vLLM's names finds nothing, which is None, never 0."""
        expected = EngineLoad(running=None, waiting=None, kv_cache_usage=None)

        assert expected == parse_engine_load(fixture("llamacpp.txt"), VLLM_METRIC_NAMES)

    def test_empty_text_reads_as_all_none(self) -> None:
        """An empty body is valid exposition with no samples."""
        expected = EngineLoad(running=None, waiting=None, kv_cache_usage=None)

        assert expected == parse_engine_load("", VLLM_METRIC_NAMES)

    def test_unconfigured_name_is_none_even_if_text_has_a_match(self) -> None:
        """A name the mapping leaves blank is never read, whatever the text holds."""
        names = MetricNames(running="vllm:num_requests_running", waiting=None, kv_cache_usage=None)

        load = parse_engine_load(fixture("vllm.txt"), names)

        assert EngineLoad(running=7.0, waiting=None, kv_cache_usage=None) == load

    def test_nan_samples_are_unknown(self) -> None:
        """A NaN gauge reads as None rather than poisoning the sum."""
        text = "vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\n"

        load = parse_engine_load(text, VLLM_METRIC_NAMES)

        assert EngineLoad(running=1.0, waiting=None, kv_cache_usage=None) == load

    def test_counter_sample_is_matched_by_its_full_name(self) -> None:
        """A counter mapped by its `_total` sample name is found (the family drops `_total`)."""
        names = MetricNames(running="vllm:prompt_tokens_total", waiting=None, kv_cache_usage=None)

        assert parse_engine_load(fixture("vllm.txt"), names).running == 182734.0

    @pytest.mark.parametrize(
        "text",
        [
            "<html><body>502 Bad Gateway</body></html>",
            "vllm:num_requests_running{engine=0} 1\n",
            "vllm:num_requests_running many\n",
            "# TYPE vllm:num_requests_running sometype\nvllm:num_requests_running 1\n",
        ],
    )
    def test_malformed_text_raises_typed_error(self, text: str) -> None:
        """Text that is not exposition format raises EngineMetricsParseError."""
        with pytest.raises(EngineMetricsParseError, match="malformed Prometheus exposition"):
            parse_engine_load(text, VLLM_METRIC_NAMES)


ENGINE_NAMES = MetricNames(running="e:running", waiting="e:waiting", kv_cache_usage="e:kv")


class TestResolveMetricNames:
    def test_empty_mapping_means_the_engine_names(self) -> None:
        """A mapping that names nothing (None or blank strings) gets the engine's names."""
        assert resolve_metric_names(ENGINE_NAMES) == ENGINE_NAMES
        blank = resolve_metric_names(ENGINE_NAMES, running="", waiting="", kv_cache_usage="")
        assert blank == ENGINE_NAMES

    def test_own_running_metric_is_a_complete_statement(self) -> None:
        """Naming a running metric leaves the blanks blank instead of seeding the engine's."""
        names = resolve_metric_names(
            ENGINE_NAMES,
            running="llamacpp:requests_processing",
            waiting="llamacpp:requests_deferred",
        )

        assert names == LLAMACPP_METRIC_NAMES

    def test_partial_mapping_without_running_seeds_only_the_blanks(self) -> None:
        """A mapping naming only its queue metric keeps it and takes the engine's elsewhere."""
        names = resolve_metric_names(ENGINE_NAMES, waiting="other:queue")

        expected = MetricNames(running="e:running", waiting="other:queue", kv_cache_usage="e:kv")
        assert expected == names


class TestMetricNamesAsPublished:
    def test_blank_is_not_exposed_and_nothing_is_filled_in(self) -> None:
        """Readers take the Meta as written: no engine's names fill a blank."""
        names = metric_names_as_published("a:run", "", None)

        assert MetricNames(running="a:run", waiting=None, kv_cache_usage=None) == names
        assert MetricNames(None, None, None) == metric_names_as_published("", "", "")
