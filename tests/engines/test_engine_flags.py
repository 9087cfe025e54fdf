"""The simulated engines take the real engines' command lines, plus --sim-* knobs."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from engine_test_support import free_port, post_json, wait_healthy

from caravan_llm.devcluster.engine.flags import (
    LLAMACPP_AUTO_PARALLEL,
    FlagError,
    parse_engine_args,
    split_flavor,
)

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"


def golden_args(name: str) -> list[str]:
    """The engine args of a rendered golden job, Nomad variables filled in."""
    job = json.loads((GOLDEN / name).read_text())
    args = job["Job"]["TaskGroups"][0]["Tasks"][0]["Config"]["args"]
    return [
        arg.replace("${NOMAD_IP_http}", "127.0.0.1").replace("${NOMAD_PORT_http}", "8080")
        for arg in args
    ]


def test_vllm_rendered_job_args_parse() -> None:
    """The args of a rendered vLLM job set the model, names, sequences and context."""
    settings = parse_engine_args(
        ["--flavor", "vllm", *golden_args("qwen-vllm-h100.job.json")], env={}
    )

    assert ("Qwen/Qwen2.5-7B-Instruct", ("qwen2.5-7b-instruct",)) == (
        settings.model,
        settings.served_model_names,
    )
    assert (64, 8192, 8000, "0.0.0.0") == (
        settings.perf.max_num_seqs,
        settings.max_model_len,
        settings.port,
        settings.host,
    )
    assert settings.perf.prefix_caching


def test_llamacpp_rendered_job_args_parse() -> None:
    """The args of a rendered llama.cpp job set slots, context per slot, alias and metrics."""
    settings = parse_engine_args(
        ["--flavor", "llamacpp", *golden_args("tiny-llamacpp-cpu.job.json")], env={}
    )

    assert ("tiny-chat", 2, 4096, True) == (
        settings.model_name,
        settings.perf.max_num_seqs,
        settings.max_model_len,
        settings.metrics_enabled,
    )
    assert ("127.0.0.1", 8080) == (settings.host, settings.port)


def test_vllm_defaults_and_positional_model() -> None:
    """`vllm serve MODEL` works, and the defaults are vLLM's (port 8000, 256 sequences)."""
    settings = parse_engine_args(["--flavor", "vllm", "vllm", "serve", "org/m"], env={})

    assert ("org/m", ("org/m",), 8000, 256) == (
        settings.model,
        settings.served_model_names,
        settings.port,
        settings.perf.max_num_seqs,
    )


def test_vllm_prefix_caching_switch_and_kv_blocks_override() -> None:
    """--no-enable-prefix-caching, --num-gpu-blocks-override and vLLM's "32k" (32,000) parse."""
    settings = parse_engine_args(
        [
            "--flavor=vllm",
            "--model",
            "m",
            "--no-enable-prefix-caching",
            "--num-gpu-blocks-override",
            "10",
            "--block-size",
            "32",
            "--max-model-len",
            "32k",
        ],
        env={},
    )

    assert (False, 320, 32, 32000) == (
        settings.perf.prefix_caching,
        settings.perf.kv_cache_tokens,
        settings.perf.block_size,
        settings.max_model_len,
    )


def test_vllm_accepts_and_ignores_other_real_flags() -> None:
    """Flags vLLM takes that do not shape the simulation are accepted."""
    settings = parse_engine_args(
        [
            "--flavor",
            "vllm",
            "--model",
            "m",
            "--dtype",
            "bfloat16",
            "--trust-remote-code",
            "--gpu-memory-utilization",
            "0.9",
            "--enforce-eager",
            "-tp",
            "4",
            "--disable-log-requests",
            "--kv-cache-dtype",
            "fp8",
        ],
        env={},
    )

    assert "m" == settings.model


def test_llamacpp_defaults_are_llama_servers() -> None:
    """Host 127.0.0.1, port 8080, automatic parallel slots and no metrics by default."""
    settings = parse_engine_args(["--flavor", "llamacpp", "-m", "/models/x.gguf"], env={})

    assert ("127.0.0.1", 8080, LLAMACPP_AUTO_PARALLEL, False, True) == (
        settings.host,
        settings.port,
        settings.perf.max_num_seqs,
        settings.metrics_enabled,
        settings.slots_enabled,
    )
    assert ("x.gguf",) == settings.served_model_names


