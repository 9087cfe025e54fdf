"""`/metrics` of the simulated engines, in each real engine's own names and types.

vLLM: prometheus_client metrics on a registry of the instance's own, labelled
`model_name` (the first served name) and `engine` ("0"), like vLLM's
PrometheusStatLogger.

llama.cpp: llama-server writes its exposition by hand, and one of its
counters (`llamacpp:n_tokens_max`) lacks the `_total` suffix that
prometheus_client forces on every counter's TYPE line, so this flavour renders
the text itself, in llama-server's order and number format. The names and
types are exactly llama-server's; there is no KV-cache metric (upstream
removed it, llama.cpp PR #13660).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from devcluster.engine.batch import CoreStats, Finished, StepOutcome

# Buckets as vLLM defines them.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

PROMETHEUS_TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _one_two_five_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


class VllmMetrics:
    """vLLM's scheduler, token, prefix-cache and latency metrics for one instance."""

    def __init__(
        self,
        *,
        model_name: str,
        max_model_len: int,
        block_size: int,
        prefix_caching: bool,
        num_gpu_blocks: int | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = ("model_name", "engine")
        values = (model_name, "0")
        reg = self.registry

        self._running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels,
            registry=reg,
        ).labels(*values)
        self._waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels,
            registry=reg,
        ).labels(*values)
        self._kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labels,
            registry=reg,
        ).labels(*values)
        self._prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=reg,
        ).labels(*values)
        self._prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=reg,
        ).labels(*values)
        self._preemptions = Counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            labels,
            registry=reg,
        ).labels(*values)
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=reg
        ).labels(*values)
        self._generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            labels,
            registry=reg,
        ).labels(*values)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*labels, "finished_reason"),
            registry=reg,
        )
        self._success = {
            reason: success.labels(*values, reason) for reason in ("stop", "length", "abort")
        }
        token_buckets = _one_two_five_buckets(max_model_len)
        self._request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            labels,
            buckets=token_buckets,
            registry=reg,
        ).labels(*values)
        self._request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            labels,
            buckets=token_buckets,
            registry=reg,
        ).labels(*values)
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        ).labels(*values)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=_REQUEST_LATENCY_BUCKETS,
            registry=reg,
        ).labels(*values)
        self._queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels,
            buckets=_REQUEST_LATENCY_BUCKETS,
            registry=reg,
        ).labels(*values)
        # vLLM writes every CacheConfig field as a label (`metrics_info()`),
        # num_gpu_blocks included once the KV cache is sized.
        cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ("block_size", "enable_prefix_caching", "num_gpu_blocks", "engine"),
            registry=reg,
        )
        cache_info.labels(str(block_size), str(prefix_caching), str(num_gpu_blocks), "0").set(1)
        self._seen_queries = 0
        self._seen_hits = 0
        self._seen_preemptions = 0

    def observe_step(self, outcome: StepOutcome) -> None:
        if outcome.emitted:
            self._generation_tokens.inc(len(outcome.emitted))
        for first in outcome.first_tokens:
            self._prompt_tokens.inc(first.prompt_len)
            self._ttft.observe(first.ttft_seconds)

    def observe_finished(self, finished: Finished, finish_reason: str) -> None:
        self._success[finish_reason].inc()
        self._e2e.observe(finished.e2e_seconds)
        self._queue_time.observe(finished.queue_seconds)
        self._request_prompt_tokens.observe(finished.prompt_len)
        self._request_generation_tokens.observe(finished.generated)

    def observe_aborted(self) -> None:
        self._success["abort"].inc()

    def render(self, stats: CoreStats) -> bytes:
        self._running.set(stats.running)
        self._waiting.set(stats.waiting)
        self._kv_usage.set(stats.kv_cache_usage)
        # The core keeps running totals; counters only move forward by the difference.
        self._prefix_queries.inc(stats.prefix_queries_tokens - self._seen_queries)
        self._prefix_hits.inc(stats.prefix_hits_tokens - self._seen_hits)
        self._preemptions.inc(stats.preemptions - self._seen_preemptions)
        self._seen_queries = stats.prefix_queries_tokens
        self._seen_hits = stats.prefix_hits_tokens
        self._seen_preemptions = stats.preemptions
        return generate_latest(self.registry)


