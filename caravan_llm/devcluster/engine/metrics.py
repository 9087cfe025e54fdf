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

from caravan_llm.devcluster.engine.batch import CoreStats, Finished, StepOutcome

# Buckets as vLLM defines them.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# Label values vLLM 0.32 writes for its enumerations (all present from the start).
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
CACHE_CONFIG_DEFAULTS: dict[str, str] = {
    # CacheConfig fields vLLM 0.32 (CPU build) writes that the simulator does not model,
    # at the values the real engine reports for the flags caravan renders.
    "_block_size_resolved": "True",
    "cache_dtype": "auto",
    "cache_hit_alignment_tokens": "None",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "gpu_memory_utilization": "0.92",
    "hash_block_size": "None",
    "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]",
    "kv_cache_layout": "None",
    "kv_offloading_backend": "native",
    "kv_offloading_size": "None",
    "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "float32",
    "num_cpu_blocks": "None",
    "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256",
    "prefix_match_unit": "None",
    "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None",
    "sliding_window": "None",
    "swa_bounded_replay": "True",
    "use_kda_recoverssm": "False",
    "use_replayssm": "False",
}
# Bytes of KV per token the simulator reports (kv_cache_memory_bytes): the tiny
# model's 2 layers x 4 heads x 32 dims x K and V x bf16.
KV_BYTES_PER_TOKEN = 1024

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
        num_gpu_blocks_override: int | None = None,
        user_specified_block_size: bool = False,
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
        self._success = {reason: success.labels(*values, reason) for reason in FINISHED_REASONS}
        waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            (*labels, "reason"),
            registry=reg,
        )
        self._waiting_capacity = waiting_by_reason.labels(*values, "capacity")
        waiting_by_reason.labels(*values, "deferred").set(0)
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine "
            "is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means "
            "sleep level 2.",
            (*labels, "sleep_state"),
            registry=reg,
        )
        sleep.labels(*values, "awake").set(1)
        sleep.labels(*values, "weights_offloaded").set(0)
        sleep.labels(*values, "discard_all").set(0)
        # Counters that stay at 0: no KV connector, no multimodal inputs, no FLOP model,
        # no queue limits (--max-num-queued-reqs) in the simulator.
        for name, help_text in (
            ("vllm:external_prefix_cache_queries", "External prefix cache queries."),
            ("vllm:external_prefix_cache_hits", "External prefix cache hits."),
            ("vllm:mm_cache_queries", "Multi-modal cache queries."),
            ("vllm:mm_cache_hits", "Multi-modal cache hits."),
            ("vllm:estimated_flops_per_gpu", "Estimated number of floating point operations."),
            ("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read."),
            ("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes written."),
        ):
            Counter(name, help_text, labels, registry=reg).labels(*values)
        # The API server counts these, so they carry no `engine` label.
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ("model_name", "reason"),
            registry=reg,
        )
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            rejections.labels(model_name, reason)
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            (*labels, "source"),
            registry=reg,
        )
        self._prompt_computed = by_source.labels(*values, "local_compute")
        self._prompt_cache_hit = by_source.labels(*values, "local_cache_hit")
        by_source.labels(*values, "external_kv_transfer")
        self._prompt_cached = Counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            labels,
            registry=reg,
        ).labels(*values)
        cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            (*labels, "source"),
            registry=reg,
        )
        self._prompt_cached_device = cached_by_source.labels(*values, "device")
        for source in ("host", "disk", "p2p", "external_unspecified"):
            cached_by_source.labels(*values, source)
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

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, help_text, labels, buckets=buckets, registry=reg)

        self._iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            _ITERATION_TOKEN_BUCKETS,
        ).labels(*values)
        self._max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        ).labels(*values)
        self._params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS
        ).labels(*values)
        self._params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        ).labels(*values)
        self._itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        ).labels(*values)
        self._tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _ITL_BUCKETS,
        ).labels(*values)
        self._inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        ).labels(*values)
        self._prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        ).labels(*values)
        self._decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        ).labels(*values)
        self._request_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            _PREEMPTION_BUCKETS,
        ).labels(*values)
        self._prefill_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
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
        kv_tokens = (num_gpu_blocks or 0) * block_size
        cache_labels = {
            **CACHE_CONFIG_DEFAULTS,
            "block_size": str(block_size),
            "effective_attention_block_size": str(block_size),
            "enable_prefix_caching": str(prefix_caching),
            "num_gpu_blocks": str(num_gpu_blocks),
            "num_gpu_blocks_override": str(num_gpu_blocks_override),
            "kv_cache_size_tokens": str(kv_tokens),
            "kv_cache_memory_bytes": str(kv_tokens * KV_BYTES_PER_TOKEN),
            "kv_cache_max_concurrency": str(round(kv_tokens / max_model_len, 2)),
            "user_specified_block_size": str(user_specified_block_size),
        }
        names = sorted(cache_labels)
        cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            (*names, "engine"),
            registry=reg,
        )
        cache_info.labels(*(cache_labels[name] for name in names), "0").set(1)
        self._seen_queries = 0
        self._seen_hits = 0
        self._seen_preemptions = 0
        # vllm:lora_requests_info, created on the first LoRA update (only with --enable-lora).
        self._lora_info: Gauge | None = None

    def observe_step(self, outcome: StepOutcome) -> None:
        if outcome.emitted:
            self._generation_tokens.inc(len(outcome.emitted))
        self._iteration_tokens.observe(outcome.prefill_tokens + outcome.decode_seqs)
        for first in outcome.first_tokens:
            self._prompt_tokens.inc(first.prompt_len)
            computed = first.prompt_len - first.cached_tokens
            self._prompt_computed.inc(computed)
            self._prompt_cache_hit.inc(first.cached_tokens)
            self._prompt_cached.inc(first.cached_tokens)
            self._prompt_cached_device.inc(first.cached_tokens)
            self._prefill_computed.observe(computed)
            self._ttft.observe(first.ttft_seconds)

    def observe_request(self, *, n: int, max_tokens: int) -> None:
        """A request's parameters, when it is accepted."""
        self._params_n.observe(n)
        self._params_max_tokens.observe(max_tokens)
        self._max_generation.observe(max_tokens)

    def observe_finished(self, finished: Finished, finish_reason: str) -> None:
        self._success[finish_reason].inc()
        self._e2e.observe(finished.e2e_seconds)
        self._queue_time.observe(finished.queue_seconds)
        self._request_prompt_tokens.observe(finished.prompt_len)
        self._request_generation_tokens.observe(finished.generated)
        self._prefill_time.observe(finished.prefill_seconds)
        self._decode_time.observe(finished.decode_seconds)
        self._inference_time.observe(finished.prefill_seconds + finished.decode_seconds)
        self._request_preemptions.observe(0)
        if finished.generated > 1:
            per_token = finished.decode_seconds / (finished.generated - 1)
            self._tpot.observe(per_token)
            self._itl.observe(per_token)

    def observe_aborted(self) -> None:
        self._success["abort"].inc()

    def observe_lora(
        self, *, max_lora: int, running: list[str], waiting: list[str], now: float
    ) -> None:
        """vLLM's `vllm:lora_requests_info`: one series, its labels the adapters of the running
        and waiting requests (comma-separated, in order of first appearance) and
        `max_lora`, its value the wall-clock time of the update; only with --enable-lora."""
        if self._lora_info is None:
            self._lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
                registry=self.registry,
                multiprocess_mode="livemostrecent",
            )
        # As vLLM, every combination seen stays a series with the time it was last
        # set: a reader takes the series with the latest value (GIE's rule).
        labels = (str(max_lora), ",".join(dict.fromkeys(waiting)), ",".join(dict.fromkeys(running)))
        self._lora_info.labels(*labels).set(now)

    def render(self, stats: CoreStats) -> bytes:
        self._running.set(stats.running)
        self._waiting.set(stats.waiting)
        self._waiting_capacity.set(stats.waiting)
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
