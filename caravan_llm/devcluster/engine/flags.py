"""Command lines of the simulated engines: the real engines' flags plus `--sim-*` knobs.

    python -m caravan_llm.devcluster.engine --flavor vllm [vllm serve flags]
    python -m caravan_llm.devcluster.engine --flavor llamacpp [llama-server flags]
    python -m caravan_llm.devcluster.engine --flavor sglang [sglang.launch_server flags]

Each flavour takes the flags its real engine takes, so a rendered Nomad job
runs unchanged with the simulator in place of the engine binary. Flags that
shape the simulation are honoured (model names, host, port, sequence limits,
context sizes, block size, batch budget, prefix caching, metrics and slots
switches). The other flags the real engines accept and that caravan's
adapters may render are accepted and ignored; they are listed in
`VLLM_IGNORED_VALUE_FLAGS`, `VLLM_IGNORED_SWITCHES`, `LLAMACPP_IGNORED_VALUE_FLAGS`
and `LLAMACPP_IGNORED_SWITCHES`. Anything else is an error, as it would be for
the real engine.

Simulation knobs come from `--sim-*` flags or, so that devcluster can set them
without touching a rendered job's arguments, from `CARAVAN_SIM_*` environment
variables (the flag wins): `--sim-load-seconds` / `CARAVAN_SIM_LOAD_SECONDS`,
and so on for every knob in `SIM_KNOBS`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Literal

from caravan_llm.devcluster.engine.batch import PerfModel
from caravan_llm.devcluster.engine.kv_events import (
    ENCODINGS,
    KvEventsConfig,
    KvEventsConfigError,
    parse_kv_events_config,
)
from caravan_llm.devcluster.engine.lora import (
    MAX_LORA_RANKS,
    NODE_ROOT_ENV,
    LoraConfig,
    LoraModuleError,
    parse_lora_module,
    runtime_updating,
)
from caravan_llm.devcluster.engine.lora_slots import (
    DEFAULT_LOAD_SECONDS,
    DEFAULT_SWAP_SECONDS,
    LoraCosts,
)
from caravan_llm.kvrelay.wire import Encoding

Flavor = Literal["vllm", "llamacpp", "sglang"]
FLAVORS: tuple[Flavor, ...] = ("vllm", "llamacpp", "sglang")
# The OpenAI-server behaviour a flavour shares (SGLang's is vLLM's; `sglang.py`).
ApiFlavor = Literal["vllm", "llamacpp"]
SIM_ENV_PREFIX = "CARAVAN_SIM_"

# vLLM `serve` flags taken with a value and ignored by the simulator.
VLLM_IGNORED_VALUE_FLAGS = (
    "--dtype",
    "--gpu-memory-utilization",
    "--revision",
    "--tokenizer-revision",
    "--tokenizer-mode",
    "--download-dir",
    "--load-format",
    "--config-format",
    "--kv-cache-dtype",
    "--quantization",
    "--seed",
    "--swap-space",
    "--cpu-offload-gb",
    "--pipeline-parallel-size",
    "--data-parallel-size",
    "--distributed-executor-backend",
    "--chat-template",
    "--generation-config",
    "--max-logprobs",
    "--tool-call-parser",
    "--reasoning-parser",
    "--uvicorn-log-level",
    "--root-path",
    "--response-role",
    "--limit-mm-per-prompt",
    "--override-generation-config",
    "--hf-overrides",
    "--compilation-config",
    "--kv-transfer-config",
    "--scheduling-policy",
    "--max-seq-len-to-capture",
    "--allowed-origins",
    "--disable-log-stats-interval",
)
# vLLM switches (with their `--no-` forms) accepted and ignored.
VLLM_IGNORED_SWITCHES = (
    "--trust-remote-code",
    "--enforce-eager",
    "--enable-chunked-prefill",
    "--disable-log-requests",
    "--enable-log-requests",
    "--disable-log-stats",
    "--disable-uvicorn-access-log",
    "--enable-auto-tool-choice",
    "--disable-frontend-multiprocessing",
    "--disable-custom-all-reduce",
    "--enable-expert-parallel",
    "--async-scheduling",
    "--enable-server-load-tracking",
)
_VLLM_SHORT_FLAGS = {
    "--quantization": "-q",
    "--pipeline-parallel-size": "-pp",
    "--data-parallel-size": "-dp",
    "--compilation-config": "-O",
}

# llama-server flags taken with a value and ignored by the simulator.
LLAMACPP_IGNORED_VALUE_FLAGS = (
    ("-t", "--threads"),
    ("-tb", "--threads-batch"),
    ("-ngl", "--gpu-layers", "--n-gpu-layers"),
    ("-ub", "--ubatch-size"),
    ("-s", "--seed"),
    ("-to", "--timeout"),
    ("--chat-template",),
    ("--cache-reuse",),
    ("-dev", "--device"),
    ("-sm", "--split-mode"),
    ("-ts", "--tensor-split"),
    ("-mg", "--main-gpu"),
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
    ("--temp",),
    ("--top-k",),
    ("--top-p",),
    ("--min-p",),
    ("--reasoning-format",),
    ("-lv", "--verbosity", "--log-verbosity"),
    ("--ctx-checkpoints",),
    ("-cram", "--cache-ram"),
    ("--threads-http",),
    ("--slot-save-path",),
    ("--path",),
    ("--api-prefix",),
)
LLAMACPP_IGNORED_SWITCHES = (
    ("-cb", "--cont-batching"),
    ("-nocb", "--no-cont-batching"),
    ("--jinja",),
    ("--no-jinja",),
    ("--no-ui", "--no-webui"),
    ("--ui", "--webui"),
    ("--mlock",),
    ("--no-mmap",),
    ("--log-disable",),
    ("-v", "--verbose", "--log-verbose"),
    ("--props",),
    ("--no-warmup",),
    ("--context-shift",),
    ("--no-context-shift",),
    ("--no-prefill-assistant",),
)


@dataclass(frozen=True, slots=True)
class SimKnob:
    """One simulation knob: its flag, its environment variable and its meaning."""

    name: str
    help: str

    @property
    def flag(self) -> str:
        return "--sim-" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return SIM_ENV_PREFIX + self.name.upper()


SIM_KNOBS = (
    SimKnob("load_seconds", "seconds the model takes to load before serving"),
    SimKnob("prefill_seconds_per_token", "prefill cost per uncached prompt token"),
    SimKnob("step_seconds", "fixed cost of one batch step (one decode token)"),
    SimKnob("decode_seconds_per_seq", "extra step cost per sequence in the batch"),
    SimKnob("kv_cache_tokens", "KV cache capacity in tokens"),
    SimKnob("block_size", "KV block size in tokens (prefix-cache granularity)"),
    SimKnob("prefix_caching", "on|off: reuse cached prompt blocks"),
    SimKnob("output_tokens", "longest natural reply (EOS between half of it and all)"),
    SimKnob("failure_rate", "share of requests answered HTTP 500 before any byte"),
    SimKnob("disconnect_rate", "share of streams whose connection drops mid-stream"),
    SimKnob("hang_rate", "share of requests that never answer"),
    SimKnob("seed", "seed of generated text and of fault draws"),
    SimKnob(
        "kv_events_encoding", "map|array: how KV events are encoded (vLLM before PR #42892: array)"
    ),
    SimKnob("lora_load_seconds", "seconds to read a LoRA adapter from disk (lora_slots.py)"),
    SimKnob("lora_swap_seconds", "seconds to copy a read LoRA adapter into a GPU slot"),
    SimKnob("lora_state_dir", "folder for <port>.json, the adapter cache's state (benchmarks)"),
)


@dataclass(frozen=True, slots=True)
class SimSettings:
    """Simulation knobs that are not part of the performance model."""

    load_seconds: float
    output_tokens: int
    failure_rate: float
    disconnect_rate: float
    hang_rate: float
    seed: int


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Everything one simulated engine instance needs, parsed from its command line."""

    flavor: Flavor
    model: str
    served_model_names: tuple[str, ...]
    host: str
    port: int
    max_model_len: int
    metrics_enabled: bool
    slots_enabled: bool
    default_max_tokens: int | None
    include_cached_tokens: bool
    force_include_usage: bool
    perf: PerfModel
    sim: SimSettings
    # `--api-key` / VLLM_API_KEY / LLAMA_API_KEY: when set, requests need one of them.
    api_keys: tuple[str, ...] = ()
    # llama-server's --embeddings and --reranking: without them those routes answer 501.
    embeddings: bool = False
    reranking: bool = False
    # vLLM's --num-gpu-blocks-override and whether --block-size was given (cache_config_info).
    num_gpu_blocks_override: int | None = None
    user_specified_block_size: bool = False
    # vLLM's --kv-events-config, and the event encoding (`--sim-kv-events-encoding`).
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    kv_events_encoding: Encoding = "map"
    # VLLM_SERVER_DEV_MODE=1: vLLM's development routes (`POST /reset_prefix_cache`).
    dev_mode: bool = False
    # vLLM's --tokenizer: where the model's tokenizer is (None: the --model directory).
    tokenizer: str | None = None

    @property
    def tokenizer_directory(self) -> Path | None:
        """vLLM's tokenizer directory when it is a local one (`hf_tokenizer` reads it)."""
        if self.flavor != "vllm":
            return None
        path = Path(self.tokenizer or self.model)
        return path if path.is_dir() else None

    # vLLM's --enable-lora and its limits (None: LoRA off), and whether
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING mounts the load and unload routes.
    lora: LoraConfig | None = None
    runtime_lora_updating: bool = False
    # Where the engine finds adapter folders (the node folder, HF_HOME).
    lora_env: Mapping[str, str] = field(default_factory=dict)
    # What adapters cost the simulated engine (`--sim-lora-*-seconds`), and where it writes
    # its adapter cache's state (`--sim-lora-state-dir`; None: nowhere).
    lora_costs: LoraCosts = field(default_factory=LoraCosts)
    lora_state_dir: Path | None = None

    @property
    def api_flavor(self) -> ApiFlavor:
        """Whose OpenAI request and response behaviour this flavour has."""
        return "llamacpp" if self.flavor == "llamacpp" else "vllm"

    @property
    def model_name(self) -> str:
        """The name responses and metrics report (vLLM: first served name; llama.cpp: alias)."""
        return self.served_model_names[0]


