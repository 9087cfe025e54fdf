"""The router's tokenizers: loaded once per model, lazily, None (logged once) when missing."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from caravan_llm.common.contract import EngineRoute, ModelView
from caravan_llm.router.tokens.model_tokenizer import ModelTokenizer, load_model_tokenizer
from caravan_llm.router.tokens.registry import Tokenizers, tokenizer_directory


def test_tokenizer_field_wins_then_a_local_model_directory(tmp_path: Path) -> None:
    """The profile's tokenizer is used first, then its model when that is a local directory."""
    views = [
        ModelView(name="a", model=str(tmp_path), tokenizer="/elsewhere"),
        ModelView(name="b", model=str(tmp_path)),
        ModelView(name="c", model="org/hub-id"),
    ]
    expected = [Path("/elsewhere"), tmp_path, None]
    assert expected == [tokenizer_directory(view) for view in views]


async def test_loads_once_for_concurrent_requests(tiny_tokenizer_dir: Path) -> None:
    """Requests arriving together for one model share one load; the result is cached."""
    loads: list[Path] = []

    def loader(directory: Path) -> ModelTokenizer:
        loads.append(directory)
        return load_model_tokenizer(directory)

    tokenizers = Tokenizers(loader=loader)
    view = ModelView(name="tiny", model=str(tiny_tokenizer_dir))
    payload = {"messages": [{"role": "user", "content": "hello"}]}
    try:
        results = await asyncio.gather(
            *(
                tokenizers.prompt_token_ids(view, EngineRoute.CHAT_COMPLETIONS, payload)
                for _ in range(5)
            )
        )
        again = await tokenizers.prompt_token_ids(view, EngineRoute.CHAT_COMPLETIONS, payload)
    finally:
        tokenizers.close()
    assert [tiny_tokenizer_dir] == loads
    assert 1 == len({*results, again})
    assert results[0] is not None


async def test_missing_tokenizer_gives_none_and_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model directory without tokenizer.json gives None, said once with model and path."""
    tokenizers = Tokenizers()
    view = ModelView(name="bare", model=str(tmp_path))
    payload = {"messages": [{"role": "user", "content": "secret prompt"}]}
    with caplog.at_level(logging.WARNING, logger="caravan_llm.router.tokens.registry"):
        try:
            first = await tokenizers.prompt_token_ids(view, EngineRoute.CHAT_COMPLETIONS, payload)
            second = await tokenizers.prompt_token_ids(view, EngineRoute.CHAT_COMPLETIONS, payload)
        finally:
            tokenizers.close()
    records = [r for r in caplog.records if r.getMessage() == "tokenizer_unavailable"]
    assert (None, None) == (first, second)
    assert [("bare", str(tmp_path))] == [(r.model, r.path) for r in records]  # type: ignore[attr-defined]
    assert "secret" not in caplog.text


async def test_token_prompts_are_exact_without_a_tokenizer() -> None:
    """A completions prompt given as token ids needs no tokenizer."""
    tokenizers = Tokenizers()
    view = ModelView(name="hub", model="org/hub-id")
    try:
        ids = await tokenizers.prompt_token_ids(view, EngineRoute.COMPLETIONS, {"prompt": [3, 4]})
    finally:
        tokenizers.close()
    assert (3, 4) == ids
