"""The SGLang flavour of the simulated engine: only what differs from the shared simulation.

    python -m caravan_llm.devcluster.engine --flavor sglang [sglang.launch_server flags]

SGLang's OpenAI server behaves as vLLM's in everything the simulation models
(request parsing, `max_tokens: 16` for completions, `continue_final_message`,
response and error shapes, served-name checks; python/sglang/srt/entrypoints/
openai/protocol.py and serving_*.py), so those come from the shared code with
the vLLM dialect. What is SGLang's own is here:

- the command line of `python -m sglang.launch_server` (`ServerArgs.add_cli_args`
  in python/sglang/srt/server_args.py): `--model-path`, `--tp`/`--tp-size`,
  `--host` (default 127.0.0.1), `--port` (default 30000),
  `--served-model-name`, `--max-running-requests`, `--context-length`,
  `--enable-metrics`, `--api-key` (no environment fallback), `--page-size`
  (the simulated prefix cache's block size) and `--kv-events-config`
  (checked as JSON; this flavour publishes no KV events);
- the API-key check (`add_api_key_middleware`, python/sglang/srt/utils):
  every path but `/health*` and `/metrics*` needs `Authorization: Bearer <key>`,
  else 401 `{"error": "Unauthorized"}`;
- `/metrics` exists only with `--enable-metrics`, with the scheduler gauges
  `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`
  (KV-cache tokens in use, 0..1) and the token counters, labelled
  `model_name`, `engine_type`, `tp_rank`, `pp_rank`
  (python/sglang/srt/metrics/collector.py);
- `/v1/models` cards `owned_by: "sglang"` with `root` and `max_model_len`.

Like the real server, it listens only once the model is loaded.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from caravan_llm.devcluster.engine.batch import PerfModel
from caravan_llm.devcluster.engine.flags import (
    EngineSettings,
    FlagError,
    _add_sim_flags,
    _float_knob,
    _int_knob,
    _knob_values,
    _positive,
    _prefix_caching,
    _sim_settings,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from caravan_llm.devcluster.engine.batch import CoreStats, StepOutcome

DEFAULT_PORT = 30000
# SGLang derives its running-request limit from GPU memory when not given.
AUTO_MAX_RUNNING_REQUESTS = 256
DEFAULT_CONTEXT_LENGTH = 8192
# SGLang's paged KV cache defaults to pages of one token.
PAGE_SIZE = 1
# `launch_server` flags taken with a value and ignored by the simulator.
IGNORED_VALUE_FLAGS = (
    "--tokenizer-path",
    "--tokenizer-mode",
    "--load-format",
    "--dtype",
    "--kv-cache-dtype",
    "--quantization",
    "--mem-fraction-static",
    "--chunked-prefill-size",
    "--max-prefill-tokens",
    "--max-total-tokens",
    "--schedule-policy",
    "--dp-size",
    "--ep-size",
    "--attention-backend",
    "--sampling-backend",
    "--grammar-backend",
    "--chat-template",
    "--reasoning-parser",
    "--tool-call-parser",
    "--log-level",
    "--random-seed",
    "--cuda-graph-max-bs",
    "--revision",
    "--download-dir",
    "--decode-log-interval",
)
IGNORED_SWITCHES = (
    "--trust-remote-code",
    "--disable-radix-cache",
    "--disable-cuda-graph",
    "--enable-torch-compile",
    "--log-requests",
    "--skip-server-warmup",
    "--enable-cache-report",
)
# Paths the API key does not guard (prefixes, as SGLang's middleware compares).
PUBLIC_PATH_PREFIXES = ("/health", "/metrics")


def sglang_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m caravan_llm.devcluster.engine --flavor sglang",
        description="Simulated SGLang server (flags of `python -m sglang.launch_server`).",
    )
    parser.add_argument("--model-path", "--model", dest="model_path", default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--tensor-parallel-size", "--tp-size", dest="tp_size", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--max-running-requests", type=int, default=None)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--enable-metrics", action="store_true", default=False)
    parser.add_argument("--api-key", default=None)
    # Tokens per KV page: the simulated prefix cache's block size when given.
    parser.add_argument("--page-size", type=int, default=None)
    # Checked as a JSON object; the simulator publishes no SGLang KV events.
    parser.add_argument("--kv-events-config", default=None)
    ignored = parser.add_argument_group("accepted and ignored by the simulator")
    for flag in IGNORED_VALUE_FLAGS:
        ignored.add_argument(flag, dest=f"ignored_{flag}", default=None)
    for flag in IGNORED_SWITCHES:
        ignored.add_argument(flag, dest=f"ignored_{flag}", action="store_true")
    _add_sim_flags(parser)
    return parser


def sglang_settings(argv: list[str], env: Mapping[str, str]) -> EngineSettings:
    """The settings of a simulated SGLang server from its command line."""
    # `python -m sglang.launch_server` may be given literally after the flavour.
    if argv[:2] == ["-m", "sglang.launch_server"]:
        argv = argv[2:]
    args = sglang_parser().parse_args(argv)
    if not args.model_path:
        raise FlagError("sglang: --model-path is required")
    values = _knob_values("vllm", args, env)
    max_running = (
        _positive("--max-running-requests", args.max_running_requests)
        if args.max_running_requests is not None
        else AUTO_MAX_RUNNING_REQUESTS
    )
    context_length = (
        _positive("--context-length", args.context_length)
        if args.context_length is not None
        else DEFAULT_CONTEXT_LENGTH
    )
    _positive("--tp", args.tp_size)
    _check_kv_events_config(args.kv_events_config)
    block_size = (
        _positive("--page-size", args.page_size)
        if args.page_size is not None
        else _int_knob(values, "block_size", minimum=1)
    )
    try:
        perf = PerfModel(
            max_num_seqs=max_running,
            kv_cache_tokens=_int_knob(values, "kv_cache_tokens", minimum=1),
            block_size=block_size,
            max_batched_tokens=max(context_length, 8192),
            step_seconds=_float_knob(values, "step_seconds"),
            decode_seconds_per_seq=_float_knob(values, "decode_seconds_per_seq"),
            prefill_seconds_per_token=_float_knob(values, "prefill_seconds_per_token"),
            prefix_caching=_prefix_caching(values, default=True),  # RadixAttention
        )
    except ValueError as exc:
        raise FlagError(str(exc)) from exc
    return EngineSettings(
        flavor="sglang",
        model=args.model_path,
        served_model_names=(args.served_model_name or args.model_path,),
        host=args.host,
        port=args.port,
        max_model_len=context_length,
        metrics_enabled=args.enable_metrics,
        slots_enabled=False,
        default_max_tokens=None,
        include_cached_tokens=False,
        force_include_usage=False,
        perf=perf,
        sim=_sim_settings(values),
        api_keys=(args.api_key,) if args.api_key else (),
    )


def _check_kv_events_config(raw: str | None) -> None:
    """SGLang parses `--kv-events-config` as JSON (`KVEventsConfig.from_cli`): so does this."""
    if raw is None:
        return
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise FlagError(f"--kv-events-config: not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise FlagError("--kv-events-config: expected a JSON object")


def is_public_path(path: str) -> bool:
    return path.startswith(PUBLIC_PATH_PREFIXES)


def model_cards(settings: EngineSettings, created: int) -> dict[str, Any]:
    cards = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": settings.max_model_len,
        }
        for name in settings.served_model_names
    ]
    return {"object": "list", "data": cards}


class SglangMetrics:
    """SGLang's scheduler gauges and token counters for one instance (tp rank 0)."""

    def __init__(self, *, model_name: str) -> None:
        self.registry = CollectorRegistry()
        names = ("model_name", "engine_type", "tp_rank", "pp_rank")
        values = (model_name, "unified", "0", "0")
        reg = self.registry
        self._running = Gauge(
            "sglang:num_running_reqs", "The number of running requests.", names, registry=reg
        ).labels(*values)
        self._queued = Gauge(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            names,
            registry=reg,
        ).labels(*values)
        self._token_usage = Gauge(
            "sglang:token_usage", "The token usage.", names, registry=reg
        ).labels(*values)
        self._prompt_tokens = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", names, registry=reg
        ).labels(*values)
        self._generation_tokens = Counter(
            "sglang:generation_tokens",
            "Number of generation tokens processed.",
            names,
            registry=reg,
        ).labels(*values)

    def observe_step(self, outcome: StepOutcome) -> None:
        if outcome.emitted:
            self._generation_tokens.inc(len(outcome.emitted))
        for first in outcome.first_tokens:
            self._prompt_tokens.inc(first.prompt_len)

    def render(self, stats: CoreStats) -> bytes:
        self._running.set(stats.running)
        self._queued.set(stats.waiting)
        self._token_usage.set(stats.kv_cache_usage)
        return generate_latest(self.registry)
