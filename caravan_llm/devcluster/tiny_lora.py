"""Tiny LoRA adapters for caravan's tiny Hugging Face model, built offline in pure Python.

    python -m caravan_llm.devcluster.tiny_lora --out DIR --seed 1 [--rank 8]

An adapter is a folder in peft's format, which vLLM (and peft) load:
`adapter_config.json` and `adapter_model.safetensors`, with `lora_A` and
`lora_B` for `q_proj`, `k_proj`, `v_proj` and `o_proj` of each of the model's
layers (devcluster/hf_tiny_model.py's shape: 2 layers, hidden size 128). Its
weights are random with a fixed seed, so the same seed and rank give the same
bytes on every machine (`random.Random`, float32); `lora_B` is drawn wide
(normal, sigma 0.5; peft would start it at zero) so the adapter's answers
differ from the base model's at temperature 0 (shared/docs/vllm-cpu.md,
section 6). A rank-8 adapter is 64 KiB.

Nothing is downloaded and neither torch nor peft is needed: the simulated
engines, caravan's own venv and the vLLM venv all run it. `write_adapter`
leaves a folder that already holds this builder's output for the same
arguments as it is, so callers can use it as a cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

# devcluster/hf_tiny_model.py's model (kept equal there; the vLLM tier checks it).
HIDDEN_SIZE = 128
LAYERS = 2
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
DEFAULT_RANK = 8
B_SIGMA = 0.5
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What this builder wrote, and from what: a folder whose stamp matches is not rewritten.
STAMP = "caravan-tiny-lora.json"
BUILDER = "caravan_llm.devcluster.tiny_lora"
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class TinyLora:
    """What an adapter is made from: its seed and rank, and the model's shape."""

    seed: int
    rank: int = DEFAULT_RANK
    hidden_size: int = HIDDEN_SIZE
    layers: int = LAYERS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be at least 1 (got {self.rank})")

    @property
    def alpha(self) -> int:
        return 2 * self.rank

    def stamp(self) -> dict[str, object]:
        return {
            "builder": BUILDER,
            "format": FORMAT_VERSION,
            "seed": self.seed,
            "rank": self.rank,
            "hidden_size": self.hidden_size,
            "layers": self.layers,
        }


Tensor = tuple[tuple[int, int], list[float]]


def adapter_tensors(spec: TinyLora) -> dict[str, Tensor]:
    """peft's tensor names, each with its shape and row-major values."""
    rng = random.Random(spec.seed)
    bound = 1.0 / math.sqrt(spec.hidden_size)
    tensors: dict[str, Tensor] = {}
    for layer in range(spec.layers):
        for target in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            a_shape = (spec.rank, spec.hidden_size)
            b_shape = (spec.hidden_size, spec.rank)
            a_values = [rng.uniform(-bound, bound) for _ in range(a_shape[0] * a_shape[1])]
            b_values = [rng.gauss(0.0, B_SIGMA) for _ in range(b_shape[0] * b_shape[1])]
            tensors[f"{prefix}.lora_A.weight"] = (a_shape, a_values)
            tensors[f"{prefix}.lora_B.weight"] = (b_shape, b_values)
    return tensors


def safetensors_bytes(tensors: dict[str, Tensor]) -> bytes:
    """The safetensors file of float32 tensors: an 8-byte little-endian header length, the
    JSON header (names sorted, with dtype, shape and byte offsets), then the data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        shape, values = tensors[name]
        data = struct.pack(f"<{len(values)}f", *values)
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    # The data starts 8-byte aligned, as the safetensors writer pads it.
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks)


def adapter_config(spec: TinyLora, base_model: str) -> dict[str, object]:
    """peft's adapter_config.json for a plain LoRA adapter (the fields vLLM reads, and peft's)."""
    return {
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": False,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": spec.rank,
        "target_modules": list(LORA_TARGETS),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_bytes(data)
    partial.replace(path)


def write_adapter(out: Path, spec: TinyLora, *, base_model: str = "caravan-tiny-chat") -> Path:
    """The adapter folder `out`, written unless it already holds this exact adapter."""
    stamp = json.dumps(
        {**spec.stamp(), "base_model": base_model}, sort_keys=True, separators=(",", ":")
    )
    stamp_file = out / STAMP
    weights = out / ADAPTER_WEIGHTS
    complete = stamp_file.is_file() and weights.is_file() and (out / ADAPTER_CONFIG).is_file()
    if complete and stamp_file.read_text(encoding="utf-8") == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    data = safetensors_bytes(adapter_tensors(spec))
    _write_atomically(weights, data)
    config = json.dumps(adapter_config(spec, base_model), indent=2, sort_keys=True) + "\n"
    _write_atomically(out / ADAPTER_CONFIG, config.encode())
    digest = hashlib.sha256(data).hexdigest()
    _write_atomically(stamp_file, stamp.encode())
    _write_atomically(out / "README.md", _readme(spec, digest).encode())
    return out


def _readme(spec: TinyLora, digest: str) -> str:
    return (
        "# A tiny LoRA adapter for caravan's tests\n\n"
        f"Random weights (seed {spec.seed}, rank {spec.rank}), written by `{BUILDER}` for the "
        "tiny model of `caravan_llm.devcluster.hf_tiny_model`; it means nothing.\n\n"
        f"sha256 of {ADAPTER_WEIGHTS}: {digest}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the adapter folder (created)")
    parser.add_argument("--seed", type=int, required=True, help="its weights' seed")
    parser.add_argument("--rank", type=int, default=DEFAULT_RANK, help="LoRA rank (r)")
    parser.add_argument("--base-model", default="caravan-tiny-chat", help="recorded in its config")
    args = parser.parse_args(argv)
    spec = TinyLora(seed=args.seed, rank=args.rank)
    out = write_adapter(args.out, spec, base_model=args.base_model)
    sys.stdout.write(f"wrote {out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
