"""Write a tiny random-weight llama GGUF that a real `llama-server` can serve.

    python -m caravan_llm.devcluster.tiny_model \\
        --vocab ggml-vocab-llama-spm.gguf --out tiny-llama.gguf

Nothing is downloaded: the tokenizer comes from the vocab-only GGUF that the
llama.cpp source tree ships (`vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf`,
kept by `scripts/build-llama-server.sh`), the weights are random (fixed seed,
so the file is the same on every run) and the whole model is ~9 MB.

Random weights give gibberish, which would make tests flaky, so one token is
made to dominate: column 0 of every embedding row is large, and the output
projection is zero except for the chosen token (and, slightly weaker, EOS) on
column 0. The model then always answers " hello hello ..." and, because EOS
sits a little below, it stops by itself after a few dozen tokens with
`finish_reason: "stop"`. The gap is kept under ~3 logits so that llama.cpp's
default `min_p` sampler does not filter EOS out.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from caravan_llm.devcluster.engine.text import CHATML_TEMPLATE

# The architecture of the tiny model (facts measured in docs/llama-cpp.md).
CONTEXT_LENGTH = 4096
EMBEDDING_LENGTH = 64
BLOCK_COUNT = 2
FEED_FORWARD_LENGTH = 128
HEAD_COUNT = 4
HEAD_COUNT_KV = 4
ROPE_DIMENSION_COUNT = 16
ROPE_FREQ_BASE = 10000.0
RMS_EPS = 1e-5

# The dominant-token trick: every hidden state is mostly column 0.
DOMINANT_COLUMN_VALUE = 16.0
ANSWER_TOKEN_TEXT = "\u2581hello"  # noqa: S105 (a token, no secret); U+2581 is SentencePiece's space
ANSWER_LOGIT_WEIGHT = 4.0
# EOS slightly below the answer token, so it wins now and then and ends the reply.
EOS_LOGIT_WEIGHT = ANSWER_LOGIT_WEIGHT - 2.5 / 7.1
RANDOM_WEIGHT_STD = 0.02
SEED = 20240501

_TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
)


class VocabError(ValueError):
    """The vocab file lacks something the tiny model needs."""


@dataclass(frozen=True, slots=True)
class Vocab:
    """The tokenizer part of a vocab-only GGUF file."""

    model: str
    pre: str
    tokens: list[str]
    scores: list[float]
    token_types: list[int]
    bos_id: int
    eos_id: int
    unknown_id: int

    def token_id(self, text: str) -> int:
        try:
            return self.tokens.index(text)
        except ValueError:
            raise VocabError(f"token {text!r} is not in the vocabulary") from None


def read_vocab(path: Path) -> Vocab:
    """Read the tokenizer fields of a vocab-only GGUF (e.g. ggml-vocab-llama-spm.gguf)."""
    reader = gguf.GGUFReader(path)
    missing = [key for key in _TOKENIZER_KEYS if key not in reader.fields]
    if missing:
        raise VocabError(f"{path}: missing tokenizer fields {missing}")

    def field(key: str) -> object:
        return reader.fields[key].contents()

    return Vocab(
        model=str(field("tokenizer.ggml.model")),
        pre=str(field("tokenizer.ggml.pre")),
        tokens=[str(token) for token in _as_list(field("tokenizer.ggml.tokens"))],
        scores=[_as_float(score) for score in _as_list(field("tokenizer.ggml.scores"))],
        token_types=[_as_int(kind) for kind in _as_list(field("tokenizer.ggml.token_type"))],
        bos_id=_as_int(field("tokenizer.ggml.bos_token_id")),
        eos_id=_as_int(field("tokenizer.ggml.eos_token_id")),
        unknown_id=_as_int(field("tokenizer.ggml.unknown_token_id")),
    )


def _as_list(value: object) -> list[object]:
    if not isinstance(value, list):
        raise VocabError(f"expected an array field, got {type(value).__name__}")
    return value


def _as_float(value: object) -> float:
    if not isinstance(value, int | float | np.integer | np.floating):
        raise VocabError(f"expected a number, got {type(value).__name__}")
    return float(value)


def _as_int(value: object) -> int:
    if not isinstance(value, int | np.integer):
        raise VocabError(f"expected an integer field, got {type(value).__name__}")
    return int(value)


def build_tensors(vocab_size: int, answer_id: int, eos_id: int) -> dict[str, np.ndarray]:
    """The model's tensors, in numpy's (rows, cols) shapes, from a fixed seed."""
    rng = np.random.default_rng(SEED)

    def random(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * RANDOM_WEIGHT_STD).astype(np.float16)

    def ones(length: int) -> np.ndarray:
        return np.ones(length, dtype=np.float32)

    embeddings = random(vocab_size, EMBEDDING_LENGTH)
    embeddings[:, 0] = DOMINANT_COLUMN_VALUE
    tensors: dict[str, np.ndarray] = {"token_embd.weight": embeddings}
    for block in range(BLOCK_COUNT):
        prefix = f"blk.{block}"
        tensors[f"{prefix}.attn_norm.weight"] = ones(EMBEDDING_LENGTH)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensors[f"{prefix}.{name}.weight"] = random(EMBEDDING_LENGTH, EMBEDDING_LENGTH)
        tensors[f"{prefix}.ffn_norm.weight"] = ones(EMBEDDING_LENGTH)
        tensors[f"{prefix}.ffn_gate.weight"] = random(FEED_FORWARD_LENGTH, EMBEDDING_LENGTH)
        tensors[f"{prefix}.ffn_up.weight"] = random(FEED_FORWARD_LENGTH, EMBEDDING_LENGTH)
        tensors[f"{prefix}.ffn_down.weight"] = random(EMBEDDING_LENGTH, FEED_FORWARD_LENGTH)
    tensors["output_norm.weight"] = ones(EMBEDDING_LENGTH)
    output = np.zeros((vocab_size, EMBEDDING_LENGTH), dtype=np.float16)
    output[answer_id, 0] = ANSWER_LOGIT_WEIGHT
    output[eos_id, 0] = EOS_LOGIT_WEIGHT
    tensors["output.weight"] = output
    return tensors


def write_tiny_model(vocab: Vocab, out: Path) -> None:
    """Write the tiny llama model with `vocab`'s tokenizer to `out`."""
    arch = "llama"
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name("caravan-tiny-llama")
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(EMBEDDING_LENGTH)
    writer.add_block_count(BLOCK_COUNT)
    writer.add_feed_forward_length(FEED_FORWARD_LENGTH)
    writer.add_head_count(HEAD_COUNT)
    writer.add_head_count_kv(HEAD_COUNT_KV)
    writer.add_rope_dimension_count(ROPE_DIMENSION_COUNT)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.token_types)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_unk_token_id(vocab.unknown_id)
    writer.add_add_bos_token(True)  # noqa: FBT003 (gguf's API)
    writer.add_add_eos_token(False)  # noqa: FBT003
    writer.add_chat_template(CHATML_TEMPLATE)

    tensors = build_tensors(len(vocab.tokens), vocab.token_id(ANSWER_TOKEN_TEXT), vocab.eos_id)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m caravan_llm.devcluster.tiny_model",
        description="Write a tiny deterministic llama GGUF for tests and demos.",
    )
    parser.add_argument("--vocab", type=Path, required=True, help="vocab-only GGUF (llama-spm)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the model")
    args = parser.parse_args(argv)
    try:
        vocab = read_vocab(args.vocab)
    except (OSError, VocabError) as exc:
        print(f"cannot read the vocab file {args.vocab}: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    write_tiny_model(vocab, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
