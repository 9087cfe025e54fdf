"""Reading a router's queue metrics from exposition text, and checking scrape targets."""

from __future__ import annotations

import math

import pytest

from caravan_llm.common.engine_scrape import ScrapeError, ScrapeFailure
from caravan_llm.scheduler.autoscale.scrape import ReplicaTarget, RouterTarget, parse_router_queues
from caravan_llm.scheduler.engines.vllm import VLLM_METRIC_NAMES

ROUTER_TEXT = """\
# HELP caravan_router_queue_depth Requests waiting for a replica.
# TYPE caravan_router_queue_depth gauge
caravan_router_queue_depth{model="qwen",router_zone="a"} 2.0
caravan_router_queue_depth{model="qwen",router_zone="b"} 1.0
caravan_router_queue_depth{model="llama"} NaN
caravan_router_queue_depth 7.0
# HELP caravan_router_queue_wait_seconds Time requests waited for a replica.
# TYPE caravan_router_queue_wait_seconds histogram
caravan_router_queue_wait_seconds_bucket{le="1.0",model="qwen"} 3.0
caravan_router_queue_wait_seconds_bucket{le="+Inf",model="qwen"} 4.0
caravan_router_queue_wait_seconds_count{model="qwen"} 4.0
caravan_router_queue_wait_seconds_sum{model="qwen"} 6.0
caravan_router_queue_wait_seconds_count{model="idle"} 0.0
caravan_router_queue_wait_seconds_sum{model="idle"} 0.0
"""


class TestParseRouterQueues:
    def test_depth_summed_per_model_and_mean_wait(self) -> None:
        """Series of one model add up, NaN and unlabelled series are skipped, wait = sum/count."""
        report = parse_router_queues("r1", ROUTER_TEXT)

        assert {"qwen": 3.0} == dict(report.depth_by_model or {})
        assert {"qwen": 1.5} == dict(report.mean_wait_s_by_model or {})

    def test_missing_families_are_unknown(self) -> None:
        """A router that does not export the queue metrics reports None, not an empty queue."""
        report = parse_router_queues("r1", "# TYPE up gauge\nup 1\n")

        assert report.depth_by_model is None
        assert report.mean_wait_s_by_model is None

    def test_untyped_samples_are_still_read(self) -> None:
        """Samples without HELP/TYPE lines are matched by name."""
        text = (
            'caravan_router_queue_depth{model="qwen"} 4\n'
            'caravan_router_queue_wait_seconds_sum{model="qwen"} 2\n'
            'caravan_router_queue_wait_seconds_count{model="qwen"} 4\n'
        )

        report = parse_router_queues("r1", text)

        assert {"qwen": 4.0} == dict(report.depth_by_model or {})
        assert {"qwen": 0.5} == dict(report.mean_wait_s_by_model or {})

    def test_malformed_text_is_a_scrape_error(self) -> None:
        """Text that is not exposition format is reported as malformed."""
        with pytest.raises(ScrapeError) as raised:
            parse_router_queues("r1", 'caravan_router_queue_depth{model="qwen" 4\n')

        assert ScrapeFailure.MALFORMED == raised.value.failure
        assert raised.value.retryable

    def test_report_is_read_only(self) -> None:
        """The report is a value: its mappings cannot be changed by a reader."""
        report = parse_router_queues("r1", ROUTER_TEXT)

        assert report.depth_by_model is not None
        with pytest.raises(TypeError):
            report.depth_by_model["qwen"] = math.inf  # type: ignore[index]


class TestTargets:
    def test_url_joins_base_and_path(self) -> None:
        """A trailing slash on the base does not double up."""
        target = ReplicaTarget("0", "http://10.0.0.5:21000/", "/metrics", VLLM_METRIC_NAMES)

        assert "http://10.0.0.5:21000/metrics" == target.url

    @pytest.mark.parametrize(
        ("base_url", "path", "field"),
        [
            ("10.0.0.5:21000", "/metrics", "base_url"),
            ("http://10.0.0.5:21000", "metrics", "metrics_path"),
        ],
    )
    def test_bad_endpoint_is_rejected_by_field(self, base_url: str, path: str, field: str) -> None:
        """A target that cannot be a URL is an error naming the field."""
        with pytest.raises(ValueError, match=field):
            RouterTarget("r1", base_url, path)