class FlagError(ValueError):
    """A command line the simulator cannot run, with the flag or value at fault."""


# Per-flavour defaults of the performance model, in the shape of each engine:
# vLLM on a GPU (fast steps, large batch), llama.cpp on CPU (slow steps that
# grow quickly with the batch).
_DEFAULTS: dict[Flavor, dict[str, float | int | str]] = {
    "vllm": {
        "load_seconds": 2.0,
        "prefill_seconds_per_token": 0.00005,
        "step_seconds": 0.015,
        "decode_seconds_per_seq": 0.0002,
        "kv_cache_tokens": 131072,
        # vLLM's CPU build uses 128-token blocks (GPU vLLM: 16); tests/real_vllm holds us to it.
        "block_size": 128,
        # Where these come from: lora_slots.py.
        "lora_load_seconds": DEFAULT_LOAD_SECONDS,
        "lora_swap_seconds": DEFAULT_SWAP_SECONDS,
        "output_tokens": 64,
        "failure_rate": 0.0,
        "disconnect_rate": 0.0,
        "hang_rate": 0.0,
        "seed": 0,
    },
    "llamacpp": {
        "load_seconds": 0.3,
        "prefill_seconds_per_token": 0.0005,
        "step_seconds": 0.02,
        "decode_seconds_per_seq": 0.004,
        "block_size": 16,
        "output_tokens": 64,
        "failure_rate": 0.0,
        "disconnect_rate": 0.0,
        "hang_rate": 0.0,
        "seed": 0,
    },
}
# llama-server with -c 0 takes the model's trained context; the simulator's "model" has this.
LLAMACPP_TRAINED_CONTEXT = 4096
LLAMACPP_AUTO_PARALLEL = 4
VLLM_DEFAULT_MAX_MODEL_LEN = 8192


