"""Issue 23, finding 9: an example profile copied from examples/profiles/ runs as it is.

devcluster's nodes have the model files the examples name (local_stack's node
root), as a real node would; the profile is submitted unchanged with the CLI.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from polling import eventually

from caravan_llm.cli.local_stack import StackOptions, local_stack

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "profiles" / "tiny-llamacpp-cpu.yaml"


async def test_the_copied_tiny_llamacpp_example_becomes_ready_unchanged(tmp_path: Path) -> None:
    """`caravan submit --wait` of the example: ready, its engine given the node's model file."""
    options = StackOptions(prefer_real_llama_server=False, gpu_nodes=0, work_dir=tmp_path)
    copied = tmp_path / "tiny.yaml"
    copied.write_bytes(EXAMPLE.read_bytes())
    async with local_stack(options) as stack:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "caravan_llm.cli",
            "submit",
            str(copied),
            "--wait",
            "--timeout",
            "90",
            env=dict(stack.env),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 120)

        def engine_notes() -> list[str] | None:
            logs = sorted(tmp_path.glob("nomad/*/alloc/*/alloc/logs/*.stderr.0"))
            lines = [line for log in logs for line in log.read_text().splitlines()]
            notes = [line for line in lines if line.startswith("devcluster: node file")]
            return notes or None

        notes = await eventually(engine_notes, 10.0, "an engine told where its model file is")

    assert (0, "") == (process.returncode, err.decode())
    assert out.decode().rstrip().endswith("all replicas ready")
    expected = (
        f"devcluster: node file /opt/models/tiny-llama.gguf is "
        f"{tmp_path / 'node-root' / 'opt' / 'models' / 'tiny-llama.gguf'}"
    )
    assert expected == notes[0]
