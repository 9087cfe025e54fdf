#!/usr/bin/env bash
# Builds a real llama.cpp `llama-server` from the llama-cpp-python source
# distribution on PyPI (it vendors the whole llama.cpp tree) and writes a tiny
# deterministic GGUF model next to it, both in a cache OUTSIDE the work tree.
#
#   scripts/build-llama-server.sh          # build if absent, then print the paths
#
# Environment:
#   CARAVAN_CACHE_DIR  cache root (default: $HOME/.cache/caravan)
#   PYTHON             interpreter with pip, gguf and numpy (default: .venv/bin/python)
#   BUILD_JOBS         parallel compile jobs (default: 2)
#
# Idempotent: with the binary, vocab and model present it only checks that the
# binary runs (well under a second). Facts behind the flags:
# /work/shared/docs/llama-cpp.md. caravan_llm/devcluster/llama_server_build.py reads the
# same layout, so keep the two in step.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="0.3.36"
# sha256 of llama_cpp_python-0.3.36.tar.gz on PyPI; a mismatch stops the build.
SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${CARAVAN_CACHE_DIR:-$HOME/.cache/caravan}"
# GGML_NATIVE=OFF below makes the binary portable across CPUs of one
# architecture, so the cache key is the architecture, not the CPU flags.
prefix="$cache_root/llama-server/${LLAMA_CPP_PYTHON_VERSION}-portable-$(uname -m)"
binary="$prefix/bin/llama-server"
vocab="$prefix/models/ggml-vocab-llama-spm.gguf"
model="$prefix/models/tiny-llama.gguf"
jobs="${BUILD_JOBS:-2}"

if [[ -n "${PYTHON:-}" ]]; then
    python="$PYTHON"
elif [[ -x "$repo_root/.venv/bin/python" ]]; then
    python="$repo_root/.venv/bin/python"
else
    python="python3"
fi

log() { printf '[build-llama-server] %s\n' "$*" >&2; }

binary_works() {
    [[ -x "$binary" ]] && "$binary" --version >/dev/null 2>&1
}

mkdir -p "$prefix/bin" "$prefix/models"

# Two callers at once (parallel CI jobs, a test and a shell) must not build
# into the same place; the second waits and then finds everything present.
exec 9>"$prefix/.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi

if binary_works && [[ -f "$vocab" ]]; then
    log "llama-server present, skipping the build"
else
    for tool in cmake make c++; do
        command -v "$tool" >/dev/null 2>&1 || {
            log "missing build tool: $tool (apt-get install cmake build-essential)"
            exit 1
        }
    done
    started=$SECONDS
    work="$(mktemp -d "$cache_root/llama-server/build.XXXXXX")"
    # The sdist (77 MB) and build tree (~300 MB extracted) are only needed
    # while building; the cache keeps the binary and the vocab file.
    trap 'rm -rf "$work"' EXIT

    log "downloading llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION (sdist) from PyPI"
    "$python" -m pip download --quiet --no-deps --no-binary llama-cpp-python \
        --dest "$work" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    sdist="$(find "$work" -maxdepth 1 -name 'llama_cpp_python-*.tar.gz' | head -n 1)"
    [[ -n "$sdist" ]] || { log "pip download produced no sdist in $work"; exit 1; }
    actual_sha="$(sha256sum "$sdist" | cut -d' ' -f1)"
    if [[ "$actual_sha" != "$SDIST_SHA256" ]]; then
        log "sha256 mismatch for $(basename "$sdist"): expected $SDIST_SHA256, got $actual_sha"
        exit 1
    fi
    tar -xzf "$sdist" -C "$work"
    src="$(find "$work" -maxdepth 1 -type d -name 'llama_cpp_python-*' | head -n 1)/vendor/llama.cpp"
    [[ -f "$src/CMakeLists.txt" ]] || { log "no vendored llama.cpp under $src"; exit 1; }

    log "configuring (static, server target only, no downloads, portable)"
    cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_CCACHE=OFF >"$work/configure.log" 2>&1 || {
        tail -n 40 "$work/configure.log" >&2
        exit 1
    }
    log "compiling llama-server with -j$jobs (about 5 minutes on 2 cores)"
    cmake --build "$work/build" --target llama-server -j "$jobs" >"$work/build.log" 2>&1 || {
        tail -n 60 "$work/build.log" >&2
        exit 1
    }
    built="$(find "$work/build" -type f -name llama-server -perm -u+x | head -n 1)"
    [[ -n "$built" ]] || { log "build finished without a llama-server binary"; exit 1; }

    # Copy then rename, so a reader never sees a half-written binary.
    cp "$src/models/ggml-vocab-llama-spm.gguf" "$vocab.tmp" && mv "$vocab.tmp" "$vocab"
    cp "$built" "$binary.tmp" && mv "$binary.tmp" "$binary"
    binary_works || { log "built binary does not run: $binary"; exit 1; }
    log "built in $((SECONDS - started)) s"
fi

# The model is rewritten when the code that generates it changes, so the cache
# never serves a model older than the generator (a stamp of its sources' hash).
generator_hash="$(cat "$repo_root/caravan_llm/devcluster/tiny_model.py" "$repo_root/caravan_llm/devcluster/engine/text.py" \
    | sha256sum | cut -d' ' -f1)"
stamp="$model.generator-sha256"
if [[ ! -f "$model" || "$(cat "$stamp" 2>/dev/null)" != "$generator_hash" ]]; then
    log "writing the tiny model"
    (cd "$repo_root" && "$python" -m caravan_llm.devcluster.tiny_model --vocab "$vocab" --out "$model.tmp")
    mv "$model.tmp" "$model"
    echo "$generator_hash" >"$stamp"
fi

echo "llama-server: $binary"
echo "model: $model"
