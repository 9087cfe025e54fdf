"""The tiny models' tokenizer builder: deterministic files with ChatML's template and eos."""

from __future__ import annotations

import json
from pathlib import Path

from caravan_llm.devcluster.engine.text import CHATML_TEMPLATE
from caravan_llm.devcluster.tiny_tokenizer import write_tokenizer


def test_two_builds_write_the_same_bytes(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """Training is deterministic: a second build's tokenizer.json and config are byte-identical."""
    write_tokenizer(tmp_path)
    names = ("tokenizer.json", "tokenizer_config.json")
    first = [(tiny_tokenizer_dir / name).read_bytes() for name in names]
    assert first == [(tmp_path / name).read_bytes() for name in names]


def test_config_names_chatml_template_and_eos(tiny_tokenizer_dir: Path) -> None:
    """tokenizer_config.json carries the simulated engines' ChatML template, eos <|im_end|>."""
    config = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    assert (CHATML_TEMPLATE, "<|im_end|>") == (config["chat_template"], config["eos_token"])
