"""The tiny LoRA builder: peft's files, safetensors that parse, the same bytes for the same seed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from caravan_llm.devcluster import hf_tiny_model, tiny_lora
from caravan_llm.devcluster.tiny_lora import TinyLora, adapter_tensors, write_adapter


def parse_safetensors(data: bytes) -> tuple[dict[str, dict[str, object]], bytes]:
    """The header (without metadata) and the data section of a safetensors file."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__")
    return header, data[8 + length :]


def test_the_weights_file_is_valid_safetensors_with_peft_names_and_shapes(tmp_path: Path) -> None:
    """Each target of each layer has lora_A (rank x hidden) and lora_B (hidden x rank) as F32,
    and the offsets tile the data section exactly."""
    out = write_adapter(tmp_path / "a", TinyLora(seed=1, rank=8))
    header, data = parse_safetensors((out / tiny_lora.ADAPTER_WEIGHTS).read_bytes())

    expected = {
        f"base_model.model.model.layers.{layer}.self_attn.{target}.lora_{part}.weight": shape
        for layer in range(2)
        for target in ("q_proj", "k_proj", "v_proj", "o_proj")
        for part, shape in (("A", [8, 128]), ("B", [128, 8]))
    }
    assert expected == {name: entry["shape"] for name, entry in header.items()}
    assert {"F32"} == {entry["dtype"] for entry in header.values()}
    spans = sorted(tuple(entry["data_offsets"]) for entry in header.values())  # type: ignore[arg-type]
    assert [0, *[end for _, end in spans[:-1]]] == [start for start, _ in spans]
    assert len(data) == spans[-1][1]
    (length,) = struct.unpack("<Q", (out / tiny_lora.ADAPTER_WEIGHTS).read_bytes()[:8])
    assert 0 == (8 + length) % 8


def test_the_config_is_peft_lora_with_the_rank_and_targets(tmp_path: Path) -> None:
    """adapter_config.json names a plain LoRA of the given rank on the attention projections."""
    out = write_adapter(tmp_path / "a", TinyLora(seed=3, rank=16), base_model="tiny")
    config = json.loads((out / tiny_lora.ADAPTER_CONFIG).read_text())

    assert ("LORA", 16, 32, "none", "tiny") == (
        config["peft_type"],
        config["r"],
        config["lora_alpha"],
        config["bias"],
        config["base_model_name_or_path"],
    )
    assert ["q_proj", "k_proj", "v_proj", "o_proj"] == config["target_modules"]


def test_the_same_seed_gives_the_same_bytes_and_another_seed_other_weights(
    tmp_path: Path,
) -> None:
    """Deterministic: two builds of seed 1 are byte-equal; seed 2 differs."""
    first = write_adapter(tmp_path / "one", TinyLora(seed=1))
    again = write_adapter(tmp_path / "again", TinyLora(seed=1))
    other = write_adapter(tmp_path / "other", TinyLora(seed=2))
    weights = tiny_lora.ADAPTER_WEIGHTS

    assert (first / weights).read_bytes() == (again / weights).read_bytes()
    assert (first / weights).read_bytes() != (other / weights).read_bytes()


def test_lora_b_is_wide_enough_to_change_the_answers() -> None:
    """lora_B is drawn with sigma 0.5 (peft starts it at zero), so the adapter moves the text."""
    tensors = adapter_tensors(TinyLora(seed=4))
    values = [v for name, (_, vs) in tensors.items() if "lora_B" in name for v in vs]
    spread = (sum(v * v for v in values) / len(values)) ** 0.5

    assert 0.4 < spread < 0.6


def test_an_existing_identical_adapter_is_kept_and_a_different_one_rewritten(
    tmp_path: Path,
) -> None:
    """write_adapter is a cache: the same arguments leave the folder alone, others rewrite it."""
    out = write_adapter(tmp_path / "a", TinyLora(seed=1))
    weights = out / tiny_lora.ADAPTER_WEIGHTS
    weights.write_bytes(b"left alone")
    write_adapter(out, TinyLora(seed=1))
    kept = weights.read_bytes()
    write_adapter(out, TinyLora(seed=1, rank=16))

    assert b"left alone" == kept
    assert 2 * 2 * 4 * 16 * 128 * 4 < len(weights.read_bytes())


def test_a_rank_below_one_is_refused() -> None:
    """A rank of 0 names no adapter."""
    with pytest.raises(ValueError, match="rank must be at least 1"):
        TinyLora(seed=1, rank=0)


def test_the_builder_and_the_model_share_one_shape() -> None:
    """The adapters fit the tiny HF model: its hidden size and layer count are the builder's."""
    assert (tiny_lora.HIDDEN_SIZE, tiny_lora.LAYERS) == (
        hf_tiny_model.HIDDEN_SIZE,
        hf_tiny_model.LAYERS,
    )
