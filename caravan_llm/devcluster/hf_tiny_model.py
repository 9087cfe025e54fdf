"""Write a tiny random-weight Llama in Hugging Face format that the real vLLM can serve.

    python -m caravan_llm.devcluster.hf_tiny_model --out DIR      # run with the vLLM venv's python

Nothing is downloaded. The tokenizer is a byte-level BPE trained here with HF
`tokenizers` on Python's own standard library (the first files in sorted
order, so every machine with the same CPython trains the same vocabulary),
with ChatML's special tokens and the simulated engines' chat template; the
weights are random with a fixed seed. The whole model is about 2 MB.

Shape facts (measured in shared/docs/vllm-cpu.md): vLLM's CPU attention takes
head sizes 32, 64, 80, ... but not 16, so 128 hidden / 4 heads = 32. Random
weights never emit EOS, so every answer ends on `length` unless the request's
`max_tokens` stops it first; temperature 0 is deterministic.

`--adapters N` also writes N rank-8 LoRA adapters (peft, random deterministic
weights) under `DIR/adapters/lora-<i>`; each changes the model's output.

Runs only in the vLLM venv (torch, transformers, tokenizers, peft); caravan's
own venv never imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

from caravan_llm.devcluster.engine.text import CHATML_TEMPLATE

VOCAB_SIZE = 2048
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
LAYERS = 2
HEADS = 4
MAX_POSITIONS = 2048
CORPUS_FILES = 150
SEED = 0
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LORA_RANK = 8
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def corpus_files() -> list[Path]:
    """The training text: the first stdlib modules in sorted order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"))[:CORPUS_FILES]


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(path) for path in corpus_files()], trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",  # noqa: S106 - a token of the vocabulary, not a secret
        eos_token="<|im_end|>",  # noqa: S106 - a token of the vocabulary, not a secret
        unk_token="<|endoftext|>",  # noqa: S106 - as above
        pad_token="<|endoftext|>",  # noqa: S106 - as above
    )
    wrapped.chat_template = CHATML_TEMPLATE
    wrapped.save_pretrained(str(out))


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


def write_adapter(model_dir: Path, out: Path, index: int) -> None:
    import torch  # noqa: PLC0415
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(SEED + 1 + index)
    base = LlamaForCausalLM.from_pretrained(str(model_dir))
    lora = LoraConfig(
        r=LORA_RANK,
        lora_alpha=2 * LORA_RANK,
        target_modules=list(LORA_TARGETS),
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, lora)
    # init_lora_weights=False already randomises B; widen it so the adapter's
    # answers visibly differ from the base model's at temperature 0.
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    peft_model.save_pretrained(str(out))


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
        write_adapter(out, out / "adapters" / f"lora-{index}", index)
    (out / "caravan-tiny-model.json").write_text(
        json.dumps({"builder": "caravan_llm.devcluster.hf_tiny_model", "adapters": args.adapters})
        + "\n",
        encoding="utf-8",
    )
    sys.stdout.write(f"wrote {out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
