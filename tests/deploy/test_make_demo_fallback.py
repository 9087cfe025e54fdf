"""`make demo` without cmake: it says so and runs the demo on the simulated llama.cpp engine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What the Makefile's demo recipe and the build script's first lines run; no cmake, no c++.
TOOLS = ("bash", "make", "dirname", "uname", "mkdir", "flock", "cat", "env")


def test_make_demo_without_cmake_falls_back_and_still_runs_the_demo(tmp_path: Path) -> None:
    """The failed build is reported in one line, then `caravan demo --once` runs anyway."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        if found is not None:
            (tools / tool).symlink_to(found)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    called = tmp_path / "called"
    stub = bin_dir / "caravan"
    stub.write_text(f'#!/bin/sh\necho "$@" > {called}\n', encoding="utf-8")
    stub.chmod(0o755)
    env = {
        "PATH": str(tools),
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "CARAVAN_CACHE_DIR": str(tmp_path / "cache"),
    }

    result = subprocess.run(
        ["make", "--no-print-directory", "-o", ".venv/.installed", "demo", f"BIN={bin_dir}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )

    assert 0 == result.returncode, result.stderr
    assert "missing build tool: cmake" in result.stderr
    assert "the demo runs the simulated llama.cpp engine instead" in result.stdout
    assert "demo --once\n" == called.read_text(encoding="utf-8")
