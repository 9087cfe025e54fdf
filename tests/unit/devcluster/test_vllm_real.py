"""devcluster's mapping of a rendered vLLM command line onto the real vLLM (CPU build)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from caravan_llm.devcluster.nomad.drivers import MAX_NICE, LaunchSpec, start_process
from caravan_llm.devcluster.vllm_build import MAX_MODEL_LEN, VllmBuild
from caravan_llm.devcluster.vllm_real import RealVllmOptions, launch, substitutions_for

BUILD = VllmBuild(python=Path("/cache/venv/bin/python"), model=Path("/cache/models/tiny"))
OPTIONS = RealVllmOptions(build=BUILD, kv_blocks=48)
RENDERED = (
    "--model", "Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "qwen",
    "--tensor-parallel-size", "2", "--port", "23456", "--max-num-seqs", "64",
    "--max-model-len", "8192", "--gpu-memory-utilization", "0.90",
    "--enable-prefix-caching", "--host", "127.9.0.2",
)  # fmt: skip


def started(args: tuple[str, ...] = RENDERED, env: dict[str, str] | None = None) -> list[str]:
    result = launch(
        args,
        env or {},
        OPTIONS,
        task_dir=Path("/data/alloc/a1/engine"),
        alloc_dir=Path("/data/alloc/a1"),
        core=1,
        tmp_dir=Path("/tmp/cvl-x"),
    )
    return list(result.argv)


def test_the_rendered_arguments_reach_the_real_api_server_with_explicit_substitutions() -> None:
    """Every rendered flag passes through, except the ones each substitution names."""
    argv = started()

    assert [str(BUILD.python), "-W", "ignore::DeprecationWarning"] == argv[:3]
    assert ["-m", "vllm.entrypoints.openai.api_server"] == argv[3:5]
    assert argv[5:] == [
        "--model", str(BUILD.model), "--served-model-name", "qwen",
        "--tensor-parallel-size", "1", "--port", "23456", "--max-num-seqs", "64",
        "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching",
        "--host", "127.9.0.2", "--enforce-eager", "--num-gpu-blocks-override", "48",
    ]  # fmt: skip
    flags = [change.flag for change in substitutions_for(RENDERED, OPTIONS)]
    assert flags == [
        "--model",
        "--tensor-parallel-size",
        "--max-model-len",
        "--gpu-memory-utilization",
        "--enforce-eager",
        "--num-gpu-blocks-override",
    ]


def test_what_already_fits_the_machine_is_not_substituted() -> None:
    """A local model, one worker, a short context and the job's own KV size stay as rendered."""
    args = (
        "--model", str(BUILD.model), "--tensor-parallel-size=1", "--max-model-len", "1024",
        "--num-gpu-blocks-override", "24", "--enforce-eager",
    )  # fmt: skip

    assert () == substitutions_for(args, OPTIONS)
    # `--flag=value` is passed on as `--flag value`, which vLLM's parser reads alike.
    assert started(args)[5:] == [
        "--model", str(BUILD.model), "--tensor-parallel-size", "1", "--max-model-len", "1024",
        "--num-gpu-blocks-override", "24", "--enforce-eager",
    ]  # fmt: skip


def test_the_environment_is_a_cpu_nodes_with_container_paths_in_the_allocation() -> None:
    """Offline Hugging Face, one core per replica, TMPDIR of its own, /alloc paths mapped."""
    result = launch(
        RENDERED,
        {"HF_HOME": "/alloc/data/hf", "VLLM_API_KEY": "k", "VLLM_CPU_KVCACHE_SPACE": "2"},
        OPTIONS,
        task_dir=Path("/data/a1/engine"),
        alloc_dir=Path("/data/a1"),
        core=0,
        tmp_dir=Path("/tmp/cvl-y"),
    )

    env = dict(result.env)
    assert "/data/a1/alloc/data/hf" == env["HF_HOME"]
    assert ("1", "0", "/tmp/cvl-y") == (
        env["HF_HUB_OFFLINE"],
        env["VLLM_CPU_OMP_THREADS_BIND"],
        env["TMPDIR"],
    )
    assert ("k", "2") == (env["VLLM_API_KEY"], env["VLLM_CPU_KVCACHE_SPACE"])


def test_the_kv_events_config_reaches_the_real_engine_unchanged() -> None:
    """--kv-events-config (ipc sockets in the allocation) passes through as rendered."""
    config = '{"enable_kv_cache_events":true,"endpoint":"ipc:///tmp/cva-x/alloc/kv-events.ipc"}'
    argv = started((*RENDERED, "--kv-events-config", config))
    assert config == argv[argv.index("--kv-events-config") + 1]
    flags = [
        change.flag
        for change in substitutions_for((*RENDERED, "--kv-events-config", config), OPTIONS)
    ]
    assert "--kv-events-config" not in flags


def test_a_real_replica_runs_below_the_agents_priority() -> None:
    """The replica's niceness travels with its launch (10 unless devcluster says otherwise)."""
    result = launch(
        RENDERED,
        {},
        OPTIONS,
        task_dir=Path("/data/alloc/a1/engine"),
        alloc_dir=Path("/data/alloc/a1"),
        core=None,
        tmp_dir=Path("/tmp/cvl-x"),
    )
    assert 10 == result.nice
    assert 0 == RealVllmOptions(build=BUILD, nice=0).nice


# Prints its niceness and its autogroup's ("none" where the kernel has none) once both
# differ from the agent's (set just after exec), or after 10 s.
WATCH_OWN_PRIORITY = """
import os, sys, time

def group():
    try:
        with open("/proc/self/autogroup") as found:
            return found.read().split()[-1]
    except OSError:
        return "none"

deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    if os.getpriority(os.PRIO_PROCESS, 0) != int(sys.argv[1]) and group() != "0":
        break
    time.sleep(0.01)
print(os.getpriority(os.PRIO_PROCESS, 0), group())
"""


async def test_start_process_applies_the_niceness_to_the_started_program(tmp_path: Path) -> None:
    """The started program (and what it starts later) runs at the agent's niceness + nice,
    and so does its session's autogroup where the kernel schedules by session."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    spec = LaunchSpec(
        (sys.executable, "-c", WATCH_OWN_PRIORITY, str(own)),
        dict(os.environ),
        nice=3,
    )
    out = tmp_path / "out"
    task = await start_process(spec, cwd=tmp_path, stdout=out, stderr=tmp_path / "err")
    assert (await task.wait()).successful
    priority, group = out.read_text().split()
    assert min(own + 3, MAX_NICE) == int(priority)
    # Under autogroup scheduling the task's own session is lowered too (drivers.py).
    assert group in {"3", "none"}
