"""What tokenizing a request's prompt costs the router, at 1k and 8k prompt tokens.

    .venv/bin/python bench/tokenize_cost.py                  # the tiny models' tokenizer
    .venv/bin/python bench/tokenize_cost.py --tokenizer DIR  # any tokenizer.json directory

Times `caravan_llm.router.tokens.prompt.prompt_token_ids` on chat requests
(template rendering + tokenizing), per request, p50 and p99, side by side:

- `whole text`: the rendered prompt tokenized in one call, no segment cache;
- `cold`: a prompt whose every piece is new (the segment cache misses);
- `shared system`: a system prompt seen before, then a new ~64-token question;
- `next turn`: a conversation's history seen before, then a new ~64-token turn;
- `next turn, async`: the same through `Tokenizers.prompt_token_ids` (the
  router's call: the model's worker thread and the hop back to the loop).

The text is Python's standard library (not the files the tiny tokenizer was
trained on), so the BPE meets real code, and every request's text is new
unless the scenario says it was seen.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from caravan_llm.common.contract import EngineRoute, ModelView
from caravan_llm.devcluster.tiny_tokenizer import CORPUS_FILES, write_tokenizer
from caravan_llm.router.tokens.model_tokenizer import ModelTokenizer, load_model_tokenizer
from caravan_llm.router.tokens.prompt import prompt_token_ids
from caravan_llm.router.tokens.registry import Tokenizers

QUESTION_TOKENS = 64
CHAT = EngineRoute.CHAT_COMPLETIONS


def corpus() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[CORPUS_FILES:]
    return "".join(path.read_text(encoding="utf-8", errors="replace") for path in files)


class Texts:
    """Consecutive slices of the corpus, each of a given token count."""

    def __init__(self, directory: Path, text: str) -> None:
        self._text = text
        self._ids_offsets = (
            Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text).offsets
        )
        self._at = 0
        self._taken = 0

    def take(self, tokens: int) -> str:
        """About `tokens` tokens of text never handed out before (a numbered line, then a slice)."""
        self._taken += 1
        if self._at + tokens >= len(self._ids_offsets):
            self._at = 0  # the corpus again, each slice made new by its number
        start = self._ids_offsets[self._at][0]
        self._at += tokens
        end = self._ids_offsets[self._at][0]
        return f"# {self._taken}\n{self._text[start:end]}"


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.median(ordered) * 1e3, p99 * 1e3


def chat(system: str, *turns: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    for index, text in enumerate(turns):
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": text})
    return {"messages": messages}


def measure(
    tokenizer: ModelTokenizer, texts: Texts, size: int, runs: int
) -> dict[str, list[float]]:
    body_tokens = size - QUESTION_TOKENS
    results: dict[str, list[float]] = {}

    def run(name: str, payload: dict[str, Any], *, use_cache: bool = True) -> None:
        started = time.perf_counter()
        ids = prompt_token_ids(tokenizer, CHAT, payload, use_cache=use_cache)
        results.setdefault(name, []).append(time.perf_counter() - started)
        assert ids is not None

    system = texts.take(body_tokens)
    run("shared system", chat(system, texts.take(QUESTION_TOKENS)))  # warms the system prompt
    results.clear()
    history = [texts.take(body_tokens // 4) for _ in range(4)]
    run("next turn", chat(history[0], *history[1:], texts.take(QUESTION_TOKENS)))
    results.clear()
    for _ in range(runs):
        run(
            "whole text",
            chat(texts.take(body_tokens), texts.take(QUESTION_TOKENS)),
            use_cache=False,
        )
        run("cold", chat(texts.take(body_tokens), texts.take(QUESTION_TOKENS)))
        run("shared system", chat(system, texts.take(QUESTION_TOKENS)))
        run("next turn", chat(history[0], *history[1:], texts.take(QUESTION_TOKENS)))
    return results


async def measure_async(directory: Path, texts: Texts, size: int, runs: int) -> list[float]:
    tokenizers = Tokenizers()
    view = ModelView(name="bench", tokenizer=str(directory))
    body_tokens = size - QUESTION_TOKENS
    history = [texts.take(body_tokens // 4) for _ in range(4)]
    samples: list[float] = []
    try:
        await tokenizers.prompt_token_ids(view, CHAT, chat(history[0], *history[1:], "warm"))
        for _ in range(runs):
            payload = chat(history[0], *history[1:], texts.take(QUESTION_TOKENS))
            started = time.perf_counter()
            await tokenizers.prompt_token_ids(view, CHAT, payload)
            samples.append(time.perf_counter() - started)
    finally:
        tokenizers.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer.json directory")
    parser.add_argument("--runs", type=int, default=60, help="requests per scenario and size")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        directory: Path = args.tokenizer or Path(scratch)
        if args.tokenizer is None:
            write_tokenizer(directory)
        tokenizer = load_model_tokenizer(directory)
        texts = Texts(directory, corpus())
        print(f"tokenizer: {directory} (segment cache: {tokenizer.segmentable})")
        print(f"{'prompt':>7} {'scenario':<18} {'p50 ms':>8} {'p99 ms':>8}")
        for size in (1024, 8192):
            results = measure(tokenizer, texts, size, args.runs)
            results["next turn, async"] = asyncio.run(
                measure_async(directory, texts, size, args.runs)
            )
            for name, samples in results.items():
                p50, p99 = percentiles(samples)
                print(f"{size:>7} {name:<18} {p50:>8.2f} {p99:>8.2f}")


if __name__ == "__main__":
    main()
