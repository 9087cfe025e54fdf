"""Write the tiny models' tokenizer: `tokenizer.json` and `tokenizer_config.json` (ChatML).

    python -m caravan_llm.devcluster.tiny_tokenizer --out DIR      # caravan's own venv

A byte-level BPE trained here with HF `tokenizers` (nothing else: no
transformers, no download) on Python's own standard library, the first
`CORPUS_FILES` modules in sorted order, so every machine with the same CPython
and `tokenizers` trains the same vocabulary, byte for byte. Its special tokens
are ChatML's: `<|endoftext|>` (id 0: bos, unk, pad), `<|im_start|>` (1),
`<|im_end|>` (2: eos). `tokenizer_config.json` carries the simulated engines'
ChatML chat template and those special tokens, as transformers 5 reads them.

The real vLLM's tiny model (`caravan_llm.devcluster.hf_tiny_model`, which
calls `write_tokenizer` here) and the simulated vLLM given such a directory
(`--model DIR`) therefore tokenize identically, and so does the router
(`caravan_llm.router.tokens`), which loads the same two files.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from caravan_llm.devcluster.engine.text import CHATML_TEMPLATE

VOCAB_SIZE = 2048
CORPUS_FILES = 150
BOS_TOKEN = "<|endoftext|>"  # noqa: S105 - a token of the vocabulary, not a secret
EOS_TOKEN = "<|im_end|>"  # noqa: S105 - as above
SPECIAL_TOKENS = (BOS_TOKEN, "<|im_start|>", EOS_TOKEN)
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def corpus_files() -> list[Path]:
    """The training text: the first stdlib modules in sorted order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"))[:CORPUS_FILES]


def train_tokenizer() -> Tokenizer:
    """The byte-level BPE, trained (deterministic for a given corpus and `tokenizers`)."""
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
    # What transformers 5 writes for a tokenizer that adds no BOS/EOS of its own
    # (the chat template writes every special token), so that a tokenizer.json
    # saved by either builder is the same file.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A:0", pair="$A:0 $B:1", special_tokens=[]
    )
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json: the special tokens and the ChatML chat template."""
    return {
        "backend": "tokenizers",
        "bos_token": BOS_TOKEN,
        "chat_template": CHATML_TEMPLATE,
        "eos_token": EOS_TOKEN,
        "pad_token": BOS_TOKEN,
        "tokenizer_class": "TokenizersBackend",
        "unk_token": BOS_TOKEN,
    }


def write_tokenizer(out: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into `out` (created)."""
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer().save(str(out / TOKENIZER_FILE))
    (out / TOKENIZER_CONFIG_FILE).write_text(
        json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write (created)")
    args = parser.parse_args(argv)
    write_tokenizer(args.out)
    sys.stdout.write(f"wrote {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
