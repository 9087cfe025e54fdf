"""The tiny GGUF model generator and where the build script's outputs are found."""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import gguf
import pytest

from caravan_llm.devcluster.engine.text import CHATML_TEMPLATE
from caravan_llm.devcluster.llama_server_build import (
    LLAMA_CPP_PYTHON_VERSION,
    LlamaServerBuild,
    build_prefix,
    find_llama_server,
)
from caravan_llm.devcluster.tiny_model import main as tiny_model_main

REPO = Path(__file__).resolve().parents[2]
PREFIX = build_prefix()
VOCAB = PREFIX / "models" / "ggml-vocab-llama-spm.gguf"
CACHED_MODEL = PREFIX / "models" / "tiny-llama.gguf"


def generator_hash() -> str:
    """The hash the build script stamps next to the model it wrote."""
    sources = [REPO / "devcluster" / "tiny_model.py", REPO / "devcluster" / "engine" / "text.py"]
    return hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()


def test_the_build_prefix_follows_the_cache_dir_variable(tmp_path: Path) -> None:
    """CARAVAN_CACHE_DIR moves the cache; the folder names the version and the architecture."""
    prefix = build_prefix({"CARAVAN_CACHE_DIR": str(tmp_path)})

    assert (
        tmp_path / "llama-server" / f"{LLAMA_CPP_PYTHON_VERSION}-portable-{platform.machine()}"
    ) == prefix


def test_nothing_is_found_in_an_empty_cache(tmp_path: Path) -> None:
    """Without a built binary and model the lookup says None (use the simulator)."""
    assert find_llama_server({"CARAVAN_CACHE_DIR": str(tmp_path)}) is None


def make_build(root: Path, *, executable: bool = True) -> tuple[Path, Path]:
    prefix = build_prefix({"CARAVAN_CACHE_DIR": str(root)})
    binary = prefix / "bin" / "llama-server"
    model = prefix / "models" / "tiny-llama.gguf"
    binary.parent.mkdir(parents=True)
    model.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755 if executable else 0o644)
    model.write_bytes(b"GGUF")
    return binary, model


def test_a_built_binary_and_model_are_found(tmp_path: Path) -> None:
    """With both files in the cache the lookup returns their paths."""
    binary, model = make_build(tmp_path)

    assert LlamaServerBuild(binary=binary, model=model) == find_llama_server(
        {"CARAVAN_CACHE_DIR": str(tmp_path)}
    )


def test_a_binary_that_cannot_run_is_not_found(tmp_path: Path) -> None:
    """A binary without the execute bit does not count as built."""
    make_build(tmp_path, executable=False)

    assert find_llama_server({"CARAVAN_CACHE_DIR": str(tmp_path)}) is None


def test_caravan_llama_server_overrides_the_binary(tmp_path: Path) -> None:
    """CARAVAN_LLAMA_SERVER names another binary; the model still comes from the cache."""
    _, model = make_build(tmp_path / "cache")
    other = tmp_path / "llama-server-cuda"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)

    found = find_llama_server(
        {"CARAVAN_CACHE_DIR": str(tmp_path / "cache"), "CARAVAN_LLAMA_SERVER": str(other)}
    )

    assert LlamaServerBuild(binary=other, model=model) == found


def test_a_missing_vocab_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The generator exits 2 and names the vocab file when it cannot read it."""
    missing = tmp_path / "nope.gguf"

    assert 2 == tiny_model_main(["--vocab", str(missing), "--out", str(tmp_path / "m.gguf")])
    assert str(missing) in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not VOCAB.is_file(), reason="no vocab file: run scripts/build-llama-server.sh")
def test_the_tiny_model_is_deterministic_and_has_the_documented_shape(tmp_path: Path) -> None:
    """The generator writes the same bytes every time: a 2-block llama with ChatML and SPM."""
    out = tmp_path / "tiny.gguf"

    assert 0 == tiny_model_main(["--vocab", str(VOCAB), "--out", str(out)])

    reader = gguf.GGUFReader(out)
    fields = {name: reader.fields[name].contents() for name in reader.fields}
    assert ("llama", 4096, 2, 64, 32000) == (
        fields["general.architecture"],
        fields["llama.context_length"],
        fields["llama.block_count"],
        fields["llama.embedding_length"],
        len(fields["tokenizer.ggml.tokens"]),
    )
    assert CHATML_TEMPLATE == fields["tokenizer.chat_template"]
    assert 2 * 9 + 3 == len(reader.tensors)
    stamp = CACHED_MODEL.with_name(CACHED_MODEL.name + ".generator-sha256")
    if CACHED_MODEL.is_file() and stamp.is_file() and stamp.read_text().strip() == generator_hash():
        # Written by the build script in another process: same generator, same bytes.
        assert CACHED_MODEL.read_bytes() == out.read_bytes()
