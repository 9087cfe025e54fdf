"""Write a tiny random-weight Llama in Hugging Face format that the real vLLM can serve.

    python -m caravan_llm.devcluster.hf_tiny_model --out DIR      # run with the vLLM venv's python

Nothing is downloaded. The tokenizer is `caravan_llm.devcluster.tiny_tokenizer`'s
(a byte-level BPE trained with HF `tokenizers` on Python's own standard
library, ChatML's special tokens and the simulated engines' chat template), so
the simulated vLLM and the router, given the same files, tokenize as this
model's vLLM does; the weights are random with a fixed seed. The whole model
is about 2 MB.

Shape facts (measured in shared/docs/vllm-cpu.md): vLLM's CPU attention takes
head sizes 32, 64, 80, ... but not 16, so 128 hidden / 4 heads = 32. Random
weights never emit EOS, so every answer ends on `length` unless the request's
`max_tokens` stops it first; temperature 0 is deterministic.

`--adapters N` also writes N rank-8 LoRA adapters under `DIR/adapters/lora-<i>`
(devcluster/tiny_lora.py: peft's format, random weights from seed i + 1, built
without peft); each changes the model's output.

Runs only in the vLLM venv (torch, transformers, tokenizers); caravan's own
venv never imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from caravan_llm.devcluster import tiny_lora
from caravan_llm.devcluster.tiny_tokenizer import VOCAB_SIZE, write_tokenizer

# The adapters' builder shares the shape (tiny_lora.HIDDEN_SIZE, LAYERS).
HIDDEN_SIZE = tiny_lora.HIDDEN_SIZE
INTERMEDIATE_SIZE = 256
LAYERS = tiny_lora.LAYERS
HEADS = 4
MAX_POSITIONS = 2048
SEED = 0
# Recorded in each adapter's config (the folder moves once written).
MODEL_NAME = "caravan-tiny-chat"


def write_model(out: Path) -> None:
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write (created)")
    parser.add_argument("--adapters", type=int, default=2, help="LoRA adapters to write too")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    write_model(out)
    for index in range(args.adapters):
        tiny_lora.write_adapter(
            out / "adapters" / f"lora-{index}",
            tiny_lora.TinyLora(seed=SEED + 1 + index),
            base_model=MODEL_NAME,
        )
    (out / "caravan-tiny-model.json").write_text(
        json.dumps({"builder": "caravan_llm.devcluster.hf_tiny_model", "adapters": args.adapters})
        + "\n",
        encoding="utf-8",
    )
    sys.stdout.write(f"wrote {out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