def test_llamacpp_accepts_its_usual_switches() -> None:
    """-t, -ngl, -cb, --jinja, --no-webui, --no-slots and friends are accepted."""
    settings = parse_engine_args(
        [
            "--flavor",
            "llamacpp",
            "-m",
            "m.gguf",
            "-t",
            "1",
            "-ngl",
            "999",
            "-cb",
            "--jinja",
            "--no-webui",
            "--no-slots",
            "-fa",
            "on",
            "-np",
            "3",
            "-c",
            "3000",
        ],
        env={},
    )

    assert (False, 3, 1000) == (
        settings.slots_enabled,
        settings.perf.max_num_seqs,
        settings.max_model_len,
    )


def test_sim_flags_win_over_environment_variables() -> None:
    """A --sim-* flag overrides its CARAVAN_SIM_* variable, which overrides the default."""
    env = {"CARAVAN_SIM_LOAD_SECONDS": "7", "CARAVAN_SIM_SEED": "5"}

    settings = parse_engine_args(["--flavor", "vllm", "--model", "m", "--sim-seed", "9"], env=env)

    assert (7.0, 9) == (settings.sim.load_seconds, settings.sim.seed)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--flavor", "tgi"], {}, "unknown flavour 'tgi'"),
        (["--model", "m"], {}, "missing --flavor"),
        (["--flavor", "vllm"], {}, "--model"),
        (["--flavor", "llamacpp"], {}, "-m/--model"),
        (
            ["--flavor", "vllm", "--model", "m"],
            {"CARAVAN_SIM_FAILURE_RATE": "2"},
            "between 0 and 1",
        ),
        (["--flavor", "vllm", "--model", "m", "--sim-step-seconds", "x"], {}, "--sim-step-seconds"),
        (["--flavor", "vllm", "--model", "m", "--max-num-seqs", "0"], {}, "--max-num-seqs"),
        (
            ["--flavor", "vllm", "--model", "m"],
            {"CARAVAN_SIM_PREFIX_CACHING": "maybe"},
            "on or off",
        ),
    ],
)
def test_bad_command_lines_name_the_flag_at_fault(
    args: list[str], env: dict[str, str], message: str
) -> None:
    """A command line the simulator cannot run raises FlagError naming the flag or value."""
    with pytest.raises(FlagError, match=message):
        parse_engine_args(args, env=env)


def test_unknown_engine_flags_are_rejected_like_the_real_engine() -> None:
    """A flag the real engine does not have ends argparse with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        parse_engine_args(["--flavor", "vllm", "--model", "m", "--no-such-flag"], env={})

    assert 2 == exit_info.value.code


def test_split_flavor_takes_out_the_flavor_and_vllm_serve() -> None:
    """--flavor and a leading `vllm serve` are removed from the engine's args."""
    assert ("vllm", ["org/m", "--port", "1"]) == split_flavor(
        ["vllm", "serve", "org/m", "--flavor", "vllm", "--port", "1"]
    )


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "caravan_llm.devcluster.engine", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=REPO,
    )


def test_cli_unknown_flavour_exits_2_with_a_clear_error() -> None:
    """`python -m caravan_llm.devcluster.engine --flavor tgi` exits 2 and names the choices."""
    result = run_cli("--flavor", "tgi")

    assert 2 == result.returncode
    assert "unknown flavour 'tgi': choose vllm, llamacpp or sglang" in result.stderr


@pytest.mark.parametrize(
    ("flavor", "flags"),
    [
        (
            "vllm",
            ["--served-model-name", "--max-num-seqs", "--enable-prefix-caching", "--sim-seed"],
        ),
        ("llamacpp", ["--parallel", "--ctx-size", "--metrics", "--no-slots", "--sim-load-seconds"]),
    ],
)
def test_cli_help_lists_the_real_flags_and_the_knobs(flavor: str, flags: list[str]) -> None:
    """--help of each flavour exits 0 and lists the engine's flags and the --sim-* knobs."""
    result = run_cli("--flavor", flavor, "--help")

    assert 0 == result.returncode
    for flag in flags:
        assert flag in result.stdout


@pytest.mark.slow
async def test_cli_serves_a_rendered_raw_exec_job_unchanged_and_stops_on_sigterm() -> None:
    """The rendered llama.cpp job's args run as-is under the simulator, which exits 0 on SIGTERM."""
    port = free_port()
    args = [arg.replace("8080", str(port)) for arg in golden_args("tiny-llamacpp-cpu.job.json")]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.devcluster.engine",
        "--flavor",
        "llamacpp",
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, f"http://127.0.0.1:{port}")
            status, body = await post_json(
                session,
                f"http://127.0.0.1:{port}/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
        process.send_signal(signal.SIGTERM)
        returncode = await asyncio.wait_for(process.wait(), timeout=10)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()

    assert (200, "tiny-chat") == (status, body["model"])
    assert 0 == returncode
