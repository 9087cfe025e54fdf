"""Where `scripts/build-llama-server.sh` leaves the real llama-server and its tiny model.

Tests, the demo and devcluster call `find_llama_server()` to choose between the
real engine and the simulated one. The layout here must match the script:

    ${CARAVAN_CACHE_DIR:-$HOME/.cache/caravan}/llama-server/<version>-portable-<arch>/
        bin/llama-server
        models/tiny-llama.gguf
        models/ggml-vocab-llama-spm.gguf

`CARAVAN_LLAMA_SERVER` names another binary (a system install, a GPU build);
the model still comes from the cache.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BUILD_SCRIPT = "scripts/build-llama-server.sh"
CACHE_DIR_ENV = "CARAVAN_CACHE_DIR"
BINARY_ENV = "CARAVAN_LLAMA_SERVER"


@dataclass(frozen=True, slots=True)
class LlamaServerBuild:
    """A built llama-server binary and the tiny model it serves."""

    binary: Path
    model: Path


def build_prefix(env: Mapping[str, str] | None = None) -> Path:
    """The cache folder the build script writes into, for this machine's architecture."""
    env = os.environ if env is None else env
    cache_root = env.get(CACHE_DIR_ENV) or str(
        Path(env.get("HOME") or Path.home()) / ".cache/caravan"
    )
    return (
        Path(cache_root)
        / "llama-server"
        / f"{LLAMA_CPP_PYTHON_VERSION}-portable-{platform.machine()}"
    )


def find_llama_server(env: Mapping[str, str] | None = None) -> LlamaServerBuild | None:
    """The built binary and model, or None when either is absent (run the build script)."""
    env = os.environ if env is None else env
    prefix = build_prefix(env)
    override = env.get(BINARY_ENV)
    binary = Path(override) if override else prefix / "bin" / "llama-server"
    model = prefix / "models" / "tiny-llama.gguf"
    if not (binary.is_file() and os.access(binary, os.X_OK) and model.is_file()):
        return None
    return LlamaServerBuild(binary=binary, model=model)