@dataclass(slots=True)
class _Window:
    """Tokens and busy seconds between two scrapes (llama-server's throughput gauges)."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0


class LlamacppMetrics:
    """llama-server's `/metrics`: the same counters and gauges, in the same order."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0
        self.prompt_seconds = 0.0
        self.tokens_predicted = 0
        self.tokens_predicted_seconds = 0.0
        self.n_decode = 0
        self.n_busy_slots = 0
        self.n_tokens_max = 0
        self._window = _Window()

    def observe_step(self, outcome: StepOutcome) -> None:
        self.n_decode += 1
        self.n_busy_slots += outcome.busy_seqs
        # llama-server counts a prompt when it is done and a generation when the slot is
        # released, so the counters move at those two moments, not per token.
        for first in outcome.first_tokens:
            processed = first.prompt_len - first.cached_tokens
            self.prompt_tokens += processed
            self.prompt_tokens_cached += first.cached_tokens
            self._window.prompt_tokens += processed

    def observe_finished(self, finished: Finished) -> None:
        self.prompt_seconds += finished.prefill_seconds
        self.tokens_predicted += finished.generated
        self.tokens_predicted_seconds += finished.decode_seconds
        self.n_tokens_max = max(self.n_tokens_max, finished.prompt_len + finished.generated)
        self._window.prompt_seconds += finished.prefill_seconds
        self._window.predicted_tokens += finished.generated
        self._window.predicted_seconds += finished.decode_seconds

    def render(self, stats: CoreStats) -> str:
        """The exposition text; like llama-server, a scrape resets the throughput window."""
        window = self._window
        self._window = _Window()
        counters = (
            (
                "prompt_tokens_total",
                "Number of prompt tokens processed, excluding cached tokens",
                self.prompt_tokens,
            ),
            (
                "prompt_tokens_cached_total",
                "Number of prompt tokens reused from the cache",
                self.prompt_tokens_cached,
            ),
            ("prompt_seconds_total", "Total time spent processing prompts", self.prompt_seconds),
            (
                "tokens_predicted_total",
                "Number of generation tokens processed",
                self.tokens_predicted,
            ),
            (
                "tokens_predicted_seconds_total",
                "Total time spent generating tokens",
                self.tokens_predicted_seconds,
            ),
            (
                "n_decode_total",
                (
                    "Total number of llama_decode() calls, excluding speculative decoding and "
                    "multimodal decoding"
                ),
                self.n_decode,
            ),
            (
                "n_tokens_max",
                "Largest observed sequence length (prompt + generation)",
                self.n_tokens_max,
            ),
            (
                "spec_decode_num_draft_tokens_total",
                "Speculative: Total draft tokens generated",
                0,
            ),
            (
                "spec_decode_num_accepted_tokens_total",
                "Speculative: Total draft tokens accepted by the target model",
                0,
            ),
            (
                "spec_decode_num_drafts_total",
                "Speculative: Total speculative decoding verification steps",
                0,
            ),
        )
        gauges = (
            (
                "prompt_tokens_seconds",
                "Average prompt throughput in tokens/s",
                _per_second(window.prompt_tokens, window.prompt_seconds),
            ),
            (
                "predicted_tokens_seconds",
                "Average generation throughput in tokens/s",
                _per_second(window.predicted_tokens, window.predicted_seconds),
            ),
            ("requests_processing", "Number of requests processing", stats.running),
            ("requests_deferred", "Number of requests deferred", stats.waiting),
            (
                "n_busy_slots_per_decode",
                "Average number of busy slots per llama_decode() call",
                self.n_busy_slots / max(self.n_decode, 1),
            ),
        )
        lines: list[str] = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, description, value in items:
                lines.append(f"# HELP llamacpp:{name} {description}")
                lines.append(f"# TYPE llamacpp:{name} {kind}")
                lines.append(f"llamacpp:{name} {_cpp_number(value)}")
        return "\n".join(lines) + "\n"


def _per_second(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def _cpp_number(value: float) -> str:
    """A number as C++'s `ostream << double` writes it (6 significant digits)."""
    return f"{float(value):g}"
