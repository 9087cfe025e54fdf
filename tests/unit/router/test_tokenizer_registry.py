"""The router's tokenizers: loaded once per model, lazily, None (logged once) when missing."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from polling import eventually

from caravan_llm.common.contract import EngineRoute, ModelView
from caravan_llm.router.tokens.conversation import ChatPrompt
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


SYSTEM = {"role": "system", "content": "a shared system prompt, long enough to matter " * 6}
TURN1 = [SYSTEM, {"role": "user", "content": "the first question of this chat " * 3}]
TURN2 = [
    *TURN1,
    {"role": "assistant", "content": "an answer the router never tokenized"},
    {"role": "user", "content": "a follow-up question " * 3},
]


async def test_a_later_turn_gets_its_historys_ids_before_the_worker_thread_is_free(
    tiny_tokenizer_dir: Path,
) -> None:
    """With the model's worker thread busy, the history's ids still come at once, on the loop."""
    tokenizers = Tokenizers()
    view = ModelView(name="tiny", model=str(tiny_tokenizer_dir))
    route = EngineRoute.CHAT_COMPLETIONS
    busy = threading.Event()
    try:
        first = await tokenizers.prompt_token_ids(view, route, {"messages": TURN1})
        assert first is not None
        # Another prompt holds the model's one worker thread.
        blocker = tokenizers._entry(view).executor.submit(busy.wait, 30)
        handed: list[tuple[Sequence[int], int]] = []
        task = asyncio.ensure_future(
            tokenizers.prompt_token_ids(
                view, route, {"messages": TURN2}, on_prefix=lambda *found: handed.append(found)
            )
        )
        await eventually(lambda: bool(handed), 10.0, "the early hand-over", interval_s=0.005)
        assert not task.done()
        assert not blocker.done()
        busy.set()
        ids = await task
    finally:
        busy.set()
        tokenizers.close()
    assert ids is not None
    truth = load_model_tokenizer(tiny_tokenizer_dir).chat_ids(
        ChatPrompt(messages=tuple(TURN2)), use_cache=False
    )
    assert truth == ids
    early, predicted = handed[0]
    # The whole first turn up to its last <|im_end|>: every id of it, in the new turn's order.
    assert tuple(early) == ids[: len(early)]
    assert len(early) > len(first) - 8
    assert 0.7 * len(ids) <= predicted <= 1.4 * len(ids)


async def test_a_template_that_rewrites_earlier_turns_stops_the_early_hand_over(
    tmp_path: Path, tiny_tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Ids handed over early that the thread's ids contradict: said once, never used again."""
    (tmp_path / "tokenizer.json").write_bytes((tiny_tokenizer_dir / "tokenizer.json").read_bytes())
    # The last message is marked: a chat's text is no prefix of its next turn's.
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if loop.last %} (last){% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tokenizers = Tokenizers()
    view = ModelView(name="marked", model=str(tmp_path))
    route = EngineRoute.CHAT_COMPLETIONS
    truth = load_model_tokenizer(tmp_path)
    handed: list[list[Sequence[int]]] = []
    results = []
    with caplog.at_level(logging.WARNING, logger="caravan_llm.router.tokens.registry"):
        try:
            for messages in (TURN1, TURN2, [*TURN2, {"role": "assistant", "content": "x"}]):
                found: list[Sequence[int]] = []
                results.append(
                    await tokenizers.prompt_token_ids(
                        view,
                        route,
                        {"messages": messages},
                        on_prefix=lambda ids, _, found=found: found.append(ids),
                    )
                )
                handed.append(found)
            enabled = tokenizers._entry(view).prefixes.enabled
        finally:
            tokenizers.close()
    expected = [
        truth.chat_ids(ChatPrompt(messages=tuple(m)), use_cache=False)
        for m in (TURN1, TURN2, [*TURN2, {"role": "assistant", "content": "x"}])
    ]
    assert expected == results  # the answers are right whatever was handed over
    mismatches = [r for r in caplog.records if r.getMessage() == "chat_prefix_mismatch"]
    assert ["marked"] == [r.model for r in mismatches]  # type: ignore[attr-defined]
    # The second turn got the first's ids early (wrong here); the third got none from the loop.
    assert handed[1]
    assert tuple(handed[1][0]) != results[1][: len(handed[1][0])]  # type: ignore[index]
    # Only the worker thread's own (right) leading ids reach the third.
    assert all(tuple(ids) == results[2][: len(ids)] for ids in handed[2])  # type: ignore[index]
    assert not enabled
