"""`caravan demo --vllm real`: the demo's vLLM model served by real vLLM processes that
caravan placed on devcluster GPU nodes, every substitution said, nothing left behind; its
two example LoRA adapters (tiny ones the demo builds) listed with their parent, each
answering from those same replicas."""

from __future__ import annotations

import asyncio
import os
import sys

from caravan_llm.devcluster.vllm_build import VllmBuild

SERVED = "qwen2.5-7b-instruct"
ADAPTERS = ("qwen2.5-7b-poet", "qwen2.5-7b-sql")


async def test_demo_once_streams_from_real_vllm_replicas(vllm_build: VllmBuild) -> None:
    """`--vllm real --once`: two real replicas ready, each substitution printed, a streamed
    completion from the vLLM model and from each of its adapters, listed with their parent
    in /v1/models, exit 0."""
    assert vllm_build.python.is_file()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "caravan_llm.cli", "demo", "--vllm", "real", "--simulated-llama",
        "--once",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith(("NOMAD_", "CONSUL_"))},
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 480)
    text = out.decode()

    assert 0 == process.returncode, err.decode()[-3000:]
    assert "vLLM replicas run the real vLLM 0.32.0" in text
    for flag in ("--model", "--tensor-parallel-size", "--max-model-len"):
        assert f"    {flag}: " in text, flag
    assert "qwen2-5-7b: 2/2 ready" in text
    completion = next(line for line in text.splitlines() if line.startswith(f"{SERVED} < "))
    assert completion.removeprefix(f"{SERVED} < ").strip(), "no streamed text"
    for adapter in ADAPTERS:
        assert f"  {adapter} (parent {SERVED})" in text
        assert f"  qwen2-5-7b: adapter {adapter}: /opt/loras/{adapter} -> " in text
        answer = next(line for line in text.splitlines() if line.startswith(f"{adapter} < "))
        assert answer.removeprefix(f"{adapter} < ").strip(), f"no streamed text from {adapter}"