def _add_sim_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "simulation", f"knobs of the simulator (also {SIM_ENV_PREFIX}<NAME> variables)"
    )
    for knob in SIM_KNOBS:
        group.add_argument(knob.flag, dest=f"sim_{knob.name}", default=None, help=knob.help)


def vllm_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m caravan_llm.devcluster.engine --flavor vllm",
        description="Simulated vLLM OpenAI server (flags of `vllm serve`).",
        allow_abbrev=False,
    )
    parser.add_argument("model_tag", nargs="?", default=None, help="model (vllm serve MODEL)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=False
    )
    parser.add_argument(
        "--enable-force-include-usage", action=argparse.BooleanOptionalAction, default=False
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--kv-events-config", default=None)
    # LoRA (devcluster/engine/lora.py).
    parser.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--max-loras", type=int, default=1)
    parser.add_argument("--max-lora-rank", type=int, default=16, choices=MAX_LORA_RANKS)
    parser.add_argument("--max-cpu-loras", type=int, default=None)
    parser.add_argument("--lora-modules", nargs="+", default=None)
    ignored = parser.add_argument_group("accepted and ignored by the simulator")
    for flag in VLLM_IGNORED_VALUE_FLAGS:
        names = [flag, _VLLM_SHORT_FLAGS[flag]] if flag in _VLLM_SHORT_FLAGS else [flag]
        ignored.add_argument(*names, dest=f"ignored_{flag}", default=None)
    for flag in VLLM_IGNORED_SWITCHES:
        ignored.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
    _add_sim_flags(parser)
    return parser


def llamacpp_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m caravan_llm.devcluster.engine --flavor llamacpp",
        description="Simulated llama.cpp server (flags of `llama-server`).",
        allow_abbrev=False,
    )
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("-a", "--alias", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("-np", "--parallel", type=int, default=-1)
    parser.add_argument("-c", "--ctx-size", type=int, default=0)
    parser.add_argument("-b", "--batch-size", type=int, default=2048)
    parser.add_argument("-n", "--predict", "--n-predict", dest="n_predict", type=int, default=-1)
    parser.add_argument("-kvu", "--kv-unified", action="store_true", default=False)
    parser.add_argument("--metrics", action="store_true", default=False)
    parser.add_argument("--slots", dest="slots", action="store_true", default=True)
    parser.add_argument("--no-slots", dest="slots", action="store_false")
    parser.add_argument("-fa", "--flash-attn", nargs="?", const="on", default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--embedding", "--embeddings", dest="embeddings", action="store_true")
    parser.add_argument("--reranking", "--rerank", dest="reranking", action="store_true")
    ignored = parser.add_argument_group("accepted and ignored by the simulator")
    for names in LLAMACPP_IGNORED_VALUE_FLAGS:
        ignored.add_argument(*names, dest=f"ignored_{names[-1]}", default=None)
    for names in LLAMACPP_IGNORED_SWITCHES:
        ignored.add_argument(*names, dest=f"ignored_{names[-1]}", action="store_true")
    _add_sim_flags(parser)
    return parser


def split_flavor(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Take `--flavor X` (or `--flavor=X`) out of argv; also drop a leading `vllm serve`."""
    rest: list[str] = []
    flavor: str | None = None
    args = list(argv)
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--flavor":
            if index + 1 >= len(args):
                raise FlagError("--flavor needs a value: vllm, llamacpp or sglang")
            flavor = args[index + 1]
            index += 2
            continue
        if arg.startswith("--flavor="):
            flavor = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        index += 1
    if rest[:1] == ["vllm"]:
        rest = rest[1:]
    if rest[:1] == ["serve"]:
        rest = rest[1:]
    return flavor, rest


def parse_engine_args(argv: Sequence[str], env: Mapping[str, str]) -> EngineSettings:
    """The settings of one simulated engine from its command line and environment.

    Raises FlagError for a bad flavour or a value the simulator cannot use;
    argparse itself exits with status 2 on flags the real engine would reject.
    """
    flavor, rest = split_flavor(argv)
    if flavor is None:
        raise FlagError("missing --flavor: choose vllm, llamacpp or sglang")
    if flavor == "vllm":
        return _vllm_settings(vllm_parser().parse_args(rest), env)
    if flavor == "llamacpp":
        return _llamacpp_settings(llamacpp_parser().parse_args(rest), env)
    if flavor == "sglang":
        # The flavour's own module builds on this one's helpers.
        from caravan_llm.devcluster.engine.sglang import sglang_settings  # noqa: PLC0415

        return sglang_settings(rest, env)
    raise FlagError(f"unknown flavour {flavor!r}: choose vllm, llamacpp or sglang")


def _knob_values(
    flavor: Flavor, args: argparse.Namespace, env: Mapping[str, str]
) -> dict[str, str]:
    values = {name: str(value) for name, value in _DEFAULTS[flavor].items()}
    for knob in SIM_KNOBS:
        from_flag = getattr(args, f"sim_{knob.name}")
        from_env = env.get(knob.env)
        if from_flag is not None:
            values[knob.name] = from_flag
        elif from_env:
            values[knob.name] = from_env
    return values


def _knob(name: str) -> SimKnob:
    return next(k for k in SIM_KNOBS if k.name == name)


def _float_knob(values: Mapping[str, str], name: str) -> float:
    knob = _knob(name)
    try:
        value = float(values[name])
    except ValueError:
        raise FlagError(
            f"{knob.flag} / {knob.env}: expected a number, got {values[name]!r}"
        ) from None
    if value < 0:
        raise FlagError(f"{knob.flag} / {knob.env}: must not be negative, got {values[name]!r}")
    return value


def _int_knob(values: Mapping[str, str], name: str, *, minimum: int | None = 0) -> int:
    knob = _knob(name)
    try:
        value = int(values[name])
    except ValueError:
        raise FlagError(
            f"{knob.flag} / {knob.env}: expected an integer, got {values[name]!r}"
        ) from None
    if minimum is not None and value < minimum:
        raise FlagError(f"{knob.flag} / {knob.env}: must be at least {minimum}, got {value}")
    return value


def _rate(values: Mapping[str, str], name: str) -> float:
    value = _float_knob(values, name)
    if value > 1:
        knob = _knob(name)
        raise FlagError(f"{knob.flag} / {knob.env}: a rate between 0 and 1, got {value}")
    return value


def _prefix_caching(values: Mapping[str, str], *, default: bool) -> bool:
    raw = values.get("prefix_caching")
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered in {"on", "true", "1", "yes"}:
        return True
    if lowered in {"off", "false", "0", "no"}:
        return False
    raise FlagError(
        f"--sim-prefix-caching / {SIM_ENV_PREFIX}PREFIX_CACHING: on or off, got {raw!r}"
    )


def _sim_settings(values: Mapping[str, str]) -> SimSettings:
    return SimSettings(
        load_seconds=_float_knob(values, "load_seconds"),
        output_tokens=_int_knob(values, "output_tokens", minimum=1),
        failure_rate=_rate(values, "failure_rate"),
        disconnect_rate=_rate(values, "disconnect_rate"),
        hang_rate=_rate(values, "hang_rate"),
        seed=_int_knob(values, "seed", minimum=None),
    )


def _kv_events(raw: str | None) -> KvEventsConfig:
    if raw is None:
        return KvEventsConfig()
    try:
        return parse_kv_events_config(raw)
    except KvEventsConfigError as exc:
        raise FlagError(str(exc)) from None


def _kv_events_encoding(values: Mapping[str, str]) -> Encoding:
    raw = values.get("kv_events_encoding", "map").strip().lower()
    for encoding in ENCODINGS:
        if raw == encoding:
            return encoding
    knob = _knob("kv_events_encoding")
    raise FlagError(f"{knob.flag} / {knob.env}: map or array, got {values['kv_events_encoding']!r}")


def _dev_mode(env: Mapping[str, str]) -> bool:
    """vLLM's `VLLM_SERVER_DEV_MODE`: `bool(int(value))`, off when unset."""
    raw = env.get("VLLM_SERVER_DEV_MODE", "0")
    try:
        return bool(int(raw))
    except ValueError:
        raise FlagError(f"VLLM_SERVER_DEV_MODE: expected 0 or 1, got {raw!r}") from None


def _positive(flag: str, value: int) -> int:
    if value < 1:
        raise FlagError(f"{flag}: must be at least 1, got {value}")
    return value


def _vllm_settings(args: argparse.Namespace, env: Mapping[str, str]) -> EngineSettings:
    model = args.model or args.model_tag
    if not model:
        raise FlagError("vllm: give the model as --model MODEL or as `vllm serve MODEL`")
    names = tuple(args.served_model_name or [model])
    values = _knob_values("vllm", args, env)
    block_size = args.block_size or _int_knob(values, "block_size", minimum=1)
    kv_tokens = (
        args.num_gpu_blocks_override * block_size
        if args.num_gpu_blocks_override
        else _int_knob(values, "kv_cache_tokens", minimum=1)
    )
    max_model_len = _max_model_len(args.max_model_len)
    try:
        perf = PerfModel(
            max_num_seqs=_positive("--max-num-seqs", args.max_num_seqs),
            kv_cache_tokens=kv_tokens,
            block_size=_positive("--block-size", block_size),
            max_batched_tokens=_positive("--max-num-batched-tokens", args.max_num_batched_tokens),
            step_seconds=_float_knob(values, "step_seconds"),
            decode_seconds_per_seq=_float_knob(values, "decode_seconds_per_seq"),
            prefill_seconds_per_token=_float_knob(values, "prefill_seconds_per_token"),
            prefix_caching=_prefix_caching(values, default=args.enable_prefix_caching),
        )
    except ValueError as exc:
        raise FlagError(str(exc)) from exc
    _positive("--tensor-parallel-size", args.tensor_parallel_size)
    return EngineSettings(
        flavor="vllm",
        model=model,
        served_model_names=names,
        # vLLM binds every interface when --host is not given.
        host=args.host or "0.0.0.0",
        port=args.port,
        max_model_len=max_model_len,
        metrics_enabled=True,
        slots_enabled=False,
        default_max_tokens=None,
        include_cached_tokens=args.enable_prompt_tokens_details,
        force_include_usage=args.enable_force_include_usage,
        perf=perf,
        sim=_sim_settings(values),
        # vLLM: `args.api_key or envs.VLLM_API_KEY`, one key.
        api_keys=tuple(key for key in [args.api_key or env.get("VLLM_API_KEY") or ""] if key),
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        user_specified_block_size=args.block_size is not None,
        kv_events=_kv_events(args.kv_events_config),
        kv_events_encoding=_kv_events_encoding(values),
        dev_mode=_dev_mode(env),
        tokenizer=args.tokenizer,
        lora=_lora_config(args),
        runtime_lora_updating=runtime_updating(env),
        lora_env={k: env[k] for k in (NODE_ROOT_ENV, "HF_HOME") if k in env},
        lora_costs=LoraCosts(
            load_seconds=_float_knob(values, "lora_load_seconds"),
            swap_seconds=_float_knob(values, "lora_swap_seconds"),
        ),
        lora_state_dir=_state_dir(values),
    )


def _state_dir(values: Mapping[str, str]) -> Path | None:
    raw = values.get("lora_state_dir")
    if not raw:
        return None
    folder = Path(raw)
    if not folder.is_dir():
        knob = _knob("lora_state_dir")
        raise FlagError(f"{knob.flag} / {knob.env}: not a folder: {raw!r}")
    return folder


def _lora_config(args: argparse.Namespace) -> LoraConfig | None:
    """vLLM's LoRA flags; --lora-modules needs --enable-lora (the modules load into it)."""
    if not args.enable_lora:
        if args.lora_modules:
            raise FlagError("--lora-modules: LoRA is not enabled; add --enable-lora")
        return None
    try:
        modules = tuple(parse_lora_module(value) for value in args.lora_modules or ())
    except LoraModuleError as exc:
        raise FlagError(str(exc)) from None
    max_loras = _positive("--max-loras", args.max_loras)
    if args.max_cpu_loras is not None and args.max_cpu_loras < max_loras:
        raise FlagError(f"max_cpu_loras ({args.max_cpu_loras}) must be >= max_loras ({max_loras})")
    return LoraConfig(
        max_loras=max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        modules=modules,
    )


def _max_model_len(raw: str | None) -> int:
    """vLLM's --max-model-len: an integer, or with a k/K/m/M suffix (`32k`)."""
    if raw is None:
        return VLLM_DEFAULT_MAX_MODEL_LEN
    text = raw.strip()
    scale = {"k": 1000, "K": 1024, "m": 1_000_000, "M": 1024 * 1024}.get(text[-1:], 1)
    digits = text[:-1] if scale != 1 else text
    try:
        value = int(float(digits) * scale)
    except ValueError:
        raise FlagError(
            f"--max-model-len: expected a number like 4096 or 32k, got {raw!r}"
        ) from None
    return _positive("--max-model-len", value)


def _llamacpp_settings(args: argparse.Namespace, env: Mapping[str, str]) -> EngineSettings:
    if not args.model:
        raise FlagError("llamacpp: -m/--model is required")
    aliases = sorted({a.strip() for a in (args.alias or "").split(",") if a.strip()})
    # llama-server keeps aliases in a sorted set and reports the first; without
    # one it reports the model file's name.
    names = tuple(aliases) if aliases else (PurePath(args.model).name,)
    values = _knob_values("llamacpp", args, env)
    auto_parallel = args.parallel < 0
    parallel = LLAMACPP_AUTO_PARALLEL if auto_parallel else _positive("-np", args.parallel)
    ctx_size = args.ctx_size if args.ctx_size > 0 else LLAMACPP_TRAINED_CONTEXT
    unified = args.kv_unified or auto_parallel
    slot_ctx = ctx_size if unified else ctx_size // parallel
    if slot_ctx < 1:
        raise FlagError(f"-c {ctx_size} is too small for -np {parallel}")
    kv_tokens = (
        _int_knob(values, "kv_cache_tokens", minimum=1) if "kv_cache_tokens" in values else ctx_size
    )
    try:
        perf = PerfModel(
            max_num_seqs=parallel,
            kv_cache_tokens=kv_tokens,
            block_size=_int_knob(values, "block_size", minimum=1),
            max_batched_tokens=_positive("-b", args.batch_size),
            step_seconds=_float_knob(values, "step_seconds"),
            decode_seconds_per_seq=_float_knob(values, "decode_seconds_per_seq"),
            prefill_seconds_per_token=_float_knob(values, "prefill_seconds_per_token"),
            prefix_caching=_prefix_caching(values, default=True),
        )
    except ValueError as exc:
        raise FlagError(str(exc)) from exc
    return EngineSettings(
        flavor="llamacpp",
        model=args.model,
        served_model_names=names,
        host=args.host,
        port=args.port,
        max_model_len=slot_ctx,
        metrics_enabled=args.metrics,
        slots_enabled=args.slots,
        default_max_tokens=args.n_predict if args.n_predict >= 0 else None,
        include_cached_tokens=True,
        force_include_usage=False,
        perf=perf,
        sim=_sim_settings(values),
        embeddings=args.embeddings,
        reranking=args.reranking,
        # llama-server: a comma-separated list; LLAMA_API_KEY when the flag is absent.
        api_keys=tuple(
            key.strip()
            for key in (args.api_key or env.get("LLAMA_API_KEY") or "").split(",")
            if key.strip()
        ),
    )
